"""Pick one strategy per node by mixed-integer programming (OR-Tools ``pywraplp``, HiGHS).

The program, Alpa's formulation (also XLA auto-sharding's) with resharding priced once per
tensor and target layout, however many consumers share it::

    minimise    Σ_n Σ_k c_n,k · x_n,k  +  Σ_v Σ_(p,q) r_v(p,q) · y_v,p,q
    subject to  Σ_k x_n,k = 1                                   (one strategy per node)
                Σ_q t_c,p,q = z_v,p      for every reader c of v   (the copy leaves the producer's layout)
                Σ_p t_c,p,q = w_c,q      for every reader c of v   (and arrives in the reader's layout)
                y_v,p,q ≥ t_c,p,q        for every reader c, p ≠ q (one move serves every reader)
                x_n,k ∈ {0, 1},  0 ≤ t, y ≤ 1

The memory budget, the keep, recompute or offload choice of every forward op and the choice of
keeping parameters and optimizer state in host memory add constraints of their own
(:mod:`autopar.passes.solve.memory_program` and :mod:`autopar.passes.solve.memory_choices`, whose docstrings
write them out).

``x_n,k`` chooses strategy ``k`` of node ``n`` with compute cost ``c_n,k``. For every tensor
``v``, ``z_v,p`` is the sum of its producer's one-hots whose strategy gives ``v`` layout ``p``,
and ``w_c,q`` the sum of a reader's one-hots that need it in layout ``q``. Each reader's
``t_c`` is a transport between the two (tight: integral whenever the one-hots are), and
``y_v,p,q`` moves ``v`` from ``p`` to ``q`` at the modelled cost ``r_v(p, q)`` once, however many
readers need that copy, as the rewriter emits it (once for the forward's readers and once
for the backward's: the backward makes its own moves). Grouping strategies by layout keeps the
variables per tensor to the distinct layouts instead of the strategies.

How a tensor's layouts are tied between its producer and its readers, and the rows of gradient
and parameter buckets, are in :mod:`autopar.passes.solve.transport`.

Three reductions keep the program small without changing its optimum. A tensor with one reader
needs no ``y``: its transport carries the cost, or, when fewer, it moves as a unit of flow over
the one-axis moves between layouts (``Σ_out f − Σ_in f = z_v,u − w_c,u`` at every layout ``u``,
each move priced by its step), whose cheapest path is the transition's cost. An op whose cost
is the same under every layout and that has one strategy per operand layout takes its operand's
variables. Nodes of repeated layers take the variables of the first layer of their class, and each tensor's moves
are priced once per copy.

A :class:`Problem` holds what the program is built from (:func:`build_program`): the strategy space
and its cost tables, the memory terms and budget, the choices beyond the strategies and what is
minimised. :class:`SearchOptions` say how :func:`solve` searches it: for how long, how close to
the optimum and from which plan. A problem fixes the program; the options never change it.
"""

import dataclasses
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass

from autopar.cost_model.estimate import MemoryTerms
from autopar.cost_model.hardware import Host
from autopar.passes.solve.memory_choices import host_capacity, host_state, keep_recompute_or_offload
from autopar.passes.solve.memory_program import MemoryTerm, in_flight_bucket, memory_budget, priced_memory
from autopar.passes.solve.mip import (
    BUDGET_HEURISTIC_ABOVE,
    BUDGET_HEURISTIC_EFFORT,
    DEFAULT_HEURISTIC_EFFORT,
    MEMORY_SCALE,
    SCALE,
    add_row,
    solve_before_deadline,
)
from autopar.passes.solve.remat import ActivationSpace, backward_view_reads
from autopar.passes.solve.stage_memory import StageMemory, stage_budget
from autopar.passes.solve.transport import (
    GradientCost,
    OneStepMoves,
    TransitionCost,
    enough_buckets,
    gathered,
    gradient_transport,
    group_by_layout,
    is_gradient,
    layout_available,
    tensor_classes,
)
from ortools.linear_solver import pywraplp

