"""Planning with pipeline stages: a plan cut into given stages (:func:`plan_stages`), and
``pipeline="auto"``: whether to cut the model into stages, over which mesh axis, and into how
many micro-batches (:func:`plan_auto`).

The candidates are the plan without stages on the whole mesh, and for every mesh axis of two
positions or more and every micro-batch count among 1, 2 and 4 times its positions that divides
the batch, the plan of one micro-batch on the other axes cut into stages over it under the 1F1B
schedule, and under the interleaved schedule with two stages per rank
(:mod:`autopar.passes.solve.stages`; 1F1B takes as long as GPipe and holds fewer micro-batches;
interleaving halves the bubble for twice the sends and more activations held). Each is planned
by the integer program; the fastest by predicted step time whose stages fit the memory budget is
the plan. Candidates are searched first to a gap of ``COARSE_GAP`` (or the one asked, if
wider) for at most ``COARSE_LIMIT_S``, then, fastest first, again to the gap asked, unless the
bound of their first search (:func:`least_step_s`) shows that none of their plans beats the
fastest plan found by then: on the LLaMA-3-70B shape in stages over the first axis of 8x8x8
H100s under 80 GB, the bounds of five candidates of six were above the fastest's step.
A candidate the model cannot take (too few layers for the stages, buffers the forward
updates, a loss that is no mean) is left out, and so is one whose plan does not fit. Pins name
placements on the whole mesh: stages over an axis keep a pin's other placements, and are left out
when a pin splits over that axis.
"""

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

from autopar.config import PlanConfig
from autopar.core.errors import InfeasiblePlanError, InputError, SolverTimeoutError
from autopar.core.mesh import Mesh
from autopar.core.pipeline import Pipeline, Stages, inner_mesh, pins_inside, pins_name_whole_mesh
from autopar.core.plan import ShardingPlan
from autopar.cost_model.hardware import InsideStages
from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.stages import assign_stages, check_stageable
from autopar.passes.propagation.samples import check_samples_apart
from autopar.passes.solve.stage_memory import StageMemory
from autopar.passes.solve.stages import check_tied, cut_stages, holding_positions, reading_positions, with_stages
from autopar.planner import plan_with, warn_over_device

log = logging.getLogger("autopar")

MICROBATCHES_PER_STAGE = (1, 2, 4)
"""Micro-batch counts tried, as multiples of the number of positions of the pipeline axis."""
SCHEDULES_TRIED = (("1f1b", 1), ("interleaved", 2))
"""The schedules tried for each, with their stages per rank."""
COARSE_GAP, COARSE_LIMIT_S = 0.02, 30.0
"""The relative gap each candidate of ``pipeline="auto"`` is first searched to, and the most
seconds that first search takes (the search asked for, if shorter)."""
Candidate = tuple[ShardingPlan, Callable[[PlanConfig], ShardingPlan]]
"""A candidate's plan at the coarse gap, and how to plan it under a config."""


def plan_auto(
    capture_at: Callable[[int], Captured], batch: int, mesh: Mesh, config: PlanConfig, given: Pipeline | None = None
) -> ShardingPlan:
    """The fastest of the candidates above, ``capture_at(m)`` capturing the model on one of
    ``m`` micro-batches of a batch of ``batch`` (0: the inputs share no batch, no stages); with
    ``given`` (a :class:`~autopar.core.pipeline.Pipeline` with parts left ``None``), the fastest
    with stages that has the parts it gives."""
    capture_at = functools.cache(capture_at)
    coarse = dataclasses.replace(
        config,
        solver_gap=max(config.solver_gap, COARSE_GAP),
        solver_time_limit_s=min(config.solver_time_limit_s, COARSE_LIMIT_S),
    )
    tried: list[Candidate] = []
    refusals: list[str] = []

    def attempt(what: str, make: Callable[[PlanConfig], ShardingPlan], refused=(InputError, InfeasiblePlanError)):
        """Plan a candidate at the coarse gap (as asked when the shorter search finds no plan in
        its time); False when the model cannot be cut so."""
        try:
            try:
                tried.append((make(coarse), make))
            except SolverTimeoutError:
                if coarse == config:
                    raise
                tried.append((make(config), make))
        except refused as exc:
            refusals.append(f"{what}: {exc}")
            return not isinstance(exc, InputError)
        return True

    if given is None:
        attempt("without stages", lambda c: plan_with(capture_at(1), mesh, c), InfeasiblePlanError)
    for axis, size in zip(mesh.axis_names, mesh.shape):
        if size < 2 or not batch:  # no batch the inputs share: nothing to cut into micro-batches
            continue
        pins = None  # given an axis, the pins name placements inside the stages
        if given is None or given.axis is None:  # the pins name placements on the whole mesh
            pins = pins_inside(config.pins_for(mesh), mesh, axis)
            if pins is None:
                refusals.append(f"stages over {axis}: a pin splits over it")
                continue
        schedules, counts = SCHEDULES_TRIED, [size * k for k in MICROBATCHES_PER_STAGE]
        if given is not None and given.schedule is not None:
            schedules = ((given.schedule, given.stages_per_rank),)
        if given is not None and given.microbatches is not None:
            counts = [given.microbatches]
        for schedule, per_rank in schedules:
            for microbatches in counts:
                pipeline = Pipeline(axis=axis, microbatches=microbatches, schedule=schedule, stages_per_rank=per_rank)
                if batch % microbatches or (given is not None and not given.allows(pipeline)):
                    continue
                if schedule == "interleaved" and microbatches % size:
                    continue

                def make(c: PlanConfig, pipeline=pipeline, pins=pins) -> ShardingPlan:
                    inside = c if pins is None else dataclasses.replace(c, pins=pins)
                    return plan_stages(capture_at(pipeline.microbatches), mesh, pipeline, inside, capture_at=capture_at)

                what = f"stages over {axis} ({schedule}) with {microbatches} micro-batches"
                if not attempt(what, make):
                    break  # the model cannot be cut so, at any micro-batch count
    if not tried:
        what = "no plan, with or without pipeline stages," if given is None else f"no plan in stages as {given} asks"
        raise InfeasiblePlanError(f"{what} fits:\n" + "\n".join(refusals or ["no candidate: see the Pipeline's parts"]))
    return _refined(tried, config, again=coarse != config)


