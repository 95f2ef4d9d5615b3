"""Parameters and buffers on ranks: the model's tensors as DTensors holding this rank's pieces.

:func:`local_piece` cuts a rank's piece out of a whole tensor (every rank holds the whole one, so
no communication is needed); :func:`distribute_state` swaps each planned parameter and buffer of
a module for a :class:`~torch.distributed.tensor.DTensor` over the plan's placements. Whole
values, gathering, norms and checkpoints are then DTensor's.

An optimizer built over the old parameters (before the first call, when the plan is made then)
is pointed at the new ones when it first steps (:func:`_step_the_new_parameters`).
"""

import contextlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.placement import Placements, Shard

_REPLACED_BY = "_autopar_replaced_by"
_hook_registered = False


def local_piece(
    full: torch.Tensor, placements: Placements, coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> torch.Tensor:
    """The part of ``full`` that the rank at ``coordinate`` holds, in memory of its own (a view
    would keep the whole tensor's storage alive)."""
    piece = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            size = piece.shape[p.dim] // mesh_shape[axis]
            piece = piece.narrow(p.dim, coordinate[axis] * size, size)
    return piece.contiguous() if piece is full else piece.clone(memory_format=torch.contiguous_format)


def as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as the piece of a DTensor laid out as ``like``."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (the tensor itself when it is no DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def distribute(whole: torch.Tensor, piece: torch.Tensor, device_mesh: DeviceMesh, placements: Placements) -> DTensor:
    """A DTensor of ``whole``'s global shape holding ``piece`` on this rank."""
    stride = torch.empty(whole.shape, device="meta").stride()
    return DTensor.from_local(piece, device_mesh, placements, run_check=False, shape=whole.shape, stride=stride)


def distribute_state(module: torch.nn.Module, pieces: Mapping[int, DTensor]) -> None:
    """Put ``pieces[id(t)]`` wherever ``module`` (or a submodule, tied weights included) holds
    parameter or buffer ``t``; parameters become parameters again, keeping ``requires_grad``.
    Each old tensor's memory is released, and an optimizer still holding an old parameter steps
    its replacement instead."""
    global _hook_registered
    replaced: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, old in table.items():
                if old is None or id(old) not in pieces:
                    continue
                if id(old) not in replaced:
                    new = pieces[id(old)]
                    replaced[id(old)] = torch.nn.Parameter(new, requires_grad=old.requires_grad) if is_param else new
                    if is_param:
                        setattr(old, _REPLACED_BY, replaced[id(old)])
                table[name] = replaced[id(old)]
    if not _hook_registered:
        register_optimizer_step_pre_hook(_step_the_new_parameters)
        DTensor._op_dispatcher._custom_op_handlers[_UNSCALE] = _found_inf_on_any_rank
        _hook_registered = True


_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


def _found_inf_on_any_rank(op_call, args, kwargs) -> None:
    """``torch.amp.GradScaler``'s check for infinite gradients over DTensor gradients: each rank
    checks its pieces, then the flag is reduced (max) over every axis of the mesh, so that every
    rank skips the step when any piece overflowed. torch's own handler reduces only over the
    axes the first gradient of the list is split on, so with gradients laid out differently
    (one replicated, the next split) a rank would step while another skips."""
    grads, found_inf, inv_scale = args
    op_call([local_of(g) for g in grads], local_of(found_inf), local_of(inv_scale), **kwargs)
    mesh = grads[0].device_mesh
    for axis in range(mesh.ndim):
        dist.all_reduce(local_of(found_inf), op=dist.ReduceOp.MAX, group=mesh.get_group(axis))


def release(old: torch.Tensor) -> None:
    """Free the memory of a tensor the module no longer holds (a caller may still hold it)."""
    old.data = torch.empty(0, dtype=old.dtype, device=old.device)


def _step_the_new_parameters(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before any optimizer steps: a parameter that autopar replaced by its DTensor (the
    optimizer was built before the plan was made) is swapped for its replacement."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = getattr(p, _REPLACED_BY, None)
            if new is not None:
                if p in optimizer.state:
                    raise RuntimeError(
                        "this optimizer has state for a parameter that autopar has since split across the "
                        "ranks. Fix: build the optimizer after the model's first call, or pass example_inputs "
                        "to autopar.compile so that parameters are split there"
                    )
                params[i] = new


@contextlib.contextmanager
def whole_fake_state(module: torch.nn.Module, device: torch.device | None = None):
    """Within the block, ``module`` holds fake tensors of its DTensors' whole shapes, and of its
    meta tensors' on ``device`` (tied tensors stay tied), so that it can be captured without
    memory (again at other input sizes, or first where it was built on the meta device);
    yields the fake mode to make inputs in."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if not isinstance(tensor, DTensor) and not (tensor is not None and tensor.is_meta):
                    continue
                if id(tensor) not in fakes:
                    with mode:
                        where = _device_of(tensor) if isinstance(tensor, DTensor) else device
                        fake = torch.empty(tensor.shape, dtype=tensor.dtype, device=where)
                    is_param = isinstance(tensor, torch.nn.Parameter)
                    fakes[id(tensor)] = (
                        torch.nn.Parameter(fake, requires_grad=tensor.requires_grad) if is_param else fake
                    )
                swapped.append((table, name, tensor))
                table[name] = fakes[id(tensor)]
    try:
        yield mode
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


def _device_of(tensor: DTensor) -> torch.device:
    """The device the program computes ``tensor`` on: its piece's, or the mesh's device for a
    piece kept in host memory."""
    device = tensor.to_local().device
    if device.type == "cpu" and tensor.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def materialise(
    module: torch.nn.Module,
    device: torch.device,
    cut: Callable[[int, torch.Tensor], torch.Tensor],
    init_weights: Callable[[torch.nn.Module], None] | None = None,
) -> dict[int, torch.Tensor]:
    """This rank's pieces of ``module``'s meta tensors, by id: module by module, in the order
    ``module.apply`` visits them, each module's own meta tensors are made whole on ``device``,
    initialised (``init_weights(module)``, else the module's ``reset_parameters()``) and cut
    (``cut(id, whole)``); the whole ones are freed before the next module, so that memory holds
    one module's whole tensors at a time. A tensor tied between modules is cut after the last
    of them initialised it, as on one device the last initialisation is the one that stays."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for t in [*sub._parameters.values(), *sub._buffers.values()]:
            if t is not None and t.is_meta:
                owners[id(t)] = owners.get(id(t), 0) + 1
    whole: dict[int, torch.Tensor] = {}
    pieces: dict[int, torch.Tensor] = {}
    order: list[torch.nn.Module] = []
    module.apply(order.append)
    for sub in order:
        own = [
            (table, name, t)
            for table in (sub._parameters, sub._buffers)
            for name, t in table.items()
            if t is not None and t.is_meta
        ]
        if not own:
            continue
        if init_weights is None:
            _check_resettable(sub, own)
        for table, name, t in own:
            if id(t) not in whole:
                made = torch.empty(t.shape, dtype=t.dtype, device=device)
                whole[id(t)] = (
                    torch.nn.Parameter(made, requires_grad=t.requires_grad)
                    if isinstance(t, torch.nn.Parameter)
                    else made
                )
            table[name] = whole[id(t)]
        with torch.no_grad():
            init_weights(sub) if init_weights is not None else sub.reset_parameters()
        for table, name, t in own:
            table[name] = t
            owners[id(t)] -= 1
            if owners[id(t)] == 0:
                pieces[id(t)] = cut(id(t), whole.pop(id(t)).detach())
    return pieces


def _check_resettable(sub: torch.nn.Module, own: list) -> None:
    """Refuse to initialise ``sub``'s meta tensors by ``reset_parameters()`` where it has none,
    or where it holds buffers and is not torch's own (torch's modules reset their buffers, such
    as batch norm's statistics; others' ``reset_parameters`` may leave a buffer computed at
    construction, such as rotary frequencies, unset)."""
    names = ", ".join(name for _, name, _ in own)
    has_buffer = any(table is sub._buffers for table, _, _ in own)
    if not hasattr(sub, "reset_parameters") or (has_buffer and not type(sub).__module__.startswith("torch.nn")):
        what = (
            "has no reset_parameters() to initialise them"
            if not hasattr(sub, "reset_parameters")
            else "holds buffers its reset_parameters() may not set"
        )
        raise ValueError(
            f"{type(sub).__name__} holds {names} on the meta device and {what}. Fix: pass init_weights= to "
            "autopar.compile, a function that initialises one module's own parameters and buffers in place "
            "(a Hugging Face model's is model._init_weights)"
        )
