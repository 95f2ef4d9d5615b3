"""Planning: capture → propagate → cost → solve → ShardingPlan, with no devices needed."""

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Mapping, Sequence

import torch

from autopar.budget_check import NoPlanUnderBudget, OverByLiveness, over_by_liveness, within_budget
from autopar.config import Pins, PlanConfig
from autopar.core.errors import InfeasiblePlanError, SolverTimeoutError
from autopar.core.explain import format_bytes
from autopar.core.graph import segment_of
from autopar.core.mesh import Mesh
from autopar.core.pipeline import Pipeline, first_microbatch, given_parts, pinned_mesh, planning_chooses, shared_batch
from autopar.core.placement import Placements
from autopar.core.plan import ShardingPlan, SolverInfo
from autopar.core.precision import MixedPrecision
from autopar.core.strategy import StrategySpace
from autopar.cost_model.estimate import CostModel, MemoryTerms, memory_terms
from autopar.cost_model.hardware import Profile
from autopar.passes.analysis.capture import (
    Captured,
    capture,
    gradients_before_cast,
    keyword_order,
    module_paths,
    split_keywords,
)
from autopar.passes.analysis.liveness import ADAM_SLOTS, Liveness
from autopar.passes.lower.liveness import plan_liveness
from autopar.passes.propagation.propagate import propagate
from autopar.passes.solve.layers import LayerClasses, repeated_layers
from autopar.passes.solve.layouts import standard_layouts
from autopar.passes.solve.merged import lifted, merged_mesh, same_strategies
from autopar.passes.solve.planning import build_plan, moment_bytes
from autopar.passes.solve.remat import ActivationSpace, activation_bytes, activation_space, in_stages
from autopar.passes.solve.solver import Problem, SearchOptions, Solution, least_memory_bound, program_size, solve

log = logging.getLogger("autopar")

WHOLE_MESH_BELOW = 1_000_000
"""Program size (:func:`~autopar.passes.solve.solver.program_size`) of a mesh of three axes or
more above which its own search is left out: the plan of the mesh with two axes merged (a
program some twenty times smaller) or a standard layout, whichever is faster, is the plan.
Building a program that large takes longer than solving the merged one, and its search
seldom finishes in the time limit."""

SHARE_ABOVE = 20_000
"""Program size (:func:`~autopar.passes.solve.solver.program_size`) from which repeated layers share
variables by default. Smaller programs solve in seconds without it and keep plans that differ
from layer to layer (an MLP alternating column and row splits)."""


def check_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, e.g. Mesh((2, 2), ('dp', 'tp')), got {type(mesh).__name__}")


def plan_captured(captured: Captured, mesh: Mesh, **options) -> ShardingPlan:
    """Plan an already captured graph with the options of :func:`autopar.plan` (and
    ``bucket_bytes``, see :class:`~autopar.config.PlanConfig`)."""
    return plan_with(captured, mesh, PlanConfig(**options))


def plan_with(captured: Captured, mesh: Mesh, config: PlanConfig) -> ShardingPlan:
    """Plan an already captured graph as ``config`` says."""
    check_mesh(mesh)
    problem = _Problem.build(captured, mesh, config)
    if config.stage_memory is not None and problem.budget is not None:
        result, live, times = problem.in_stages()
    elif problem.merges and program_size(problem.space) > WHOLE_MESH_BELOW:
        result, live, times = problem.merged_plan()
    else:
        result, live, times = _searched(problem, mesh)
    if math.isinf(result.predicted_step_s):
        raise InfeasiblePlanError(
            "no plan reduces every gradient in the parameters' dtype (MixedPrecision.reduce_dtype): an op between "
            "a gradient's making and its cast cannot run on partial sums. Fix: reduce_dtype=None"
        )
    classes = problem.classes
    result = dataclasses.replace(
        result,
        memory=dataclasses.replace(result.memory, liveness_peak_bytes=live.peak_bytes if live else 0),
        solver=dataclasses.replace(
            result.solver,
            layer_classes=classes.num_classes,
            shared_layers=classes.num_shared_layers,
            aligned_layers=classes.num_aligned_layers,
        ),
        stage_s={**problem.stages, **times},
    )
    _report(result, problem)
    return result


def _searched(problem: "_Problem", mesh: Mesh) -> tuple[ShardingPlan, Liveness | None, dict[str, float]]:
    """The plan the search finds, or the fastest standard layout when that is faster or the
    search finds none in time; with its program's liveness and the stage times. (Repeated layers
    share a class only as the standard layouts treat them, so that a class does not keep the
    search from any of them.)"""
    try:
        result, live, times, _ = within_budget(problem.attempt, problem.budget, mesh)
    except SolverTimeoutError as exc:
        return problem.no_plan_in_time(exc)
    except OverByLiveness as exc:
        fallback = problem.layout_within_budget()
        if fallback is None:
            raise InfeasiblePlanError(str(exc)) from None
        log.warning("no searched plan's program fits the budget; returning the %s layout", fallback[0].solver.layout)
        return fallback
    except NoPlanUnderBudget:
        raise InfeasiblePlanError(problem.over_budget()) from None
    if result.solver.status == "FEASIBLE":
        result, live = problem.no_slower_than_a_layout(result, live)
    return result, live, times