from autopar.core.errors import InfeasiblePlanError, SolverTimeoutError
from autopar.core.plan import SolverInfo
from autopar.core.strategy import NodeSpace, StrategySpace, ValueRef

log = logging.getLogger(__name__)

_LARGE = 400_000  # variables past which the root relaxation alone takes minutes on a small host


@dataclass(frozen=True, slots=True)
class Solution:
    """The chosen strategy index of every node and how the solve went."""

    choice: dict[str, int]
    info: SolverInfo
    recomputed: frozenset[str] = frozenset()
    """Forward ops the backward runs again instead of keeping their outputs."""
    offloaded: frozenset[str] = frozenset()
    """Forward ops whose outputs wait in host memory for the backward."""
    host_optimizer: frozenset[str] = frozenset()
    """Parameters whose optimizer state lives in host memory and is stepped there."""
    host_params: frozenset[str] = frozenset()
    """Parameters (a subset of ``host_optimizer``) that live in host memory themselves."""
    prefetched: frozenset[str] = frozenset()
    """Segments whose offloaded outputs are copied back during the backward of the segment
    after them, ahead of their first read."""


@dataclass(frozen=True, slots=True)
class Problem:
    """What the integer program optimises, everything :func:`build_program` builds it from: the
    strategy space with its precomputed cost tables, the memory terms and the budget, the choices
    beyond the strategies (recompute, offload, host memory) and what is minimised. A problem fixes
    the program, its variables, rows and objective, so every search of it has the same optimum
    (:class:`SearchOptions` decide only how the search runs). The memory budget belongs here
    rather than among the options: it is a row of the program, it moves the optimum, and with it
    (or ``minimise="memory"``) ``host`` adds the offload choices. Only ``space``, ``node_costs``
    and ``transition_s`` are positional; without the others the program is Alpa's alone."""

    space: StrategySpace
    node_costs: Mapping[str, list[float]]
    """Seconds of every node under each of its strategies."""
    transition_s: TransitionCost
    """``transition_s(ref, src, dst)``: seconds of moving tensor ``ref`` from layout ``src`` to
    ``dst``. With ``one_step_moves`` it must be the cheapest path over those moves, as
    :func:`autopar.passes.propagation.redistribute.transition` is."""
    _: KW_ONLY
    gradient_s: GradientCost | None = None
    """Prices moving a parameter's gradient that only the parameter reads: the seconds of the
    move without bucket latency, and its share of a bucket when it joins one
    (:meth:`~autopar.cost_model.estimate.CostModel.gradient_s`); without it gradients are moved
    one by one."""
    gather_s: GradientCost | None = None
    """Likewise prices moving a parameter for the ops that read it
    (:meth:`~autopar.cost_model.estimate.CostModel.gather_s`): the moves that are one all-gather
    join the buckets of their phase and of the layer of their readers."""
    segments: Mapping[str, str] | None = None
    """Each node's layer (:func:`~autopar.passes.analysis.capture.segment_of`), for ``gather_s``'s
    buckets."""
    one_step_moves: OneStepMoves | None = None
    """``one_step_moves(ref)`` lists the moves of ``ref`` that change one mesh axis, priced; when
    given, a tensor with one reader moves along them
    (:func:`~autopar.passes.solve.transport.layout_flow`), which takes fewer variables than all
    pairs of layouts on N-D meshes."""
    shared: Mapping[str, str] | None = None
    """Nodes of repeated layers mapped to their counterpart in the representative layer of their
    class (:func:`autopar.passes.solve.layers.repeated_layers`): they take its choice instead of
    their own variables, and the costs of every copy add up on the shared variables."""
    activations: ActivationSpace | None = None
    """Makes the views of parameters the backward reads again in the backward (their moves priced
    there) and, with ``choose_recompute``, adds the keep-or-recompute choice of every forward op;
    the kept and recomputed activations then replace ``memory.activations`` of those ops."""
    choose_recompute: bool = True
    """Whether the program chooses what ``activations`` keeps, recomputes or offloads."""
    host: Host | None = None
    """Adds, under a memory budget or with ``minimise="memory"``, offload to host memory of
    activations (with ``choose_recompute``), of optimizer state and of parameters (not in
    pipeline stages, ``stage_memory``: their runtime keeps both on the device)."""
    memory: MemoryTerms | None = None
    """The per-device memory of every strategy, counted at each moment of the step
    (:func:`~autopar.passes.solve.memory_program.memory_budget`); without it the program counts
    no memory."""
    budget_bytes: float | None = None
    """With ``memory``, the bytes per device the peak is kept under."""
    bucket_bytes: float | None = None
    """With ``memory``, the size of a gradient bucket, whose packed copy in flight beside the
    backward is counted (:func:`~autopar.passes.solve.memory_program.in_flight_bucket`)."""
    minimise: str = "time"
    """``"time"`` for the fastest plan, ``"memory"`` for the plan with the least memory (its peak;
    needs ``memory``)."""
    stage_memory: StageMemory | None = None
    """For a plan in pipeline stages: each position of the pipeline axis is held to the budget
    (:mod:`autopar.passes.solve.stage_memory`) instead of one device holding every node."""
    bucket_groups: Mapping[str, int] | None = None
    """For a plan in pipeline stages, each parameter's stage by qualified name
    (:attr:`~autopar.cost_model.estimate.CostModel.bucket_groups`, as the plan's buckets read
    it): each stage's gradients join buckets of their own, each paying its latency."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """How :func:`solve` searches a :class:`Problem`'s program: when it stops and where it starts.
    None of them changes the program, so its optimum is the same under any options; they decide
    how close to it the plan returned is proven and how long that may take."""

    time_limit_s: float = 120.0
    """Seconds the search may take; past them it returns the best plan found (status
    ``FEASIBLE``, with its bound)."""
    relative_gap: float = 1e-3
    """The search stops at a plan proven within this fraction of the optimum."""
    start: Solution | Mapping[str, int] | None = None
    """A plan for the search to start from: a :class:`Solution` of this program (under another
    budget, say), or strategy indices of some nodes, which the solver completes. A start that
    satisfies the program makes the result at least as fast as the start; one that does not is
    dropped. When the search finds no plan in its time limit and the start gives every node's
    strategy, the start comes back with status ``START`` (its objective unknown: NaN)."""


@dataclass(frozen=True, slots=True)
class Program:
    """The plan's integer program, built (:func:`build_program`), with the variables a plan is
    read from."""

    solver: pywraplp.Solver
    ind: dict[str, list[list]]
    """Each node's one-hot terms, by strategy (shared nodes hold their class's)."""
    own: set[str]
    """Nodes with one-hot variables of their own."""
    shared: dict[str, str]
    choices: dict[str, dict]
    """The activation and host-memory choices' variables by name, under the field of
    :class:`Solution` that names those chosen."""
    peak: object
    """The per-device peak's variable, with memory terms."""
    budget_row: object
    """The row keeping ``peak`` under the budget, with one."""
    scale: float
    """The objective's units per second (or per byte, minimising memory)."""
    priced_budget: float | None
    """The memory budget of a search for the fastest plan under one."""
    choosing: bool
    activations: ActivationSpace | None
    memory: MemoryTerms | None