def _refined(tried: list[Candidate], config: PlanConfig, again: bool = True) -> ShardingPlan:
    """The fastest plan of the candidates ``tried`` (each a plan at the coarse gap, and how to
    plan the candidate under a config), each searched again at ``config``'s gap, fastest first,
    but for those whose coarse search already came within it and those no plan of which can
    beat the fastest found before them (:func:`least_step_s`)."""
    best: ShardingPlan | None = None
    for plan, make in sorted(tried, key=lambda t: t[0].predicted_step_s):
        least = least_step_s(plan)
        if best is not None and least >= best.predicted_step_s:
            log.info("pipeline=auto: %s: no plan under %.3g s per step, not searched again", _described(plan), least)
            continue
        if again and _gap(plan) > config.solver_gap:
            try:
                plan = min(plan, make(config), key=lambda p: p.predicted_step_s)
            except InfeasiblePlanError:
                pass  # the coarse search's plan stands
        log.info("pipeline=auto: %s, %.3g s per step", _described(plan), plan.predicted_step_s)
        if best is None or plan.predicted_step_s < best.predicted_step_s:
            best = plan
    assert best is not None
    log.info("pipeline=auto: chose %s", _described(best))
    return best


def least_step_s(plan: ShardingPlan) -> float:
    """A lower bound on the predicted step of every plan of ``plan``'s candidate (its mesh, its
    stages' cuts, micro-batches and schedule), from the bound of the search that found it. Without
    stages the step is the program's objective and the step's overhead. In ``P`` positions, ``M``
    micro-batches and ``v`` stages per rank, the step is ``M·b + (Σ − b)/v + g``, ``b`` the busiest
    position's time per micro-batch, ``Σ`` every stage's, ``g`` the slowest position's gradient
    collectives (:attr:`~autopar.core.pipeline.Stages.step_s`); since ``b ≥ Σ/P`` and ``g`` is at
    least the mean of every position's, it is at least ``(M + (P − 1)/v)/P`` times ``Σ`` plus the
    gradient collectives priced at ``v/(v·M + P − 1)`` of their time, which is what the program of
    one micro-batch minimises (:func:`plan_stages`). It bounds the plans the program expresses
    (identical layers share their choices) as the program prices them, at most what the stages
    add up (tested); 0 where the search has no bound, and for a plan without stages under a
    budget (which may be a lower budget's, :func:`~autopar.budget_check.within_budget`)."""
    bound = _bound(plan)
    if not math.isfinite(bound) or (plan.stages is None and plan.memory_budget_bytes is not None):
        return 0.0
    if plan.stages is None:
        return bound + plan.overhead_s
    st = plan.stages
    return bound * _passes(st.microbatches, st.positions, st.stages_per_rank) / st.positions + plan.overhead_s


def _passes(microbatches: int, positions: int, stages_per_rank: int) -> float:
    """``M + (P − 1)/v``: how many times a step of stages that take as long runs one micro-batch's
    work on a position (:func:`least_step_s`)."""
    return microbatches + (positions - 1) / stages_per_rank


