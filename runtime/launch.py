"""Process groups and device meshes: joining the ranks a launcher started.

``autopar run -n N script.py`` starts N local ranks through torchrun (``torch.distributed.run``),
the launcher that also spans hosts. :func:`device_mesh` joins them: gloo on CPU, NCCL on CUDA.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.core.mesh import Mesh


def device_type_of(module: torch.nn.Module) -> str:
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"


def ensure_process_group(mesh: Mesh, device_type: str) -> None:
    """Join the process group the launcher set up, and check it matches ``mesh``."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(
                f"autopar.compile needs a torch.distributed process group with {mesh.size} ranks for {mesh}, "
                f"and none is running. Fix: launch the script with `autopar run -n {mesh.size} script.py` "
                "(or torchrun), or call torch.distributed.init_process_group first"
            )
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world != mesh.size:
        raise ValueError(
            f"{mesh} has {mesh.size} devices but the process group has {world} ranks. Fix: launch "
            f"with `autopar run -n {mesh.size}`, or use a mesh whose sizes multiply to {world}"
        )


def device_mesh(mesh: Mesh, device_type: str, timeout: datetime.timedelta | None = None) -> DeviceMesh:
    """The ranks as a :class:`DeviceMesh` with ``mesh``'s shape and axis names. With ``timeout``,
    each axis's process groups are made with it, so that a collective on the mesh (the per-rank
    program's, or DTensor's) that a rank does not join fails after it instead of waiting."""
    ensure_process_group(mesh, device_type)
    if timeout is None:
        return init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)
    ranks = torch.arange(mesh.size).reshape(mesh.shape)
    groups = []
    for axis in range(mesh.ndim):
        lines = ranks.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist()
        group, _ = dist.new_subgroups_by_enumeration(lines, timeout=timeout)
        groups.append(group)
    return DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=mesh.axis_names)


def torchrun(num_ranks: int, target: list[str], *, launcher_args: list[str] | None = None) -> int:
    """Run ``target`` (a script and its arguments, or ``-m module ...``) on ``num_ranks`` ranks
    per host through torchrun. Without ``--nnodes`` in ``launcher_args`` all ranks are local."""
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank unless the user says otherwise
    extra = list(launcher_args or [])
    if not any(a.startswith("--nnodes") for a in extra):
        extra.append("--standalone")
    module = target[:1] == ["-m"]
    argv = [f"--nproc-per-node={num_ranks}", *extra, *(["-m"] if module else []), *target[1 if module else 0 :]]
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except Exception as exc:  # torchrun raises ChildFailedError with each rank's traceback
        print(exc, file=sys.stderr)
        return 1
    return 0