def _strategy_variables(solver, space: StrategySpace, node_costs, shared: dict[str, str]):
    """Each node's one-hot terms by strategy (``ind``), the nodes with variables of their own,
    and the ``(node, operand)`` pairs whose node follows its operand's layout: shared nodes take
    their class's terms, and ops that cost the same under every layout their operand's."""
    copies: dict[str, list[str]] = defaultdict(list)
    for name, first in shared.items():
        copies[first].append(name)
    by_name = space.index()
    followed: set[tuple[str, ValueRef]] = set()
    ind: dict[str, list[list]] = {}
    own: set[str] = set()  # nodes with one-hot variables of their own
    for n in space.nodes:
        if n.name in shared:
            continue
        follow = None
        if len(set(node_costs[n.name])) == 1 and _copied_with_operand(n, shared, copies, by_name):
            follow = _follow_operand(n, by_name, ind)
        if follow is not None:
            followed.add((n.name, n.args[0]))
        else:
            own.add(n.name)
        ind[n.name] = follow if follow is not None else _one_strategy_per_node(solver, n)
    for n in space.nodes:
        if n.name in shared:
            first = by_name[shared[n.name]]
            ind[n.name] = ind[first.name]
            if (first.name, first.args[0] if first.args else None) in followed:
                followed.add((n.name, n.args[0]))
    return ind, own, followed


