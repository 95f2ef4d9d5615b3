"""Placements of a tensor on a mesh: one ``Shard(dim)``, ``Replicate()`` or ``Partial()`` per mesh
axis, reusing :mod:`torch.distributed.tensor`'s placement types.

They print as ``S(0)``, ``R`` and ``P``; a tensor's placements on a 2-D mesh print as
``(S(0), R)``.
"""

import re
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "Partial",
    "Placement",
    "Placements",
    "Layout",
    "layout",
    "Replicate",
    "Shard",
    "R",
    "P",
    "S",
    "format_placement",
    "format_placements",
    "parse_placement",
    "parse_placements",
    "parse_placements_text",
]

Placements = tuple[Placement, ...]
"""A tensor's placement on each mesh axis, in mesh-axis order."""


class Layout(tuple):
    """Placements that hash in constant time, one object per distinct value (:func:`layout`).
    torch's placements hash in Python, and building the plan's program keys its tables by the
    layouts of strategies millions of times. Equal to, and hashed as, the plain tuple."""

    _hash: int

    def __new__(cls, placements: Placements) -> "Layout":
        self = super().__new__(cls, placements)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return layout, (tuple(self),)  # hashed again where it is loaded: a Partial's hash is a string's


_LAYOUTS: dict[Placements, Layout] = {}  # a few hundred at most: the placements of the meshes planned


def layout(placements: Placements) -> Layout:
    """The one :class:`Layout` equal to ``placements``."""
    found = _LAYOUTS.get(placements)
    if found is None:
        found = _LAYOUTS[placements] = Layout(placements)
    return found


R = Replicate()
P = Partial("sum")


def S(dim: int) -> Shard:
    """``Shard(dim)``, short for use in rule tables."""
    return Shard(dim)


def format_placement(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    raise TypeError(f"unknown placement {placement!r}")


def format_placements(placements: Placements) -> str:
    return "(" + ", ".join(format_placement(p) for p in placements) + ")"


_SHARD = re.compile(r"^S\((\d+)\)$")


def parse_placement(text: str) -> Placement:
    """Parse ``"S(0)"``, ``"R"`` or ``"P"``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    match = _SHARD.match(text)
    if match:
        return Shard(int(match.group(1)))
    raise ValueError(f"cannot read placement {text!r}: write 'S(<dim>)', 'R' or 'P'")


def parse_placements_text(text: str) -> Placements:
    """Inverse of :func:`format_placements`: ``"(S(0), R)"`` → ``(Shard(0), Replicate())``."""
    inner = text.strip()
    if not (inner.startswith("(") and inner.endswith(")")):
        raise ValueError(f"cannot read placements {text!r}: write them like '(S(0), R)'")
    return tuple(parse_placement(p) for p in inner[1:-1].split(","))


def parse_placements(value: str | Sequence[str], num_axes: int) -> Placements:
    """Parse one placement per mesh axis; a single string is accepted for a 1-D mesh."""
    items = [value] if isinstance(value, str) else list(value)
    if len(items) != num_axes:
        raise ValueError(f"placements {value!r} name {len(items)} mesh axes; the mesh has {num_axes}")
    return tuple(parse_placement(p) if isinstance(p, str) else p for p in items)