def _gap(plan: ShardingPlan) -> float:
    """How far from its bound the search left ``plan`` (1 when it has none)."""
    objective, bound = plan.solver.objective_s, _bound(plan)
    if not (math.isfinite(bound) and math.isfinite(objective)):
        return 1.0
    return (objective - bound) / objective if objective > 0 else 0.0


def _bound(plan: ShardingPlan) -> float:
    """The bound of the search that found ``plan``, ``-inf`` when it has none: a search stopped
    before its bound was finite reports its plan's objective as the bound
    (:mod:`~autopar.passes.solve.highs_child`)."""
    solver, bound = plan.solver, plan.solver.bound_s
    if not math.isfinite(solver.objective_s) or (solver.status != "OPTIMAL" and bound >= solver.objective_s):
        return -math.inf
    return bound


def _described(plan: ShardingPlan) -> str:
    st = plan.stages
    return "no stages" if st is None else f"stages over {st.axis} x {st.microbatches} micro, {st.schedule}"


def check_pipeline(pipeline, mesh: Mesh, pins) -> "Pipeline | str | None":
    """``pipeline`` checked for ``mesh``: ``None`` (or ``"off"``), ``"auto"`` or a
    :class:`~autopar.core.pipeline.Pipeline` over one of its axes (or with its axis left to
    planning)."""
    if pipeline in (None, "off"):
        return None
    if pins_name_whole_mesh(pipeline):
        return pipeline
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be None, 'auto' or an autopar.Pipeline, got {pipeline!r}")
    pipeline.check(mesh)
    return pipeline


def plan_stages(
    captured: Captured,
    mesh: Mesh,
    pipeline: Pipeline,
    config: PlanConfig,
    segments: tuple[tuple[str, ...], ...] | None = None,
    capture_at: Callable[[int], Captured] | None = None,
) -> ShardingPlan:
    """Plan ``captured`` (one micro-batch) on the mesh inside the stages of ``pipeline``, each
    position of the pipeline axis held to the memory budget (what it recomputes chosen with the
    placements, :mod:`autopar.passes.solve.stage_memory`), and cut it into the stages
    (:mod:`autopar.passes.solve.stages`), or into the units of ``segments``. ``capture_at``
    (``m`` -> the model captured on the first of ``m`` micro-batches) shows that the micro-batch's
    graph computes no value from the batch's size
    (:func:`~autopar.passes.propagation.samples.check_samples_apart`); without it (a plan made
    again in the stages of one so checked, :func:`plan_again_in`) that is not checked."""
    pipeline.check(mesh)
    divisor = check_stageable(captured)
    check_samples_apart(captured, pipeline.microbatches, divisor, capture_at)
    positions = mesh.shape[mesh.axis_names.index(pipeline.axis)]
    if segments is None:
        segments = cut_stages(captured, positions * pipeline.stages_per_rank)
    staged = assign_stages(captured, segments)
    check_tied(staged, captured, positions)
    inside = dataclasses.replace(
        config,
        hardware=InsideStages(config.profile, mesh),
        gradient_share=1 / _passes(pipeline.microbatches, positions, pipeline.stages_per_rank),  # see least_step_s
        bucket_groups={
            k.name: staged.stage_of[n.name]
            for n, k in zip(captured.placeholders, captured.inputs)
            if k.kind == "param" and n.name in staged.stage_of
        },
        stage_memory=StageMemory.of(
            pipeline.schedule,
            positions,
            pipeline.microbatches,
            pipeline.stages_per_rank,
            staged.stage_of,
            holding_positions(captured, staged, positions),
            reading_positions(captured, staged, positions),
        ),
    )
    plan = plan_with(captured, inner_mesh(mesh, pipeline.axis), inside)
    link = config.profile.link(mesh, mesh.axis_names.index(pipeline.axis))
    plan = with_stages(plan, captured, staged, segments, pipeline, mesh, link, config.budget_bytes)
    if config.budget_bytes is None:
        warn_over_device(plan, config.profile)
    return plan


def plan_again_in(captured: Captured, mesh: Mesh, stages: Stages, pins, config: PlanConfig) -> ShardingPlan:
    """Plan ``captured``, the model at other sizes or in another mode where it runs other ops
    than its plan in ``stages`` has, in the same stages: the same cuts, pipeline and ``pins``
    (the plan's placements of the parameters, buffers and inputs on the mesh inside the stages,
    so that every rank's pieces stay as they are)."""
    return plan_stages(captured, mesh, stages.pipeline, dataclasses.replace(config, pins=dict(pins)), stages.segments)
