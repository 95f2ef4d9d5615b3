"""Memory constraints of the plan's integer program.

The layout program (:mod:`autopar.passes.solve.solver`) chooses strategy ``k`` of node ``n`` by the
one-hot ``x_n,k``. Given the memory each strategy holds, this module counts the memory of a
device at each *moment* of the step, the backward of each segment in the order the backward
reaches them (:attr:`~autopar.passes.solve.remat.ActivationSpace.backward_order`), and keeps the
peak ``M`` under the budget::

                M ≥ Σ_n Σ_k m_n,k,t · x_n,k + Q_S(t) + T_S(t) + B    for every moment t
                M ≥ Σ_n Σ_k m_n,k,last · x_n,k + S,   S ≥ 2 Σ_k p_n,k · x_n,k  for every parameter n
                M ≤ budget                                  (memory budget, when given)
                T_S ≥ Σ_(u ∈ A_n) Σ_k a_u,k · x_u,k − Σ_(u ∈ D_n) h_u + Σ_j e_n,j  for every backward op n of segment S
                M ≥ Σ_n Σ_k m_n,k,0 · x_n,k + T_F,
                T_F ≥ Σ_(u ∈ A_n) Σ_k (a_u,k · x_u,k − b_u,k · k_u,k) + Σ_j e_n,j − L_n  for every forward op n
                L_n = Σ_(n' after n) Σ_k b_n',k · k_n',k
                e_n,j ≥ Σ_k r_n,j,k · x_n,k − Σ_k' o_u,k' · x_u,k',  e_n,j ≥ 0   for every value u op n reads

``m_n,k,t`` is the memory node ``n`` holds at moment ``t`` under strategy ``k``: a parameter's
piece and its optimizer state at every moment, its gradient from the first moment after the
start of the backward that makes it, a forward value the backward reads up to the last moment
whose backward reads it (the runtime frees it then, :func:`autopar.passes.lower.partition.boxed`).
The last moment, the end of the backward, holds every gradient; the optimizer step holds what
it holds but for its temporaries, and the step's own ``S``: two of the largest parameter.
While op ``n`` runs, the outputs of the ops ``A_n`` of its phase (``a_u,k`` bytes, all of them)
are alive, from the op that makes them to their last reader in the phase
(:attr:`~autopar.passes.solve.remat.ActivationSpace.alive`); ``e_n,j`` is at least what the copy of
its j-th operand adds when the op reads it in a larger layout than it is made in (``r_n,j,k``
bytes, a gathered copy, alive while the op runs; ``o_u,k`` the bytes of u's outputs).
``T_S(t)`` is the most the backward of moment t's segment holds beyond the moment's start while
one of its ops runs (of the backward ops in no segment, at every moment): what it made, less
the forward values ``D_n`` it has read for the last time by then
(:attr:`~autopar.passes.solve.remat.ActivationSpace.freed`; ``h_u`` their bytes kept, or recomputed
or reloaded for the segment). ``T_F`` is what the forward holds beyond what it keeps for the
backward at its fullest, counted with what the first moment holds (every kept activation, no
gradient), less what the ops after ``n`` keep (``L_n``), not made yet. ``Q_S(t)`` is the values
the backward of moment t's segment recomputes or
copies back (:mod:`autopar.passes.solve.memory_choices`), ``B`` the packed copy of a gradient bucket
in flight beside the backward (:func:`in_flight_bucket`). Within a stack of repeated layers the
memory of a moment lies on the line between the stack's first and last moments; only those are
rows. When the solver finds no plan under the budget in time, the budget row is dropped and
``M`` priced in the objective instead (:func:`priced_memory`).

What the device holds is also chosen (:mod:`autopar.passes.solve.memory_choices`): whether the
backward keeps each forward op's outputs, recomputes them or copies them back from host memory
(their kept bytes enter ``m``, their recomputed and reloaded bytes ``Q_S``), and whether a
parameter's optimizer state, and the parameter itself, live in host memory (terms of
:func:`memory_budget`).
"""

import time
from collections import defaultdict
from typing import Literal

from autopar.cost_model.estimate import MemoryTerms
from autopar.passes.solve.mip import MEMORY_SCALE, solve_before_deadline
from autopar.passes.solve.remat import ActivationSpace
from ortools.linear_solver import pywraplp

MomentSpan = Literal["always", "grad", "made", "kept"]
"""The moments of the step a memory term is alive at: every one, from its node's gradient on
(without a node, once the backward has begun), at the start of the backward that makes that
gradient, or as long as its node's kept outputs."""

