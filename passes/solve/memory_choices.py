"""Activation and host-memory choices of the plan's integer program: keep, recompute or offload.

The layout program (:mod:`autopar.passes.solve.solver`) chooses strategy ``k`` of node ``n`` by the
one-hot ``x_n,k``; :mod:`autopar.passes.solve.memory_program` counts the memory ``m_n,k,t`` that node
``n`` holds at moment ``t`` of the step under strategy ``k``, and keeps the peak ``M`` under the
budget. This module adds the choices of what the device holds, their rows and their time in the
objective, and gives what they hold to :func:`~autopar.passes.solve.memory_program.memory_budget`.

With activation choices (:mod:`autopar.passes.solve.remat`) every forward op ``n`` is also kept
(``K_n``), recomputed (``R_n``) or offloaded to host memory (``O_n``), all binary, and the saved
activations leave ``m``::

                K_n + R_n + O_n ≥ 1          for every op the backward reads
                K_u + R_u + O_u ≥ R_n        for every operand u of n in n's segment
                K_u ≥ R_n                    for every operand u of n in another segment
                K_u ≥ K_n                    for every view n of u (a view's bytes are u's)
                k_n,j ≤ x_n,j,  Σ_j k_n,j = K_n   (by strategy j; likewise r_n,j and o_n,j)
                Q_S ≥ Σ_(n ∈ S) Σ_j b_n,j · (r_n,j + o_n,j)   for every segment S (its recomputed
                                                 or reloaded values, alive during its backward)
                Q_S+1 ≥ Σ_(n ∈ S+1) Σ_j b_n,j · (r_n,j + o_n,j) + Σ_(n ∈ S) Σ_j b_n,j · o_n,j − M_S · (1 − F_S)
                E_n ≥ (moves of n's operands) − C_n · (1 − R_n)
                B_S ≥ B_(S−1) + Σ_(n ∈ S) Σ_j t_n,j · o_n,j − Σ_(n ∈ S) Σ_k c_n,k · x_n,k,   B_S ≥ 0
                W_S ≥ Σ_(n ∈ S) Σ_j t_n,j · o_n,j − Σ_(n ∈ bw(S+1)) Σ_k c_n,k · x_n,k,   W_S ≥ 0
                W_S ≥ Σ_(n ∈ S) Σ_j t_n,j · o_n,j − T_S · F_S
                b_n,j · k_n,j enter m_n,j,t,
                Σ_n Σ_j c_n,j · r_n,j + E_n + B_last + Σ_S W_S the objective

``t_n,j`` is the time of copying op n's held bytes over the host link one way. The copies out
run beside the forward, in segment order: ``B_S`` is what is still to copy when segment S's
forward compute ends, and what is left when the forward ends (``B_last``) is charged. The copies
back of segment S are either made when the backward first reads them and charged whole, or
prefetched (``F_S``, binary): issued when the backward of the segment after it starts
(``bw(S+1)``, whose backward runs just before S's), so that they run beside it, at the price of
holding them on the device beside that segment's recomputed and reloaded values; what they leave
(``W_S``) is charged. ``M_S`` and ``T_S`` are the bytes and copy time of S's offload if all its
ops were offloaded. The copies back of the segment the backward reaches first are never
prefetched. A layer standing for ``c`` repeated layers (shared choices) has ``c − 1`` of its
copies prefetched beside the backward of their next copy, and the one the backward reaches first
beside the segment before it, each part with its own ``W``. With optimizer offload
(ZeRO-Offload), a parameter's optimizer state may live in host memory (``H_p``, binary), where
the host steps it: its bytes leave the budget, and its gradient's copy out, its parameter's
copy back and the host's update enter the objective. The parameter itself may live there too
(``P_p ≤ H_p``, ZeRO-Infinity): its piece and its gradient leave the budget, and it is copied to
the device for the forward and again for the backward instead of back after the update (one
more copy per step).

Host memory is finite: what a device offloads (activations, optimizer state, parameters with
their gradients, each copy of a repeated layer counted) stays within its share of its host's
memory, ``Σ_n Σ_j c_n·b_n,j·o_n,j + Σ_p Σ_k c_p·(s_p,k·h_p,k + (w_p,k + g_p,k)·q_p,k) ≤ C``,
with ``h_p,k``, ``q_p,k`` the products of ``H_p``, ``P_p`` with the parameter's strategy one-hot
(:func:`host_capacity`). In pipeline stages, where a device holds the activations of several
micro-batches and its optimizer state and parameters stay on it, the activations' sum counts
as many times as a position holds micro-batches at most (every stage's, an upper bound on one
position's).
"""

