"""The logical device mesh that a plan is made for, and the α-β link of a mesh axis."""

import math
from dataclasses import dataclass

from autopar.core.kinds import CollectiveKind


@dataclass(frozen=True, slots=True)
class Mesh:
    """A logical grid of devices, e.g. ``Mesh((2, 2), ("dp", "tp"))``.

    Planning needs only the shape; at run time the mesh is laid over the ranks of the current
    process group in row-major order (rank ``r`` sits at ``numpy.unravel_index(r, shape)``), as
    :func:`torch.distributed.device_mesh.init_device_mesh` does.
    """

    shape: tuple[int, ...]
    """Devices along each mesh axis."""
    axis_names: tuple[str, ...] = ()
    """One name per axis; defaults to ``("axis0", "axis1", ...)``."""

    def __post_init__(self) -> None:
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)
        if not shape or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(f"Mesh shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        names = tuple(self.axis_names) or tuple(f"axis{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(
                f"Mesh{shape} has {len(shape)} axes but {len(names)} axis names {names}; give one name per axis"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh axis names must be distinct, got {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)

    @property
    def size(self) -> int:
        """Total number of devices."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Position of ``rank`` on the mesh (row-major)."""
        coord = []
        for n in reversed(self.shape):
            coord.append(rank % n)
            rank //= n
        return tuple(reversed(coord))

    def __str__(self) -> str:
        return "Mesh(" + " x ".join(f"{name}={n}" for name, n in zip(self.axis_names, self.shape)) + ")"


@dataclass(frozen=True, slots=True)
class Link:
    """An α-β link: a collective moving ``n`` bytes per rank costs about ``latency_s + n * s_per_byte``."""

    latency_s: float
    """α, the fixed cost of one collective call."""
    s_per_byte: float
    """β, the inverse of the bandwidth."""
    per_kind: tuple[tuple[CollectiveKind, float, float], ...] = ()
    """Measured ``(collective kind, α, β)`` that replace the two above for that kind (a
    calibrated profile has one per collective)."""
    local_op_s: float = 0.0
    """Time of one local op that the per-rank program runs around a collective on this link
    (packing a bucket, putting gathered pieces side by side); :func:`mesh_links` sets it from
    the device's profile."""
    local_s_per_byte: float = 0.0
    """Seconds per byte such an op copies (read and written once each)."""
    send: tuple[float, float] | None = None
    """Measured ``(α, β)`` of one point-to-point send between two ranks (pipeline stages send
    so), where it differs from a collective's (on gloo a collective's α is many sends'); ``None``:
    the link's own two above."""

    @classmethod
    def from_dict(cls, data: dict) -> "Link":
        """The inverse of ``dataclasses.asdict``, as plans and profile files store links."""
        return cls(
            data["latency_s"],
            data["s_per_byte"],
            tuple(tuple(k) for k in data["per_kind"]),
            data.get("local_op_s", 0.0),
            data.get("local_s_per_byte", 0.0),
            None if data.get("send") is None else tuple(data["send"]),
        )

    def scaled(self, factor: float) -> "Link":
        """This link with every time ``factor`` times longer."""
        return Link(
            self.latency_s * factor,
            self.s_per_byte * factor,
            tuple((kind, alpha * factor, beta * factor) for kind, alpha, beta in self.per_kind),
            self.local_op_s * factor,
            self.local_s_per_byte * factor,
            None if self.send is None else (self.send[0] * factor, self.send[1] * factor),
        )

    def send_s(self, nbytes: float) -> float:
        """Seconds of sending ``nbytes`` from one rank to another over this link."""
        alpha, beta = self.send if self.send is not None else (self.latency_s, self.s_per_byte)
        return alpha + nbytes * beta

    def alpha_beta(self, kind: CollectiveKind) -> tuple[float, float]:
        for name, alpha, beta in self.per_kind:
            if name == kind:
                return alpha, beta
        return self.latency_s, self.s_per_byte