MemoryTerm = tuple[str | None, object, float, MomentSpan]
"""``(node, variable, megabytes per copy, span)``: a term of :func:`memory_budget`."""


def memory_budget(
    solver,
    memory: MemoryTerms,
    ind: dict,
    budget_bytes: float | None,
    shared: dict[str, str],
    acts: ActivationSpace | None,
    chosen: tuple | None = None,
    terms: list[MemoryTerm] | None = None,
):
    """The per-device peak ``M`` of the module docstring: at least the memory alive at each
    moment of the backward, and at most the budget when one is given. ``acts`` gives the
    moments (one, holding everything, without it); ``chosen`` (the kept terms and the
    segments' recomputed megabytes of
    :func:`~autopar.passes.solve.memory_choices.keep_recompute_or_offload`) replaces the
    activations of the forward ops; ``terms`` adds ``(node, variable, megabytes per copy,
    span)`` terms (:data:`MemoryTerm`), as :func:`~autopar.passes.solve.memory_choices.host_state`
    makes them: alive at every moment (``"always"``), from
    the node's gradient on (``"grad"``; without a node, once the backward has begun), at the
    start of the backward that makes it (``"made"``) or as long as its kept outputs (``"kept"``).
    Returns ``M`` and the budget row (``None`` without a
    budget)."""
    moments = _Moments(acts, ind, shared)
    replaced = frozenset(acts.nodes) if acts is not None and chosen is not None else frozenset()
    _strategy_memory(moments, memory, ind, shared, replaced)
    kept, refilled = chosen if chosen is not None else ({}, {})
    picked = kept if chosen is not None else None
    _backward_temporaries(solver, memory, acts, ind, shared, picked, moments)
    forward = _forward_held(solver, memory, acts, ind, shared, picked) if acts is not None else None
    stepped = _optimizer_step(solver, memory, ind, shared)
    for segment, var in refilled.items():
        moments.during(segment, var)
    for name, per_var in kept.items():
        for var, megabytes in per_var.items():
            moments.add(name, "kept", var, megabytes)
    for name, var, megabytes, kind in terms or ():
        moments.add(name, kind, var, megabytes)
    peak = solver.NumVar(0.0, solver.infinity(), "memory_peak")
    for row in moments.rows(stepped, forward):
        solver.Add(peak >= sum(c * v for v, c in row.items()) + sum(c * v for v, c in moments.everywhere.items()))
    budget = solver.Add(peak <= budget_bytes * MEMORY_SCALE) if budget_bytes is not None else None
    return peak, budget


class _Moments:
    """The memory alive at the moments of the step, as terms ``{variable: megabytes}``: over a
    span of moments, during the backward of one segment, or at every moment. ``acts`` gives the
    moments (one, holding everything, without it)."""

    def __init__(self, acts: ActivationSpace | None, ind: dict, shared: dict[str, str]):
        self.moments = acts.moments if acts is not None else 1
        self.last = self.moments - 1
        self.released = acts.released if acts is not None else {}
        self.made = acts.grad_made if acts is not None else {}
        self.copies: dict[str, list[str]] = defaultdict(list)  # per node with choices of its own: those sharing them
        for name in ind:
            self.copies[shared.get(name, name)].append(name)
        # (first, last moment) -> {var: MB}
        self.alive: dict[tuple[int, int], dict] = defaultdict(lambda: defaultdict(float))
        represent = _represented(acts, shared) if acts is not None else {}
        self.order = [represent.get(s, s) for s in acts.backward_order] if acts is not None else []
        self.everywhere: dict = {}
        self.at_moment: list[dict] = [{} for _ in range(self.moments)]

    def add(self, name: str | None, kind: MomentSpan, var, megabytes: float) -> None:
        """``megabytes`` on ``var`` for every copy of node ``name``, over the moments ``kind``
        names (:data:`MomentSpan`)."""
        for copy in self.copies.get(name, (name,)):
            span = (
                (self.made.get(copy, 0) if copy is not None else min(1, self.last), self.last)
                if kind == "grad"
                else (0, self.released.get(copy, self.last))
                if kind == "kept"
                else (max(self.made.get(copy, 0) - 1, 0),) * 2
                if kind == "made"
                else (0, self.last)
            )
            self.alive[span][var] += megabytes

    def during(self, segment: str | None, var) -> None:
        """``var`` alive during the backward of ``segment``: at its start, and at the end of the
        backward for the last segment (at every moment for no segment's)."""
        if segment in self.order:
            for k, s in enumerate(self.order):
                if s == segment:
                    self.at_moment[k][var] = 1.0
            if self.order[-1] == segment:
                self.at_moment[-1][var] = 1.0
        else:
            self.everywhere[var] = 1.0

    def rows(self, stepped, forward) -> list[dict]:
        """The rows of ``M``, but for the terms alive at every moment: the moments'
        (:func:`_distinct_moments`), the optimizer step's (what the last moment holds, and
        ``stepped``, ``S``) and, given ``T_F`` (``forward``), the forward's (what the first moment
        holds, with ``T_F``)."""
        rows = _distinct_moments(self.alive, self.at_moment)
        rows.append({**_alive_at(self.alive, self.last), stepped: 1.0})
        if forward is not None:
            rows.append({**_alive_at(self.alive, 0), forward: 1.0})
        return rows


