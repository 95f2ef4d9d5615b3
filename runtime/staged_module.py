"""The module ``autopar.compile(..., pipeline=Pipeline(...))`` returns: one rank's stage of a
pipelined plan (:mod:`autopar.runtime.pipeline`).

Each rank holds the parameters of its stage only, as DTensors on the mesh inside the stages;
the others' are freed. A call runs the whole step's schedule, forwards and backwards of every
micro-batch, and returns the batch's loss on every rank; ``backward()`` on it then writes the
gradients the schedule made (times the loss's gradient, 1 for ``loss.backward()``: the moves are
linear). Tools that would read every stage's parameters through ``pmodel.parameters()`` (torch's
``clip_grad_norm_``, an optimizer built over them, ``torch.distributed.checkpoint``) would see one
stage's only, so ``parameters()`` refuses and names the stage-aware methods instead.
"""

import datetime

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import capture
from autopar.passes.analysis.stages import assign_stages
from autopar.runtime.allocator import keep_freed_memory
from autopar.runtime.launch import device_mesh, device_type_of, ensure_process_group
from autopar.runtime.module import ParallelModule, _modes, _refuse_split_pins_of_parts
from autopar.runtime.pipeline import StageRunner
from autopar.runtime.program import check_plan, check_tensors, refuse_autocast
from autopar.runtime.state import ParameterCounts, gradient_as, local_of, piece_of, release
from torch.distributed.tensor import DTensor

from autopar.core.errors import InputError, RewriteError, StalePlanError
from autopar.core.mesh import Mesh
from autopar.core.pipeline import Pipeline, first_microbatch, inner_mesh, pins_inside, shared_batch
from autopar.core.plan import ShardingPlan


