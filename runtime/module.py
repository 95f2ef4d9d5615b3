"""The module ``autopar.compile`` returns: runs one rank's share of the planned training step."""

import contextlib
import datetime
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import Captured, InputKind, capture, keyword_order, split_keywords
from autopar.passes.analysis.hooks import has_gradient_hooks
from autopar.passes.lower.rewrite import check_fits, runs_planned_ops
from autopar.runtime.allocator import keep_freed_memory
from autopar.runtime.calls import (
    HOOKS,
    SETTINGS_CAPTURES,
    changed_settings,
    check_ranks_agree,
    modes,
    setting_changes,
)
from autopar.runtime.handoff import next_planning, planning_on_rank0, wait_for_rank0_to_plan
from autopar.runtime.launch import device_mesh, device_type_of
from autopar.runtime.offload import HostOptimizer
from autopar.runtime.program import (
    BACKENDS,
    Lowered,
    Program,
    Step,
    Unsynced,
    check_plan,
    check_tensors,
    lower,
    named_timeouts,
    refuse_autocast,
    refuse_input_gradients,
)
from autopar.runtime.state import (
    ParameterCounts,
    as_planned,
    distribute,
    distribute_state,
    local_of,
    local_piece,
    materialise,
    release,
    whole_fake_state,
    whole_of,
)
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_unflatten

from autopar.core.errors import InputError
from autopar.core.mesh import Mesh
from autopar.core.placement import Placements, Shard
from autopar.core.plan import ShardingPlan

log = logging.getLogger("autopar")


def _lean_step(optimizer_class: type[torch.optim.Optimizer], options: dict, params: list[torch.Tensor]) -> dict:
    """``options`` with ``fused=True`` where the step runs on CUDA, the class takes ``fused``
    and the caller chose no implementation (see :meth:`ParallelModule.optimizer`)."""
    if "fused" in options or "foreach" in options or not any(p.is_cuda for p in params):
        return options
    if "fused" not in inspect.signature(optimizer_class.__init__).parameters:
        return options
    return {**options, "fused": True}