def _strategy_memory(
    moments: _Moments, memory: MemoryTerms, ind: dict, shared: dict[str, str], replaced: frozenset
) -> None:
    """The parameters, optimizer state, gradients and activations each strategy holds, on its
    one-hot terms, but for the activations of the ops in ``replaced`` (their kept terms of the
    activation choices replace them)."""
    parts: tuple[tuple[MomentSpan, dict[str, list[float]]], ...] = (
        ("always", memory.params),
        ("always", memory.optimizer),
        ("grad", memory.grads),
        ("kept", memory.activations),
    )
    for kind, part in parts:
        for name, sizes in part.items():
            if name in shared or (part is memory.activations and name in replaced):
                continue
            for k, group in enumerate(ind[name]):
                for var in group:
                    if sizes[k]:
                        moments.add(name, kind, var, sizes[k] * MEMORY_SCALE)


def _backward_temporaries(
    solver,
    memory: MemoryTerms,
    acts: ActivationSpace | None,
    ind: dict,
    shared: dict[str, str],
    kept: dict | None,
    moments: _Moments,
) -> None:
    """``T_S`` of the module docstring, per segment of the backward (of the backward ops in
    none under ``None``), alive during its backward: at least what each of its ops holds while
    it runs beyond the moment's start, with the copies it gathers."""
    temporaries: dict = {}
    for name, sizes in memory.temporaries.items():
        if name in shared or (acts is not None and name in acts.segment):
            continue  # a repeated layer's: the same constraint as its first layer's; a forward op's: T_F
        segment = acts.backward_segment.get(name) if acts is not None else None
        segment = segment if segment in moments.order else None
        if segment not in temporaries:
            temporaries[segment] = solver.NumVar(0.0, solver.infinity(), "")
            moments.during(segment, temporaries[segment])
        if acts is None:
            held = sum(sizes[k] * MEMORY_SCALE * sum(group) for k, group in enumerate(ind[name]) if group and sizes[k])
        else:
            held = sum(_made(acts, ind, u) for u in acts.alive[name]) - sum(
                _freed_mb(memory, acts, ind, shared, kept, u, acts.backward_segment[name])
                for u in acts.freed.get(name, ())
            )
        solver.Add(temporaries[segment] >= held + sum(_moved_copies(solver, memory, ind, name)))


def _optimizer_step(solver, memory: MemoryTerms, ind: dict, shared: dict[str, str]):
    """``S`` of the module docstring, the optimizer step's temporaries: at least two of every
    parameter's piece."""
    stepped = solver.NumVar(0.0, solver.infinity(), "")
    for name in memory.optimizer:
        if name not in shared:
            solver.Add(
                stepped
                >= sum(2 * size * MEMORY_SCALE * sum(group) for size, group in zip(memory.params[name], ind[name]))
            )
    return stepped


def _distinct_moments(alive: dict[tuple[int, int], dict], at_moment: list[dict]) -> list[dict]:
    """The memory alive at each moment, ``{variable: megabytes}``: the terms ``alive`` over a
    span of moments that holds it, and the moment's own terms; without the moments whose
    memory lies between that of the moments before and after them (inside a stack of repeated
    layers the memory moves linearly from one layer's backward to the next)."""
    rows: list[dict] = []
    for k, own in enumerate(at_moment):
        row = _alive_at(alive, k)
        for var, megabytes in own.items():
            row[var] += megabytes
        while len(rows) >= 2 and _between(rows[-2], rows[-1], row):
            rows.pop()
        rows.append(row)
    return rows


