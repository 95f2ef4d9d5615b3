"""The rows that tie a tensor's layout at its producer to the layouts its readers need, and
the buckets its moves join (:func:`autopar.passes.solve.solver.solve`'s program; its docstring
writes out the transport ``t``, the shared moves ``y`` and the flows).

Gradient buckets (:mod:`autopar.passes.propagation.buckets`). A parameter's node reads the parameter's
gradient, which moves into the parameter's placements once made; a move that is one
all-reduce or reduce-scatter, or all-reduces over several mesh axes, joins a bucket, and a
bucket pays one collective latency α per mesh axis for all its gradients. Such a move's
``r_v(p, q)`` is its bandwidth terms only, and the buckets of each group ``g`` (collective kinds
and mesh axes, dtype; in pipeline stages also the parameter's stage, each stage's gradients
reduced in buckets of their own) are counted and priced α_g each::

                N_g ≥ Σ_v Σ_(p,q) s_v,p,q · t_v,p,q      (enough buckets for the bytes)
                N_g ≥ Σ_(p,q) t_v,p,q    for every gradient v   (one as soon as a gradient joins)
                α_g · N_g in the objective,  N_g ≥ 0

summing over the bucketed moves ``(p, q)`` of ``g``, with ``s_v,p,q = min(1, bytes /
bucket_bytes)`` the move's share of a bucket. Which gradients share a bucket is not known while
layouts are chosen: the shares are linear in the choice and add up to one α per full bucket, and
the second family charges a whole α to gradients that fill less than one bucket, as the step
pays it. ``N_g`` needs no integrality: with integral one-hots it is ``max(1, Σ s)`` as soon as a
gradient joins. A gradient that only its parameter reads moves by the reader's transport ``t``,
not by a flow over one-axis moves (:func:`layout_flow`), whose paths could chain bucketed steps that the
rewriter would run one by one.

Parameters are gathered in buckets too, one per layer and phase
(:func:`~autopar.passes.propagation.buckets.parameter_gathers`): a parameter's move for its readers that is
one all-gather is priced likewise, with groups ``g`` of kind, mesh axis, dtype, phase and the
readers' layer; a parameter standing for ``c`` copies of a repeated layer joins with ``c · y``
(each copy gathers on its own), and such moves use transports, not flows.
"""

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from autopar.passes.propagation.buckets import BucketShare
from autopar.passes.solve.mip import add_row

from autopar.core.kinds import Phase
from autopar.core.placement import Placements
from autopar.core.strategy import NodeSpace, StrategySpace, ValueRef

TransitionCost = Callable[[ValueRef, Placements, Placements], float]
GradientCost = Callable[[ValueRef, Placements, Placements], tuple[float, BucketShare | None]]
OneStepMoves = Callable[[ValueRef], Sequence[tuple[Placements, Placements, float]]]


def group_by_layout(terms: list[list], layouts: list[Placements]) -> dict[Placements, list[list]]:
    groups: dict[Placements, list[list]] = defaultdict(list)
    for t, layout in zip(terms, layouts):
        groups[layout].append(t)
    return groups


def _flat(group: list[list]) -> list:
    return [v for terms in group for v in terms]


def tensor_classes(
    space: StrategySpace, shared: dict[str, str], followed: set, backward_reads: dict[str, ValueRef]
) -> dict[tuple, int]:
    """Group the graph's tensors by what the program sees of them: the (shared) tensor and the
    set of (shared) readers that need it, in the forward or in the backward (which makes its
    own moves; ``backward_reads`` are views made again there, by the tensor they read, which
    a view that follows its operand reads as it is). Every class gets one set of move
    variables, priced as many times as it has tensors."""
    by_name = space.index()
    readers: dict[tuple, set[tuple[str, int]]] = defaultdict(set)
    for n in space.nodes:
        for j, ref in enumerate(n.args):
            if (n.name, ref) not in followed:
                in_backward = by_name[ref[0]].phase == "backward" or (n.kind == "op" and n.phase == "backward")
                readers[ref, in_backward].add((shared.get(n.name, n.name), j))
    for view, ref in backward_reads.items():
        if (view, ref) not in followed:
            readers[ref, True].add((shared.get(view, view), 0))
    classes: dict[tuple, int] = defaultdict(int)
    for (ref, _), who in readers.items():
        classes[(shared.get(ref[0], ref[0]), ref[1]), frozenset(who)] += 1
    return classes


