"""How a tensor moves from one placement to another: the steps, one mesh axis at a time.

Planning prices each transition with this function and the plan records its steps
(:class:`autopar.core.plan.PlannedMove`); the rewriter runs the recorded steps, so the
collectives the plan reports are exactly the ones the per-rank graph runs.

Per axis, from → to:

========== ========== =====================================================
from       to         step
========== ========== =====================================================
``S(d)``   ``R``      all-gather along ``d``
``P``      ``R``      all-reduce
``P``      ``S(d)``   reduce-scatter along ``d``
``S(d)``   ``S(e)``   all-to-all
``R``      ``S(d)``   local slice, no communication
``R``      ``P``      keep the value on the axis' first rank, zeros elsewhere
========== ========== =====================================================

On an N-D mesh a transition is a sequence of such one-axis steps. Each step is priced with the
α-β link of its axis on the bytes the tensor has at that point, and the transition takes the
cheapest sequence through valid layouts (a shortest path): gathering over a slow axis while the
tensor is still split on a fast one, for example. The solver prices moves the same way.
"""

import functools
import heapq
import itertools
import math
from collections.abc import Iterator

from autopar.core.mesh import Link, Mesh
from autopar.core.move import Step
from autopar.core.placement import Partial, Placements, Replicate, Shard


def local_shape(shape: tuple[int, ...], placements: Placements, mesh: Mesh) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape`` laid out as ``placements``."""
    local = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            local[p.dim] //= mesh.shape[axis]
    return tuple(local)


def valid_layouts(shape: tuple[int, ...], mesh: Mesh, partial: bool) -> tuple[Placements, ...]:
    """Every layout of a tensor of ``shape``: per axis replicated, split along a dim or, when
    ``partial``, a partial sum. A dim split by several axes must be divisible by the product of
    their sizes (the first axis cuts it, each later axis cuts the pieces). An axis of one rank
    only replicates."""
    options = []
    for size in mesh.shape:
        if size == 1:
            options.append([Replicate()])
            continue
        axis = [Replicate()] + [Shard(d) for d, n in enumerate(shape) if n % size == 0]
        options.append(axis + [Partial()] if partial else axis)
    layouts = []
    for combo in itertools.product(*options):
        factor: dict[int, int] = {}
        for size, p in zip(mesh.shape, combo):
            if isinstance(p, Shard):
                factor[p.dim] = factor.get(p.dim, 1) * size
        if all(shape[d] % f == 0 for d, f in factor.items()):
            layouts.append(tuple(combo))
    return tuple(layouts)


def _innermost(layout: Placements, dim: int, axis: int) -> bool:
    """Whether no axis after ``axis`` splits ``dim``: only the innermost cut of a dim can be
    gathered, and a new cut can only go inside the existing ones."""
    return not any(isinstance(p, Shard) and p.dim == dim for p in layout[axis + 1 :])


def one_axis_step(
    cur: Placements, nxt: Placements, axis: int, shape: tuple[int, ...], itemsize: int, mesh: Mesh
) -> Step | None:
    """The step that changes ``cur`` into ``nxt`` on ``axis`` alone (they agree elsewhere), or
    ``None`` where no single step does: a split turning into a partial sum, or a cut of a dim
    that a later axis also cuts."""
    s, d = cur[axis], nxt[axis]
    before = math.prod(local_shape(shape, cur, mesh)) * itemsize
    if isinstance(s, Shard) and not _innermost(cur, s.dim, axis):
        return None
    if isinstance(d, Shard) and not _innermost(cur, d.dim, axis):
        return None
    if isinstance(s, Shard):
        if isinstance(d, Shard):
            return Step("all_to_all", axis, s.dim, d.dim, before)
        if isinstance(d, Replicate):
            return Step("all_gather", axis, s.dim, bytes=math.prod(local_shape(shape, nxt, mesh)) * itemsize)
        return None
    if isinstance(s, Partial):
        if isinstance(d, Shard):
            return Step("reduce_scatter", axis, d.dim, bytes=before)
        return Step("all_reduce", axis, bytes=before)
    return Step("slice", axis, d.dim) if isinstance(d, Shard) else Step("zero", axis)


def step_s(step: Step, mesh: Mesh, links: tuple[Link, ...]) -> float:
    """Modelled time of one step under the α-β ``links`` (one per mesh axis), with the local
    ops the per-rank program runs around it (:func:`local_work`); local steps are free.

    With ``n`` ranks on the axis and ``B`` bytes as in :attr:`Step.bytes`, bandwidth terms follow
    the ring algorithms: all-reduce ``α + 2(n-1)/n·B·β``; all-gather, reduce-scatter, all-to-all
    ``α + (n-1)/n·B·β``.
    """
    n = mesh.shape[step.axis]
    if not step.is_collective or n == 1:
        return 0.0
    link = links[step.axis]
    ops, copied = local_work(step)
    return (
        link.alpha_beta(step.kind)[0]
        + bandwidth_s(step, mesh, links)
        + ops * link.local_op_s
        + copied * link.local_s_per_byte
    )


def bandwidth_s(step: Step, mesh: Mesh, links: tuple[Link, ...]) -> float:
    """The bandwidth term of a collective step's time (see :func:`step_s`)."""
    n = mesh.shape[step.axis]
    rounds = 2 if step.kind == "all_reduce" else 1
    return rounds * (n - 1) / n * step.bytes * links[step.axis].alpha_beta(step.kind)[1]