def _moves(solver, problem: Problem, ind, shared, followed, costs, reader_moves, bucketed) -> None:
    """The rows and costs of moving every tensor between its producer's and its readers'
    layouts (:mod:`autopar.passes.solve.transport`): gradients by their buckets, parameters by
    the gathers their readers need, the rest by ``transition_s`` (or the one-step moves)."""
    space, activations, transition_s = problem.space, problem.activations, problem.transition_s
    gradient_s, gather_s, one_step_moves = problem.gradient_s, problem.gather_s, problem.one_step_moves
    segments = problem.segments or {}
    by_name = space.index()
    backward_reads = backward_view_reads(activations, space) if activations is not None else {}
    bucket_shares: dict[tuple, list] = defaultdict(list)
    groups = problem.bucket_groups
    by_stage: dict[tuple, Counter] = defaultdict(Counter)  # a gradient class's copies, by their parameter's stage
    for n in space.nodes if groups is not None else ():
        if n.kind == "param" and n.args:
            ref, param = n.args[0], shared.get(n.name, n.name)
            by_stage[(shared.get(ref[0], ref[0]), ref[1]), param][groups.get(n.target, 0)] += 1  # as the plan's buckets
    for (ref, readers), count in tensor_classes(space, shared, followed, backward_reads).items():
        if gradient_s is not None and is_gradient(readers, by_name):
            reader = next(iter(readers))
            copies = by_stage[ref, reader[0]] if groups is not None else {0: count}
            gradient_transport(solver, costs, ref, by_name, reader, copies, ind, gradient_s, bucket_shares, bucketed)
        elif gather_s is not None and by_name[ref[0]].kind == "param":
            price, joined = gathered(gather_s, ref, readers, count, by_name, segments, bucket_shares)
            layout_available(solver, costs, ref, by_name, readers, count, ind, price, None, reader_moves, joined)
        else:
            layout_available(
                solver, costs, ref, by_name, readers, count, ind, transition_s, one_step_moves, reader_moves
            )
    enough_buckets(solver, costs, bucket_shares)


def build_program(problem: Problem) -> Program:
    """Build ``problem``'s integer program, the one :func:`solve` searches: a one-hot per node
    and the moves between the layouts of its strategies, then the activation and host-memory
    choices and the memory rows, then the objective (seconds, or the peak's bytes)."""
    solver = pywraplp.Solver.CreateSolver("HIGHS")
    shared = dict(problem.shared or {})
    ind, own, followed = _strategy_variables(solver, problem.space, problem.node_costs, shared)
    costs = _compute_costs(problem, ind)
    reader_moves: dict[tuple[str, int], list] = {}
    bucketed: list[tuple] = []  # (share of a bucket, its largest value) of every gradient move that joins one
    _moves(solver, problem, ind, shared, followed, costs, reader_moves, bucketed)
    choosing = problem.activations is not None and problem.choose_recompute
    choices, peak, budget_row = _memory_rows(solver, problem, ind, shared, choosing, costs, reader_moves, bucketed)
    return Program(
        solver,
        ind,
        own,
        shared,
        choices,
        peak,
        budget_row,
        _objective(solver, problem, costs, peak),
        problem.budget_bytes if problem.minimise == "time" else None,
        choosing,
        problem.activations,
        problem.memory,
    )


