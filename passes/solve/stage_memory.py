"""Memory rows of a plan in pipeline stages: every position of the pipeline axis under the budget.

With stages, the plan's integer program is one micro-batch's graph on the mesh inside the
stages (:mod:`autopar.passes.solve.stages`), and no device holds all of it: the ranks at position
``r`` of the pipeline axis hold the parameters of their stages, and the activations their stages
keep for each micro-batch in flight. So instead of the moments of one device's step
(:mod:`autopar.passes.solve.memory_program`), the peak ``M`` is at least, for every position
``r`` and every fullest moment ``L`` of its schedule::

    M ≥ Σ_(p held at r) Σ_k s_p,k · x_p,k  +  m · Σ_(input i read at r) Σ_k b_i,k · x_i,k
        +  Σ_(stage s at r) L_s · A_s  +  T  +  R
    A_s = Σ_(op n of stage s) kept_n          T ≥ Σ_k t_n,k · x_n,k   for every op n
    R ≥ Q_S                                   for every segment S
    M ≤ budget

``s_p,k`` is parameter ``p``'s piece under strategy ``k`` with its gradient and optimizer state
(a weight tied across stages counts at each position holding a copy), and, with more than one
micro-batch, at the position whose stage makes its gradient, twice the gradient as the backward
makes it (before its collectives: whole where they reduce-scatter it, at its producer's
strategy): the sum of the micro-batches' gradients, held from the first backward to the last,
and a micro-batch's, which its backward returns beside the sum before it is added in; ``b_i,k`` is a
micro-batch's piece of model input ``i``, of which the ranks whose stages read it hold all
``m`` micro-batches' for the step. ``kept_n`` is what op
``n`` keeps for the backward (its keep, recompute or offload choice,
:mod:`autopar.passes.solve.memory_choices`, or its outputs the backward reads when nothing is
chosen; what it offloads is in host memory, counted against the host's capacity as many
times as a position holds micro-batches at most), ``L_s`` how many micro-batches' activations of stage
``s`` the position holds at that moment (:func:`~autopar.core.pipeline.held_activations`: after a
forward its schedule runs), ``T`` the largest temporary of an op (outside the chosen ones) and
``R`` the most a segment's backward recomputes or copies back (``Q_S``). Parameters and their
optimizer state stay on the device. These are the parts
:func:`~autopar.passes.solve.stages.with_stages` adds up for each position's predicted peak.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.cost_model.estimate import MemoryTerms
from autopar.passes.solve.mip import MEMORY_SCALE, add_row

from autopar.core.pipeline import Schedule, order


@dataclass(frozen=True)
class StageMemory:
    """Where a plan in pipeline stages holds its memory."""

    positions: int
    """Positions of the pipeline axis; stage ``s`` runs at position ``s % positions``."""
    stage_of: Mapping[str, int]
    """Each node's stage, by name (ops, and parameters, buffers and tangents)."""
    holders: Mapping[str, tuple[int, ...]]
    """Each parameter's placeholder → the positions holding it."""
    readers: Mapping[str, tuple[int, ...]]
    """Each model input's placeholder → the positions whose stages read it."""
    microbatches: int
    moments: tuple[tuple[Mapping[int, int], ...], ...]
    """Per position, the moments its activations can be fullest at: micro-batches held by stage."""

    @property
    def most_in_flight(self) -> int:
        """The most micro-batches whose activations a position holds at once, over its stages."""
        return max(sum(live.values()) for moments in self.moments for live in moments)

    @classmethod
    def of(
        cls,
        schedule: Schedule,
        positions: int,
        microbatches: int,
        stages_per_rank: int,
        stage_of: Mapping[str, int],
        holders: Mapping[str, tuple[int, ...]],
        readers: Mapping[str, tuple[int, ...]],
    ) -> "StageMemory":
        moments = []
        for position in range(positions):
            live: dict[int, int] = {}
            seen: list[dict[int, int]] = []
            for action, _, stage in order(schedule, position, positions, microbatches, stages_per_rank):
                live[stage] = live.get(stage, 0) + (1 if action == "F" else -1)
                if action == "F":
                    seen.append(dict(live))
            fullest = [a for a in seen if not any(b != a and all(b.get(s, 0) >= n for s, n in a.items()) for b in seen)]
            moments.append(tuple({tuple(sorted(m.items())): m for m in fullest}.values()))
        return cls(positions, dict(stage_of), dict(holders), dict(readers), microbatches, tuple(moments))


