"""``autopar.compile``: plan a model for a mesh and run it on the current process group."""

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from autopar.config import Pins, PlanConfig
from autopar.core.mesh import Mesh
from autopar.core.pipeline import Pipeline, Stages, given_parts, pinned_mesh, planning_chooses
from autopar.core.plan import ShardingPlan
from autopar.core.precision import MixedPrecision
from autopar.cost_model.hardware import Profile
from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.liveness import ADAM_SLOTS
from autopar.planner import check_mesh, plan_with
from autopar.runtime.module import BACKENDS, ParallelModule
from autopar.runtime.staged_module import PipelinedModule
from autopar.stage_search import check_pipeline, plan_again_in, plan_auto, plan_stages


def default_backend(model: torch.nn.Module) -> str:
    """Inductor on GPUs; eager on CPUs, where compiling costs more than a short run gains."""
    param = next(model.parameters(), None)
    on_gpu = param is not None and (param.device.type == "cuda" or (param.is_meta and torch.cuda.is_available()))
    return "inductor" if on_gpu else "eager"


def compile(
    model: torch.nn.Module | None = None,
    mesh: Mesh | None = None,
    example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None,
    *,
    hardware: "str | Profile" = "h100",
    pins: Pins | None = None,
    memory_budget: "int | str | None" = None,
    plan: ShardingPlan | None = None,
    backend: str | None = None,
    fallback: bool = True,
    solver_time_limit_s: float = 120.0,
    solver_gap: float = 1e-3,
    share_layers: bool | None = None,
    recompute: str = "auto",
    init_weights: "Callable[[torch.nn.Module], None] | None" = None,
    timeout: float | None = None,
    mixed_precision: MixedPrecision | None = None,
    optimizer_slots: int = ADAM_SLOTS,
    pipeline: "Pipeline | str | None" = None,
):
    """Parallelize ``model`` over ``mesh`` and return a module that trains on every rank.

    Call it on every rank of a process group of ``mesh.size`` ranks (``autopar run -n N
    script.py`` starts one). Rank 0 plans and the plan is broadcast, unless ``plan`` is given.
    Without ``example_inputs`` the inputs of the first call are used; given as a dict, or when
    the first call passes tensors by keyword (``pmodel(input_ids=ids, labels=ids)``), later calls
    pass those by the same keywords. The model's parameters are replaced in place by their local
    pieces.

    Used without a model it is a decorator for a module class or a module-returning function::

        @autopar.compile(mesh=Mesh((4,), ("dp",)))
        class Net(nn.Module): ...

    Options are those of :func:`autopar.plan`, plus ``plan`` (run this plan instead of solving),
    ``backend``: ``"inductor"`` or ``"eager"`` (default: Inductor on CUDA, eager on CPU), and
    ``init_weights``: for a model built under ``torch.device("meta")``, a function that
    initialises one module's own parameters and buffers in place (default: each module's
    ``reset_parameters()``); each rank then allocates and keeps only its pieces; and
    ``mixed_precision``: a :class:`~autopar.core.precision.MixedPrecision` policy (compute in
    ``param_dtype`` with float32 master parameters and optimizer state); and
    ``timeout``: seconds after which a collective on the mesh that some rank does not join
    fails (default: ``autopar run --timeout``'s when it started the ranks, else the process
    group's, 30 minutes for gloo, 10 for NCCL). On gloo the
    program's collectives then raise :class:`~autopar.core.errors.CollectiveError` on every rank that
    waits; on NCCL, torch's watchdog aborts the waiting processes; and ``pipeline``: an
    :class:`~autopar.core.pipeline.Pipeline` that turns one mesh axis into pipeline stages
    (:class:`~autopar.runtime.staged_module.PipelinedModule`), ``"auto"`` to let planning choose
    whether and how (:mod:`autopar.stage_search`), or ``None`` (default) for none.
    """
    options = dict(
        hardware=hardware,
        pins=pins,
        memory_budget=memory_budget,
        plan=plan,
        backend=backend,
        fallback=fallback,
        solver_time_limit_s=solver_time_limit_s,
        solver_gap=solver_gap,
        share_layers=share_layers,
        recompute=recompute,
        init_weights=init_weights,
        timeout=timeout,
        mixed_precision=mixed_precision,
        optimizer_slots=optimizer_slots,
        pipeline=pipeline,
    )
    if model is None:
        if mesh is None:
            raise TypeError("autopar.compile needs mesh=..., e.g. @autopar.compile(mesh=Mesh((4,), ('dp',)))")
        return functools.partial(_decorate, mesh=mesh, example_inputs=example_inputs, options=options)
    return _parallelize(model, mesh, example_inputs, options)