class ParallelModule(torch.nn.Module):
    """A model running on every rank of a mesh under a :class:`ShardingPlan`.

    Once planned, the wrapped model's parameters and buffers are
    DTensors (:class:`~torch.distributed.tensor.DTensor`) on a device mesh with the mesh's axis names,
    laid out as the plan places them, so that torch's tools see whole tensors: ``numel()``,
    ``full_tensor()``, ``torch.nn.utils.clip_grad_norm_``, optimizers and
    ``torch.distributed.checkpoint``. The per-rank program reads and writes their local pieces.
    ``forward`` returns what the model returns, whole on every rank, and writes the new values
    of buffers the model updates in place (batch norm's running statistics) into their pieces;
    ``backward()`` on the result fills the parameters' gradients, DTensors laid out as the
    parameters. :meth:`optimizer` builds the optimizer the plan was made for (with optimizer
    state in host memory where the plan says so).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: Mesh,
        *,
        example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None,
        plan: ShardingPlan | None,
        backend: str,
        planner,
        pins: Mapping[str, Placements] | None = None,
        init_weights: Callable[[torch.nn.Module], None] | None = None,
        timeout_s: float | None = None,
        param_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        self.module = model
        self._mesh = mesh
        self._plan = plan
        self._backend = backend
        self._planner = planner
        self._pins = dict(pins or {})
        self._init_weights = init_weights
        self._timeout_s = timeout_s
        self._param_dtype = param_dtype
        self._built = False
        self._state_slots: tuple = (None, [])
        self._optimizer_checked = False
        self._sync = True
        self._unsynced = Unsynced()
        self._calls = 0
        """Calls so far, the same count on every rank."""
        self._ignored: set[str] = set()
        """Settings (:func:`~autopar.runtime.calls.modes`) found not to change the graph when they changed."""
        self._settings_captures = 0
        """Captures made because settings alone changed."""
        self._keywords: tuple[str, ...] | None = None
        """The names of the tensors passed by keyword, in the program's order after the positional
        ones: those of ``example_inputs`` given as a dict, or of the first call."""
        self._fixed: dict[str, object] = {}
        """The other arguments passed by keyword (``return_loss=True``), traced into the graph."""
        if example_inputs is not None:
            if isinstance(example_inputs, Mapping):
                example_inputs = self._positional((), dict(example_inputs))
            else:
                self._keywords = ()
            self._build(tuple(example_inputs))

    @property
    def plan(self) -> ShardingPlan:
        """The plan this module runs (available after the first call when no example inputs
        were given)."""
        if self._plan is None:
            raise RuntimeError(
                "the plan is made on the first call; pass example_inputs to autopar.compile to plan earlier"
            )
        return self._plan

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **options
    ) -> torch.optim.Optimizer:
        """An optimizer of ``optimizer_class`` over this rank's parameters, with the optimizer
        state of the parameters the plan puts in host memory (``plan.host_optimizer``) there,
        stepped on the host (:class:`~autopar.runtime.offload.HostOptimizer`); a plain
        ``optimizer_class(self.parameters(), **options)`` when the plan offloads none, or only
        parameters living in host memory (``plan.host_params``), which it steps in place.

        On CUDA, a class that takes ``fused=`` (Adam, AdamW, SGD, ...) is built fused unless
        ``fused`` or ``foreach`` is given: torch's default there, the multi-tensor (foreach)
        step, holds a temporary the size of every parameter on the device (Adam's square roots
        of the second moments), which the plan's memory does not count; the fused step holds
        none, and the plan counts two of the largest parameter, what the for-loop step holds."""
        if not self._built:
            raise RuntimeError(
                "pmodel.optimizer() needs the plan, which is made on the model's first call. Fix: pass "
                "example_inputs to autopar.compile, or build the optimizer after the first call"
            )
        on_host = {id(self.module.get_parameter(name)) for name in self._stepped_on_host()}
        self._optimizer_checked = True
        options = _lean_step(optimizer_class, options, list(self.parameters()))
        if not on_host:
            return optimizer_class(self.parameters(), **options)
        return HostOptimizer(self.parameters(), on_host, optimizer_class, **options)

    def _stepped_on_host(self) -> list[str]:
        """Parameters whose optimizer state the plan steps on the host while they stay on the
        device (those living in host memory are stepped in place by any optimizer)."""
        return [name for name in self.plan.host_optimizer if name not in self.plan.host_params]

    def forward(self, *inputs, **keywords):
        first = self._keywords is None
        try:
            return self._run(self._positional(inputs, keywords))
        except BaseException:
            if first and not self._built:  # a failed first call fixes no keywords
                self._keywords, self._fixed = None, {}
            raise

    def _positional(self, inputs: tuple, keywords: dict) -> tuple:
        """A call's tensors in the program's order: the positional ones, then those passed by
        keyword, by the names the first call or ``example_inputs`` gave (any order). Its other
        keyword arguments must be those of that call, which are traced into the graph."""
        tensors, fixed = split_keywords(keywords)
        if self._keywords is None:
            self._keywords, self._fixed = keyword_order(self.module, tensors), fixed
        if tensors.keys() != set(self._keywords) or not _same_values(fixed, self._fixed):
            planned = ", ".join([*self._keywords, *(f"{k}={v!r}" for k, v in self._fixed.items())]) or "none"
            given = ", ".join([*tensors, *(f"{k}={v!r}" for k, v in fixed.items())]) or "none"
            raise InputError(
                f"the model was compiled for calls passing {planned} by keyword (after its positional inputs), but "
                f"this call passes {given}. Fix: pass the same tensors and settings by keyword as when compiled "
                "(in any order), or compile again for these"
            )
        return (*inputs, *(tensors[name] for name in self._keywords))

    def _run(self, inputs: tuple):
        refuse_autocast()
        check_tensors(inputs)
        refuse_input_gradients(inputs)
        if not self._built:
            self._build(inputs, first_call=True)
            self._check_same_inputs(inputs)
        else:
            self._switch(inputs)
            if not self._optimizer_checked:
                if self._stepped_on_host():
                    log.warning(
                        "the plan keeps the optimizer state of %d parameters in host memory, but no optimizer "
                        "was built by pmodel.optimizer(torch.optim.AdamW, ...): an optimizer built otherwise "
                        "keeps it on the device, over the plan's memory",
                        len(self._stepped_on_host()),
                    )
                self._optimizer_checked = True
        flat = [*self._state(), *self._local_inputs(inputs)]
        results = Step.apply(self._program_for_gradients(), *flat)
        return tree_unflatten(self._write_back(results), self._captured.out_spec)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops the gradients of micro-batches under :meth:`no_sync` not yet
        synchronised, which, unlike DDP's, are not in ``.grad`` (an optimizer's ``zero_grad``
        does not drop them)."""
        self._unsynced.take()
        super().zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without the gradients' collectives, as DDP's ``no_sync``: the
        backward of a call made inside keeps each gradient as it makes it, before any
        collective (a parameter split by the plan then holds its whole gradient), and adds it
        to the sum of the micro-batches before; the backward of the next call made outside adds
        the sum before its collectives, which then run once for all the micro-batches. The
        parameters' ``.grad`` change only then. Run each micro-batch's forward and backward
        inside, and the last one's outside; ``pmodel.zero_grad()`` drops sums of an abandoned
        round."""
        _refuse_unsynced_steps(self)
        hooked = [name for name, p in self.module.named_parameters() if has_gradient_hooks(p)]
        if hooked:
            raise InputError(
                f"parameters {', '.join(hooked)} carry gradient hooks, which under no_sync() would be called once, on "
                "the sum of the micro-batches' gradients, where one device calls them at each backward. Fix: "
                "accumulate without no_sync() (each backward then reduces its gradients), or remove the hooks"
            )
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _unsynced_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients of calls under :meth:`no_sync` are not yet in ``.grad``."""
        return list(self.parameters()) if self._unsynced.grads is not None else []

    def _program_for_gradients(self) -> Program:
        """The program for this call: inside :meth:`no_sync`, the one that keeps its gradients
        unreduced; outside, after micro-batches inside, the one that adds their sums; else the
        plan's."""
        if (self._sync and self._unsynced.grads is None) or not torch.is_grad_enabled():
            return self._program  # a call with no backward (evaluation) runs the plan's
        if self.plan.host_params or self.plan.host_optimizer:
            raise InputError(
                "no_sync() keeps every gradient on the device until the micro-batch that synchronises, and the plan "
                "keeps parameters or optimizer state in host memory. Fix: accumulate without no_sync() (each "
                "micro-batch then reduces its gradients), or compile with a larger memory_budget"
            )
        for form in ("unreduced", "accumulated"):  # both at once: one that cannot be made refuses no_sync at once
            if (self._key, form) not in self._variants:
                lowered = self._lowered[self._key]
                self._variants[self._key, form] = lower(
                    lowered.captured,
                    lowered.plan,
                    self._mesh,
                    self._coordinate,
                    self._groups,
                    self._backend,
                    self._timeout_s,
                    form,
                    self._unsynced,
                )
        program = self._variants[self._key, "unreduced" if not self._sync else "accumulated"].program
        if self._unsynced.layouts is not None and self._unsynced.layouts != program.unreduced_layouts:
            raise InputError(
                "the micro-batches under no_sync ran a plan that makes their gradients in other placements than this "
                "call's (their sizes or the model's mode made autopar plan their ops again). Fix: accumulate "
                "micro-batches of one size and mode, or without no_sync()"
            )
        return program

    def _write_back(self, results: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy the new values of updated buffers into the module's buffers; return the model's
        outputs (those that view another made again from it, outside the program)."""
        outputs = []
        with torch.no_grad():
            for value, name in zip(results, self._program.updated_buffers):
                if name is None:
                    outputs.append(value)
                else:
                    local_of(self.module.get_buffer(name)).copy_(value)
        return self._program.outputs.again(outputs)

    # building ----------------------------------------------------------------------------

    def _build(self, inputs: tuple, first_call: bool = False) -> None:
        """Plan (or check the given plan) and lower it for ``inputs``: the global batch of
        ``example_inputs``, or the ``first_call``'s inputs, which pass a pinned split as this
        rank's part and so cannot give the whole batch's shapes."""
        device_type = device_type_of(self.module)
        on_meta = device_type == "meta"
        if on_meta:  # built on the meta device: each rank materialises its pieces where it computes
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if device_type == "cpu":
            keep_freed_memory()
        timeout = None if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
        self._device_mesh = device_mesh(self._mesh, device_type, timeout)
        self._world = None if timeout is None else dist.new_group(timeout=timeout)  # for the inputs' size check
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        )
        check_tensors(inputs)
        with whole_fake_state(self.module, self._device) if on_meta else contextlib.nullcontext():
            # the inputs give shapes: one requiring a gradient would make a graph that computes it
            captured = capture(
                self.module, tuple(x.detach() for x in inputs), self._param_dtype, self._keywords, self._fixed
            )
        if first_call:
            _refuse_split_pins_of_parts(captured, self._pins)
        plan = self._plan if self._plan is not None else self._plan_on_rank0(captured)
        check_plan(plan, captured, self._mesh, self._pins)
        self._plan = plan
        self._coordinate = tuple(int(c) for c in self._device_mesh.get_coordinate())
        self._groups = [self._device_mesh.get_group(axis).group_name for axis in range(self._mesh.ndim)]
        self._inputs = [
            (n.meta["val"], k.name) for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "input"
        ]
        """The planned value and name of each input, in call order (dtype, device and dims hold at
        every size)."""
        self._lowered: dict[tuple, Lowered] = {}
        self._variants: dict[tuple, Lowered] = {}
        """Programs for gradient accumulation (:meth:`no_sync`), by input sizes and modes and what they do with
        the gradients."""
        self._lower(captured, plan)
        self._shard_state(captured)
        self._built = True
        _check_optimizer_state(self)
        log.info(
            "rank %d at %s runs %d collectives per step (%s backend)",
            dist.get_rank(),
            self._coordinate,
            len(self.collectives),
            self._backend,
        )

    def _lower(self, captured: Captured, plan: ShardingPlan, key: tuple | None = None) -> None:
        """Make and cache the per-rank program of ``plan`` for ``captured`` under ``key`` (by
        default its inputs' sizes and the model's modes now), and run it from now."""
        if key is None:
            key = (
                tuple(
                    tuple(n.meta["val"].shape)
                    for n, k in zip(captured.placeholders, captured.inputs)
                    if k.kind == "input"
                ),
                self._modes_now(),
            )
        self._lowered[key] = lower(
            captured, plan, self._mesh, self._coordinate, self._groups, self._backend, self._timeout_s
        )
        self._run_for(key)

    def _run_for(self, key: tuple) -> None:
        lowered = self._lowered[key]
        self._captured, self._program, self.per_rank_graph, self.collectives = lowered[:4]
        self._layouts = lowered.layouts
        self._key = key

    def _switch(self, inputs: tuple) -> None:
        """Run the program for these inputs' sizes and the model's mode: the cached one, or the
        plan lowered for them (captured again on fake tensors, the plan checked to fit, no
        solving). Where the model runs other ops there (its code branches on a size; dropout in
        eval mode), those ops are planned with the parameters and buffers pinned where they are."""
        key = self._whole_key(inputs)
        self._check_same_inputs(inputs)
        if key == self._key:
            return
        if key in self._lowered:
            self._run_for(key)
            return
        started = time.perf_counter()
        with whole_fake_state(self.module) as mode:
            with mode:
                fakes = tuple(torch.empty(shape, dtype=x.dtype, device=x.device) for shape, x in zip(key[0], inputs))
            captured = capture(self.module, fakes, self._param_dtype, self._keywords, self._fixed)
        if self._same_program(captured, key):
            unchanged = (key[0], self._modes_now())
            self._lowered[unchanged] = self._lowered[self._key]
            self._run_for(unchanged)
            return
        changed = self._count_settings_capture(key)
        plan = self._plan
        if not runs_planned_ops(captured, plan):
            plan = self._plan_on_rank0(captured, self._state_pins(captured))
        check_fits(captured, plan)
        self._lower(captured, plan, key)
        log.log(
            logging.WARNING if changed else logging.INFO,
            "lowered %s for input sizes %s (%s mode%s) in %.1f s",
            "the plan" if plan is self._plan else "a plan",
            ", ".join(map(str, key[0])),
            "training" if self.module.training else "eval",
            f"; the model's settings changed, {changed}" if changed else "",
            time.perf_counter() - started,
        )

    def _modes_now(self, requires_grad: bool = True) -> tuple:
        """The model's modes and settings now (:func:`~autopar.runtime.calls.modes`), less the settings found not to
        change its graph."""
        flags, values = modes(self.module, requires_grad)
        return flags, tuple(v for v in values if v[0] not in self._ignored)

    def _running_graph_hash(self) -> str:
        """The fingerprint of the graph the running program was lowered from."""
        return self._captured.graph_hash

    def _only_settings_changed(self, key: tuple) -> bool:
        """Whether ``key`` has the running program's sizes and training flags."""
        return key[0] == self._key[0] and key[1][0] == self._key[1][0]

    def _same_program(self, captured: Captured, key: tuple) -> bool:
        """Whether only settings changed from the running program's ``key`` and ``captured``
        computes what its graph does (the same fingerprint, and no tensor constants, whose values
        the fingerprint leaves out): those settings are then ignored from now on (a counter the
        forward keeps)."""
        if not self._only_settings_changed(key) or captured.graph_hash != self._running_graph_hash():
            return False
        if any(n.op == "get_attr" for n in captured.graph.graph.nodes):
            return False
        changes = [name for name, _, _ in setting_changes(self._key, key)]
        hooks = [name for name in changes if name.endswith(HOOKS)]
        # a hook that changes nothing now may be joined by one that does: hooks are never ignored
        self._ignored.update(name for name in changes if name not in hooks)
        if hooks:
            log.warning(
                "%s changed, so the model was captured again: its graph did not change. A hook whose values change "
                "each step (one reading a step count) captures each step; register hooks that compute alike",
                ", ".join(hooks),
            )
        return True

    def _count_settings_capture(self, key: tuple) -> str:
        """The settings that changed from the running program's ``key`` (``""`` if none), refused
        once they have made ``SETTINGS_CAPTURES`` captures: each change is a new constant of the
        graph, captured and lowered again."""
        changed = changed_settings(self._key, key)
        if changed and self._only_settings_changed(key):
            self._settings_captures += 1
            if self._settings_captures > SETTINGS_CAPTURES:
                raise InputError(
                    f"the model's settings changed again ({changed}), {self._settings_captures} times: each change "
                    "is a constant of the captured graph, captured and lowered again. Fix: hold a value that changes "
                    "while training in a tensor the forward reads (self.register_buffer('temperature', "
                    "torch.tensor(1.0)), then update it in place), or compile again"
                )
        return changed

    def _state_pins(self, captured: Captured) -> dict[str, Placements]:
        """Pins that keep the parameters and buffers where they are, for planning the ops a
        model runs at other sizes or in another mode; refused where the plan keeps state in host
        memory (a new plan could place it otherwise) or the model reads state it did not before."""
        if self._plan.host_params or self._plan.host_optimizer:
            raise InputError(
                "at these input sizes, or in this mode, the model runs other ops than planned, and the plan keeps "
                "parameters or optimizer state in host memory, where a plan for these ops could not follow it. Fix: "
                "call it at the planned sizes and mode, or compile without offloading (a larger memory_budget)"
            )
        state = [k.name for k in captured.inputs if k.kind in ("param", "buffer")]
        unplanned = [name for name in state if name not in self._plan.placements]
        if unplanned:
            raise InputError(
                f"at these input sizes, or in this mode, the model reads {', '.join(unplanned)}, which it did not read "
                "when planned, so they were never split across the ranks. Fix: compile with example inputs in this mode"
            )
        return {name: self._plan.placements[name] for name in state}

    def _whole_key(self, inputs: tuple) -> tuple:
        """Each input's whole shape (an input whose split was pinned is passed as this rank's
        part; every rank's part must make the same whole), once the inputs are checked against
        the planned ones, and the training flags of the modules (eval mode captures another
        graph where dropout or batch norm differ). The forward has checked they are tensors."""
        planned = self._inputs
        if len(inputs) != len(planned):
            raise TypeError(
                f"the model was compiled for {len(planned)} inputs ({', '.join(name for _, name in planned)}), "
                f"got {len(inputs)}"
            )
        key = []
        for x, (value, name) in zip(inputs, planned):
            if x.dtype != value.dtype or x.device.type != value.device.type or x.ndim != value.ndim:
                raise InputError(
                    f"input '{name}' is a {x.ndim}-d {x.dtype} tensor on {x.device.type}, but the plan was made for a "
                    f"{value.ndim}-d {value.dtype} tensor on {value.device.type}. Fix: pass it as planned (e.g. "
                    f"x.to({value.dtype})), or compile again with example inputs like this one"
                )
            shape = list(x.shape)
            if self.passes_own_part(name):
                for axis, p in enumerate(self._layouts[name]):
                    if isinstance(p, Shard):
                        shape[p.dim] *= self._mesh.shape[axis]
            key.append(tuple(shape))
        if any(self.passes_own_part(name) for _, name in planned):
            self._check_same_whole(key)
        return tuple(key), self._modes_now()

    def _check_same_whole(self, key: list[tuple[int, ...]]) -> None:
        """Refuse parts of per-rank inputs that do not make the same whole on every rank (a
        smaller last part on some ranks only): the ranks would run programs of other sizes."""
        sizes = torch.tensor([n for shape in key for n in shape], device=self._device)
        bounds = torch.cat([sizes, -sizes])  # one all-reduce of the largest sizes and of the smallest
        with named_timeouts(self._timeout_s, "check of the inputs' sizes"):
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self._world)
        agree = torch.equal(bounds[: len(sizes)], -bounds[len(sizes) :])
        release(bounds)  # here, not on gloo's thread, which may hold it past the wait
        if not agree:
            raise InputError(
                f"the ranks passed parts of per-rank inputs of different sizes (this rank's make the whole shapes "
                f"{', '.join(map(str, key))}). Fix: give every rank parts of the same size, e.g. "
                "DistributedSampler(drop_last=True) or DataLoader(drop_last=True)"
            )

    def _check_same_inputs(self, inputs: tuple) -> None:
        """Refuse ranks whose whole inputs, or the graphs of whose running programs, differ
        (:func:`~autopar.runtime.calls.check_ranks_agree`), at the calls numbered by powers of two
        (1, 2, 4, ...), which every rank counts alike, so that a loader's first batch is checked
        and a long run pays next to nothing. A setting changed on some ranks only is found at the
        next checked call, which compares the graphs the call before ran: up to twice as many
        calls later."""
        self._calls += 1
        if self._calls & (self._calls - 1) or dist.get_world_size(self._world) == 1:
            return
        whole = [(x, name) for x, (_, name) in zip(inputs, self._inputs) if not self.passes_own_part(name)]
        check_ranks_agree(
            whole, self._running_graph_hash(), self._modes_now, self._device, self._world, self._timeout_s
        )

    def _plan_on_rank0(
        self, captured: Captured, state_pins: Mapping[str, Placements] | None = None, **options
    ) -> ShardingPlan:
        """Rank 0 plans (with ``state_pins`` added to the pins, and the planner's ``options``) and
        sends the plan to every rank;
        if planning fails there, every rank raises the same error instead of waiting for a plan
        that never comes. Under a timeout the other ranks wait for the plan as long as rank 0
        shows it is planning (:func:`~autopar.runtime.handoff.planning_on_rank0`), and the plan's broadcast is bounded
        like the program's collectives."""
        n = next_planning()
        box: list = [None]
        with planning_on_rank0(self._timeout_s, n) if dist.get_rank() == 0 else contextlib.nullcontext():
            if dist.get_rank() == 0:
                try:
                    # planning on rank 0 alone draws random values (op timing): every rank's generators must stay
                    # alike for what draws after it (a DataLoader's shuffle, dropout)
                    with torch.random.fork_rng(devices=[self._device.index] if self._device.type == "cuda" else []):
                        box = [("plan", self._planner(captured, state_pins, **options).to_json())]
                except Exception as exc:
                    box = [("error", exc)]
        if dist.get_rank() != 0 and self._timeout_s is not None:
            wait_for_rank0_to_plan(self._timeout_s, n)
        with named_timeouts(self._timeout_s, "broadcast of the plan"):
            dist.broadcast_object_list(box, src=0, group=self._world)
        kind, value = box[0]
        if kind == "error":
            raise value
        return ShardingPlan.from_json(value)

    def _shard_state(self, captured: Captured, elsewhere: frozenset[int] = frozenset()) -> None:
        """Replace each planned parameter and buffer by a DTensor holding this rank's piece, in
        host memory (pinned on CUDA) for the parameters the plan keeps there. Tensors on the meta
        device are materialised piece by piece (:func:`~autopar.runtime.state.materialise`);
        those in ``elsewhere`` (by id: other ranks' pipeline stages read them) are made and
        initialised too, so that every rank draws the random values one device would, and not
        kept."""
        planned = {}
        for kind in captured.inputs:
            if kind.kind in ("param", "buffer"):
                tensor = self._tensor_of(kind)
                planned[id(tensor)] = (kind.name, tensor)

        def cut(key: int, whole: torch.Tensor) -> torch.Tensor:
            if key in elsewhere:
                return whole.new_empty(0)
            if key not in planned:
                raise ValueError(
                    "the model holds tensors on the meta device that its forward does not use. Fix: "
                    "build them on a real device, or drop them"
                )
            name = planned[key][0]
            with torch.no_grad():
                piece = self.rank_part(name, whole)
            if name in self._plan.host_params and piece.device.type != "cpu":
                piece = piece.to("cpu").pin_memory()
            return piece

        made = materialise(self.module, self._device, cut, self._init_weights)
        pieces = {
            key: distribute(
                tensor, made[key] if key in made else cut(key, tensor.detach()), self._device_mesh, self._layouts[name]
            )
            for key, (name, tensor) in planned.items()
        }
        distribute_state(self.module, pieces)
        for _, tensor in planned.values():
            if not tensor.is_meta:
                release(tensor)

    def _tensor_of(self, kind: InputKind) -> torch.Tensor:
        """The model's parameter or buffer that a graph input of kind ``"param"`` or ``"buffer"`` reads."""
        return self.module.get_parameter(kind.name) if kind.kind == "param" else self.module.get_buffer(kind.name)

    def _state(self) -> list[torch.Tensor]:
        """The parameters and buffers, DTensors, in the program's order (:class:`Step` takes
        their local pieces and gives the parameters' gradients back as DTensors). Read from the
        submodules' tables, found once per captured graph: a state dict loaded or a parameter
        replaced changes the tables, not the submodules."""
        if self._state_slots[0] is not self._captured:
            slots = []
            for k in self._captured.inputs:
                if k.kind in ("param", "buffer"):
                    owner, _, attr = k.name.rpartition(".")
                    module = self.module.get_submodule(owner)
                    slots.append((module._parameters if k.kind == "param" else module._buffers, attr, k.name))
            self._state_slots = (self._captured, slots)
        state = [table.get(attr) for table, attr, _ in self._state_slots[1]]
        replaced = [name for x, (_, _, name) in zip(state, self._state_slots[1]) if not isinstance(x, DTensor)]
        if replaced:
            raise InputError(
                f"{', '.join(replaced)} {'were' if len(replaced) > 1 else 'was'} replaced or removed after compiling "
                "(the plan's DTensor is gone). Fix: copy the new values into the compiled module's own "
                "(pmodel.load_state_dict(whole_state_dict), or with torch.no_grad(): p.copy_(distribute_tensor(new, "
                "p.device_mesh, p.placements))), or compile the changed model again"
            )
        return state

    def _local_inputs(self, inputs: tuple) -> list[torch.Tensor]:
        return [
            x if self.passes_own_part(name) else self.rank_part(name, x) for x, (_, name) in zip(inputs, self._inputs)
        ]

    def passes_own_part(self, name: str) -> bool:
        """Whether each rank passes only its own part of input ``name`` (its placements were
        pinned to a split) rather than the whole tensor."""
        return name in self._plan.pinned and any(isinstance(p, Shard) for p in self._layouts[name])

    def rank_part(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the parameter, buffer or input ``name`` of the given whole value."""
        return local_piece(whole, self._layouts[name], self._coordinate, self._mesh.shape)

    # state -------------------------------------------------------------------------------

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's whole parameters and buffers, with the model's own key names (what
        Hugging Face's ``save_pretrained(state_dict=...)`` or ``model.load_state_dict`` take).

        Every rank takes part in the gathers; with ``rank0_only`` the other ranks get ``{}``.
        """
        keep = not rank0_only or dist.get_rank() == 0
        state = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            whole = whole_of(t)  # every rank gathers; only the keeping ranks hold the whole tensors
            if keep:
                state[name] = whole
        return state

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load a state dict keyed by the model's own names (a whole one, as the model or
        :meth:`full_state_dict` gives it) or by this module's (``module.``-prefixed, as
        ``state_dict()`` and ``torch.distributed.checkpoint`` give it). Whole tensors are cut
        to this rank's pieces; DTensors are laid out as planned."""
        state_dict = _model_names(state_dict)
        current = self.module.state_dict(keep_vars=True)
        planned = {
            k: as_planned(k, current[k], v, self._coordinate, self._mesh.shape) if k in current else v
            for k, v in state_dict.items()
        }
        return self.module.load_state_dict(planned, strict=strict, assign=assign)

    def parameter_counts(self) -> ParameterCounts:
        """How many parameter values the model has, whole and on this rank (tied ones once)."""
        params = list(self.module.parameters())
        return ParameterCounts(whole=sum(p.numel() for p in params), this_rank=sum(local_of(p).numel() for p in params))

    def _apply(self, fn, recurse=True):
        if self._built:
            raise RuntimeError(
                "the compiled model's dtype or device cannot change (pmodel.to, .half, .cuda, ...): its per-rank "
                "program was planned for them. Fix: convert the model before autopar.compile, or autocast inside "
                "its forward for lower-precision compute"
            )
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a ParallelModule holds process groups and per-rank programs, which cannot be pickled or copied. "
            "Fix: save its plan (torch.save(pmodel.plan) or pmodel.plan.to_json()) and its state "
            "(torch.distributed.checkpoint, or pmodel.full_state_dict()), and compile the model again to restore it. "
            "For an average of the weights (torch.optim.swa_utils.AveragedModel copies its model), keep DTensors: "
            "ema = [p.detach().clone() for p in pmodel.parameters()], then after each step "
            "torch._foreach_lerp_(ema, [p.detach() for p in pmodel.parameters()], 1 - decay)"
        )


