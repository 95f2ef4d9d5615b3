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
(:mod:`autopar.passes.memory_program`, whose docstring writes them out).

``x_n,k`` chooses strategy ``k`` of node ``n`` with compute cost ``c_n,k``. For every tensor
``v``, ``z_v,p`` is the sum of its producer's one-hots whose strategy gives ``v`` layout ``p``,
and ``w_c,q`` the sum of a reader's one-hots that need it in layout ``q``. Each reader's
``t_c`` is a transport between the two (tight: integral whenever the one-hots are), and
``y_v,p,q`` moves ``v`` from ``p`` to ``q`` at the modelled cost ``r_v(p, q)`` once, however many
readers need that copy, as the rewriter emits it (once for the forward's readers and once
for the backward's: the backward makes its own moves). Grouping strategies by layout keeps the
variables per tensor to the distinct layouts instead of the strategies.

Gradient buckets (:mod:`autopar.passes.buckets`). A parameter's node reads the parameter's
gradient, which moves into the parameter's placements once made; a move that is one
all-reduce or reduce-scatter, or all-reduces over several mesh axes, joins a bucket, and a
bucket pays one collective latency α per mesh axis for all its gradients. Such a move's
``r_v(p, q)`` is its bandwidth terms only, and the buckets of each group ``g`` (collective kinds
and mesh axes, dtype) are counted and priced α_g each::

                N_g ≥ Σ_v Σ_(p,q) s_v,p,q · t_v,p,q      (enough buckets for the bytes)
                N_g ≥ Σ_(p,q) t_v,p,q    for every gradient v   (one as soon as a gradient joins)
                α_g · N_g in the objective,  N_g ≥ 0

summing over the bucketed moves ``(p, q)`` of ``g``, with ``s_v,p,q = min(1, bytes /
bucket_bytes)`` the move's share of a bucket. Which gradients share a bucket is not known while
layouts are chosen: the shares are linear in the choice and add up to one α per full bucket, and
the second family charges a whole α to gradients that fill less than one bucket, as the step
pays it. ``N_g`` needs no integrality: with integral one-hots it is ``max(1, Σ s)`` as soon as a
gradient joins. A gradient that only its parameter reads moves by the reader's transport ``t``,
not by the flow over one-axis moves below, whose paths could chain bucketed steps that the
rewriter would run one by one.

Parameters are gathered in buckets too, one per layer and phase
(:func:`~autopar.passes.buckets.parameter_gathers`): a parameter's move for its readers that is
one all-gather is priced likewise, with groups ``g`` of kind, mesh axis, dtype, phase and the
readers' layer; a parameter standing for ``c`` copies of a repeated layer joins with ``c · y``
(each copy gathers on its own), and such moves use transports, not flows.

Three reductions keep the program small without changing its optimum. A tensor with one reader
needs no ``y``: its transport carries the cost, or, when fewer, it moves as a unit of flow over
the one-axis moves between layouts (``Σ_out f − Σ_in f = z_v,u − w_c,u`` at every layout ``u``,
each move priced by its step), whose cheapest path is the transition's cost. An op whose cost
is the same under every layout and that has one strategy per operand layout takes its operand's
variables. Nodes of repeated layers take the first layer's variables, and each tensor's moves
are priced once per copy.
"""

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from autopar.cost_model.estimate import MemoryTerms
from autopar.cost_model.hardware import Host
from autopar.errors import InfeasiblePlanError
from autopar.passes.buckets import BucketShare
from autopar.passes.memory_program import host_state, in_flight_bucket, keep_recompute_or_offload, memory_budget, priced_memory
from autopar.passes.mip import MEMORY_SCALE, SCALE, solve_before_deadline
from autopar.passes.remat import ActivationSpace, backward_param_reads
from autopar.passes.strategy import NodeSpace, StrategySpace, ValueRef
from autopar.placement import Placements
from autopar.plan import SolverInfo

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


TransitionCost = Callable[[ValueRef, Placements, Placements], float]
GradientCost = Callable[[ValueRef, Placements, Placements], tuple[float, BucketShare | None]]
OneStepMoves = Callable[[ValueRef], Sequence[tuple[Placements, Placements, float]]]


def solve(space: StrategySpace, node_costs: dict[str, list[float]], transition_s: TransitionCost,
          *, gradient_s: GradientCost | None = None, gather_s: GradientCost | None = None,
          segments: Mapping[str, str] | None = None, memory: MemoryTerms | None = None, budget_bytes: float | None = None,
          one_step_moves: OneStepMoves | None = None, shared: dict[str, str] | None = None,
          activations: ActivationSpace | None = None, choose_recompute: bool = True, host: Host | None = None,
          minimise: str = "time", time_limit_s: float = 120.0, relative_gap: float = 1e-3,
          start: "Solution | Mapping[str, int] | None" = None, bucket_bytes: float | None = None) -> Solution:
    """Solve the program above. ``transition_s(ref, src, dst)`` prices moving tensor ``ref``.
    ``gradient_s``, when given, prices moving a parameter's gradient that only the parameter
    reads: the seconds of the move without bucket latency, and its share of a bucket when it
    joins one (:meth:`~autopar.cost_model.estimate.CostModel.gradient_s`); without it gradients
    are moved one by one. ``gather_s`` likewise prices moving a parameter for the ops that read
    it (:meth:`~autopar.cost_model.estimate.CostModel.gather_s`): the moves that are one
    all-gather join the buckets of their phase and of the layer of their readers, ``segments``
    giving each node's layer (:func:`~autopar.passes.capture.segment_of`).

    ``one_step_moves(ref)`` lists the moves of ``ref`` that change one mesh axis, priced; when
    given, a tensor with one reader moves along them (:func:`_layout_flow`), which takes fewer
    variables than all pairs of layouts on N-D meshes. ``transition_s`` must then be the
    cheapest path over these moves, as :func:`autopar.passes.redistribute.transition` is.

    ``activations`` makes the views of parameters the backward reads again in the backward
    (their moves priced there) and, with ``choose_recompute``, adds the keep-or-recompute
    choice of every forward op; the kept and recomputed activations then replace
    ``memory.activations`` of those ops. ``host`` adds, under a memory budget, offload to host
    memory of activations (with ``choose_recompute``), of optimizer state and of parameters.

    ``shared`` maps nodes of repeated layers to their counterpart in the first layer
    (:func:`autopar.passes.layers.repeated_layers`): they take its choice instead of their own
    variables, and the costs of every copy add up on the shared variables.

    With ``memory`` and ``budget_bytes`` the per-device memory is kept under the budget
    (:func:`~autopar.passes.memory_program.memory_budget`), with the packed copy of a gradient
    bucket of ``bucket_bytes`` in flight beside the backward counted when given
    (:func:`~autopar.passes.memory_program.in_flight_bucket`); ``minimise="memory"`` looks for
    the plan with the least memory instead of the fastest. The search stops at a plan proven
    within ``relative_gap`` of the optimum, or at ``time_limit_s`` with the best plan found
    (status ``FEASIBLE``; the bound is reported). Under a budget, the first fifth of the time
    (20 s at most) looks for any plan that fits, without ``start``: one found, the search goes on
    from it for the rest of the time; none, the search starts from ``start`` for the rest of
    the time, and if that finds none either,
    :func:`~autopar.passes.memory_program.priced_memory` looks instead. (A start can lead HiGHS
    away from the optimum, so it is used only where the search alone finds nothing.)
    Raises :class:`InfeasiblePlanError` when no plan satisfies the constraints.

    ``start`` is a plan for the search to start from: a :class:`Solution` of this program (under
    another budget, say), or strategy indices of some nodes, which the solver completes. A start
    that satisfies the program makes the result at least as fast as the start; one that does not
    is dropped.
    """
    started = time.perf_counter()
    solver = pywraplp.Solver.CreateSolver("HIGHS")
    shared = dict(shared or {})
    first_layers = set(shared.values())
    by_name = space.index()
    followed: set[tuple[str, ValueRef]] = set()
    ind: dict[str, list[list]] = {}
    own: set[str] = set()  # nodes with one-hot variables of their own
    for n in space.nodes:
        if n.name in shared:
            continue
        follow = None
        if len(set(node_costs[n.name])) == 1 and _copied_with_operand(n, shared, first_layers):
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
    costs: dict = defaultdict(float)
    for n in space.nodes:
        for k, terms in enumerate(ind[n.name]):
            for var in terms:
                costs[var] += node_costs[n.name][k]
    reader_moves: dict[tuple[str, int], list] = {}
    backward_reads = backward_param_reads(activations, space) if activations is not None else {}
    bucket_shares: dict[tuple, list] = defaultdict(list)
    bucketed: list[tuple] = []  # (share of a bucket, its largest value) of every gradient move that joins one
    for (ref, readers), count in _tensor_classes(space, shared, followed, backward_reads).items():
        if gradient_s is not None and _gradient(readers, by_name):
            _gradient_transport(solver, costs, ref, by_name, next(iter(readers)), count, ind, gradient_s, bucket_shares,
                                bucketed)
        elif gather_s is not None and by_name[ref[0]].kind == "param":
            price, joined = _gathered(gather_s, ref, readers, count, by_name, segments or {}, bucket_shares)
            _layout_available(solver, costs, ref, by_name, readers, count, ind, price, None, reader_moves, joined)
        else:
            _layout_available(solver, costs, ref, by_name, readers, count, ind, transition_s, one_step_moves, reader_moves)
    _enough_buckets(solver, costs, bucket_shares)
    again, away, ahead, on_host, params_on_host = {}, {}, {}, {}, {}
    choosing = activations is not None and choose_recompute
    offloading = host if budget_bytes is not None or minimise == "memory" else None
    if choosing:
        again, away, ahead, kept_mb, recompute_mb = keep_recompute_or_offload(solver, activations, ind, node_costs, reader_moves,
                                                                              shared, costs, offloading)
    host_mb = None
    if memory is not None and offloading is not None:
        on_host, params_on_host, host_mb = host_state(solver, memory, ind, shared, offloading, costs)
    if memory is not None and bucketed and bucket_bytes:
        host_mb = {**(host_mb or {}), in_flight_bucket(solver, bucketed, bucket_bytes): 1.0}
    objective = solver.Objective()
    if memory is not None:
        memory_coefs, peak, budget_row = memory_budget(solver, memory, ind, budget_bytes, shared,
                                                        (activations, kept_mb, recompute_mb) if choosing else None, host_mb)
    if minimise == "memory":
        for var, coef in memory_coefs.items():
            objective.SetCoefficient(var, coef)
        objective.SetCoefficient(peak, 1.0)
        scale = MEMORY_SCALE
    else:
        for var, cost in costs.items():
            objective.SetCoefficient(var, cost * SCALE)
        scale = SCALE
    objective.SetMinimization()
    if solver.NumVariables() > _LARGE:
        log.warning("the plan's integer program has %d variables; the solver may not finish within the time limit. "
                    "Pins on the large tensors, or a 1-D mesh, shrink it.", solver.NumVariables())
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, relative_gap)
    priced = budget_bytes is not None and minimise == "time"
    hint = _hint(start, ind, own, shared, ((again, "recomputed"), (away, "offloaded"), (ahead, "prefetched"),
                                           (on_host, "host_optimizer"), (params_on_host, "host_params")))
    outcome = solve_before_deadline(solver, params, min(time_limit_s * 0.2, 20.0) if priced else time_limit_s,
                                    () if priced else hint)
    status = outcome[0] if outcome is not None else pywraplp.Solver.NOT_SOLVED
    left = started + time_limit_s - time.perf_counter()
    answered = (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE, pywraplp.Solver.INFEASIBLE)
    if priced and status not in answered and hint and left > 1.0:
        log.info("no plan under the memory budget yet; searching from the start given for %.0f s more", left)
        outcome = solve_before_deadline(solver, params, left, hint)
        status = outcome[0] if outcome is not None else pywraplp.Solver.NOT_SOLVED
    elif priced and status == pywraplp.Solver.FEASIBLE and left > 1.0:
        log.info("a plan under the memory budget found; searching for a faster one for %.0f s more", left)
        found = outcome[1]
        better = solve_before_deadline(solver, params, left, [(var, found[var.index()]) for var in solver.variables()])
        if better is not None and better[1] is not None and better[2] <= outcome[2]:
            outcome, status = better, better[0]
    if priced and status not in answered:
        log.info("no plan under the memory budget yet; searching by a price on memory instead")
        outcome = priced_memory(solver, params, memory_coefs, peak, budget_row, budget_bytes,
                                 started + time_limit_s, hint)
        status = outcome[0] if outcome is not None else pywraplp.Solver.NOT_SOLVED
    elapsed = time.perf_counter() - started
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE, pywraplp.Solver.INFEASIBLE):
        raise InfeasiblePlanError(
            f"the solver found no plan for {len(space.nodes)} nodes ({solver.NumVariables()} variables) within "
            f"its time limit ({elapsed:.0f} s).\nFix: raise solver_time_limit_s, pin the large tensors, or plan "
            "for a 1-D mesh"
        )
    if status == pywraplp.Solver.INFEASIBLE:
        reason = "within the memory budget" if budget_bytes is not None else "that satisfies the pins"
        raise InfeasiblePlanError(
            f"no plan {reason} exists for {len(space.nodes)} nodes (solver status {status}).\n"
            "Fix: remove conflicting pins, or raise the memory budget"
        )
    _, values, objective_value, bound = outcome
    choice = {
        name: max(range(len(terms)), key=lambda k: sum(values[v.index()] for v in terms[k]))
        for name, terms in ind.items()
    }
    def chosen(variables: dict, names) -> frozenset[str]:
        return frozenset(name for name in names if values[variables[shared.get(name, name)].index()] > 0.5)

    prefetched = frozenset()
    if choosing:
        recomputed, offloaded = chosen(again, activations.nodes), chosen(away, activations.nodes)
        own = {name: activations.segment[shared.get(name, name)] for name in offloaded}
        prefetched = frozenset(activations.segment[name] for name in offloaded
                               if own[name] in ahead and values[ahead[own[name]].index()] > 0.5)
    else:
        recomputed, offloaded = activations.param_views if activations is not None else frozenset(), frozenset()
    stepped_on_host = [name for name in memory.optimizer if shared.get(name, name) in on_host] if on_host else []
    host_optimizer, host_params = chosen(on_host, stepped_on_host), chosen(params_on_host, stepped_on_host)
    info = SolverInfo(
        status="OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE",
        objective_s=objective_value / scale,
        bound_s=bound / scale,
        solve_s=elapsed,
        num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints(),
        shared_nodes=len(shared),
    )
    log.debug("solved %d variables, %d constraints in %.2fs: %s", info.num_variables,
              info.num_constraints, elapsed, info.status)
    return Solution(choice, info, recomputed, offloaded, host_optimizer, host_params, prefetched)


def _hint(start: "Solution | Mapping[str, int] | None", ind: dict, own: set[str], shared: dict[str, str],
          families: tuple) -> list[tuple]:
    """``(variable, value)`` pairs setting the one-hots of the nodes ``start`` chooses for
    and, when it is a :class:`Solution`, the activation and host-memory choices: each family is
    the variables by name and the field of the solution naming those chosen."""
    if start is None:
        return []
    choice = start.choice if isinstance(start, Solution) else start
    hint = []
    for name, k in choice.items():
        if name in own:
            hint.extend((terms[0], float(j == k)) for j, terms in enumerate(ind[name]))
    if isinstance(start, Solution):
        for variables, field in families:
            chosen = {shared.get(name, name) for name in getattr(start, field)}
            hint.extend((var, float(name in chosen)) for name, var in variables.items())
    return hint


def _one_strategy_per_node(solver, node: NodeSpace) -> list[list]:
    variables = [solver.BoolVar(f"x[{node.name},{k}]") for k in range(len(node.strategies))]
    solver.Add(sum(variables) == 1)
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
    groups = _group(ind[producer.name], [s.outputs[ref[1]] for s in producer.strategies])
    return [[v for terms in groups.get(s.inputs[0], []) for v in terms] for s in node.strategies]


def _group(terms: list[list], layouts: list[Placements]) -> dict[Placements, list[list]]:
    groups: dict[Placements, list[list]] = defaultdict(list)
    for t, layout in zip(terms, layouts):
        groups[layout].append(t)
    return groups


def _flat(group: list[list]) -> list:
    return [v for terms in group for v in terms]


def _copied_with_operand(node: NodeSpace, shared: dict[str, str], first_layers: set[str]) -> bool:
    """Whether following its operand means the same for every copy of ``node``: the operand
    is not itself a copy, and a node of a first layer only follows an operand of that layer."""
    if len(node.args) != 1:
        return False
    operand = node.args[0][0]
    return operand not in shared and (node.name not in first_layers or operand in first_layers)


def _tensor_classes(space: StrategySpace, shared: dict[str, str], followed: set,
                    backward_reads: dict[str, ValueRef]) -> dict[tuple, int]:
    """Group the graph's tensors by what the program sees of them: the (shared) tensor and the
    set of (shared) readers that need it, in the forward or in the backward (which makes its
    own moves; ``backward_reads`` are views made again there, by the tensor they read). Every
    class gets one set of move variables, priced as many times as it has tensors."""
    by_name = space.index()
    readers: dict[tuple, set[tuple[str, int]]] = defaultdict(set)
    for n in space.nodes:
        for j, ref in enumerate(n.args):
            if (n.name, ref) not in followed:
                in_backward = by_name[ref[0]].phase == "backward" or (n.kind == "op" and n.phase == "backward")
                readers[ref, in_backward].add((shared.get(n.name, n.name), j))
    for view, ref in backward_reads.items():
        readers[ref, True].add((shared.get(view, view), 0))
    classes: dict[tuple, int] = defaultdict(int)
    for (ref, _), who in readers.items():
        classes[(shared.get(ref[0], ref[0]), ref[1]), frozenset(who)] += 1
    return classes


def _gradient(readers: frozenset, by_name: dict[str, NodeSpace]) -> bool:
    """Whether a tensor is a parameter's gradient that only its parameter reads."""
    return len(readers) == 1 and by_name[next(iter(readers))[0]].kind == "param"


def _layout_available(solver, costs: dict, ref: ValueRef, by_name: dict[str, NodeSpace], readers: frozenset,
                      count: int, ind: dict, transition_s: TransitionCost, one_step_moves: OneStepMoves | None,
                      reader_moves: dict, joined: Callable | None = None) -> None:
    """Tie every reader's needed layout to the producer's, and price each move ``count`` times.
    ``reader_moves[reader, j]`` gets what moving its ``j``-th operand costs, as
    ``(variable or None, seconds)`` terms. ``joined(p, q, made)``, when given, is told of every
    move and the variable (or 1) saying whether it is made (:func:`_gathered`)."""
    producer = by_name[ref[0]]
    src = {p: _flat(g) for p, g in _group(ind[producer.name], [s.outputs[ref[1]] for s in producer.strategies]).items()}
    moves: dict[tuple, object] = {}
    for name, j in sorted(readers):
        n = by_name[name]
        dst = {q: _flat(g) for q, g in _group(ind[n.name], [s.inputs[j] for s in n.strategies]).items()}
        if len(src) == 1 and len(dst) == 1:
            (p,), (q,) = src, dst
            reader_moves.setdefault((name, j), [(None, transition_s(ref, p, q))] if p != q else [])
            if p != q:
                _move(solver, costs, moves, ref, p, q, count, transition_s, None, joined)
            continue
        if len(readers) == 1 and one_step_moves is not None:
            arcs = one_step_moves(ref)
            flow = _layout_flow(solver, costs, arcs, src, dst, count) if len(arcs) < len(src) * len(dst) else None
            if flow is not None:
                reader_moves.setdefault((name, j), flow)
                continue
        t = _transport(solver, src, dst)
        reader_moves.setdefault((name, j), [(var, transition_s(ref, p, q)) for (p, q), var in t.items() if p != q])
        for (p, q), var in t.items():
            if p != q and len(readers) == 1:
                costs[var] += count * transition_s(ref, p, q)  # the only reader: its transport is the move
                if joined is not None:
                    joined(p, q, var)
            elif p != q:
                _move(solver, costs, moves, ref, p, q, count, transition_s, var, joined)


def _transport(solver, src: dict, dst: dict) -> dict:
    """A reader's copy of a tensor: ``t[p, q]`` moves it from the producer's layout ``p`` to the
    reader's ``q``, given each side's one-hot sums by layout."""
    t = {(p, q): solver.NumVar(0.0, 1.0, "") for p in src for q in dst}
    for p, terms in src.items():  # the reader's copy leaves the producer's layout
        solver.Add(sum(t[p, q] for q in dst) == sum(terms))
    for q, terms in dst.items():  # and arrives in the layout the reader needs
        solver.Add(sum(t[p, q] for p in src) == sum(terms))
    return t


def _gradient_transport(solver, costs: dict, ref: ValueRef, by_name: dict[str, NodeSpace], reader: tuple[str, int],
                        count: int, ind: dict, gradient_s: GradientCost, bucket_shares: dict, bucketed_shares: list) -> None:
    """Move a parameter's gradient to the parameter's layout by the parameter's transport, each
    move priced ``count`` times by ``gradient_s``. For every group of buckets its moves join,
    ``bucket_shares[group, α]`` gets whether the gradient joins one and its share of one, and
    ``bucketed_shares`` that share with its largest value."""
    producer, (name, j) = by_name[ref[0]], reader
    src = {p: _flat(g) for p, g in _group(ind[producer.name], [s.outputs[ref[1]] for s in producer.strategies]).items()}
    dst = {q: _flat(g) for q, g in _group(ind[name], [s.inputs[j] for s in by_name[name].strategies]).items()}
    bucketed: dict[tuple, list] = defaultdict(list)
    for (p, q), var in _transport(solver, src, dst).items():
        if p != q:
            seconds, share = gradient_s(ref, p, q)
            costs[var] += count * seconds
            if share is not None:
                bucketed[share.group, share.latency_s].append((var, count * share.fraction))
    for key, moves in bucketed.items():
        bucket_shares[key].append((sum(var for var, _ in moves), sum(fraction * var for var, fraction in moves)))
        bucketed_shares.append((sum(fraction * var for var, fraction in moves), max(fraction for _, fraction in moves)))


def _gathered(gather_s: GradientCost, ref: ValueRef, readers: frozenset, count: int, by_name: dict[str, NodeSpace],
              segments: Mapping[str, str], bucket_shares: dict) -> tuple[TransitionCost, Callable]:
    """How parameter ``ref`` moves for ``readers``, ``count`` copies of it: each move priced by
    ``gather_s``, and a function that enters a move that joins a bucket, once made, in
    ``bucket_shares`` (see :func:`_enough_buckets`) under its phase and its readers' layer: each
    copy of a repeated layer gathers in buckets of its own."""
    phase = "backward" if any(by_name[name].phase == "backward" for name, _ in readers) else "forward"
    segment = segments.get(min(readers)[0], "")
    priced: dict[tuple, tuple] = {}

    def gathered(p, q) -> tuple:
        if (p, q) not in priced:
            priced[p, q] = gather_s(ref, p, q)
        return priced[p, q]

    def joined(p, q, made) -> None:
        share = gathered(p, q)[1]
        if share is not None:
            bucket_shares[(share.group, phase, segment), share.latency_s].append((count * made, count * share.fraction * made))

    return (lambda _, p, q: gathered(p, q)[0]), joined


def _enough_buckets(solver, costs: dict, bucket_shares: dict) -> None:
    """The bucket counts ``N_g`` of the module docstring, each bucket priced at its group's α.
    ``bucket_shares[group, α]`` holds, per gradient or parameter, how many buckets of the group
    it joins at least (whether it joins one, for a gradient) and its share of them, as
    expressions in its moves."""
    for (_, latency), gradients in bucket_shares.items():
        buckets = solver.NumVar(0.0, solver.infinity(), "")
        solver.Add(buckets >= sum(share for _, share in gradients))  # enough buckets for the bytes
        for joins, _ in gradients:
            solver.Add(buckets >= joins)  # and one as soon as a gradient joins
        costs[buckets] += latency


def _layout_flow(solver, costs: dict, arcs, src: dict, dst: dict, count: int) -> list | None:
    """Move a tensor with one reader as a unit of flow from the producer's layout to the
    reader's along one-axis moves: a cheapest flow is a cheapest path, the transition's cost,
    with a variable per move instead of per pair of layouts. Returns the ``(flow, seconds)``
    of every move, or ``None`` (nothing added) when a layout is outside the moves' layouts."""
    layouts = dict.fromkeys(u for u, _, _ in arcs)
    if not (src.keys() <= layouts.keys() and dst.keys() <= layouts.keys()):
        return None
    out: dict = defaultdict(list)
    into: dict = defaultdict(list)
    priced = []
    for u, v, cost in arcs:
        f = solver.NumVar(0.0, 1.0, "")
        out[u].append(f)
        into[v].append(f)
        costs[f] += count * cost
        priced.append((f, cost))
    for u in layouts:  # what leaves a layout is what the producer gives it plus what arrives, less what the reader keeps
        solver.Add(sum(out[u]) - sum(into[u]) == sum(src.get(u, [])) - sum(dst.get(u, [])))
    return priced


def _move(solver, costs: dict, moves: dict, ref: ValueRef, p, q, count: int, transition_s: TransitionCost, need,
          joined: Callable | None = None) -> None:
    """Price moving ``ref`` from ``p`` to ``q`` once per tensor of its class, whichever readers
    need it (``need`` is a reader's transport variable, or ``None`` when the move is certain)."""
    if (p, q) not in moves:
        moves[p, q] = solver.NumVar(0.0, 1.0, "")
        costs[moves[p, q]] += count * transition_s(ref, p, q)
        if joined is not None:
            joined(p, q, moves[p, q])
    solver.Add(moves[p, q] >= (1 if need is None else need))  # one copy serves every reader


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
