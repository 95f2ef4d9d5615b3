"""Views and layout changes: reshapes, transposes, expands, splits, concatenations, slices, padding."""

import math

import torch
from autopar.passes.rules import Row, register, register_shape_arg, tensor_args, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten
prims = torch.ops.prims

register_shape_arg(
    1,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.slice_backward.default,
    aten.select_backward.default,
    prims.broadcast_in_dim.default,
)


def reshape_dim_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> dict[int, int]:
    """Input dims whose even split survives a reshape, mapped to the output dim that carries it.

    A split of input dim ``d`` into contiguous chunks is a split of output dim ``e`` exactly when
    the dims before them hold the same number of elements (``prod(in[:d]) == prod(out[:e])``):
    then every chunk of one is a chunk of the other.
    """
    mapping = {}
    for d, size in enumerate(in_shape):
        if size <= 1:
            continue
        outer = math.prod(in_shape[:d])
        for e, out_size in enumerate(out_shape):
            if out_size > 1 and math.prod(out_shape[:e]) == outer:
                mapping[d] = e
                break
    return mapping


@register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
)
def reshape_rule(node: fx.Node) -> list[Row]:
    x, out = val(node.args[0]), val(node)
    if node.target is aten.expand.default:
        offset = out.ndim - x.ndim
        mapping = {d: d + offset for d in range(x.ndim) if x.shape[d] == out.shape[d + offset] > 1}
    else:
        mapping = reshape_dim_map(tuple(x.shape), tuple(out.shape))
    if node.target in (aten.squeeze.dim, aten.squeeze.dims):
        named = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        for d in named:  # a named dim of size > 1 stays, but a rank's piece of size 1 would be squeezed
            mapping.pop(d % max(x.ndim, 1), None)
    if x.numel() == 0:
        mapping = {}  # sizes do not tell which dims of an empty tensor match
    rows: list[Row] = [((R,), (R,))]
    if node.target is not aten.expand.default:
        rows.append(((P,), (P,)))  # a reshape of partial sums is a partial sum
    rows += [((S(e),), (S(d),)) for d, e in mapping.items()]  # the split follows the data
    return rows


@register(aten.repeat.default)
def repeat_rule(node: fx.Node) -> list[Row]:
    """``repeat(x, repeats)``: ``x`` tiled ``repeats[d]`` times along each dim (new dims first).
    A dim repeated once splits with the output's; a tiled dim stays whole."""
    x, repeats = val(node.args[0]), list(node.args[1])
    lead = len(repeats) - x.ndim
    rows: list[Row] = [((R,), (R,))]
    if x.is_floating_point():
        rows.append(((P,), (P,)))  # tiling partial sums tiles their sum
    rows += [((S(lead + d),), (S(d),)) for d in range(x.ndim) if repeats[lead + d] == 1 and x.shape[d] > 1]
    return rows


@register(aten.t.default, aten.transpose.int, aten.permute.default)
def permute_rule(node: fx.Node) -> list[Row]:
    x = val(node.args[0])
    if node.target is aten.permute.default:
        order = [d % x.ndim for d in node.args[1]]
    else:
        order = list(range(x.ndim))
        if x.ndim >= 2:
            d0, d1 = (0, 1) if node.target is aten.t.default else (node.args[1] % x.ndim, node.args[2] % x.ndim)
            order[d0], order[d1] = order[d1], order[d0]
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]
    rows += [((S(e),), (S(d),)) for e, d in enumerate(order)]  # output dim e is input dim order[e]
    return rows


@register(aten.split.Tensor, aten.split_with_sizes.default)
def split_rule(node: fx.Node) -> list[Row]:
    x, outs = val(node.args[0]), val(node)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % x.ndim
    n = len(outs)
    rows: list[Row] = [((R,) * n, (R,)), ((P,) * n, (P,))]
    rows += [((S(d),) * n, (S(d),)) for d in range(x.ndim) if d != dim]  # split along another dim
    return rows


