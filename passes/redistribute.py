"""How a tensor moves from one placement to another: the steps, one mesh axis at a time.

The same function prices a transition for the solver, lists it in the plan and drives the
rewriter, so the collectives the plan reports are exactly the ones the per-rank graph runs.

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

Axes that give up a split or a partial sum go first, then axes that take one, so that no dim is
ever split by two axes in between.
"""

import math
from dataclasses import dataclass

from autopar.mesh import Mesh
from autopar.placement import Partial, Placements, Replicate, Shard

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True, slots=True)
class Step:
    """One per-axis step of a transition."""

    kind: str
    """A collective (``COLLECTIVE_KINDS``) or a local ``"slice"`` / ``"zero"``."""
    axis: int
    """Mesh axis."""
    dim: int | None = None
    """Tensor dim gathered, scattered or sliced; for all-to-all the dim that is gathered."""
    to_dim: int | None = None
    """For all-to-all, the dim that becomes split."""
    bytes: int = 0
    """Bytes per rank: the result of an all-gather, the input of a reduce-scatter, the local
    tensor of an all-reduce or all-to-all."""

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS


def local_shape(shape: tuple[int, ...], placements: Placements, mesh: Mesh) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape`` laid out as ``placements``."""
    local = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            local[p.dim] //= mesh.shape[axis]
    return tuple(local)


def transition(src: Placements, dst: Placements, shape: tuple[int, ...], itemsize: int,
               mesh: Mesh) -> tuple[Step, ...]:
    """The steps that turn a tensor laid out as ``src`` into one laid out as ``dst``."""
    cur = list(src)
    steps: list[Step] = []

    def nbytes() -> int:
        return math.prod(local_shape(shape, tuple(cur), mesh)) * itemsize

    def free(dim: int) -> bool:
        return not any(isinstance(p, Shard) and p.dim == dim for p in cur)

    for axis, (s, d) in enumerate(zip(src, dst)):
        if s == d:
            continue
        if isinstance(s, Shard):
            if isinstance(d, Shard) and free(d.dim):
                steps.append(Step("all_to_all", axis, s.dim, d.dim, nbytes()))
                cur[axis] = d
            else:
                cur[axis] = Replicate()
                steps.append(Step("all_gather", axis, s.dim, bytes=nbytes()))
        elif isinstance(s, Partial):
            if isinstance(d, Shard) and free(d.dim):
                steps.append(Step("reduce_scatter", axis, d.dim, bytes=nbytes()))
                cur[axis] = d
            else:
                steps.append(Step("all_reduce", axis, bytes=nbytes()))
                cur[axis] = Replicate()
    for axis, d in enumerate(dst):
        if cur[axis] == d:
            continue
        steps.append(Step("slice", axis, d.dim) if isinstance(d, Shard) else Step("zero", axis))
        cur[axis] = d
    return tuple(steps)