def stage_budget(
    solver,
    memory: MemoryTerms,
    ind: dict,
    shared: dict[str, str],
    chosen: tuple | None,
    choosing: frozenset[str],
    stages: StageMemory,
    budget_bytes: float | None,
):
    """The peak ``M`` of the module docstring with its rows, and the row keeping it under the
    budget (``None`` without one). ``chosen`` holds the kept megabytes of the ops that choose
    (``{op: {variable: megabytes}}``, the class's first layer's op for a repeated layer) and each
    segment's recomputed megabytes, as
    :func:`~autopar.passes.solve.memory_choices.keep_recompute_or_offload` returns them;
    ``choosing`` names every op that chooses (their outputs are no temporaries)."""

    def onehot(name: str, sizes: list[float]) -> list[tuple[object, float]]:
        return [(var, size * MEMORY_SCALE) for k, size in enumerate(sizes) for var in ind[name][k] if size]

    kept_mb, refilled = chosen if chosen is not None else ({}, {})
    held: list[list[tuple[object, float]]] = [[] for _ in range(stages.positions)]
    for name, positions in stages.holders.items():
        if name not in memory.params:  # a parameter no op reads
            continue
        none = [0.0] * len(memory.params[name])  # a frozen parameter has no gradient or optimizer state
        sizes = [
            a + b + c
            for a, b, c in zip(memory.params[name], memory.grads.get(name, none), memory.optimizer.get(name, none))
        ]
        for position in positions:
            held[position] += onehot(name, sizes)
        if stages.microbatches > 1 and name in memory.made_grads:  # the sums, and a micro-batch's added to them
            producer, made = memory.made_grads[name]  # by the stage making it (a tied weight's others get it made)
            held[stages.stage_of.get(name, 0) % stages.positions] += onehot(producer, [2 * b for b in made])
    for name, positions in stages.readers.items():
        if name in memory.activations:  # every micro-batch's piece, held for the step
            for position in positions:
                held[position] += onehot(name, [stages.microbatches * b for b in memory.activations[name]])
    kept: dict[int, list[tuple[object, float]]] = {}
    for name, stage in stages.stage_of.items():
        first = shared.get(name, name)
        if first in kept_mb:
            kept.setdefault(stage, []).extend(kept_mb[first].items())
        elif chosen is None and name in memory.activations:
            kept.setdefault(stage, []).extend(onehot(name, memory.activations[name]))
    transient = solver.NumVar(0.0, solver.infinity(), "stage_transient")
    for name, sizes in memory.temporaries.items():
        if name not in shared and name not in choosing and any(sizes):
            add_row(solver, 0.0, solver.infinity(), [(transient, 1.0), *((v, -c) for v, c in onehot(name, sizes))])
    again = solver.NumVar(0.0, solver.infinity(), "stage_recomputed")
    for var in refilled.values():
        add_row(solver, 0.0, solver.infinity(), [(again, 1.0), (var, -1.0)])
    peak = solver.NumVar(0.0, solver.infinity(), "memory_peak")
    for position, moments in enumerate(stages.moments):
        for live in moments:
            terms = [(peak, 1.0), (transient, -1.0), (again, -1.0), *((v, -c) for v, c in held[position])]
            for stage, count in live.items():
                terms += [(v, -c * count) for v, c in kept.get(stage, ())]
            add_row(solver, 0.0, solver.infinity(), terms)
    budget = add_row(solver, -solver.infinity(), budget_bytes * MEMORY_SCALE, [(peak, 1.0)]) if budget_bytes else None
    return peak, budget