def is_gradient(readers: frozenset, by_name: dict[str, NodeSpace]) -> bool:
    """Whether a tensor is a parameter's gradient that only its parameter reads."""
    return len(readers) == 1 and by_name[next(iter(readers))[0]].kind == "param"


def layout_available(
    solver,
    costs: dict,
    ref: ValueRef,
    by_name: dict[str, NodeSpace],
    readers: frozenset,
    count: int,
    ind: dict,
    transition_s: TransitionCost,
    one_step_moves: OneStepMoves | None,
    reader_moves: dict,
    joined: Callable | None = None,
) -> None:
    """Tie every reader's needed layout to the producer's, and price each move ``count`` times
    (a move priced infinite is never made).
    ``reader_moves[reader, j]`` gets what moving its ``j``-th operand costs, as
    ``(variable or None, seconds)`` terms, and the most seconds those terms can add up to.
    ``joined(p, q, made)``, when given, is told of every move and the variable (or 1) saying
    whether it is made (:func:`gathered`)."""
    producer = by_name[ref[0]]
    src = {
        p: _flat(g)
        for p, g in group_by_layout(ind[producer.name], [s.outputs[ref[1]] for s in producer.strategies]).items()
    }
    moves: dict[tuple, object] = {}
    for name, j in sorted(readers):
        n = by_name[name]
        dst = {q: _flat(g) for q, g in group_by_layout(ind[n.name], [s.inputs[j] for s in n.strategies]).items()}
        if len(src) == 1 and len(dst) == 1:
            (p,), (q,) = src, dst
            seconds = transition_s(ref, p, q) if p != q else 0.0
            if math.isinf(seconds):
                solver.Constraint(1.0, 1.0)  # the one move there is is forbidden: no plan
                continue
            reader_moves.setdefault((name, j), ([(None, seconds)] if p != q else [], seconds))
            if p != q:
                _move(solver, costs, moves, ref, p, q, count, transition_s, None, joined)
            continue
        if len(readers) == 1 and one_step_moves is not None:
            arcs = one_step_moves(ref)
            flow = layout_flow(solver, costs, arcs, src, dst, count) if len(arcs) < len(src) * len(dst) else None
            if flow is not None:
                reader_moves.setdefault((name, j), (flow, sum(c for _, c in flow)))
                continue
        t = _transport(solver, src, dst)
        priced = {(p, q): transition_s(ref, p, q) for p, q in t if p != q}
        for pq in [pq for pq, seconds in priced.items() if math.isinf(seconds)]:
            t.pop(pq).SetUb(0.0)  # a move the cost model forbids (it prices it infinite) is never made
            del priced[pq]
        reader_moves.setdefault(
            (name, j), ([(var, priced[pq]) for pq, var in t.items() if pq in priced], max(priced.values(), default=0.0))
        )  # one pair of layouts is used
        for (p, q), var in t.items():
            if p != q and len(readers) == 1:
                costs[var] += count * priced[p, q]  # the only reader: its transport is the move
                if joined is not None:
                    joined(p, q, var)
            elif p != q:
                _move(solver, costs, moves, ref, p, q, count, transition_s, var, joined)


def _transport(solver, src: dict, dst: dict) -> dict:
    """A reader's copy of a tensor: ``t[p, q]`` moves it from the producer's layout ``p`` to the
    reader's ``q``, given each side's one-hot sums by layout."""
    t = {(p, q): solver.NumVar(0.0, 1.0, "") for p in src for q in dst}
    for p, terms in src.items():  # the reader's copy leaves the producer's layout
        add_row(solver, 0.0, 0.0, [*((t[p, q], 1.0) for q in dst), *((v, -1.0) for v in terms)])
    for q, terms in dst.items():  # and arrives in the layout the reader needs
        add_row(solver, 0.0, 0.0, [*((t[p, q], 1.0) for p in src), *((v, -1.0) for v in terms)])
    return t