def _compute_costs(problem: Problem, ind: dict[str, list[list]]) -> dict:
    """Seconds per one-hot variable: each node's cost under a strategy on that strategy's terms
    (a shared variable adds up the costs of every copy). The moves add theirs after."""
    costs: dict = defaultdict(float)
    for n in problem.space.nodes:
        for k, terms in enumerate(ind[n.name]):
            for var in terms:
                costs[var] += problem.node_costs[n.name][k]
    return costs


def _memory_rows(solver, problem: Problem, ind, shared, choosing: bool, costs, reader_moves, bucketed):
    """The keep, recompute or offload choice of every forward op (when ``choosing``), the choice
    of keeping optimizer state and parameters in host memory (under a budget or minimising
    memory, with a host, without pipeline stages), and the per-device peak with the row keeping it under the budget
    (with memory terms). Returns the choices' variables by name under the field of
    :class:`Solution` that names those chosen, the peak's variable and the budget's row (``None``
    without memory terms)."""
    memory, activations = problem.memory, problem.activations
    again, away, ahead, on_host, params_on_host = {}, {}, {}, {}, {}
    offloading = problem.host if problem.budget_bytes is not None or problem.minimise == "memory" else None
    host_mb: list = []
    kept = None
    if choosing:
        again, away, ahead, kept_mb, refilled = keep_recompute_or_offload(
            solver, activations, ind, problem.node_costs, reader_moves, shared, costs, offloading, host_mb
        )
        kept = (kept_mb, refilled)
    terms: list[MemoryTerm] = []
    stages = problem.stage_memory
    if memory is not None and offloading is not None and stages is None:  # stages keep their state on the device
        on_host, params_on_host, terms = host_state(solver, memory, ind, shared, offloading, costs, host_mb)
    if offloading is not None:
        host_capacity(solver, host_mb, offloading, 1 if stages is None else stages.most_in_flight)
    if memory is not None and bucketed and problem.bucket_bytes:
        terms.append((None, in_flight_bucket(solver, bucketed, problem.bucket_bytes), 1.0, "grad"))
    peak = budget_row = None
    if memory is not None and stages is not None:
        choosing_ops = frozenset(activations.nodes) if choosing else frozenset()
        peak, budget_row = stage_budget(solver, memory, ind, shared, kept, choosing_ops, stages, problem.budget_bytes)
    elif memory is not None:
        peak, budget_row = memory_budget(solver, memory, ind, problem.budget_bytes, shared, activations, kept, terms)
    choices = {
        "recomputed": again,
        "offloaded": away,
        "prefetched": ahead,
        "host_optimizer": on_host,
        "host_params": params_on_host,
    }
    return choices, peak, budget_row


def _objective(solver, problem: Problem, costs: dict, peak) -> float:
    """Minimise the peak (``minimise="memory"``) or the seconds in ``costs``; the objective's
    units per second (or per byte)."""
    objective = solver.Objective()
    if problem.minimise == "memory":
        objective.SetCoefficient(peak, 1.0)
        scale = MEMORY_SCALE
    else:
        for var, cost in costs.items():
            objective.SetCoefficient(var, cost * SCALE)
        scale = SCALE
    objective.SetMinimization()
    return scale


_ANSWERED = (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE, pywraplp.Solver.INFEASIBLE)
"""Statuses that answer the program: a plan, or the proof that none exists."""


