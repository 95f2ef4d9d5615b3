"""The logical device mesh that a plan is made for."""

import math
from dataclasses import dataclass


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
