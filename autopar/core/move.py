"""A move of a tensor between placements, as the plan records it: one mesh axis per step.

Planning works out each move (:func:`autopar.passes.propagation.redistribute.transition`, or the
collectives a bucket runs) and prices it; the plan keeps the steps it priced
(:class:`autopar.core.plan.PlannedMove`, :attr:`autopar.core.plan.PlannedBucket.steps`), and
lowering runs those steps as they are, so the program moves every tensor exactly as priced.
"""

from dataclasses import dataclass
from typing import Literal, get_args

from autopar.core.kinds import CollectiveKind
from autopar.core.mesh import Mesh

COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = get_args(CollectiveKind)
"""Every collective kind, read from the one definition, :data:`autopar.core.kinds.CollectiveKind`."""

StepKind = Literal[CollectiveKind, "slice", "zero"]
"""A step of a move: a collective, or one of the two local steps (a slice of the rank's piece,
or zeros on every rank of the axis but the first). :class:`~autopar.passes.propagation.rank_ops.Rank`
has one method of each name."""


@dataclass(frozen=True, slots=True)
class Step:
    """One per-axis step of a move."""

    kind: StepKind
    """A collective (``COLLECTIVE_KINDS``) or a local ``"slice"`` / ``"zero"``."""
    axis: int
    """Mesh axis."""
    dim: int | None = None
    """Tensor dim gathered, scattered or sliced; for all-to-all the dim that is gathered."""
    to_dim: int | None = None
    """For all-to-all, the dim that becomes split."""
    bytes: int = 0
    """Bytes per rank at the planned sizes: the result of an all-gather, the input of a
    reduce-scatter, the local tensor of an all-reduce or all-to-all."""

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def to_dict(self, mesh: Mesh) -> dict:
        """Its JSON object: the mesh axis by name, dims only where the step has them."""
        data: dict = {"kind": self.kind, "axis": mesh.axis_names[self.axis]}
        data.update({k: v for k, v in (("dim", self.dim), ("to_dim", self.to_dim)) if v is not None})
        return {**data, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: dict, mesh: Mesh) -> "Step":
        """Inverse of :meth:`to_dict`."""
        axis = mesh.axis_names.index(data["axis"])
        return cls(data["kind"], axis, data.get("dim"), data.get("to_dim"), data["bytes"])