def _report(result: ShardingPlan, problem: "_Problem") -> None:
    """Log the plan's figures, and warn when a plan made without a budget overflows the device."""
    log.debug("stages: %s", ", ".join(f"{k} {v:.2f}s" for k, v in result.stage_s.items()))
    log.info(
        "planned %d nodes on %s: %s, predicted step %.3g s, peak %.3g GB per device, %d collectives",
        len(problem.space.nodes),
        problem.mesh,
        result.solver.status,
        result.predicted_step_s,
        result.peak_memory_bytes / 1e9,
        len(result.collectives),
    )
    if problem.budget is None and problem.config.bucket_groups is None:  # stages warn on their own peaks
        warn_over_device(result, problem.profile)


def warn_over_device(result: ShardingPlan, profile: Profile) -> None:
    """Warn when a plan made without a budget needs more than the device's memory."""
    device = profile.memory_bytes
    if device and result.peak_memory_bytes > device:
        log.warning(
            "the plan needs %s per device, more than the %s of a %s device: it is the fastest plan with "
            "memory left out; pass memory_budget=%d (%s) for one that fits",
            format_bytes(result.peak_memory_bytes),
            format_bytes(device),
            profile.name,
            device,
            format_bytes(device),
        )


@dataclasses.dataclass(frozen=True)
class _Problem:
    """One planning once its costs are known: the strategy space with its cost tables, the
    activations' choices and the layer classes, and the options every search of it reads (the
    search for the fastest plan, the standard layouts it is checked against, and the search
    for the least memory that explains a budget no plan fits)."""

    captured: Captured
    mesh: Mesh
    profile: Profile
    pins: dict[str, Placements]
    budget: int | None
    recompute: str
    time_limit_s: float
    gap: float
    space: StrategySpace
    costs: CostModel
    compute: dict
    node_costs: dict
    memory: MemoryTerms
    activations: ActivationSpace
    classes: LayerClasses
    segments: dict[str, str]
    stages: dict[str, float]
    """Seconds the stages before the search took: capture, propagate and cost."""
    config: PlanConfig
    solved: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """:meth:`solved_under`'s answers by the solver's budget."""
    found_layouts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """:attr:`layout_choices`, :attr:`layouts` and :meth:`completed_layouts` once found, kept by
    :meth:`sharing_as_the_layouts`'s copy (the layer classes do not change them)."""

    @classmethod
    def build(cls, captured: Captured, mesh: Mesh, config: PlanConfig, group_by_layouts: bool = True) -> "_Problem":
        """The problem of planning ``captured`` on ``mesh`` as ``config`` says, its repeated layers
        grouped as the standard layouts treat them unless ``group_by_layouts`` is false."""
        profile, pins, recompute = config.profile, config.pins_for(mesh), config.recompute
        t0 = time.perf_counter()
        space = propagate(captured, mesh, pins=pins, fallback=config.fallback)
        t1 = time.perf_counter()
        unreduced = _reduced_after_cast(captured, config.mixed_precision)
        costs = CostModel(
            captured,
            mesh,
            profile,
            bucket_bytes=config.bucket_bytes,
            unreduced=unreduced,
            gradient_share=config.gradient_share,
            bucket_groups=config.bucket_groups,
        )
        compute = costs.compute_costs(space)
        node_costs = costs.node_costs(space, compute)
        if config.stage_memory is not None and config.stage_memory.microbatches > 1:
            costs.with_accumulation(space, node_costs, config.stage_memory.microbatches - 1)
        t2 = time.perf_counter()
        memory = memory_terms(space, costs, optimizer_slots=config.optimizer_slots)
        activations = activation_space(captured, space, costs, recompute, offload=costs.host() is not None)
        if config.stage_memory is not None:
            activations = in_stages(activations, config.stage_memory.stage_of)
        classes = _layer_classes(captured, space, node_costs, memory, config.share_layers)
        if classes.num_classes:
            log.info(
                "%d repeated layers in %d classes share the choice of their class's first layer",
                classes.num_shared_layers,
                classes.num_classes,
            )
        log.info(
            "solving for %d nodes with %d strategies on %s",
            len(space.nodes),
            sum(len(n.strategies) for n in space.nodes),
            mesh,
        )
        problem = cls(
            captured,
            mesh,
            profile,
            pins,
            config.budget_bytes,
            recompute,
            config.solver_time_limit_s,
            config.solver_gap,
            space,
            costs,
            compute,
            node_costs,
            memory,
            activations,
            classes,
            {name: segment_of(path) for name, path in module_paths(captured).items()},
            {"capture": captured.capture_s, "propagate": t1 - t0, "cost": t2 - t1},
            config,
        )
        return problem.sharing_as_the_layouts() if classes.num_classes and group_by_layouts else problem

    def sharing_as_the_layouts(self) -> "_Problem":
        """This problem with its layers grouped into classes that every standard layout treats
        alike (:func:`~autopar.passes.solve.layers.repeated_layers`'s ``alike``), so that sharing
        a class does not keep the search from a layout: layers that a layout splits by column
        and by row in turn get a class each. (A layer alike to no other still aligns with its
        class's ops whatever the layouts do there.)"""
        started = time.perf_counter()
        choices = [choice for _, choice in self.layout_choices]
        classes = repeated_layers(self.captured, self.space, self.node_costs, self.memory, alike=choices)
        self.stages["layouts"] = time.perf_counter() - started
        if classes == self.classes:
            return self
        log.info(
            "layers grouped as the standard layouts treat them: %d classes (from %d), %d layers sharing (from %d)",
            classes.num_classes,
            self.classes.num_classes,
            classes.num_shared_layers,
            self.classes.num_shared_layers,
        )
        return dataclasses.replace(self, classes=classes, solved={})

    @property
    def chooses(self) -> bool:
        """Whether the search chooses what to recompute, and the program's liveness is measured."""
        return self.budget is not None or self.recompute == "layers"

    def program(self, **choices) -> Problem:
        """This planning's integer program (:class:`~autopar.passes.solve.solver.Problem`): its
        cost tables, with ``choices`` (memory terms, budget, what is minimised) added."""
        return Problem(
            self.space,
            self.node_costs,
            self.costs.transition_s,
            gradient_s=self.costs.gradient_s,
            gather_s=self.costs.gather_s,
            segments=self.segments,
            one_step_moves=self.costs.one_step_moves,
            shared=self.classes.template,
            activations=self.activations,
            host=self.costs.host(),
            bucket_bytes=self.costs.bucket_bytes,
            stage_memory=self.config.stage_memory,
            bucket_groups=self.costs.bucket_groups or None,
            **choices,
        )

    def solve(self, program: Problem, **options) -> Solution:
        """:func:`~autopar.passes.solve.solver.solve` on ``program`` within this planning's time
        limit, with ``options`` (:class:`~autopar.passes.solve.solver.SearchOptions`) added."""
        return solve(program, SearchOptions(time_limit_s=self.time_limit_s, **options))

    @functools.cached_property
    def least_memory_bound(self) -> float:
        """Bytes per device no plan goes below, by the solver's count
        (:func:`~autopar.passes.solve.solver.least_memory_bound`): a budget below it has no plan,
        whatever the search's time limit."""
        return least_memory_bound(self.program(memory=self.memory))

    def priced(self, solution: Solution) -> ShardingPlan:
        return build_plan(
            self.captured,
            self.space,
            solution,
            self.costs,
            self.compute,
            self.memory,
            self.activations,
            hardware_name=self.profile.name,
            pinned=tuple(self.pins),
            memory_budget_bytes=self.budget,
            stage_s=self.stages,
        )

    def attempt(self, solver_budget: float | None):
        """The fastest plan the solver finds within ``solver_budget`` (:meth:`solved_under`), as
        ``(plan, its program's liveness, stage times, solution)``."""
        plan, times, solution = self.solved_under(solver_budget)
        started = time.perf_counter()
        live = plan_liveness(self.captured, plan) if self.chooses else None
        return plan, live, {**times, "memory": time.perf_counter() - started}, solution

    def solved_under(self, solver_budget: float | None) -> tuple[ShardingPlan, dict[str, float], Solution]:
        """The fastest plan the solver finds within ``solver_budget`` (started under a budget from
        every parameter split as far as it goes, else from :attr:`merged` if any), with the stage
        times and its solution, searched once per budget; :class:`SolverTimeoutError` when it
        finds none in time."""
        if solver_budget in self.solved:
            return self.solved[solver_budget]
        start = _sharded_parameters(self.space, self.memory) if self.budget is not None else None
        if start is None and self.merged is not None:
            start = self.merged[1].choice
        started = time.perf_counter()
        program = self.program(
            memory=self.memory if self.budget else None, budget_bytes=solver_budget, choose_recompute=self.chooses
        )
        solution = self.solve(program, relative_gap=self.gap, start=start)
        if solution.info.status == "START":  # nothing found in time
            raise SolverTimeoutError(
                "the solver found no plan within its time limit",
                solve_s=solution.info.solve_s,
                num_variables=solution.info.num_variables,
                num_constraints=solution.info.num_constraints,
            )
        solved = time.perf_counter()
        plan = self.priced(solution)
        self.solved[solver_budget] = plan, {"solve": solved - started, "plan": time.perf_counter() - solved}, solution
        return self.solved[solver_budget]

    def in_stages(self) -> tuple[ShardingPlan, None, dict[str, float]]:
        """The fastest plan the search finds for one micro-batch of a plan in pipeline stages
        under a budget, each position of the pipeline axis held to it by its own rows
        (:mod:`autopar.passes.solve.stage_memory`); the plan's own liveness, which runs every
        stage on one device, is not its ranks'. With no stage times but the search's."""
        try:
            plan, times, _ = self.solved_under(float(self.budget))
        except SolverTimeoutError:
            raise  # says nothing of whether a plan fits
        except InfeasiblePlanError:
            raise InfeasiblePlanError(
                f"no plan of the stages holds every position of the pipeline axis within memory_budget="
                f"{format_bytes(self.budget)} per device, recomputing{' and offloading' if self.costs.host() else ''} "
                "what it can. Fix: more positions or "
                "micro-batches, the 1f1b schedule (interleaving and GPipe hold more activations), or a larger "
                "memory_budget"
            ) from None
        return plan, None, times

    @property
    def merges(self) -> bool:
        """Whether :attr:`merged` plans merged meshes: on three axes or more, unless
        ``recompute="layers"``, whose choices of what to recompute a lifted plan would not carry."""
        return self.mesh.ndim >= 3 and self.recompute != "layers"

    @functools.cached_property
    def merged(self) -> tuple[str, Solution] | None:
        """On a mesh of three axes or more: the fastest plan of the mesh with two adjacent axes
        merged (:mod:`autopar.passes.solve.merged`), named, as a solution for this mesh (each
        node's strategy and, under a budget, what it recomputes and offloads); without a budget
        the search of this mesh starts from it. ``None`` when none is found or :attr:`merges`
        is false. Under a budget each merged mesh is planned as :func:`_searched` plans, its
        program's liveness within the budget (skipped when the relaxation shows no plan of it
        fits), the fastest by its search first. The liveness of a slower one is checked only
        while its searched plan is within the search's gap of the fastest checked one: a
        correction lowers the budget it is searched under, which makes its plan slower but for
        the gap (its plan is priced lifted to this mesh, so this is a heuristic, not a proof). A
        merged mesh of three axes or more is planned only when its own program is small enough
        to search (``WHOLE_MESH_BELOW``)."""
        if not self.merges:
            return None
        started, best, best_s = time.perf_counter(), None, math.inf
        searched: list[tuple[float, int, "_Problem"]] = []  # under a budget: the lifted plan's step before its check
        for axis in range(self.mesh.ndim - 1):
            if any(p[axis] != p[axis + 1] for p in self.pins.values()) or 1 in self.mesh.shape[axis : axis + 2]:
                continue  # a pin that differs over the two axes has no merged form; an axis of 1 merges to itself
            flat = merged_mesh(self.mesh, axis)
            pins = {name: (*p[:axis], *p[axis + 1 :]) for name, p in self.pins.items()}
            sub = _Problem.build(self.captured, flat, dataclasses.replace(self.config, pins=pins))
            if flat.ndim >= 3 and program_size(sub.space) > WHOLE_MESH_BELOW:
                continue
            try:
                if self.budget is None:
                    solution = sub.solve(sub.program(), relative_gap=self.gap)
                elif sub.budget < sub.least_memory_bound:
                    continue
                else:
                    solution = sub.solved_under(float(sub.budget))[2]
            except (SolverTimeoutError, InfeasiblePlanError):
                continue
            found = self._lifted(sub, solution, axis)
            if self.budget is not None:  # a plan that does not lift goes first: its correction may lift
                searched.append((-math.inf if found is None else found[0].predicted_step_s, axis, sub))
            elif found is not None and found[0].predicted_step_s < best_s:
                best, best_s = (f"plan of {sub.mesh}", found[1]), found[0].predicted_step_s
        for step_s, axis, sub in sorted(searched, key=lambda c: c[:2]):
            if step_s >= best_s * (1 + self.gap):
                break
            try:
                solution = within_budget(sub.attempt, sub.budget, sub.mesh)[3]
            except (SolverTimeoutError, InfeasiblePlanError, NoPlanUnderBudget):
                continue
            found = self._lifted(sub, solution, axis)
            if found is not None and found[0].predicted_step_s < best_s and found[0].peak_memory_bytes <= self.budget:
                best, best_s = (f"plan of {sub.mesh}", found[1]), found[0].predicted_step_s
        self.stages["merged"] = time.perf_counter() - started
        return best

    def _lifted(self, sub: "_Problem", solution: Solution, axis: int) -> tuple[ShardingPlan, Solution] | None:
        """The plan of ``sub`` (this mesh with ``axis`` and the next merged) lifted to this mesh,
        priced, with its solution; ``None`` when some node has no lifted strategy."""
        choice = lifted(sub.space, solution.choice, self.space, axis)
        if len(choice) < len(self.space.nodes):
            return None
        if self.budget is None:
            solution = Solution(choice, solution.info, recomputed=self.activations.param_views)
        else:
            solution = dataclasses.replace(solution, choice=choice)
        return self.priced(solution), solution

    def merged_plan(self) -> tuple[ShardingPlan, Liveness | None, dict[str, float]]:
        """The fastest of the plan of a merged mesh and the standard layouts whose program fits
        (under a budget, by its liveness), without searching this mesh's own program
        (``WHOLE_MESH_BELOW``); with its liveness and the stage times. :class:`InfeasiblePlanError`
        when none fits."""
        info = SolverInfo("LAYOUT", math.nan, -math.inf, 0.0, 0, 0)
        live = None
        for plan in self.layouts_by_speed(info, with_merged=True):
            live = plan_liveness(self.captured, plan) if self.chooses else None
            if self.budget is None or live.peak_bytes <= self.budget:
                log.info("the program of %s is too large to search: its plan is the %s", self.mesh, plan.solver.layout)
                return plan, live, {}
        if live is not None:
            raise InfeasiblePlanError(over_by_liveness(self.budget, live, self.mesh))
        fits = "" if self.budget is None else f" fits memory_budget={format_bytes(self.budget)} per device"
        raise InfeasiblePlanError(
            f"no plan of a mesh with two of the axes of {self.mesh} merged, and no standard layout{fits} (the "
            "mesh's own program is too large to search).\nFix: "
            + ("raise memory_budget, plan for a larger mesh, shrink the batch, or " if self.budget is not None else "")
            + "pin the large tensors"
        )

    def layout_within_budget(self) -> tuple[ShardingPlan, Liveness | None, dict[str, float]] | None:
        """The fastest standard layout, completed as :meth:`fallback_layout` says, whose program
        fits the budget by its liveness, with that liveness and no stage times; ``None`` when
        none does."""
        found = self.fallback_layout(SolverInfo("LAYOUT", math.nan, -math.inf, 0.0, 0, 0))
        return None if found is None else (*found, {})

    def fallback_layout(self, solver: SolverInfo) -> tuple[ShardingPlan, Liveness | None] | None:
        """What planning returns when the search has no plan to give: the fastest standard
        layout whose program fits the budget by its liveness (checked only under a budget or
        ``recompute="layers"``), each layout completed both op by op (:meth:`layouts_by_speed`,
        with the merged meshes' plan without a budget) and by the search
        (:meth:`completed_layouts`), with its liveness; ``None`` when none fits. Its solver
        line carries ``solver``'s size and time."""
        candidates = self.layouts_by_speed(solver, with_merged=self.budget is None) + [
            _as_layout(plan, solver) for plan in self.completed_layouts()
        ]
        for plan in sorted(candidates, key=lambda plan: plan.predicted_step_s):
            live = plan_liveness(self.captured, plan) if self.chooses else None
            if live is None or self.budget is None or live.peak_bytes <= self.budget:
                return plan, live
        return None

    def completed_layouts(self) -> list[ShardingPlan]:
        """The standard layouts as hand-written layouts are planned (``benchmarks.plan_quality``'s):
        each layout's parameter placements pinned and the rest searched without the budget,
        from the layout as :attr:`layouts` completes it, for the layouts whose parameters,
        gradients and optimizer state fit the budget; the plans whose predicted peak fits it,
        of status ``LAYOUT``. The layouts fastest as :attr:`layouts` completes them go first,
        and the searches, with the programs they build, share the planning's time limit. A layout
        completed op by op places each activation as the op before it left it; the search
        places them all at once, as a user planning the layout's parameters by hand with pins
        would get them (LLaMA-3-8B's shape on 16x16 H100s under 80 GB: FSDP with Megatron, 2.27 s
        per step, where the fastest layout completed op by op is 2.50 s)."""
        if "completed" not in self.found_layouts:
            self.found_layouts["completed"] = self._completed_layouts()
        return self.found_layouts["completed"]

    def _completed_layouts(self) -> list[ShardingPlan]:
        params = [n for n in self.space.nodes if n.kind == "param"]
        state = (self.memory.params, self.memory.grads, self.memory.optimizer)

        def held(choice: dict[str, int]) -> float:
            return sum(sizes[choice[node]] for part in state for node, sizes in part.items())

        fastest_first = [plan.solver.layout for plan in self.layouts]
        fitting = sorted(
            ((name, c) for name, c in self.layout_choices if self.budget is None or held(c) <= self.budget),
            key=lambda layout: fastest_first.index(layout[0]) if layout[0] in fastest_first else len(fastest_first),
        )
        deadline, plans = time.perf_counter() + self.time_limit_s, []
        for name, choice in fitting:
            if deadline - time.perf_counter() <= 0:
                break
            pins = {n.target: n.strategies[choice[n.name]].outputs[0] for n in params}
            config = dataclasses.replace(self.config.with_pins(pins), memory_budget=None)
            try:  # the pinned parameters tell alternating layers apart: no regrouping by the layouts
                sub = _Problem.build(self.captured, self.mesh, config, group_by_layouts=False)
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                solution = dataclasses.replace(sub, time_limit_s=left).solve(
                    sub.program(choose_recompute=sub.chooses),
                    relative_gap=self.gap,
                    start=same_strategies(self.space, choice, sub.space),
                )
            except (SolverTimeoutError, InfeasiblePlanError):
                continue
            if solution.info.status == "START":  # nothing better than the layout completed op by op
                continue
            chosen = same_strategies(sub.space, solution.choice, self.space)
            if len(chosen) < len(self.space.nodes):
                continue
            info = SolverInfo("LAYOUT", math.nan, -math.inf, 0.0, 0, 0, layout=name)
            plan = self.priced(Solution(chosen, info, recomputed=solution.recomputed))
            if self.budget is None or plan.peak_memory_bytes <= self.budget:
                plans.append(plan)
        log.info(
            "%d of the %d standard layouts completed by the search within %.0f s fit",
            len(plans),
            len(self.layout_choices),
            self.time_limit_s,
        )
        return plans

    def best_layout(self, solver: SolverInfo) -> ShardingPlan | None:
        """The fastest of :meth:`layouts_by_speed` (with the merged meshes' plan without a budget:
        under one, planning them costs searches this fallback does not wait for); ``None`` when
        none fits."""
        return next(iter(self.layouts_by_speed(solver, with_merged=self.budget is None)), None)

    @property
    def layout_choices(self) -> list[tuple[str, dict[str, int]]]:
        """``(name, strategy index of every node)`` of each standard layout
        (:mod:`autopar.passes.solve.layouts`)."""
        if "choices" not in self.found_layouts:
            self.found_layouts["choices"] = list(
                standard_layouts(
                    self.space,
                    self.mesh,
                    self.node_costs,
                    self.costs.transition_s,
                    self.classes.template,
                    self.costs.value_kind,
                )
            )
        return self.found_layouts["choices"]

    @property
    def layouts(self) -> list[ShardingPlan]:
        """The standard layouts whose predicted peak fits the budget, as priced plans of status
        ``LAYOUT``, fastest first."""
        if "priced" not in self.found_layouts:
            self.found_layouts["priced"] = self._priced_layouts()
        return self.found_layouts["priced"]

    def _priced_layouts(self) -> list[ShardingPlan]:
        info, views = SolverInfo("LAYOUT", math.nan, -math.inf, 0.0, 0, 0), self.activations.param_views
        plans = [
            self.priced(Solution(choice, dataclasses.replace(info, layout=name), recomputed=views))
            for name, choice in self.layout_choices
        ]
        fitting = [plan for plan in plans if self.budget is None or plan.peak_memory_bytes <= self.budget]
        return sorted(fitting, key=lambda plan: plan.predicted_step_s)

    def layouts_by_speed(self, solver: SolverInfo, with_merged: bool) -> list[ShardingPlan]:
        """:attr:`layouts` and, ``with_merged``, the plan of a merged mesh (:attr:`merged`) whose
        predicted peak fits the budget, fastest first, as plans of status ``LAYOUT`` carrying the
        size and time of the search that ``solver`` describes."""
        plans = list(self.layouts)
        merged = self.merged if with_merged else None
        if merged is not None:
            name, solution = merged
            plan = self.priced(dataclasses.replace(solution, info=dataclasses.replace(solution.info, layout=name)))
            if self.budget is None or plan.peak_memory_bytes <= self.budget:
                plans.append(plan)
        return sorted((_as_layout(plan, solver) for plan in plans), key=lambda plan: plan.predicted_step_s)

    def no_plan_in_time(self, exc: SolverTimeoutError):
        """The fastest standard layout that fits, when the search found no plan in its time
        limit; the error when none fits. Returns the plan, its program's liveness and the stage
        times."""
        info = SolverInfo("LAYOUT", math.nan, -math.inf, exc.solve_s, exc.num_variables, exc.num_constraints)
        found = self.fallback_layout(info)
        if found is None:
            if self.budget is not None:
                self.decide_budget()
            raise exc
        layout, live = found
        log.warning("the solver found no plan within its time limit; returning the %s layout", layout.solver.layout)
        return layout, live, {"solve": exc.solve_s}

    def no_slower_than_a_layout(
        self, result: ShardingPlan, live: Liveness | None
    ) -> tuple[ShardingPlan, Liveness | None]:
        """``result``, a plan the search stopped at its time limit with, or the fastest standard
        layout that fits when that is predicted faster."""
        layout = self.best_layout(result.solver)
        if layout is None or layout.predicted_step_s >= result.predicted_step_s:
            return result, live
        layout_live = plan_liveness(self.captured, layout) if self.chooses else None
        if self.budget is not None and layout_live.peak_bytes > self.budget:
            return result, live
        log.warning(
            "the solver stopped at its time limit with a plan predicted slower than the %s layout; "
            "returning the layout",
            layout.solver.layout,
        )
        return layout, layout_live

    def decide_budget(self) -> None:
        """Raise :class:`InfeasiblePlanError` when no plan fits the budget, as the relaxation's
        bound on the least memory shows (whatever the time limit), or the least-memory search
        proves; return when neither does."""
        if self.budget < self.least_memory_bound:
            raise InfeasiblePlanError(self.over_budget()) from None
        least = self.least_memory()
        if least is not None and least.info.status == "OPTIMAL" and least.info.objective_s > self.budget:
            raise InfeasiblePlanError(self.over_budget(least)) from None

    def least_memory(self) -> Solution | None:
        """The plan with the least memory the search finds in its time limit, offloading all it
        can; ``None`` when it finds none."""
        try:
            return self.solve(self.program(memory=self.memory, minimise="memory"))
        except SolverTimeoutError:
            return None

    def over_budget(self, least: Solution | None = None) -> str:
        """Why no plan fits the budget: the least memory any plan needs (the relaxation's bound,
        and :meth:`least_memory`'s plan, ``least`` when already found, by part) and what would
        fit."""
        budget, mesh, bound = self.budget, self.mesh, self.least_memory_bound
        least = least or self.least_memory()
        if least is None:
            found = f"any plan needs at least {format_bytes(bound)}, {format_bytes(bound - budget)} over"
            need = bound
        else:
            est = self._least_memory_estimate(least)
            need = est.peak_bytes
            parts = {
                "parameters": est.params_bytes,
                "gradients": est.grads_bytes,
                "optimizer state": est.optimizer_bytes,
                "activations": est.activations_bytes + est.recomputed_bytes,
                "largest temporary": est.transient_bytes,
            }
            largest = max(parts, key=parts.get)
            state = est.params_bytes + est.grads_bytes + est.optimizer_bytes
            if state >= budget:
                over = f"parameters, gradients and optimizer state alone need {format_bytes(state)} per device"
            else:
                over = (
                    f"the {largest} ({format_bytes(parts[largest])}) "
                    f"{'do' if largest in ('parameters', 'gradients', 'activations') else 'does'} "
                    "not fit in what the rest leaves"
                )
            breakdown = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
            if least.info.status == "OPTIMAL":
                found = f"the least memory any plan needs is {format_bytes(need)}, {format_bytes(need - budget)} over"
            else:
                found = (
                    f"any plan needs at least {format_bytes(bound)}, and the plan with the least memory found "
                    f"in the time limit needs {format_bytes(need)}"
                )
            found += f" ({breakdown}, not all alive at once); {over}"
        factor = math.ceil(need / budget * 10) / 10  # the split parts shrink with the device count
        return (
            f"no plan on {mesh} fits memory_budget={format_bytes(budget)} per device: {found}.\n"
            f"Fix: raise memory_budget to at least {math.ceil(need)} bytes ({format_bytes(need)}), or plan for a mesh "
            f"about {factor:g}x larger ({math.ceil(mesh.size * factor)} devices or more), or shrink the batch"
        )

    def _least_memory_estimate(self, least: Solution):
        memory, activations = self.memory, self.activations
        chosen = (least.recomputed, least.offloaded, least.prefetched)
        return dataclasses.replace(
            memory.estimate(
                least.choice,
                (frozenset(activations.nodes), *activation_bytes(activations, least.choice, *chosen)),
                least.host_optimizer,
                least.host_params,
            ),
            moment_bytes=moment_bytes(
                memory, activations, least.choice, *chosen, least.host_optimizer, least.host_params
            ),
        )