def _same_values(given: dict, planned: dict) -> bool:
    """Whether two calls' keyword settings are the same, in value and type (``1`` is not ``True``)."""
    return given.keys() == planned.keys() and all(
        type(value) is type(planned[name]) and value == planned[name] for name, value in given.items()
    )


_ACCUMULATING: "weakref.WeakSet[ParallelModule]" = weakref.WeakSet()
"""Modules that ran micro-batches under ``no_sync``, which every optimizer step checks."""
_step_hook = None


def _refuse_unsynced_steps(module: ParallelModule) -> None:
    """Make every optimizer refuse to step ``module``'s parameters while it holds gradients of
    micro-batches under ``no_sync`` that no backward has synchronised yet: their ``.grad`` would
    miss them."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_refuse_unsynced_step)
    _ACCUMULATING.add(module)


def _refuse_unsynced_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in list(_ACCUMULATING):
        if any(id(p) in stepped for p in module._unsynced_parameters()):
            raise RuntimeError(
                "the optimizer steps parameters whose gradients of micro-batches under pmodel.no_sync() were never "
                "synchronised: only the backward of a call outside no_sync() adds them to .grad. Fix: run the last "
                "micro-batch's forward and backward outside no_sync(), after the others' backward"
            )


_PLANNED: "weakref.WeakSet[ParallelModule]" = weakref.WeakSet()
"""Built modules, whose parameters' optimizers are checked at their first step."""
_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
"""Optimizers whose state has been checked against the plans of the modules they step."""
_state_hook = None


