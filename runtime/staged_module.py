"""The module ``autopar.compile(..., pipeline=Pipeline(...))`` returns: one rank's stage of a
pipelined plan (:mod:`autopar.runtime.pipeline`).

Each rank holds the parameters of its stage only, as DTensors on the mesh inside the stages;
the others' are taken out of the model (``None`` in their modules' tables, as pruning leaves
them). So the model's state dict and ``named_parameters()`` are the stage's, and
``torch.distributed.checkpoint`` saves every stage's entries under the model's own names (a
weight tied across stages, equal on both, once), to be loaded under any plan. A call runs the
whole step's schedule, forwards and backwards of every micro-batch, and returns the batch's loss
on every rank; ``backward()`` on it then writes the gradients the schedule made (times the
loss's gradient, 1 for ``loss.backward()``: the moves are linear). ``pmodel.parameters()``, which
torch's ``clip_grad_norm_`` and parameter counts read, refuses: they would see one stage's only;
``pmodel.clip_grad_norm_`` and ``parameter_counts`` combine the stages. Other batch sizes and
the eval mode lower the same plan again where the model runs the planned ops."""

import datetime
import logging
import time

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import Captured, capture
from autopar.passes.analysis.stages import assign_stages
from autopar.passes.lower.rewrite import check_fits, runs_planned_ops
from autopar.runtime.allocator import keep_freed_memory
from autopar.runtime.launch import device_mesh, device_type_of, ensure_process_group
from autopar.runtime.module import (
    ParallelModule,
    _model_names,
    _refuse_split_pins_of_parts,
)
from autopar.runtime.pipeline import StageRunner
from autopar.runtime.program import (
    Unsynced,
    check_plan,
    check_tensors,
    refuse_autocast,
    refuse_input_gradients,
    refuse_second_order,
)
from autopar.runtime.state import ParameterCounts, gradient_as, local_of, piece_of, release, whole_fake_state
from torch.distributed.tensor import DTensor

from autopar.core.errors import InputError, RewriteError, StalePlanError
from autopar.core.mesh import Mesh
from autopar.core.pipeline import (
    Pipeline,
    first_microbatch,
    inner_mesh,
    pins_inside,
    pins_name_whole_mesh,
    planning_chooses,
    shared_batch,
)
from autopar.core.plan import ShardingPlan

log = logging.getLogger("autopar")