def gradient_transport(
    solver,
    costs: dict,
    ref: ValueRef,
    by_name: dict[str, NodeSpace],
    reader: tuple[str, int],
    copies: Mapping[int, int],
    ind: dict,
    gradient_s: GradientCost,
    bucket_shares: dict,
    bucketed_shares: list,
) -> None:
    """Move a parameter's gradient to the parameter's layout by the parameter's transport, each
    move priced once per copy by ``gradient_s``; ``copies`` counts them by pipeline stage (0
    without stages). For every group of buckets its moves join, and every stage holding
    copies, ``bucket_shares[(group, stage), α]`` gets whether the gradient joins one and its
    copies' share of them (each stage's gradients have buckets of their own, as the staged
    runtime reduces them), and ``bucketed_shares`` that share with its largest value."""
    producer, (name, j) = by_name[ref[0]], reader
    src = {
        p: _flat(g)
        for p, g in group_by_layout(ind[producer.name], [s.outputs[ref[1]] for s in producer.strategies]).items()
    }
    dst = {q: _flat(g) for q, g in group_by_layout(ind[name], [s.inputs[j] for s in by_name[name].strategies]).items()}
    bucketed: dict[tuple, list] = defaultdict(list)
    count = sum(copies.values())
    for (p, q), var in _transport(solver, src, dst).items():
        if p != q:
            seconds, share = gradient_s(ref, p, q)
            costs[var] += count * seconds
            if share is not None:
                for stage, n in copies.items():
                    bucketed[(share.group, stage), share.latency_s].append((var, n * share.fraction))
    for key, moves in bucketed.items():
        bucket_shares[key].append((sum(var for var, _ in moves), sum(fraction * var for var, fraction in moves)))
        bucketed_shares.append((sum(fraction * var for var, fraction in moves), max(fraction for _, fraction in moves)))


def gathered(
    gather_s: GradientCost,
    ref: ValueRef,
    readers: frozenset,
    count: int,
    by_name: dict[str, NodeSpace],
    segments: Mapping[str, str],
    bucket_shares: dict,
) -> tuple[TransitionCost, Callable]:
    """How parameter ``ref`` moves for ``readers``, ``count`` copies of it: each move priced by
    ``gather_s``, and a function that enters a move that joins a bucket, once made, in
    ``bucket_shares`` (see :func:`enough_buckets`) under its phase and its readers' layer: each
    copy of a repeated layer gathers in buckets of its own."""
    phase: Phase = "backward" if any(by_name[name].phase == "backward" for name, _ in readers) else "forward"
    segment = segments.get(min(readers)[0], "")
    priced: dict[tuple, tuple] = {}

    def price(p, q) -> tuple:
        if (p, q) not in priced:
            priced[p, q] = gather_s(ref, p, q)
        return priced[p, q]

    def joined(p, q, made) -> None:
        share = price(p, q)[1]
        if share is not None:
            bucket_shares[(share.group, phase, segment), share.latency_s].append(
                (count * made, count * share.fraction * made)
            )

    return (lambda _, p, q: price(p, q)[0]), joined


def enough_buckets(solver, costs: dict, bucket_shares: dict) -> None:
    """The bucket counts ``N_g`` of the module docstring, each bucket priced at its group's α.
    ``bucket_shares[g, α]`` (``g``: a gradient's group and stage, or a parameter's group, phase
    and layer) holds, per gradient or parameter, how many buckets of the group
    it joins at least (whether it joins one, for a gradient) and its share of them, as
    expressions in its moves."""
    for (_, latency), gradients in bucket_shares.items():
        buckets = solver.NumVar(0.0, solver.infinity(), "")
        solver.Add(buckets >= sum(share for _, share in gradients))  # enough buckets for the bytes
        for joins, _ in gradients:
            solver.Add(buckets >= joins)  # and one as soon as a gradient joins
        costs[buckets] += latency


def layout_flow(solver, costs: dict, arcs, src: dict, dst: dict, count: int) -> list | None:
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
    for u in layouts:  # leaving a layout: what the producer gives it plus what arrives, less what the reader keeps
        terms = [(f, 1.0) for f in out[u]] + [(f, -1.0) for f in into[u]]
        terms += [(v, -1.0) for v in src.get(u, ())] + [(v, 1.0) for v in dst.get(u, ())]
        add_row(solver, 0.0, 0.0, terms)
    return priced


def _move(
    solver,
    costs: dict,
    moves: dict,
    ref: ValueRef,
    p,
    q,
    count: int,
    transition_s: TransitionCost,
    need,
    joined: Callable | None = None,
) -> None:
    """Price moving ``ref`` from ``p`` to ``q`` once per tensor of its class, whichever readers
    need it (``need`` is a reader's transport variable, or ``None`` when the move is certain)."""
    if (p, q) not in moves:
        moves[p, q] = solver.NumVar(0.0, 1.0, "")
        costs[moves[p, q]] += count * transition_s(ref, p, q)
        if joined is not None:
            joined(p, q, moves[p, q])
    if need is None:  # one copy serves every reader
        moves[p, q].SetLb(1.0)
    else:
        add_row(solver, 0.0, solver.infinity(), [(moves[p, q], 1.0), (need, -1.0)])