def _check_optimizer_state(module: ParallelModule) -> None:
    """Make the first step of every optimizer of ``module``'s parameters warn when it keeps more
    tensors per parameter than the plan's memory counts (``optimizer_slots``)."""
    global _state_hook
    if _state_hook is None:
        _state_hook = register_optimizer_step_post_hook(_warn_of_uncounted_state)
    _PLANNED.add(module)


def _warn_of_uncounted_state(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    stepped = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    for module in list(_PLANNED):
        params = [stepped[id(p)] for p in module.parameters() if id(p) in stepped and p.dim() > 0]  # not Adam's step
        if not params:
            continue
        kept = max(
            sum(torch.is_tensor(v) and v.shape == p.shape for v in optimizer.state.get(p, {}).values()) for p in params
        )
        planned = module.plan.optimizer_slots
        if kept > planned:
            log.warning(
                "%s keeps %d tensors the size of each parameter, but the plan's memory counts %d "
                "(optimizer_slots=%d): each device holds more than the plan predicts. Fix: plan with "
                "optimizer_slots=%d",
                type(optimizer).__name__,
                kept,
                planned,
                planned,
                kept,
            )


def _model_names(state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``state_dict`` keyed by the model's own names: without the ``module.`` prefix of this
    module's ``state_dict()`` (and of ``torch.distributed.checkpoint``'s) where every key has it."""
    prefix = "module."
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix) :]: v for k, v in state_dict.items()}
    return state_dict


def _refuse_split_pins_of_parts(captured: Captured, pins: Mapping[str, Placements]) -> None:
    split = [k.name for k in captured.inputs if k.kind == "input" and any(p.is_shard() for p in pins.get(k.name, ()))]
    if split:
        raise InputError(
            f"input {', '.join(repr(name) for name in split)} is pinned to a split, so every call passes this rank's "
            "part of it, and the first call's part does not say how large the whole batch is. Fix: pass "
            "example_inputs=(the global batch) to autopar.compile"
        )