from collections import defaultdict
from dataclasses import dataclass, field

from autopar.cost_model.estimate import MemoryTerms
from autopar.cost_model.hardware import Host
from autopar.passes.solve.memory_program import MemoryTerm, _represented
from autopar.passes.solve.mip import MEMORY_SCALE, SCALE
from autopar.passes.solve.remat import ActivationSpace


def keep_recompute_or_offload(
    solver,
    acts: ActivationSpace,
    ind: dict,
    node_costs: dict[str, list[float]],
    reader_moves: dict,
    shared: dict[str, str],
    costs: dict,
    host: Host | None = None,
    host_mb: list | None = None,
):
    """The activation constraints of the module docstring, with offload when ``host`` is
    given. Returns each op's recompute and offload variables, each segment's prefetch variable
    ``F_S``, the megabytes each op keeps (for each copy of a repeated layer) as ``{op:
    {variable: megabytes}}``, and each segment's recomputed and reloaded megabytes ``Q_S``.
    ``host_mb`` gets the megabytes offloaded, every copy counted, as linear terms."""
    copies = _copies(shared)
    own = [name for name in acts.nodes if name not in shared]
    keep = {name: solver.IntVar(0, 0 if name in acts.never_kept else 1, "") for name in own}
    again = {name: solver.IntVar(0, 1 if name in acts.recomputable else 0, "") for name in own}
    away = {name: solver.IntVar(0, 1 if host is not None and name in acts.offloadable else 0, "") for name in own}
    choices = (keep, again, away)
    kept_mb, segments, offloads = _priced_choices(
        solver, acts, own, ind, node_costs, reader_moves, shared, copies, costs, host, host_mb, choices
    )
    ahead: dict = {}
    reloaded: dict[str, list] = {}  # per segment: megabytes copied back beside its backward
    if offloads.copied_out:
        _copies_out(solver, acts, own, ind, node_costs, copies, costs, offloads)
        ahead, reloaded = _copies_back(solver, acts, own, ind, node_costs, shared, copies, costs, offloads)
    _at_hand(solver, acts, shared, choices)
    return again, away, ahead, kept_mb, _refilled(solver, segments, reloaded)


