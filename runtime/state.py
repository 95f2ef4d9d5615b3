"""Parameters and buffers on ranks: the model's tensors as DTensors holding this rank's pieces.

:func:`local_piece` cuts a rank's piece out of a whole tensor (every rank holds the whole one, so
no communication is needed); :func:`distribute_state` swaps each planned parameter and buffer of
a module for a :class:`~torch.distributed.tensor.DTensor` over the plan's placements. Whole
values, gathering, norms and checkpoints are then DTensor's; :func:`whole_of` and
:func:`as_planned` take state dict entries out of the module and back in.

An optimizer built over the old parameters (before the first call, when the plan is made then)
is pointed at the new ones as they replace the old (:func:`_repoint_optimizers`).
"""

import contextlib
import gc
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autopar.core.placement import Placements, Shard

_handler_registered = False


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
    """``local`` as the piece of a DTensor laid out as ``like``, on ``local``'s device."""
    return _on_its_device(local, like.device_mesh, like.placements, like.shape, like.stride())


def _on_its_device(
    piece: torch.Tensor, device_mesh: DeviceMesh, placements, shape: torch.Size, stride: tuple[int, ...]
) -> DTensor:
    """A DTensor holding ``piece`` where it is. ``DTensor.from_local`` would move a piece in
    host memory (a parameter the plan keeps there) to the mesh's device; FSDP2 builds the
    DTensors of its CPU-offloaded parameters this way too."""
    spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, piece.dtype))
    return DTensor(piece, spec, requires_grad=piece.requires_grad)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (the tensor itself when it is no DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def piece_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` itself, outside autograd (the tensor when it is no
    DTensor): the per-rank program's autograd function takes the DTensors and hands back their
    gradients as DTensors itself (:func:`gradient_as`), instead of ``to_local()`` and its
    backward per parameter and step, whose DTensor checks cost more than a small model's step."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def gradient_as(grad: torch.Tensor | None, like: DTensorSpec | None) -> torch.Tensor | None:
    """``grad``, a parameter's local gradient, as the gradient of a DTensor of spec ``like``
    (``grad`` itself where ``like`` is ``None``: a parameter that is no DTensor)."""
    if grad is None or like is None:
        return grad
    return DTensor(grad, like, requires_grad=False)


def whole_of(tensor: torch.Tensor) -> torch.Tensor:
    """A whole copy of a parameter or buffer (a collective for a DTensor: every rank calls it)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().clone()
    local = tensor.to_local().detach()
    if local.device.type != tensor.device_mesh.device_type:  # a parameter kept in host memory
        local = local.to(tensor.device_mesh.device_type)
        tensor = as_dtensor(local, tensor)
    return tensor.detach().full_tensor()


def as_planned(
    key: str, current: torch.Tensor, value: torch.Tensor, coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> torch.Tensor:
    """State dict entry ``key``'s ``value`` laid out as the module's ``current`` tensor: a DTensor
    redistributed, a whole tensor cut to the piece of the rank at ``coordinate``; anything
    loaded into a tensor that is no DTensor is left as it is."""
    if not isinstance(current, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        return value.redistribute(current.device_mesh, current.placements)
    if tuple(value.shape) != tuple(current.shape):
        raise ValueError(
            f"state dict entry {key!r} has shape {tuple(value.shape)}, but the model's is "
            f"{tuple(current.shape)}. Fix: load a state dict of this model"
        )
    piece = local_piece(value.to(current.dtype), current.placements, coordinate, mesh_shape)
    return as_dtensor(piece.to(current.to_local().device), current)


class ParameterCounts(NamedTuple):
    """How many parameter values a model has, whole and on this rank."""

    whole: int
    """Values of the model's parameters."""
    this_rank: int
    """Values this rank holds (replicated ones counted on every rank that holds them)."""


def distribute(whole: torch.Tensor, piece: torch.Tensor, device_mesh: DeviceMesh, placements: Placements) -> DTensor:
    """A DTensor of ``whole``'s global shape holding ``piece`` on this rank, on ``piece``'s device."""
    return _on_its_device(piece, device_mesh, placements, whole.shape, torch.empty(whole.shape, device="meta").stride())


def with_hooks_of(old: torch.Tensor, new: torch.nn.Parameter) -> torch.nn.Parameter:
    """``new`` holding the gradient hooks the user registered on ``old`` (``register_hook``,
    ``register_post_accumulate_grad_hook``): the same tables, so that their handles still
    remove them. They are called with ``new``'s gradients, DTensors laid out as it is."""
    if old._backward_hooks:
        new._backward_hooks = old._backward_hooks
    if old._post_accumulate_grad_hooks:
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    return new


def distribute_state(module: torch.nn.Module, pieces: Mapping[int, DTensor]) -> None:
    """Put ``pieces[id(t)]`` wherever ``module`` (or a submodule, tied weights included) holds
    parameter or buffer ``t``; parameters become parameters again, keeping ``requires_grad``.
    An optimizer already built over an old parameter steps its replacement instead."""
    global _handler_registered
    replaced: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, old in table.items():
                if old is None or id(old) not in pieces:
                    continue
                if id(old) not in replaced:
                    new = pieces[id(old)]
                    if is_param:
                        new = with_hooks_of(old, torch.nn.Parameter(new, requires_grad=old.requires_grad))
                    replaced[id(old)] = new
                table[name] = replaced[id(old)]
    _repoint_optimizers(replaced)
    if not _handler_registered:
        DTensor._op_dispatcher._custom_op_handlers[_UNSCALE] = _found_inf_on_any_rank
        _handler_registered = True


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
    flag = local_of(found_inf)
    on_mesh = flag if flag.device.type == mesh.device_type else flag.to(mesh.device_type)  # pieces in host memory
    for axis in range(mesh.ndim):
        dist.all_reduce(on_mesh, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
    if on_mesh is not flag:
        flag.copy_(on_mesh)


def release(old: torch.Tensor) -> None:
    """Free the memory of a tensor the module no longer holds (a caller may still hold it)."""
    old.data = torch.empty(0, dtype=old.dtype, device=old.device)


def _repoint_optimizers(replaced: Mapping[int, torch.Tensor]) -> None:
    """Point every optimizer of the process that holds a replaced parameter (one built before
    the plan was made) at its replacement, before it steps, unscales or clips through its
    parameter groups; refused where it already has state for the old parameter."""
    for optimizer in [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]:
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if id(p) not in replaced:
                    continue
                if p in optimizer.state:
                    raise RuntimeError(
                        "an optimizer has state for a parameter that autopar now splits across the ranks. Fix: "
                        "build the optimizer after the model's first call, or pass example_inputs to "
                        "autopar.compile so that parameters are split there"
                    )
                params[i] = replaced[id(p)]


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
    one module's whole tensors at a time. A tensor tied between modules is cut once the last of
    them is done: with ``init_weights`` each of them initialises it in turn, as
    ``model.apply(init_weights)`` would; with ``reset_parameters`` the first one's values stay
    (each module draws its own at construction, and tying by assignment keeps the first's).
    Initialisation a parent module does in its own constructor after building its children is
    not replayed: pass ``init_weights`` for it."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for t in [*sub._parameters.values(), *sub._buffers.values()]:
            if t is not None and t.is_meta:
                owners[id(t)] = owners.get(id(t), 0) + 1
    whole: dict[int, torch.Tensor] = {}
    pieces: dict[int, torch.Tensor] = {}
    initialised: set[int] = set()
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
                    with_hooks_of(t, torch.nn.Parameter(made, requires_grad=t.requires_grad))
                    if isinstance(t, torch.nn.Parameter)
                    else made
                )
            table[name] = whole[id(t)]
        with torch.no_grad():
            if init_weights is not None:
                init_weights(sub)
            else:
                kept = {id(t): whole[id(t)].detach().clone() for _, _, t in own if id(t) in initialised}
                sub.reset_parameters()
                for key, value in kept.items():
                    whole[key].detach().copy_(value)
        for table, name, t in own:
            initialised.add(id(t))
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