def solve(problem: Problem, options: SearchOptions = SearchOptions()) -> Solution:
    """Solve ``problem``'s program (above) as ``options`` say: the search stops at a plan proven
    within ``relative_gap`` of the optimum, or at ``time_limit_s`` with the best plan found
    (status ``FEASIBLE``; the bound is reported).

    Under a budget, the search runs without ``start`` (in large programs from a dive on the
    strategy choices, :func:`~autopar.passes.solve.highs_child.dive`, and with half of HiGHS's
    effort on finding plans, ``BUDGET_HEURISTIC_EFFORT``), and goes on to the time limit once it
    has found a plan that fits; if it has found none in the first fifth of the time (20 s at
    most), it starts again from ``start`` for the rest of the time, and if that finds none
    either, :func:`~autopar.passes.solve.memory_program.priced_memory` looks instead. (A start can
    lead HiGHS away from the optimum, so it is used only where the search alone finds nothing.)

    Raises :class:`InfeasiblePlanError` when no plan satisfies the constraints, and
    :class:`SolverTimeoutError` when the search finds no plan in time and ``start`` does not
    give every node's strategy (when it does, the start comes back with status ``START``).
    """
    started = time.perf_counter()
    built = build_program(problem)
    _warn_if_large(built.solver)
    outcome = _search(built, options, started, _hint(options.start, built))
    status = _status(outcome)
    elapsed = time.perf_counter() - started
    if status not in _ANSWERED:
        return _without_plan(built, options.start, elapsed, len(problem.space.nodes))
    if status == pywraplp.Solver.INFEASIBLE:
        reason = "within the memory budget" if built.peak is not None else "that satisfies the pins"
        raise InfeasiblePlanError(
            f"no plan {reason} exists for {len(problem.space.nodes)} nodes (solver status {status}).\n"
            "Fix: remove conflicting pins, or raise the memory budget"
        )
    return _read(built, outcome, elapsed)


def _warn_if_large(solver) -> None:
    """Warn of a program too large to solve within a time limit, naming what shrinks it."""
    if solver.NumVariables() > _LARGE:
        log.warning(
            "the plan's integer program has %d variables; the solver may not finish within the time limit. "
            "Pins on the large tensors, or a 1-D mesh, shrink it.",
            solver.NumVariables(),
        )


def _without_plan(
    built: Program, start: Solution | Mapping[str, int] | None, elapsed: float, num_nodes: int
) -> Solution:
    """What a search that found no plan in its time limit returns: ``start``, status ``START``
    (its objective unknown: NaN), when it gives every node's strategy; otherwise it raises
    :class:`SolverTimeoutError`."""
    solver = built.solver
    whole = _complete_start(start, built.ind)
    if whole is None:
        raise SolverTimeoutError(
            f"the solver found no plan for {num_nodes} nodes ({solver.NumVariables()} variables) within "
            f"its time limit ({elapsed:.0f} s).\nFix: raise solver_time_limit_s, pin the large tensors, or plan "
            "for a 1-D mesh",
            solve_s=elapsed,
            num_variables=solver.NumVariables(),
            num_constraints=solver.NumConstraints(),
        )
    log.warning("the solver found no plan within its time limit (%.0f s); keeping the plan it started from", elapsed)
    info = SolverInfo(
        status="START",
        objective_s=math.nan,
        bound_s=-math.inf,
        solve_s=elapsed,
        num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints(),
        shared_nodes=len(built.shared),
    )
    if isinstance(start, Solution):
        return dataclasses.replace(start, info=info)
    views = built.activations.param_views if built.activations is not None else frozenset()
    return Solution(whole, info, recomputed=views)