class PipelinedModule(ParallelModule):
    """A model running on every rank of a mesh under a plan with pipeline stages."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, *, pipeline: "Pipeline | str", **options):
        if isinstance(pipeline, Pipeline):
            pipeline.check(mesh)
        self._pipeline = pipeline
        super().__init__(model, mesh, **options)

    # building ----------------------------------------------------------------------------

    def _build(self, inputs: tuple, first_call: bool = False) -> None:
        """Plan (with ``pipeline="auto"``, choose between stages and none first), then build the
        stage this rank runs, or the module of a plan without stages."""
        check_tensors(inputs)
        device_type = device_type_of(self.module)
        if device_type == "meta":
            raise InputError(
                "pipeline stages do not yet build a model from the meta device. Fix: build it on a real device, "
                "or compile without pipeline="
            )
        if self._plan is None and self._searched:
            ensure_process_group(self._mesh, device_type)
            timeout = None if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
            self._world = None if timeout is None else dist.new_group(timeout=timeout)
            self._plan = self._plan_on_rank0(MicroBatches(self.module, inputs, self._param_dtype))
        if self._searched and self._plan is not None:
            if self._plan.stages is None:
                return super()._build(inputs, first_call)
            stages = self._plan.stages
            if self._pipeline == "auto" or self._pipeline.axis is None:  # pins on the whole mesh, as planned
                self._pins = pins_inside(self._pins, self._mesh, stages.axis)
            self._pipeline = Pipeline(
                axis=stages.axis,
                microbatches=stages.microbatches,
                schedule=stages.schedule,
                stages_per_rank=stages.stages_per_rank,
            )
        if device_type == "cuda":
            raise InputError(
                "pipeline stages run on gloo (CPU) only so far: their sends are not yet batched as NCCL needs "
                "(one stage's send and its peer's would wait on each other). Fix: compile without pipeline= on GPUs"
            )
        keep_freed_memory()
        self._whole_shapes = _batch_shapes(inputs, self._pipeline.microbatches)
        captured = capture(self.module, first_microbatch(inputs, self._pipeline.microbatches), self._param_dtype)
        self._modes_built = _modes(self.module)
        if first_call:
            _refuse_split_pins_of_parts(captured, self._pins)
        inner = self._lay_out(device_type)
        plan = self._plan if self._plan is not None else self._plan_on_rank0(captured)
        check_plan(plan, captured, inner, self._pins)
        _check_stages(plan, self._pipeline, self._whole_mesh)
        self._plan = plan
        self._runner = _on_every_stage(
            lambda: StageRunner(
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
            )  # fmt: skip
        )
        self._captured = self._runner.captured
        self._layouts = self._runner.layouts
        self._inputs = [
            (n.meta["val"], k.name) for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "input"
        ]
        self.collectives = self._runner.collectives
        self._shard_state(self._captured)
        self._release_other_stages()
        self._built = True

    @property
    def _searched(self) -> bool:
        """Whether planning chooses the stages (``pipeline="auto"``, or a Pipeline with parts left
        ``None``) and they are not chosen yet."""
        return self._pipeline == "auto" or not self._pipeline.complete

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
        self._device = torch.device("cpu")
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

    def _release_other_stages(self) -> None:
        mine = {k.name for k in self._captured.inputs if k.kind in ("param", "buffer")}
        for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if name not in mine:
                release(tensor)

    # running -----------------------------------------------------------------------------

    @property
    def _in_stages(self) -> bool:
        return self._built and self._plan.stages is not None

    def forward(self, *inputs):
        refuse_autocast()
        if not self._built:
            self._build(inputs, first_call=True)
        if not self._in_stages:
            return super().forward(*inputs)
        shapes, modes = self._whole_key(inputs)
        if shapes != self._whole_shapes or modes != self._modes_built:
            raise InputError(
                f"the pipelined plan was made for inputs of shapes {self._whole_shapes} in "
                f"{'training' if self.module.training else 'eval'} mode as now, got {shapes}"
                f"{'' if modes == self._modes_built else ' in another mode'}; pipeline stages do not yet lower the "
                "plan for other sizes or modes, and every rank passes the whole batch (not its part). Fix: pass "
                "batches of the planned size (DataLoader(drop_last=True)) in the planned mode, or compile again"
            )
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

    def named_parameters(self, *args, **kwargs):
        if not self._in_stages:
            return super().named_parameters(*args, **kwargs)
        self.parameters()

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
        return optimizer_class(self.stage_parameters(), **options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._in_stages:
            return super().zero_grad(set_to_none)
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

    def no_sync(self):
        if not self._in_stages:
            return super().no_sync()
        raise InputError(
            "pipeline stages accumulate over their micro-batches already; no_sync() is not needed. Fix: raise "
            "Pipeline(microbatches=...) instead of accumulating outside"
        )

    def full_state_dict(self, *, rank0_only: bool = False):
        if not self._in_stages:
            return super().full_state_dict(rank0_only=rank0_only)
        raise InputError(_NO_CHECKPOINT)

    def state_dict(self, *args, **kwargs):
        if not self._in_stages:
            return super().state_dict(*args, **kwargs)
        raise InputError(_NO_CHECKPOINT)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if not self._in_stages:
            return super().load_state_dict(state_dict, strict, assign)
        raise InputError(_NO_CHECKPOINT)


_NO_CHECKPOINT = (
    "checkpoints of a pipelined module are not supported yet: each rank holds one stage's parameters. Fix: compile "
    "without pipeline= to save or load state"
)


class MicroBatches:
    """Captures the model on one of ``m`` micro-batches of ``inputs`` (what ``pipeline="auto"``
    plans each candidate on)."""

    def __init__(self, module: torch.nn.Module, inputs: tuple, param_dtype):
        self.module, self.inputs, self.param_dtype = module, inputs, param_dtype
        self.batch = shared_batch(inputs)

    def __call__(self, microbatches: int):
        return capture(self.module, first_microbatch(self.inputs, microbatches), self.param_dtype)


class _Step(torch.autograd.Function):
    """The step's schedule as one autograd function of the stage's state: its result is the
    batch's loss, and its backward hands out the gradients the schedule made."""

    @staticmethod
    def forward(ctx, module: PipelinedModule, local, divisor, backward: bool, *state):
        runner = module._runner
        kinds = [k for k in module._captured.inputs if k.kind in ("param", "buffer")]
        loss, grads = runner.step({k.name: piece_of(x) for k, x in zip(kinds, state)}, local, divisor, backward)
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
        scale = None if bool(tangent == 1) else tangent
        grads = [
            gradient_as(g if g is None or scale is None else g * scale.to(g.dtype), spec)
            for g, spec in zip(ctx.grads, ctx.specs)
        ]
        ctx.grads = None
        return (None, None, None, None, *grads)


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