def _parallelize(model, mesh: Mesh | None, example_inputs, options: dict) -> ParallelModule:
    """:func:`compile` of a model: check the arguments, then wrap the model in a module that plans
    with the checked options (or runs the given plan)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"autopar.compile takes a torch.nn.Module, got {type(model).__name__}")
    if mesh is None:
        raise TypeError("autopar.compile needs a mesh, e.g. autopar.compile(model, Mesh((2, 2), ('dp', 'tp')))")
    check_mesh(mesh)
    config = PlanConfig.of(options)
    pipeline = check_pipeline(options["pipeline"], mesh, options["pins"])
    pins = config.pins_for(pinned_mesh(pipeline, mesh))
    plan, backend, timeout = options["plan"], options["backend"], options["timeout"]
    if timeout is None:
        timeout = _timeout_of_the_launch()
    _check_run_options(plan, backend, timeout)
    run = dict(
        example_inputs=example_inputs,
        plan=plan,
        backend=backend or default_backend(model),
        pins=pins,
        init_weights=options["init_weights"],
        timeout_s=timeout,
        param_dtype=config.param_dtype,
    )
    if planning_chooses(pipeline):
        planner = functools.partial(_plan_auto, mesh=mesh, config=config, given=given_parts(pipeline))
        return PipelinedModule(model, mesh, pipeline=pipeline, planner=planner, **run)
    if pipeline is not None:
        planner = functools.partial(_plan_stages, mesh=mesh, pipeline=pipeline, config=config)
        return PipelinedModule(model, mesh, pipeline=pipeline, planner=planner, **run)
    planner = lambda captured, state_pins=None: plan_with(captured, mesh, config.with_pins(state_pins or {}))  # noqa: E731
    return ParallelModule(model, mesh, planner=planner, **run)


def _plan_auto(
    micro, state_pins=None, stages: Stages | None = None, *, mesh: Mesh, config: PlanConfig, given: Pipeline | None
) -> ShardingPlan:
    """``pipeline="auto"``'s choice (or, ``given`` a Pipeline with parts left ``None``, the
    choice of those parts) for a model's first inputs (``micro`` captures it on micro-batches of
    them); a graph captured at other sizes or in another mode is planned in the ``stages``
    chosen, or without once it chose none."""
    if stages is not None:
        return plan_again_in(micro, mesh, stages, state_pins, config)
    if isinstance(micro, Captured):
        return plan_with(micro, mesh, config.with_pins(state_pins or {}))
    return plan_auto(micro, micro.batch, mesh, config.with_pins(state_pins or {}), given)


def _plan_stages(
    captured,
    state_pins=None,
    stages: Stages | None = None,
    capture_at: Callable[[int], Captured] | None = None,
    *,
    mesh: Mesh,
    pipeline: Pipeline,
    config: PlanConfig,
) -> ShardingPlan:
    """The plan in ``pipeline``'s stages (``capture_at`` capturing the model on one of ``m``
    micro-batches, for the check of :func:`~autopar.stage_search.plan_stages`); a graph captured
    at other sizes or in another mode is planned in the ``stages`` its first plan cut."""
    if stages is not None:
        return plan_again_in(captured, mesh, stages, state_pins, config)
    return plan_stages(captured, mesh, pipeline, config.with_pins(state_pins or {}), capture_at=capture_at)


TIMEOUT_VARIABLE = "AUTOPAR_TIMEOUT_S"
"""The environment variable through which ``autopar run --timeout`` gives every rank its
default ``timeout``."""


def _timeout_of_the_launch() -> float | None:
    value = os.environ.get(TIMEOUT_VARIABLE)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT_VARIABLE}={value!r} is not a number of seconds; set it (or autopar run --timeout) to e.g. 300"
        ) from None


def _check_run_options(plan, backend: str | None, timeout: float | None) -> None:
    """Check the options that the runtime reads rather than the planner (``PlanConfig`` checks
    the planner's), so that a wrong one fails at the call, before any tracing."""
    if plan is not None and not isinstance(plan, ShardingPlan):
        raise TypeError(
            f"plan must be a ShardingPlan (ShardingPlan.from_json reads a saved one), got {type(plan).__name__}"
        )
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout!r}: give the seconds a collective may wait, a positive number")


def _decorate(target, *, mesh: Mesh, example_inputs, options):
    if inspect.isclass(target) and issubclass(target, torch.nn.Module):

        @functools.wraps(target, updated=())
        def make(*args, **kwargs):
            return compile(target(*args, **kwargs), mesh, example_inputs, **options)

        return make
    if callable(target):

        @functools.wraps(target)
        def make(*args, **kwargs):
            model = target(*args, **kwargs)
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"@autopar.compile: {target.__name__}() returned {type(model).__name__}, not a torch.nn.Module"
                )
            return compile(model, mesh, example_inputs, **options)

        return make
    raise TypeError(
        f"@autopar.compile decorates a module class or a function returning a module, not {type(target).__name__}"
    )
