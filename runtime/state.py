"""Parameters on ranks: cutting the local piece out of a whole tensor, and gathering it back."""

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from autopar.placement import Placements, Shard


def local_piece(full: torch.Tensor, placements: Placements, coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]) -> torch.Tensor:
    """The part of ``full`` that the rank at ``coordinate`` holds, in memory of its own (a view
    would keep the whole tensor's storage alive)."""
    piece = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            size = piece.shape[p.dim] // mesh_shape[axis]
            piece = piece.narrow(p.dim, coordinate[axis] * size, size)
    return piece.contiguous() if piece is full else piece.clone(memory_format=torch.contiguous_format)


def gather_whole(local: torch.Tensor, placements: Placements, device_mesh: DeviceMesh) -> torch.Tensor:
    """All-gather a rank's piece back into the whole tensor on every rank."""
    whole = local.detach()
    for axis in reversed(range(len(placements))):
        p = placements[axis]
        if isinstance(p, Shard):
            whole = funcol.wait_tensor(funcol.all_gather_single(whole.contiguous(), p.dim, (device_mesh, axis)))
    return whole.clone()