class PipelinedModule(ParallelModule):
    """A model running on every rank of a mesh under a plan with pipeline stages."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, *, pipeline: "Pipeline | str", **options):
        if isinstance(pipeline, Pipeline):
            pipeline.check(mesh)
        self._pipeline = pipeline
        self._sums: dict[int, Unsynced] = {}
        """Each of this rank's stages' gradient sums under ``no_sync``, by stage, for every input size."""
        self._round = _Round()
        """The calls under ``no_sync`` the sums hold."""
        self._elsewhere: list[tuple[dict, str, torch.Tensor]] = []
        """The tables, names and whole-shape meta stand-ins of the tensors only other ranks'
        stages hold (:meth:`_drop_other_stages`)."""
        self._frozen: set[str] | None = None
        """The parameters that required no gradient when the stages were lowered."""
        super().__init__(model, mesh, **options)

    # building ----------------------------------------------------------------------------

    def _build(self, inputs: tuple, first_call: bool = False) -> None:
        """Plan (with ``pipeline="auto"``, choose between stages and none first), then build the
        stage this rank runs, or the module of a plan without stages."""
        check_tensors(inputs)
        device_type = device_type_of(self.module)
        if device_type == "meta":  # each rank materialises its stage's pieces
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device("cpu")
        if self._plan is None and self._searched:
            ensure_process_group(self._mesh, device_type)
            timeout = None if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
            self._world = None if timeout is None else dist.new_group(timeout=timeout)
            self._plan = self._plan_on_rank0(MicroBatches(self, inputs))
        if self._searched and self._plan is not None:
            if self._plan.stages is None:
                return super()._build(inputs, first_call)
            stages = self._plan.stages
            if pins_name_whole_mesh(self._pipeline):  # as planned
                self._pins = pins_inside(self._pins, self._mesh, stages.axis)
            self._pipeline = stages.pipeline
        if device_type == "cuda":
            raise InputError(
                "pipeline stages run on gloo (CPU) only so far: their sends are not yet batched as NCCL needs "
                "(one stage's send and its peer's would wait on each other). Fix: compile without pipeline= on GPUs"
            )
        keep_freed_memory()
        whole_shapes = _batch_shapes(inputs, self._pipeline.microbatches)
        captured = self._capture(first_microbatch(tuple(x.detach() for x in inputs), self._pipeline.microbatches))
        if first_call:
            _refuse_split_pins_of_parts(captured, self._pins)
        inner = self._lay_out(device_type)
        plan = self._plan
        if plan is None:  # in given stages, whose planner compares the micro-batch's graph with the batch's
            plan = self._plan_on_rank0(captured, capture_at=MicroBatches(self, tuple(x.detach() for x in inputs)))
        check_plan(plan, captured, inner, self._pins)
        _check_stages(plan, self._pipeline, self._whole_mesh)
        self._plan = plan
        self._runners = {(whole_shapes, self._modes_now()): _on_every_stage(lambda: self._stage_runner(captured))}
        """This rank's stages lowered for each size of the whole batch and mode of the model."""
        self._use(next(iter(self._runners)))
        self._inputs = [
            (n.meta["val"], k.name) for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "input"
        ]
        self._state_keys = list(self.module.state_dict(keep_vars=True))
        """The model's state dict keys, every stage's, in the model's order."""
        read = {id(self._tensor_of(k)) for k in captured.inputs if k.kind in ("param", "buffer")}
        mine = {id(self._tensor_of(k)) for k in self._captured.inputs if k.kind in ("param", "buffer")}
        self._shard_state(self._captured, elsewhere=frozenset(read - mine))
        self._drop_other_stages(read - mine)
        self._built = True

    def _capture(self, inputs: tuple, shapes: tuple | None = None) -> Captured:
        """The model captured on ``inputs`` (one micro-batch), or on fake tensors like them of
        ``shapes``, with fake tensors of the whole shapes in place of its DTensors, of meta
        tensors, and of the tensors only other ranks' stages hold."""
        for table, name, stand_in in self._elsewhere:
            table[name] = stand_in
        try:
            with whole_fake_state(self.module, self._device) as mode:
                if shapes is not None:
                    with mode:
                        inputs = tuple(torch.empty(n, dtype=x.dtype, device=x.device) for n, x in zip(shapes, inputs))
                return capture(self.module, inputs, self._param_dtype, self._keywords, self._fixed)
        finally:
            for table, name, _ in self._elsewhere:
                table[name] = None

    def _stage_runner(self, captured: Captured, plan: ShardingPlan | None = None) -> StageRunner:
        plan = plan or self._plan
        return StageRunner(
            captured,
            plan,
            assign_stages(captured, plan.stages.segments),
            self._position,
            self._coordinate,
            self._groups,
            self._peers,
            self._backend,
            self._timeout_s,
            self._device,
            self._sums,
        )

    def _stage_pins(self, captured: Captured) -> dict:
        """The plan's placements of the parameters, buffers and inputs, which a plan of other ops
        in the same stages keeps (each rank's pieces stay where they are)."""
        return {**self._state_pins(captured), **self._plan.inputs}

    def _running_graph_hash(self) -> str:
        return self._runner.graph_hash if self._in_stages else super()._running_graph_hash()

    def _use(self, key: tuple) -> None:
        """Run the stages lowered for whole batches of these shapes, in this mode, from now."""
        self._runner, self._key = self._runners[key], key
        self._captured = self._runner.captured
        self._layouts = self._runner.layouts
        self.collectives = self._runner.collectives

    def _lower_for(self, key: tuple, inputs: tuple) -> None:
        """Lower the plan's stages for whole batches of other shapes or another mode (the model
        captured again on fake tensors, the plan checked to fit, no solving), on every rank.
        Where the model runs other ops there (eval mode without dropout), those are planned in
        the same stages, the parameters, buffers and inputs pinned where they are."""
        shapes, count = key[0], self._pipeline.microbatches

        def lowered() -> StageRunner:
            started = time.perf_counter()
            captured = self._capture(inputs, tuple((s[0] // count, *s[1:]) for s in shapes))
            if self._same_program(captured, key):
                return self._runner
            changed = self._count_settings_capture(key)
            plan = self._plan
            if not runs_planned_ops(captured, plan):
                plan = self._plan_on_rank0(captured, self._stage_pins(captured), stages=plan.stages)
            check_fits(captured, plan)
            runner = self._stage_runner(captured, plan)
            log.log(
                logging.WARNING if changed else logging.INFO,
                "lowered %s for input shapes %s (%s mode%s) in %.1f s",
                "the stages' plan" if plan is self._plan else "a plan in the same stages",
                ", ".join(map(str, shapes)),
                "training" if self.module.training else "eval",
                f"; the model's settings changed, {changed}" if changed else "",
                time.perf_counter() - started,
            )
            return runner

        self._runners[key] = self._runners[key[0], self._modes_now()] = _on_every_stage(lowered)

    @property
    def _searched(self) -> bool:
        """Whether planning chooses the stages (``pipeline="auto"``, or a Pipeline with parts left
        ``None``) and they are not chosen yet."""
        return planning_chooses(self._pipeline)

    def _lay_out(self, device_type: str) -> Mesh:
        """Lay the mesh over the ranks: this rank's stage, its peers on the other stages (at its
        position inside them) and the mesh inside the stages, which it returns."""
        whole, axis = self._mesh, self._pipeline.axis
        inner = inner_mesh(whole, axis)
        laid = whole if set(inner.axis_names) <= set(whole.axis_names) else _with_axis(whole, inner)
        timeout = None if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
        mesh = device_mesh(laid, device_type, timeout)
        if not hasattr(self, "_world"):  # pipeline="auto" made it to broadcast its choice
            self._world = None if timeout is None else dist.new_group(timeout=timeout)
        where = tuple(int(c) for c in mesh.get_coordinate())
        at = laid.axis_names.index(axis)
        kept = [i for i, name in enumerate(laid.axis_names) if name in inner.axis_names]
        self._coordinate = tuple(where[i] for i in kept)
        self._groups = [mesh.get_group(i).group_name for i in kept]
        self._peers = [
            int(mesh.mesh[tuple(t if i == at else c for i, c in enumerate(where))]) for t in range(mesh.size(at))
        ]
        self._position, self._stage_group = where[at], mesh.get_group(at)
        self._device_mesh = mesh[inner.axis_names if len(inner.axis_names) > 1 else inner.axis_names[0]]
        self._whole_mesh, self._mesh = whole, inner  # pieces are cut on the mesh inside the stages
        return inner

    def _drop_other_stages(self, elsewhere: set[int]) -> None:
        """Take the parameters and buffers that only other positions' stages read (by id,
        ``elsewhere``) out of the model: ``None`` in their modules' tables, as
        torch's pruning leaves them, so that the model's state dict, ``named_parameters()`` and
        ``torch.distributed.checkpoint`` hold this rank's stages' own. Each is remembered as a
        meta tensor of its whole shape (one for tied ones), to capture the model again."""
        stand_ins: dict[int, torch.Tensor] = {}
        for sub in self.module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is None or id(tensor) not in elsewhere:
                        continue
                    if id(tensor) not in stand_ins:
                        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                        is_param = isinstance(tensor, torch.nn.Parameter)
                        stand_ins[id(tensor)] = (
                            torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta
                        )
                        release(tensor)
                    self._elsewhere.append((table, name, stand_ins[id(tensor)]))
                    table[name] = None

    # running -----------------------------------------------------------------------------

    def _modes_now(self, requires_grad: bool = True) -> tuple:
        """Under stages, less the parameters' ``requires_grad`` flags, which ranks holding other
        stages cannot see: a change after compiling is refused instead."""
        if self._plan is None or self._plan.stages is None:
            return super()._modes_now(requires_grad)
        frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
        if self._frozen is None:
            self._frozen = frozen
        elif frozen != (was := self._frozen & {name for name, _ in self.module.named_parameters()}):
            raise InputError(
                f"parameters {', '.join(sorted(frozen ^ was))} were frozen or unfrozen after compiling into pipeline "
                "stages, whose ranks hold other stages' parameters and cannot follow (ranks of other stages wait for "
                "this one until the timeout=). Fix: set requires_grad before autopar.compile, or compile again"
            )
        return super()._modes_now(requires_grad=False)

    @property
    def _in_stages(self) -> bool:
        return self._built and self._plan.stages is not None

    def _run(self, inputs: tuple):
        refuse_autocast()
        check_tensors(inputs)
        refuse_input_gradients(inputs)
        if not self._built:
            self._build(inputs, first_call=True)
        if not self._in_stages:
            return super()._run(inputs)
        self._round.check()
        key = self._whole_key(inputs)
        self._check_same_inputs(inputs)
        if key not in self._runners:
            _batch_shapes(inputs, self._pipeline.microbatches)
            self._lower_for(key, inputs)
        self._use(key)
        count = self._pipeline.microbatches
        slices = [tuple(x.chunk(count)[m] for x in inputs) for m in range(count)]  # whole micro-batches
        divisor = self._runner.batch_divisor(slices)
        read = {k.name for k in self._captured.inputs if k.kind == "input"}
        local = [
            {name: self.rank_part(name, x) for x, (_, name) in zip(micro, self._inputs) if name in read}
            for micro in slices
        ]
        return _Step.apply(self, local, divisor, torch.is_grad_enabled(), *self._state())

    def passes_own_part(self, name: str) -> bool:
        """With stages every rank passes the whole batch: the stages cut it into micro-batches first."""
        return super().passes_own_part(name) if not self._in_stages else False

    # the stage's parameters ----------------------------------------------------------------

    def stage_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of this rank's stage (DTensors on the mesh inside the stages)."""
        return [self.module.get_parameter(k.name) for k in self._captured.inputs if k.kind == "param"]

    def parameters(self, recurse: bool = True):
        if not self._in_stages:
            return super().parameters(recurse)
        raise TypeError(
            "with pipeline stages each rank holds its stage's parameters only, so torch tools reading "
            "pmodel.parameters() (clip_grad_norm_, an optimizer, a parameter count) would see one stage. Fix: "
            "pmodel.optimizer(torch.optim.AdamW, ...), pmodel.clip_grad_norm_(max_norm), and "
            "pmodel.stage_parameters() for this stage's"
        )

    def _counted(self) -> list[torch.nn.Parameter]:
        """This stage's parameters but the copies of weights tied to another stage's, which that
        stage counts."""
        return [
            self.module.get_parameter(k.name)
            for k in self._captured.inputs
            if k.kind == "param" and k.name not in self._runner.copies
        ]

    def parameter_counts(self) -> ParameterCounts:
        """How many parameter values the model has (every stage's, tied ones once), and on this rank
        (copies of weights tied to another stage included)."""
        if not self._in_stages:
            return super().parameter_counts()
        mine = self._counted()
        whole = torch.tensor([sum(p.numel() for p in mine)], device=self._device)
        dist.all_reduce(whole, group=self._stage_group)
        return ParameterCounts(whole=int(whole), this_rank=sum(local_of(p).numel() for p in self.stage_parameters()))

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **options):
        """An optimizer of ``optimizer_class`` over this rank's stage's parameters."""
        if not self._in_stages:
            return super().optimizer(optimizer_class, **options)
        if self._plan.host_optimizer:
            raise InputError(
                "the pipelined plan keeps optimizer state in host memory, which pipeline stages do not run yet. "
                "Fix: compile with a larger memory_budget"
            )
        self._optimizer_checked = True
        optimizer = optimizer_class(self.stage_parameters(), **options)
        optimizer.register_load_state_dict_pre_hook(_check_groups_loaded)
        return optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._in_stages:
            return super().zero_grad(set_to_none)
        self._drop_sums()
        for p in self.stage_parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every stage's gradients: each stage's norm
        (over the mesh inside it, as DTensor computes it) is combined along the pipeline axis,
        and every stage scales its gradients by the same factor. Returns the total norm."""
        if not self._in_stages:
            return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)
        grads = [p.grad for p in self._counted() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=self._device)
        norm = local_of(norm.full_tensor() if hasattr(norm, "full_tensor") else norm).to(self._device)
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self._stage_group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=self._stage_group)
            norm = norm.pow(1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(self.stage_parameters(), max_norm, norm)
        return norm

    def _drop_sums(self) -> None:
        for sums in self._sums.values():
            sums.take()
        self._round = _Round()

    def _unsynced_parameters(self) -> list[torch.nn.Parameter]:
        if not self._in_stages:
            return super()._unsynced_parameters()
        return self.stage_parameters() if self._round.pending else []

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, every stage's, with the model's own key
        names: each stage gathers its own inside, and the stages exchange them along the
        pipeline axis (to rank 0 only with ``rank0_only``; the other ranks get ``{}``)."""
        if not self._in_stages:
            return super().full_state_dict(rank0_only=rank0_only)
        own = super().full_state_dict()
        if rank0_only and any(self._coordinate):  # rank 0's stage group is the one at the first place inside
            return {}
        parts: list = [None] * self._stage_group.size()
        if rank0_only:
            dist.gather_object(own, parts if dist.get_rank() == 0 else None, dst=0, group=self._stage_group)
            if dist.get_rank() != 0:
                return {}
        else:
            dist.all_gather_object(parts, own, group=self._stage_group)
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged[k] for k in self._state_keys if k in merged}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load this rank's stages' entries of a state dict: a whole one (the model's names, as
        the model or :meth:`full_state_dict` gives it, every stage's) or this module's
        (``module.``-prefixed, as ``state_dict()`` and ``torch.distributed.checkpoint`` give
        it). Entries of other stages are skipped; ``strict`` still refuses keys the model does
        not have, and this stage's keys missing."""
        if not self._in_stages:
            return super().load_state_dict(state_dict, strict, assign)
        state_dict = _model_names(state_dict)
        here = set(self.module.state_dict(keep_vars=True))
        elsewhere = set(self._state_keys) - here
        return super().load_state_dict(
            {k: v for k, v in state_dict.items() if k not in elsewhere}, strict=strict, assign=assign
        )


def _check_groups_loaded(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Refuse, before loading, optimizer state whose parameter groups lost their
    hyperparameters: a checkpoint of stages saved without flattening keeps one stage's groups
    (every stage saves its own under the same key), in which the other stages' parameters are
    not."""
    for group in state_dict["param_groups"]:
        if set(group) <= {"params"}:
            raise InputError(
                "the optimizer state loaded has no hyperparameters for this stage's parameters: a checkpoint of "
                "pipeline stages keeps each stage's parameter groups only when the optimizer's state dict is "
                "flattened. Fix: pass options=StateDictOptions(flatten_optimizer_state_dict=True) to get_state_dict "
                "and set_state_dict, when saving and when loading"
            )


class MicroBatches:
    """Captures the model on one of ``m`` micro-batches of ``inputs`` (what ``pipeline="auto"``
    plans each candidate on)."""

    def __init__(self, module: PipelinedModule, inputs: tuple):
        self.module, self.inputs = module, inputs
        self.batch = shared_batch(inputs)

    def __call__(self, microbatches: int) -> Captured:
        return self.module._capture(first_microbatch(self.inputs, microbatches))


class _Step(torch.autograd.Function):
    """The step's schedule as one autograd function of the stage's state: its result is the
    batch's loss, and its backward hands out the gradients the schedule made."""

    @staticmethod
    def forward(ctx, module: PipelinedModule, local, divisor, backward: bool, *state):
        runner = module._runner
        kinds = [k for k in module._captured.inputs if k.kind in ("param", "buffer")]
        pieces = {k.name: piece_of(x) for k, x in zip(kinds, state)}
        held = module._round.held
        try:
            loss, grads = runner.step(pieces, local, divisor, backward, module._sync, held > 0)
        except BaseException:
            if backward and (held or not module._sync):  # the sums of the round are incomplete
                module._drop_sums()
                module._round.broken = True
            raise
        ctx.module, ctx.synced, ctx.held = module, module._sync, 0
        if backward and not module._sync:
            module._round.held += 1
        elif backward and held:  # the sums of the calls before are in these gradients now
            ctx.held, module._round.taken = held, True
        ctx.grads = [grads.get(k.name) if k.kind == "param" else None for k in kinds]
        ctx.specs = [x._spec if isinstance(x, DTensor) else None for x in state]
        if runner.makes_loss:
            whole = loss.contiguous()
        else:
            whole = torch.empty((), dtype=runner.loss_dtype, device=module._device)
        dist.broadcast(whole, src=module._peers[runner.output_position], group=module._stage_group)
        return whole

    @staticmethod
    def backward(ctx, tangent):
        refuse_second_order()
        if not ctx.synced:
            ctx.module._round.tangents.append(tangent.detach().clone())
            return (None, None, None, None, *[None] * len(ctx.grads))
        if ctx.held:
            tangents = ctx.module._round.tangents
            ctx.module._round = _Round()
            _check_accumulated(ctx.held, tangents, tangent)
        scale = None if bool(tangent == 1) else tangent
        grads = [
            gradient_as(g if g is None or scale is None else g * scale.to(g.dtype), spec)
            for g, spec in zip(ctx.grads, ctx.specs)
        ]
        ctx.grads = None
        return (None, None, None, None, *grads)


class _Round:
    """A round of gradient accumulation over calls under ``no_sync``: the calls whose gradients
    the sums hold (a call runs its backward schedule, adding them, before its loss's backward),
    the gradients their losses got, and whether a call outside took the sums (its backward then
    pending) or a call failed half-way (the sums then lost)."""

    def __init__(self):
        self.held, self.tangents, self.taken, self.broken = 0, [], False, False

    @property
    def pending(self) -> bool:
        """Whether gradients of the round are not in ``.grad`` yet, or lost."""
        return bool(self.held or self.taken or self.broken)

    def check(self) -> None:
        """Refuse a call while the round cannot go on."""
        if self.broken:
            raise InputError(
                "a call failed half-way in a round of gradient accumulation under no_sync(), and the gradients the "
                "round summed are lost. Fix: pmodel.zero_grad() and run the round again"
            )
        if self.taken:
            raise InputError(
                "the last call added the gradients of the calls under no_sync() before it to its own, but no backward "
                "ran on its loss, so they never reached .grad. Fix: call backward() on the loss of the call after "
                "no_sync(), or pmodel.zero_grad() to drop the round"
            )


def _check_accumulated(held: int, tangents: list[torch.Tensor], tangent: torch.Tensor) -> None:
    """Refuse gradients made with the sums of calls under ``no_sync`` where they are not what
    one device would make: the sums were added unscaled before this call's collectives and
    scale by this call's loss's gradient, so every call's loss must have had the same one, and
    every call one backward."""
    if len(tangents) != held:
        raise InputError(
            f"the {held} calls under no_sync() before this one ran {len(tangents)} backwards, but pipeline stages add "
            "a call's gradients to the sums once, when it runs. Fix: call backward() once on the loss of every call "
            "under no_sync(), or pmodel.zero_grad() to drop the round"
        )
    if any(not torch.equal(t, tangent) for t in tangents):
        raise InputError(
            "the calls under no_sync() gave their losses other gradients than this call's (e.g. loss * 0.5 and "
            "loss * 0.25): pipeline stages sum the calls' gradients before this call's, which scale alike. Fix: scale "
            "every call's loss by the same factor (loss / number of calls), or accumulate without no_sync()"
        )


def _on_every_stage(build):
    """``build()``, once every rank of the job has built its part: a stage that cannot build its
    part raises its error, and the others raise one naming it, instead of waiting for its sends."""
    try:
        made, failed = build(), None
    except Exception as exc:  # any failure, reported to the other stages before it is raised
        made, failed = None, exc
    flag = torch.tensor([0 if failed is None else dist.get_rank() + 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failed is not None:
        raise failed
    if int(flag):
        raise RewriteError(f"rank {int(flag) - 1} could not build its pipeline stage; its error says why")
    return made


def _with_axis(mesh: Mesh, inner: Mesh) -> Mesh:
    """``mesh`` with the one-position axis of ``inner`` (a mesh that is all pipeline axis)."""
    return Mesh(mesh.shape + inner.shape, mesh.axis_names + inner.axis_names)


def _batch_shapes(inputs: tuple, microbatches: int) -> tuple:
    """The inputs' shapes, once checked to share a dim 0 (the batch) that ``microbatches`` divides."""
    batch = shared_batch(inputs)
    if not batch or batch % microbatches:
        raise InputError(
            f"inputs of shapes {', '.join(str(tuple(x.shape)) for x in inputs)} cannot be cut into {microbatches} "
            "micro-batches: pipeline stages cut every input along dim 0, the batch, which all must share. Fix: a "
            f"batch size that Pipeline(microbatches={microbatches}) divides, and inputs batched along dim 0"
        )
    return tuple(tuple(x.shape) for x in inputs)


def _check_stages(plan: ShardingPlan, pipeline: Pipeline, mesh: Mesh) -> None:
    stages = plan.stages
    if stages is None:
        raise StalePlanError("the plan has no pipeline stages but pipeline= asks for them. Fix: plan with pipeline=")
    asked = (mesh, pipeline.axis, pipeline.microbatches, pipeline.schedule, pipeline.stages_per_rank)
    if (stages.mesh, stages.axis, stages.microbatches, stages.schedule, stages.stages_per_rank) != asked:
        raise StalePlanError(
            f"the plan's stages ({stages.axis} of {stages.mesh}, {stages.microbatches} micro-batches, "
            f"{stages.schedule}, {stages.stages_per_rank} per rank) are not those pipeline= asks for ({pipeline.axis} "
            f"of {mesh}, {pipeline.microbatches}, {pipeline.schedule}, {pipeline.stages_per_rank}). Fix: plan again "
            "with this pipeline="
        )