@register(aten.cat.default)
def cat_rule(node: fx.Node) -> list[Row]:
    args = [val(a) for a in tensor_args(node)]
    out = val(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.ndim
    k = len(args)
    rows: list[Row] = [((R,), (R,) * k), ((P,), (P,) * k)]
    rows += [((S(d),), (S(d),) * k) for d in range(out.ndim) if d != dim]  # split along another dim
    return rows


@register(prims.broadcast_in_dim.default)
def broadcast_in_dim_rule(node: fx.Node) -> list[Row]:
    """``broadcast_in_dim(x, shape, dims)``: input dim ``i`` becomes output dim ``dims[i]``."""
    x, out = val(node.args[0]), val(node)
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]
    for d, e in enumerate(node.args[2]):
        if x.shape[d] == out.shape[e] > 1:
            rows.append(((S(e),), (S(d),)))  # the split follows the data
    return rows


@register(aten.slice_backward.default)
def slice_backward_rule(node: fx.Node) -> list[Row]:
    """``slice_backward(grad, input_sizes, dim, start, end, step)`` pads ``grad`` with zeros."""
    grad = val(node.args[0])
    dim = node.args[2] % grad.ndim
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]  # zero padding is linear
    rows += [((S(d),), (S(d),)) for d in range(grad.ndim) if d != dim]  # split another dim
    return rows


@register(aten.select_backward.default)
def select_backward_rule(node: fx.Node) -> list[Row]:
    """``select_backward(grad, input_sizes, dim, index)`` puts ``grad`` back at ``index`` of a
    new dim ``dim``, zeros elsewhere."""
    grad = val(node.args[0])
    dim = node.args[2] % (grad.ndim + 1)
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]  # zero padding is linear
    rows += [((S(d if d < dim else d + 1),), (S(d),)) for d in range(grad.ndim)]  # split another dim
    return rows


@register(aten.unbind.int)
def unbind_rule(node: fx.Node) -> list[Row]:
    """``unbind(x, dim)``: the slices of ``x`` along ``dim``."""
    x, outs = val(node.args[0]), val(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % x.ndim
    n = len(outs)
    rows: list[Row] = [((R,) * n, (R,)), ((P,) * n, (P,))]
    rows += [((S(d if d < dim else d - 1),) * n, (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim
    return rows


@register(aten.stack.default)
def stack_rule(node: fx.Node) -> list[Row]:
    """``stack(tensors, dim)``: the tensors along a new dim ``dim``."""
    args = [val(a) for a in tensor_args(node)]
    out = val(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.ndim
    k = len(args)
    rows: list[Row] = [((R,), (R,) * k), ((P,), (P,) * k)]
    rows += [((S(d if d < dim else d + 1),), (S(d),) * k) for d in range(out.ndim - 1)]  # split another dim
    return rows


@register(aten.constant_pad_nd.default)
def constant_pad_rule(node: fx.Node) -> list[Row]:
    """``constant_pad_nd(x, pad, value)``: ``pad`` holds (before, after) pairs from the last dim
    backwards; a negative amount crops."""
    x = val(node.args[0])
    pad = node.args[1]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    padded = {x.ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    rows: list[Row] = [((R,), (R,))]
    if value == 0 and x.is_floating_point():
        rows.append(((P,), (P,)))  # zero padding is linear
    rows += [((S(d),), (S(d),)) for d in range(x.ndim) if d not in padded]  # split a dim that is not padded
    return rows


@register(aten.slice.Tensor, aten.select.int)
def slice_rule(node: fx.Node) -> list[Row]:
    x = val(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else 0) % x.ndim
    drops = node.target is aten.select.int
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]
    for d in range(x.ndim):
        if d != dim:
            rows.append(((S(d - 1 if drops and d > dim else d),), (S(d),)))  # index another dim
    return rows