def _forward_held(
    solver, memory: MemoryTerms, acts: ActivationSpace, ind: dict, shared: dict[str, str], kept: dict | None
):
    """``T_F`` of the module docstring: at least, for every forward op ``n``, the megabytes of
    the outputs alive while it runs beyond what they keep, with the copies it gathers, less
    what the ops after it keep (``L_n``). Of the copies of a repeated layer's op, only the last
    one's row: the others have the same terms, less more of what comes after them."""
    held = solver.NumVar(0.0, solver.infinity(), "")
    later: dict = defaultdict(float)  # L_n, {variable: megabytes}
    beyond: dict = {}  # per value, {variable: megabytes} of its outputs beyond what it keeps
    seen = set()
    for name in reversed(acts.nodes):
        own = shared.get(name, name)
        if own not in seen:
            seen.add(own)
            terms: dict = defaultdict(float)  # the row's, summed as plain numbers: these rows are long
            for u in acts.alive[name]:
                if u not in beyond:
                    beyond[u] = _beyond_kept(acts, ind, _kept(memory, ind, shared, kept, u), u)
                for var, megabytes in beyond[u].items():
                    terms[var] += megabytes
            for extra in _moved_copies(solver, memory, ind, own):
                terms[extra] += 1.0
            for var, megabytes in later.items():
                terms[var] -= megabytes
            row = solver.RowConstraint(0.0, solver.infinity(), "")  # T_F - Σ terms >= 0
            row.SetCoefficient(held, 1.0)
            for var, coefficient in terms.items():
                row.SetCoefficient(var, -coefficient)
        for var, megabytes in _kept(memory, ind, shared, kept, name).items():
            later[var] += megabytes
    return held


def _beyond_kept(acts: ActivationSpace, ind: dict, kept: dict, name: str) -> dict:
    """``{variable: megabytes}`` of op ``name``'s outputs, by its strategy (:func:`_made`), less
    the megabytes ``kept`` of them."""
    terms: dict = defaultdict(float)
    for size, group in zip(acts.made[name], ind[name]):
        if size:
            for var in group:
                terms[var] += size * MEMORY_SCALE
    for var, megabytes in kept.items():
        terms[var] -= megabytes
    return terms


def _kept(memory: MemoryTerms, ind: dict, shared: dict[str, str], kept: dict | None, name: str) -> dict:
    """The megabytes the end of the forward counts for forward op ``name``, ``{variable:
    megabytes}``: its kept megabytes (``kept``, by
    :func:`~autopar.passes.solve.memory_choices.keep_recompute_or_offload`) or, without activation
    choices, the activations the backward reads."""
    if kept is not None:
        return kept.get(shared.get(name, name), {})
    return {
        var: size * MEMORY_SCALE
        for size, group in zip(memory.activations.get(name, ()), ind[name])
        if size
        for var in group
    }


def _freed_mb(
    memory: MemoryTerms,
    acts: ActivationSpace,
    ind: dict,
    shared: dict[str, str],
    kept: dict | None,
    name: str,
    segment: str,
):
    """The megabytes the backward of ``segment`` frees after its last read of forward op
    ``name``'s outputs: those it holds for the backward (kept, or recomputed or reloaded for
    its own segment's backward) or, without activation choices, the activations the backward
    reads."""
    if kept is not None and acts.segment[name] == segment:
        return sum(size * MEMORY_SCALE * sum(group) for size, group in zip(acts.bytes[name], ind[name]) if size)
    return sum(mb * var for var, mb in _kept(memory, ind, shared, kept, name).items())


def _made(acts: ActivationSpace, ind: dict, name: str):
    """The megabytes of op ``name``'s outputs, by its strategy."""
    return sum(size * MEMORY_SCALE * sum(group) for size, group in zip(acts.made[name], ind[name]) if size)


def _moved_copies(solver, memory: MemoryTerms, ind: dict, name: str) -> list:
    """Per value op ``name`` may read in a larger layout than it is made in, a variable at
    least the bytes the copy adds, ``e ≥ Σ_k r_k · x_n,k − Σ_k' m_k' · x_u,k'``, ``e ≥ 0``
    (the copy's bytes less the value's own: a lower bound)."""
    found = []
    for (producer, _), read, made in memory.moved.get(name, ()):
        if max(read, default=0.0) <= min(made, default=0.0):
            continue
        extra = solver.NumVar(0.0, solver.infinity(), "")
        solver.Add(
            extra
            >= sum(r * MEMORY_SCALE * sum(group) for r, group in zip(read, ind[name]) if r)
            - sum(m * MEMORY_SCALE * sum(group) for m, group in zip(made, ind[producer]) if m)
        )
        found.append(extra)
    return found