def _as_layout(plan: ShardingPlan, solver: SolverInfo) -> ShardingPlan:
    """``plan``, a standard layout (or a merged mesh's plan) named by its solver line, returned
    with status ``LAYOUT`` and the size and time of the search that ``solver`` describes."""
    layout = plan.solver.layout
    info = dataclasses.replace(solver, status="LAYOUT", objective_s=math.nan, bound_s=-math.inf, layout=layout)
    return dataclasses.replace(plan, solver=info)


def _reduced_after_cast(captured: Captured, policy: MixedPrecision | None) -> frozenset[str]:
    """The values that must not be reduced across ranks under ``policy``: with a ``reduce_dtype``,
    every gradient before the backward casts it to its parameter's dtype."""
    if policy is None or policy.reduce_dtype is None:
        return frozenset()
    before = gradients_before_cast(captured)
    for dtype in set(before.values()):
        if dtype != policy.reduce_dtype:
            raise ValueError(
                f"MixedPrecision(reduce_dtype={policy.reduce_dtype}): the gradients are stepped in {dtype}, the "
                f"parameters' dtype, and are reduced in it or in param_dtype. Fix: reduce_dtype={dtype}, or None "
                "to let the plan choose"
            )
    return frozenset(before)


def _sharded_parameters(space, memory) -> dict[str, int]:
    """A start for the search under a budget: every parameter in its layout with the fewest
    bytes per device (split over every axis it can be, as FSDP or ZeRO-3 would), the rest left
    for the solver to complete. HiGHS can take long to find any plan under a budget alone."""
    return {
        n.name: min(range(len(n.strategies)), key=memory.params[n.name].__getitem__)
        for n in space.nodes
        if n.kind == "param"
    }