def _search(built: Program, options: SearchOptions, started: float, hint: list[tuple]):
    """Run the search as :func:`solve` describes (under a budget: without ``hint`` first, then
    from it, then by a price on memory) for ``options.time_limit_s``, the later steps until that
    long after ``started``; the last outcome of
    :func:`~autopar.passes.solve.mip.solve_before_deadline`, or ``None``."""
    solver, ind = built.solver, built.ind
    relative_gap, time_limit_s = options.relative_gap, options.time_limit_s
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, relative_gap)
    priced = built.priced_budget is not None
    large = priced and solver.NumVariables() > BUDGET_HEURISTIC_ABOVE
    effort = BUDGET_HEURISTIC_EFFORT if large else DEFAULT_HEURISTIC_EFFORT
    strategy_vars = [var for name in built.own for terms in ind[name] for var in terms] if large else []
    outcome = solve_before_deadline(
        solver,
        params,
        time_limit_s,
        () if priced else hint,
        give_up_without_plan_s=min(time_limit_s * 0.2, 20.0) if priced else math.inf,
        heuristic_effort=effort,
        dive=strategy_vars,
        plain=built.peak is None and not priced,
        restarts=not priced or large,
    )
    status = _status(outcome)
    left = started + time_limit_s - time.perf_counter()
    if priced and status not in _ANSWERED and hint and left > 1.0:
        log.info("no plan under the memory budget yet; searching from the start given for %.0f s more", left)
        outcome = solve_before_deadline(solver, params, left, hint, heuristic_effort=effort)
        status = _status(outcome)
    if priced and status not in _ANSWERED:
        log.info("no plan under the memory budget yet; searching by a price on memory instead")
        outcome = priced_memory(
            solver, params, built.peak, built.budget_row, built.priced_budget, started + time_limit_s, hint
        )
    return outcome


def _status(outcome: tuple | None) -> int:
    """The status of a search's outcome, ``NOT_SOLVED`` when the deadline passed without one."""
    return outcome[0] if outcome is not None else pywraplp.Solver.NOT_SOLVED


def _read(built: Program, outcome: tuple, elapsed: float) -> Solution:
    """The plan in the values of a search's ``outcome``."""
    status, values, objective_value, bound = outcome
    ind, shared, solver = built.ind, built.shared, built.solver
    choice = {
        name: max(range(len(terms)), key=lambda k: sum(values[v.index()] for v in terms[k]))
        for name, terms in ind.items()
    }

    def chosen(variables: dict, names) -> frozenset[str]:
        return frozenset(name for name in names if values[variables[shared.get(name, name)].index()] > 0.5)

    again, away, ahead, on_host, params_on_host = built.choices.values()
    activations, memory = built.activations, built.memory
    prefetched = frozenset()
    if built.choosing:
        recomputed, offloaded = chosen(again, activations.nodes), chosen(away, activations.nodes)
        own = {name: activations.segment[shared.get(name, name)] for name in offloaded}
        prefetched = frozenset(
            activations.segment[name]
            for name in offloaded
            if own[name] in ahead and values[ahead[own[name]].index()] > 0.5
        )
    else:
        recomputed, offloaded = activations.param_views if activations is not None else frozenset(), frozenset()
    stepped_on_host = [name for name in memory.optimizer if shared.get(name, name) in on_host] if on_host else []
    host_optimizer, host_params = chosen(on_host, stepped_on_host), chosen(params_on_host, stepped_on_host)
    info = SolverInfo(
        status="OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE",
        objective_s=objective_value / built.scale,
        bound_s=bound / built.scale,
        solve_s=elapsed,
        num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints(),
        shared_nodes=len(shared),
    )
    log.debug(
        "solved %d variables, %d constraints in %.2fs: %s",
        info.num_variables,
        info.num_constraints,
        elapsed,
        info.status,
    )
    return Solution(choice, info, recomputed, offloaded, host_optimizer, host_params, prefetched)


RELAXATION_LIMIT_S = 600.0
"""Seconds the relaxation of :func:`least_memory_bound` may take, whatever the search's time
limit."""


def least_memory_bound(problem: Problem) -> float:
    """Bytes per device below which no plan goes, as the program counts memory: the least peak
    of the linear relaxation of ``problem``'s program minimising memory (its ``minimise`` set so),
    offloading all it can. The relaxation takes as long as the program needs, not a time limit
    that a busy machine reaches sooner, so a budget below this bound is refused on any machine
    alike. Zero when the program has no plan or the relaxation does not finish within
    ``RELAXATION_LIMIT_S``."""
    built = build_program(dataclasses.replace(problem, minimise="memory"))
    outcome = solve_before_deadline(built.solver, pywraplp.MPSolverParameters(), RELAXATION_LIMIT_S, relax=True)
    status = _status(outcome)
    if status == pywraplp.Solver.NOT_SOLVED:
        log.warning("the relaxation bounding the least memory did not finish; no budget is refused by it")
    if status != pywraplp.Solver.OPTIMAL:
        return 0.0  # an infeasible program (pins that conflict) is reported by the search
    return outcome[2] / MEMORY_SCALE