def local_work(step: Step) -> tuple[int, int]:
    """``(ops, bytes copied)`` of the local ops the per-rank program
    (:class:`autopar.passes.propagation.rank_ops.Rank`) runs around a collective step on one tensor: an
    all-gather or reduce-scatter along a dim other than 0 moves the tensor's pieces along that
    dim to dim 0 or back (:func:`~autopar.passes.propagation.rank_ops.stacked_pieces`, one
    copy); an all-to-all does that before and after."""
    if step.kind in ("all_gather", "reduce_scatter") and step.dim not in (None, 0):
        return 2, step.bytes
    if step.kind == "all_to_all":
        return 4, 2 * step.bytes
    return 0, 0


def transition(
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    partial: bool,
    mesh: Mesh,
    links: tuple[Link, ...],
) -> tuple[Step, ...]:
    """The cheapest steps that turn a tensor laid out as ``src`` into one laid out as ``dst``
    (``partial``: whether the tensor may be a partial sum, i.e. is floating point)."""
    if src == dst:
        return ()
    return _shortest_paths(src, shape, itemsize, partial, mesh, links)[dst][1]


def neighbours(
    cur: Placements, layouts: "_OneAxisApart", shape, itemsize: int, mesh: Mesh
) -> Iterator[tuple[Placements, Step]]:
    """The layouts one step away from ``cur`` among ``layouts``, with that step."""
    for axis in range(mesh.ndim):
        for nxt in layouts.groups[axis].get(cur[:axis] + cur[axis + 1 :], ()):
            if nxt[axis] != cur[axis]:
                step = one_axis_step(cur, nxt, axis, shape, itemsize, mesh)
                if step is not None:
                    yield nxt, step


class _OneAxisApart:
    """Layouts grouped, for each mesh axis, by their placements on the other axes: the layouts
    one axis apart from a layout are in its group (in the layouts' order), found without
    comparing it with every layout."""

    def __init__(self, layouts: tuple[Placements, ...], ndim: int) -> None:
        self.groups: list[dict[tuple, list[Placements]]] = [{} for _ in range(ndim)]
        for v in layouts:
            for axis in range(ndim):
                self.groups[axis].setdefault(v[:axis] + v[axis + 1 :], []).append(v)


@functools.lru_cache(maxsize=1024)
def _arcs(
    shape: tuple[int, ...], itemsize: int, partial: bool, mesh: Mesh, links: tuple[Link, ...]
) -> dict[Placements, tuple[tuple[Placements, Step, float], ...]]:
    """Per valid layout of a tensor, the valid layouts one step away, with the step and its time."""
    layouts = valid_layouts(shape, mesh, partial)
    apart = _OneAxisApart(layouts, mesh.ndim)
    return {
        u: tuple((v, step, step_s(step, mesh, links)) for v, step in neighbours(u, apart, shape, itemsize, mesh))
        for u in layouts
    }


@functools.lru_cache(maxsize=4096)
def _shortest_paths(
    src: Placements, shape, itemsize: int, partial: bool, mesh: Mesh, links: tuple[Link, ...]
) -> dict[Placements, tuple[float, tuple[Step, ...]]]:
    arcs = _arcs(shape, itemsize, partial, mesh, links)
    best: dict[Placements, tuple[float, tuple[Step, ...]]] = {}
    order = itertools.count()
    heap = [(0.0, 0, next(order), src, ())]
    while heap:
        cost, _, _, cur, steps = heapq.heappop(heap)
        if cur in best:
            continue
        best[cur] = (cost, steps)
        out = arcs.get(cur)
        if out is None:  # a source outside the valid layouts
            out = tuple(
                (v, step, step_s(step, mesh, links))
                for v, step in neighbours(cur, _OneAxisApart(tuple(arcs), mesh.ndim), shape, itemsize, mesh)
            )
        for nxt, step, seconds in out:
            if nxt not in best:
                heapq.heappush(heap, (cost + seconds, len(steps) + 1, next(order), nxt, steps + (step,)))
    return best


@functools.lru_cache(maxsize=1024)
def one_step_moves(
    shape: tuple[int, ...], itemsize: int, partial: bool, mesh: Mesh, links: tuple[Link, ...]
) -> tuple[tuple[Placements, Placements, float], ...]:
    """Every one-step move between valid layouts of a tensor, with its modelled time: the arcs
    whose shortest paths :func:`transition` takes."""
    return tuple(
        (u, v, seconds) for u, out in _arcs(shape, itemsize, partial, mesh, links).items() for v, _, seconds in out
    )