@dataclass
class _Offloads:
    """Per segment, what its ops offloaded to host memory copy over the host link."""

    copied_out: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    """Per segment: (nanoseconds of a copy one way, o_n,j)."""
    offloaded: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    """Per segment: (megabytes, o_n,j)."""
    longest_out: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Per segment: the most nanoseconds its copies out can take."""


def _priced_choices(
    solver,
    acts: ActivationSpace,
    own: list[str],
    ind: dict,
    node_costs: dict[str, list[float]],
    reader_moves: dict,
    shared: dict[str, str],
    copies: dict[str, int],
    costs: dict,
    host: Host | None,
    host_mb: list | None,
    choices: tuple[dict, dict, dict],
) -> tuple[dict[str, dict], dict[str, list], _Offloads]:
    """Each ``own`` op's keep, recompute and offload choices (``choices``: ``K_n``, ``R_n``,
    ``O_n``) split by its strategy, with what they hold and cost: the megabytes each op keeps,
    ``{op: {variable: megabytes}}``, each segment's recomputed and reloaded megabytes as linear
    terms, and what each segment copies to host memory (:class:`_Offloads`). The recompute
    time and the moves of a recomputed op's operands enter ``costs``; ``host_mb`` gets the
    megabytes offloaded, every copy counted."""
    keep, again, away = choices
    by_reader: dict[str, list] = defaultdict(list)
    most_s: dict[str, float] = defaultdict(float)
    for (reader, _), (terms, most) in reader_moves.items():
        by_reader[reader].extend(terms)
        most_s[reader] += most
    offloads = _Offloads()
    kept_mb: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    segments: dict[str, list] = defaultdict(list)
    for name in own:
        count, segment = 1 + copies[name], acts.segment[name]
        kept_k, again_k = _per_strategy(solver, ind[name], keep[name]), _per_strategy(solver, ind[name], again[name])
        away_k = _per_strategy(solver, ind[name], away[name]) if away[name].ub() else [0] * len(ind[name])
        for k, size in enumerate(acts.bytes[name]):
            if size:
                kept_mb[name][kept_k[k]] += size * MEMORY_SCALE
                segments[segment].append(size * MEMORY_SCALE * (again_k[k] + away_k[k]))
                if away[name].ub():
                    offloads.copied_out[segment].append((count * host.copy_s(size) * SCALE, away_k[k]))
                    offloads.offloaded[segment].append((size * MEMORY_SCALE, away_k[k]))
                    if host_mb is not None:
                        host_mb.append(count * size * MEMORY_SCALE * away_k[k])
        if away[name].ub():  # an op is offloaded in one strategy at most
            offloads.longest_out[segment] += count * host.copy_s(max(acts.bytes[name])) * SCALE
        if name in acts.extra:
            readers_again = [again[shared.get(r, r)] for r in acts.extra[name][1]]
            _extra_kept(solver, acts.extra[name], ind[name], again[name], readers_again, kept_mb[name])
        if name in acts.copied:
            _copy_kept(solver, acts.copied[name], kept_k, ind[acts.views[name]], kept_mb[name])
        if name in acts.recomputable and name not in acts.param_views:  # those are priced as backward reads
            for k, seconds in enumerate(node_costs[name]):
                costs[again_k[k]] += count * seconds
            _recompute_moves(solver, by_reader[name], most_s[name], again[name], count, costs)
    return kept_mb, segments, offloads


def _copies_out(
    solver,
    acts: ActivationSpace,
    own: list[str],
    ind: dict,
    node_costs: dict,
    copies: dict[str, int],
    costs: dict,
    offloads: _Offloads,
) -> None:
    """``B_S`` of the module docstring: the copies out run beside the forward, in segment
    order, and what is still to copy when the forward ends (``B_last``) is charged."""
    work = _segment_work(acts.nodes, acts.segment, set(own), ind, node_costs, copies)
    backlog = 0.0
    for segment in dict.fromkeys(acts.segment[name] for name in own):  # in forward order
        after = solver.NumVar(0.0, solver.infinity(), "")
        solver.Add(
            after >= backlog + sum(c * o for c, o in offloads.copied_out[segment]) - sum(work[segment])
        )  # B_S ≥ B_(S−1) + out_S − work_S
        backlog = after
    costs[backlog] += 1 / SCALE  # what is still to copy when the forward ends


def _copies_back(
    solver,
    acts: ActivationSpace,
    own: list[str],
    ind: dict,
    node_costs: dict,
    shared: dict[str, str],
    copies: dict[str, int],
    costs: dict,
    offloads: _Offloads,
) -> tuple[dict, dict[str, list]]:
    """``F_S`` and ``W_S`` of the module docstring: each segment's copies back, made when the
    backward first reads them or prefetched beside the backward of another segment
    (:func:`_reloaded_during`), with what they leave charged. Returns the prefetch variables by
    segment, and per segment the megabytes copied back beside its backward."""
    ahead: dict = {}
    reloaded: dict[str, list] = defaultdict(list)
    backward_work = _segment_work(
        acts.backward_segment,
        acts.backward_segment,
        set(acts.backward_segment) - set(shared),
        ind,
        node_costs,
        defaultdict(int),
    )  # of one copy of a repeated layer
    for segment, beside in _reloaded_during(acts, own, shared, copies).items():
        if not offloads.copied_out[segment]:
            continue
        back = sum(c * o for c, o in offloads.copied_out[segment])
        bound = offloads.longest_out[segment]
        mb = sum(m * o for m, o in offloads.offloaded[segment])
        if any(during is not None for during, _, _ in beside):
            ahead[segment] = solver.IntVar(0, 1, "")  # F_S
        for during, part, times in beside:
            stall = solver.NumVar(0.0, solver.infinity(), "")  # W_S, for the part of S's copies beside one segment
            costs[stall] += 1 / SCALE
            if during is None:
                solver.Add(stall >= part * back)
                continue
            solver.Add(stall >= part * back - times * sum(backward_work[during]))
            solver.Add(stall >= part * (back - bound * ahead[segment]))
            reloaded[during].append(mb - sum(m for m, _ in offloads.offloaded[segment]) * (1 - ahead[segment]))
    return ahead, reloaded


def _at_hand(solver, acts: ActivationSpace, shared: dict[str, str], choices: tuple[dict, dict, dict]) -> None:
    """The rows that give the backward every value it reads: each op it reads is kept,
    recomputed or reloaded, a recomputed op's operands are at hand, and a kept view keeps what
    it views (``choices``: ``K``, ``R``, ``O`` by op, a repeated layer's ops taking its first's)."""
    keep, again, away = choices
    for name in acts.nodes:
        k, r, o = keep[shared.get(name, name)], again[shared.get(name, name)], away[shared.get(name, name)]
        solver.Add(
            k + r + o >= (1 if name in acts.saved else 0)
        )  # the backward finds it kept, recomputes or reloads it
        for operand in acts.operands[name]:
            u = shared.get(operand, operand)
            solver.Add(
                keep[u] + (0 if acts.crosses(name, operand) else again[u] + away[u]) >= r
            )  # a recomputed op's operands are at hand
        if name in acts.views:
            base = acts.views[name]
            solver.Add(keep[shared.get(base, base)] >= k)  # a kept view keeps what it views


def _refilled(solver, segments: dict[str, list], reloaded: dict[str, list]) -> dict:
    """``Q_S`` of the module docstring for every segment: at least its recomputed and reloaded
    megabytes (``segments``), and those with each part of the reloads of another segment copied
    back beside its backward (``reloaded``)."""
    refilled = {}
    for segment in sorted(set(segments) | set(reloaded)):
        refilled[segment] = solver.NumVar(0.0, solver.infinity(), "")  # Q_S
        solver.Add(refilled[segment] >= sum(segments.get(segment, ())))
        for mb in reloaded.get(segment, ()):
            solver.Add(
                refilled[segment] >= sum(segments.get(segment, ())) + mb
            )  # with the reloads copied back beside it
    return refilled


def host_state(
    solver, memory: MemoryTerms, ind: dict, shared: dict[str, str], host: Host, costs: dict, host_mb: list | None = None
):
    """``H_p`` and ``P_p`` of the module docstring for every parameter: its optimizer state, and
    the parameter with its gradient, in host memory. Returns ``{parameter: H_p}``,
    ``{parameter: P_p}`` and the megabytes they take off the device, per copy of a repeated
    layer, as terms of :func:`~autopar.passes.solve.memory_program.memory_budget` (the gradient's only
    from when it is made; the
    backward that makes it holds the parameter's copy in and the gradient before it goes out).
    ``host_mb`` gets the megabytes they put in host memory, every copy counted, as linear terms."""
    copies = _copies(shared)
    optimizer, params = {}, {}
    saved_mb: list[MemoryTerm] = []
    for name, sizes in memory.optimizer.items():
        if name in shared:
            continue
        stepped = [host.optimizer_s(grad, size) for grad, size in zip(memory.grads[name], sizes)]
        if any(s is None for s in stepped):
            continue
        optimizer[name], params[name] = solver.IntVar(0, 1, ""), solver.IntVar(0, 1, "")
        solver.Add(params[name] <= optimizer[name])  # a parameter on the host is stepped there
        count = 1 + copies[name]
        state_k = _per_strategy(solver, ind[name], optimizer[name])
        param_k = _per_strategy(solver, ind[name], params[name])
        for k, (state, param) in enumerate(zip(state_k, param_k)):
            saved_mb.append((name, state, -sizes[k] * MEMORY_SCALE, "always"))
            costs[state] += count * stepped[k]
            saved_mb.append((name, param, -memory.params[name][k] * MEMORY_SCALE, "always"))
            saved_mb.append((name, param, -memory.grads[name][k] * MEMORY_SCALE, "grad"))
            saved_mb.append((name, param, (memory.params[name][k] + memory.grads[name][k]) * MEMORY_SCALE, "made"))
            costs[param] += count * host.copy_s(memory.params[name][k])  # copied in twice a step instead of back once
            if host_mb is not None:
                host_mb.append(
                    count * MEMORY_SCALE * (sizes[k] * state + (memory.params[name][k] + memory.grads[name][k]) * param)
                )
    return optimizer, params, saved_mb


def host_capacity(solver, host_mb: list, host: Host, copies: int = 1) -> None:
    """What a device offloads stays within its share of its host's memory (the row in the module
    docstring), holding ``copies`` of it at once (in pipeline stages, the most micro-batches a
    position holds the activations of)."""
    if host_mb and host.capacity_bytes < float("inf"):
        solver.Add(copies * sum(host_mb) <= host.capacity_bytes * MEMORY_SCALE)


def _segment_work(names, segment: dict[str, str], own, ind: dict, node_costs: dict, copies: dict) -> dict[str, list]:
    """Per segment, the nanoseconds of compute of its ops among ``names`` (those in ``own``,
    each priced for every copy of a shared layer), as linear terms."""
    work: dict[str, list] = defaultdict(list)
    for name in names:
        if name in own:
            work[segment[name]].extend(
                (1 + copies[name]) * node_costs[name][k] * SCALE * var
                for k, group in enumerate(ind[name])
                for var in group
            )
    return work


def _reloaded_during(
    acts: ActivationSpace, own: list[str], shared: dict[str, str], copies: dict
) -> dict[str, list[tuple[str | None, float, int]]]:
    """Per segment of ``own`` ops, beside whose backward its copies back run when prefetched:
    ``(segment of own ops or None, part of its copies, how many copies of that backward hide
    them)`` (:meth:`~autopar.passes.solve.remat.ActivationSpace.reloaded_during`; a copy of a repeated
    layer stands for the layer; ``None``: never prefetched). A layer standing for ``c`` repeated
    layers (shared choices) has ``c − 1`` of its copies prefetched beside the backward of their
    next copy, and the copy the backward reaches first beside the segment before it."""
    times = {acts.segment[name]: 1 + copies[name] for name in own}
    represent = _represented(acts, shared)
    during = acts.reloaded_during()
    found = {}
    for segment, count in times.items():
        if count == 1:
            beside = during.get(segment)
            found[segment] = [(represent.get(beside, beside), 1.0, 1)]
            continue
        layers = [s for s in acts.backward_order if represent.get(s, s) == segment]
        beside = during.get(layers[0]) if layers else None
        found[segment] = [(segment, (count - 1) / count, count - 1), (represent.get(beside, beside), 1 / count, 1)]
    return found


def _copies(shared: dict[str, str]) -> dict[str, int]:
    copies: dict[str, int] = defaultdict(int)
    for first in shared.values():
        copies[first] += 1
    return copies


def _per_strategy(solver, terms: list[list], choice) -> list:
    """``choice`` (keep or recompute) split by the op's strategy: ``c_k ≤ x_k``, ``Σ_k c_k =
    choice``, so that its bytes and seconds are exact linear terms (tighter than a big M)."""
    split = [solver.NumVar(0.0, 1.0, "") for _ in terms]
    for var, group in zip(split, terms):
        solver.Add(var <= sum(group))
    solver.Add(sum(split) == choice)
    return split


def _extra_kept(solver, extra: tuple, terms: list[list], again, readers_again: list, kept_mb: dict) -> None:
    """The outputs of an op that the backward does not read are kept when one of their forward
    readers m is recomputed and the op is not: ``F_n ≥ R_m − R_n``, their bytes ``b'_n,k`` on
    ``w_k ≤ x_k`` with ``Σ_k w_k ≥ F_n``."""
    sizes, _ = extra
    needed = solver.NumVar(0.0, 1.0, "")
    for reader in readers_again:
        solver.Add(needed >= reader - again)
    split = [solver.NumVar(0.0, 1.0, "") for _ in terms]
    for var, group in zip(split, terms):
        solver.Add(var <= sum(group))
    solver.Add(sum(split) >= needed)
    for var, size in zip(split, sizes):
        kept_mb[var] += size * MEMORY_SCALE


def _copy_kept(solver, copied: tuple[list[float], list[float]], kept_k: list, base: list[list], kept_mb: dict) -> None:
    """A kept view of an op's output that it reads in a larger layout than the output is made in
    keeps the moved copy (a gathered copy that the view looks into): at least its bytes beyond
    the output's, ``c ≥ Σ_k r_k · k_n,k − Σ_k' m_k' · x_u,k'``, ``c ≥ 0``, among the view's kept
    megabytes. ``copied`` holds ``r``, per strategy of the view, and ``m``, per strategy of the
    op it views."""
    read, made = copied
    extra = solver.NumVar(0.0, solver.infinity(), "")
    solver.Add(
        extra
        >= sum(r * MEMORY_SCALE * var for r, var in zip(read, kept_k) if r)
        - sum(m * MEMORY_SCALE * sum(group) for m, group in zip(made, base) if m)
    )
    kept_mb[extra] += 1.0


def _recompute_moves(solver, moves: list, bound: float, again, count: int, costs: dict) -> None:
    """``E_n ≥ (operand moves) − C_n (1 − R_n)``, in nanoseconds, priced ``count`` times;
    ``moves`` are the ``(variable or None, seconds)`` terms of moving the op's operands and
    ``bound``, ``C_n``, the most seconds they can add up to."""
    if not moves:
        return
    work = sum(c * (1 if v is None else v) for v, c in moves)
    extra = solver.NumVar(0.0, solver.infinity(), "")
    solver.Add(extra >= (work - bound * (1 - again)) * SCALE)
    costs[extra] += count / SCALE