def _layer_classes(captured: Captured, space, node_costs, memory, share_layers: bool | None) -> LayerClasses:
    """Repeated layers share variables when asked, or by default when the program would be large."""
    if share_layers is False or (share_layers is None and program_size(space) < SHARE_ABOVE):
        return LayerClasses({}, 0, 0)
    return repeated_layers(captured, space, node_costs, memory)


def plan(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    hardware: "str | Profile" = "h100",
    pins: Pins | None = None,
    memory_budget: "int | str | None" = None,
    fallback: bool = True,
    solver_time_limit_s: float = 120.0,
    solver_gap: float = 1e-3,
    share_layers: bool | None = None,
    recompute: str = "auto",
    mixed_precision: MixedPrecision | None = None,
    optimizer_slots: int = ADAM_SLOTS,
    pipeline: "Pipeline | str | None" = None,
) -> ShardingPlan:
    """Plan ``model`` for ``mesh`` without any process group or device.

    Args:
        model: the single-device module; ``model(*example_inputs)`` returns the loss (or any
            tensors; gradients are taken of the first output's tangent as torch does).
        mesh: the logical mesh, e.g. ``Mesh((2, 2), ("dp", "tp"))``.
        example_inputs: global-batch tensors with the shapes of training, in order, or a dict
            of those passed by keyword (``{"input_ids": ids, "labels": ids}``: ``model(**example_inputs)``;
            values other than tensors, such as ``return_loss=True``, are traced into the graph).
        hardware: ``"h100"``, ``"h200"``, ``"a100"``, ``"cpu"`` or a profile object.
        pins: fixed placements by parameter qualified name or forward argument name, one
            placement per mesh axis (a string for 1-D meshes): ``{"fc1.weight": ("R", "S(0)")}``.
        memory_budget: per-device bytes, or a size like ``"40GB"`` / ``"512MiB"``; the plan's
            predicted peak stays under it or planning fails saying what is over and what fits.
        fallback: run ops that have no sharding rule replicated (with a warning) instead of
            raising :class:`~autopar.core.errors.UnsupportedOpError`.
        solver_time_limit_s: stop the MIP after this long with the best plan found.
        solver_gap: stop the MIP at a plan proven within this fraction of the fastest
            (0.001 by default; 0.01 finds plans under a tight memory budget much sooner).
        share_layers: give identical repeated layers (``layers.0``, ``layers.1``, …) one
            shared choice, so the program grows with the distinct layers, not all of them.
            ``None`` (default) shares them when the program would be large.
        recompute: which activations the backward recomputes instead of keeping: ``"auto"``
            (default) lets the solver choose, with the layouts, what the memory budget needs;
            ``"none"`` keeps them all; ``"layers"`` recomputes each layer of a stack from its
            input (activation checkpointing of every block) and chooses the rest as ``"auto"``.
        mixed_precision: compute with parameters and inputs cast to
            ``mixed_precision.param_dtype`` (:class:`~autopar.core.precision.MixedPrecision`).
        optimizer_slots: the tensors of a parameter's size the optimizer keeps for each
            parameter, which the plan's memory counts: 2 (default) for Adam and AdamW, 1 for SGD
            with momentum, 0 for SGD without. The module warns at the first step of an optimizer
            that keeps more.
        pipeline: an :class:`~autopar.core.pipeline.Pipeline` cutting the model into stages over
            one mesh axis (pins then name placements on the other axes; parts left ``None`` are
            chosen), ``"auto"`` to choose whether and how (:mod:`autopar.stage_search`), or
            ``None`` (default) for no stages.
    """
    check_mesh(mesh)
    keywords: tuple[str, ...] = ()
    fixed: dict[str, object] = {}
    if isinstance(example_inputs, Mapping):
        tensors, fixed = split_keywords(example_inputs)
        keywords = keyword_order(model, tensors)
        example_inputs = tuple(tensors[name] for name in keywords)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "example_inputs must be a tuple of tensors, e.g. (x, y), or a dict of those passed by keyword, "
            "e.g. {'input_ids': ids, 'labels': ids}"
        )
    config = PlanConfig.of(locals())
    from autopar.stage_search import check_pipeline, plan_auto, plan_stages  # they plan through this module

    pipeline = check_pipeline(pipeline, mesh, pins)
    config.pins_for(pinned_mesh(pipeline, mesh))

    if pipeline is None:
        return plan_with(capture(model, tuple(example_inputs), config.param_dtype, keywords, fixed), mesh, config)
    batch = shared_batch(example_inputs)
    if isinstance(pipeline, Pipeline) and pipeline.microbatches and (not batch or batch % pipeline.microbatches):
        raise ValueError(
            f"pipeline stages cut every input along dim 0 into {pipeline.microbatches} micro-batches; the inputs "
            "share no batch size that divides. Fix: inputs batched along dim 0, a batch Pipeline(microbatches=) divides"
        )

    def capture_at(microbatches: int) -> Captured:
        return capture(model, first_microbatch(example_inputs, microbatches), config.param_dtype, keywords, fixed)

    if planning_chooses(pipeline):
        return plan_auto(capture_at, batch, mesh, config, given_parts(pipeline))
    return plan_stages(capture_at(pipeline.microbatches), mesh, pipeline, config, capture_at=capture_at)