def _hint(start: "Solution | Mapping[str, int] | None", program: Program) -> list[tuple]:
    """``(variable, value)`` pairs setting the one-hots of the nodes ``start`` chooses for
    and, when it is a :class:`Solution`, the activation and host-memory choices."""
    if start is None:
        return []
    choice = start.choice if isinstance(start, Solution) else start
    hint = []
    for name, k in choice.items():
        if name in program.own:
            hint.extend((terms[0], float(j == k)) for j, terms in enumerate(program.ind[name]))
    if isinstance(start, Solution):
        for field, variables in program.choices.items():
            chosen = {program.shared.get(name, name) for name in getattr(start, field)}
            hint.extend((var, float(name in chosen)) for name, var in variables.items())
    return hint


def _complete_start(start: "Solution | Mapping[str, int] | None", ind: dict) -> dict[str, int] | None:
    """The strategy of every node from ``start``, when it gives one for each."""
    if start is None:
        return None
    choice = start.choice if isinstance(start, Solution) else start
    return dict(choice) if all(name in choice for name in ind) else None


def _one_strategy_per_node(solver, node: NodeSpace) -> list[list]:
    variables = [solver.BoolVar(f"x[{node.name},{k}]") for k in range(len(node.strategies))]
    add_row(solver, 1.0, 1.0, [(v, 1.0) for v in variables])
    return [[v] for v in variables]


def _follows(node: NodeSpace, by_name: dict[str, NodeSpace]) -> bool:
    """A one-input op with one strategy per operand layout, costing the same under each (a view,
    a detach), shares its operand's variables instead of getting its own: it runs in whatever
    layout the operand arrives in. Strategies needing a layout the operand never has are
    dropped: moving a view's operand costs the same bytes as moving the view after it. (The
    caller checks the cost.)"""
    if node.kind != "op" or len(node.args) != 1:
        return False
    ref = node.args[0]
    producer = by_name[ref[0]]
    if producer.kind == "param":
        return False
    needs = [s.inputs[0] for s in node.strategies]
    return len(set(needs)) == len(needs) and set(needs) >= {s.outputs[ref[1]] for s in producer.strategies}


def _follow_operand(node: NodeSpace, by_name: dict[str, NodeSpace], ind: dict[str, list[list]]) -> list[list] | None:
    if not _follows(node, by_name):
        return None
    ref = node.args[0]
    producer = by_name[ref[0]]
    groups = group_by_layout(ind[producer.name], [s.outputs[ref[1]] for s in producer.strategies])
    return [[v for terms in groups.get(s.inputs[0], []) for v in terms] for s in node.strategies]


def _copied_with_operand(
    node: NodeSpace, shared: dict[str, str], copies: dict[str, list[str]], by_name: dict[str, NodeSpace]
) -> bool:
    """Whether following its operand means the same for every copy of ``node``: the operand
    is not itself a copy, and the operand of each copy of ``node`` is a copy of that operand
    (a layer's node reading the layer before it does not follow, since its copies read other
    layers)."""
    if len(node.args) != 1:
        return False
    operand = node.args[0]
    return operand[0] not in shared and all(
        (shared.get(by_name[c].args[0][0]), by_name[c].args[0][1]) == operand for c in copies.get(node.name, ())
    )


def program_size(space: StrategySpace) -> int:
    """A quick measure of the program's size: strategies plus, per tensor read, the pairs of
    layouts its transport relates."""
    by_name = space.index()
    size = 0
    for n in space.nodes:
        size += len(n.strategies)
        for j, (name, index) in enumerate(n.args):
            size += len({s.outputs[index] for s in by_name[name].strategies}) * len({s.inputs[j] for s in n.strategies})
    return size