def _alive_at(alive: dict[tuple[int, int], dict], moment: int) -> dict:
    """``{variable: megabytes}`` of the terms ``alive`` over a span of moments that holds ``moment``."""
    row: dict = defaultdict(float)
    for (first, last), terms in alive.items():
        if first <= moment <= last:
            for var, megabytes in terms.items():
                row[var] += megabytes
    return row


def _between(a: dict, b: dict, c: dict) -> bool:
    """Whether ``b = a + t (c − a)`` for one ``t`` in [0, 1], coefficient by coefficient."""
    keys = set(a) | set(b) | set(c)
    step = {v: c.get(v, 0.0) - a.get(v, 0.0) for v in keys}
    largest = max(keys, key=lambda v: abs(step[v]), default=None)
    t = 0.0 if largest is None or step[largest] == 0 else (b.get(largest, 0.0) - a.get(largest, 0.0)) / step[largest]
    return -1e-12 <= t <= 1 + 1e-12 and all(
        abs(b.get(v, 0.0) - a.get(v, 0.0) - t * step[v]) <= 1e-9 * max(1.0, abs(b.get(v, 0.0))) for v in keys
    )


def in_flight_bucket(solver, bucketed: list[tuple], bucket_bytes: float):
    """The megabytes of the packed copy of a gradient bucket in flight beside the backward: at
    least the bucketed gradients' bytes, up to one full bucket, ``B ≥ min(c, Σ share · c)`` by
    a binary ``z``: ``B ≥ Σ share · c − U·z``, ``B ≥ min(c, U)·z``, with ``U`` the most the
    bucketed gradients can take. ``bucketed`` holds each gradient's share of a bucket (a linear
    expression) and its largest value."""
    full = bucket_bytes * MEMORY_SCALE
    most = full * sum(top for _, top in bucketed)
    held, full_bucket = solver.NumVar(0.0, solver.infinity(), "bucket_buffer"), solver.IntVar(0, 1, "")
    solver.Add(held >= full * sum(share for share, _ in bucketed) - most * full_bucket)
    solver.Add(held >= min(full, most) * full_bucket)
    return held


def priced_memory(solver, params, peak, budget_row, budget_bytes: float, deadline: float, hint: list[tuple] = ()):
    """A plan under the budget when the solver finds none in time: the budget row is dropped and
    the peak ``M`` priced in the objective at λ nanoseconds per megabyte, λ raised tenfold until the
    fastest plan at that price fits, then bisected (geometrically) towards the smallest price
    that fits. Each of these programs solves like one without a budget. Returns the fitting
    outcome with the least time (status ``FEASIBLE``, bound 0), or ``None``. Each search starts
    from ``hint`` (see :func:`~autopar.passes.solve.mip.solve_before_deadline`)."""
    objective = solver.Objective()
    time_coefs = {var.index(): (var, objective.GetCoefficient(var)) for var in solver.variables()}
    budget_row.SetUb(solver.infinity())
    memory_vars = [(peak, 1.0)]

    def attempt(price: float):
        for var, coef in memory_vars:
            objective.SetCoefficient(var, time_coefs[var.index()][1] + price * coef)
        outcome = solve_before_deadline(solver, params, max(deadline - time.perf_counter(), 1.0), hint)
        if outcome is None or outcome[1] is None:
            return None, float("inf")
        values = outcome[1]
        used = sum(coef * values[var.index()] for var, coef in memory_vars)
        seconds = sum(coef * values[index] for index, (_, coef) in time_coefs.items())
        return (pywraplp.Solver.FEASIBLE, values, seconds, 0.0), used

    budget_mb, best, low, high = budget_bytes * MEMORY_SCALE, None, 0.0, None
    price = 1.0
    while time.perf_counter() < deadline and price < 1e12:
        outcome, used = attempt(price)
        if outcome is not None and used <= budget_mb:
            best, high = outcome, price
            break
        low, price = price, price * 10
    for _ in range(6):
        if high is None or time.perf_counter() >= deadline:
            break
        price = (low * high) ** 0.5 if low else high / 10
        outcome, used = attempt(price)
        if outcome is not None and used <= budget_mb:
            high = price
            best = outcome if best is None or outcome[2] < best[2] else best
        else:
            low = price
    return best


def _represented(acts: ActivationSpace, shared: dict[str, str]) -> dict[str, str]:
    """Each segment of a repeated layer → the segment of the first layer, whose choices it takes."""
    return {acts.segment[name]: acts.segment[first] for name, first in shared.items() if name in acts.segment}
