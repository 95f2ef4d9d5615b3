"""Batch norm in training, forward and backward, as one op each: split the channels, or the
batch.

A channel's statistics are over every dim but the channels, so a channel split normalises
locally. A batch split needs the whole batch's statistics: each rank sums its piece, and the
sums are all-reduced over the axes that split the batch (the forward's mean, then its
variance about that mean; the backward's two sums of the gradient), as synchronised batch
norm does. Kept whole, the op is one node of the graph instead of the twenty-odd its
decomposition makes, each a tensor the planner would lay out and move.
"""

import torch
from autopar.passes.rules import Row, Split, register, register_split, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten

_FORWARD = aten._native_batch_norm_legit_functional.default
_BACKWARD = aten.native_batch_norm_backward.default


def _roles(node: fx.Node, activations: tuple[int, ...]) -> list[bool]:
    """For each tensor argument, in order, whether it is an activation (``[N, C, ...]``,
    at argument positions ``activations``) rather than a per-channel vector."""
    return [
        i in activations
        for i, a in enumerate(node.args)
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


def _row(roles: list[bool], activation, vector) -> tuple:
    return tuple(activation if is_activation else vector for is_activation in roles)


@register(_FORWARD)
def batch_norm_rule(node: fx.Node) -> list[Row]:
    """``(out, mean, rstd, new_running_mean, new_running_var) =
    _native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training,
    momentum, eps)``."""
    roles = _roles(node, (0,))
    rows: list[Row] = [
        ((R,) * 5, _row(roles, R, R)),  # whole on every rank
        ((S(1),) + (S(0),) * 4, _row(roles, S(1), S(0))),  # split the channels: statistics per channel
    ]
    if node.args[5]:  # training: the batch's own statistics
        rows.append(((S(0),) + (R,) * 4, _row(roles, S(0), R)))  # split the batch: _batch_norm_split
    return rows


@register(_BACKWARD)
def batch_norm_backward_rule(node: fx.Node) -> list[Row]:
    """``(grad_x, grad_weight, grad_bias) = native_batch_norm_backward(grad_out, x, weight,
    running_mean, running_var, save_mean, save_invstd, train, eps, output_mask)``; an output
    the mask leaves out is ``None``."""
    roles = _roles(node, (0, 1))
    outs = val(node)

    def out_row(grad_x, grad_affine):
        return tuple(None if o is None else (grad_x if i == 0 else grad_affine) for i, o in enumerate(outs))

    rows: list[Row] = [
        (out_row(R, R), _row(roles, R, R)),
        (out_row(S(1), S(0)), _row(roles, S(1), S(0))),  # split the channels
        (out_row(P, P), (P,) + _row(roles, R, R)[1:]),  # linear in grad_out
    ]
    if node.args[7]:  # train
        rows.append((out_row(S(0), R), _row(roles, S(0), R)))  # split the batch: _batch_norm_backward_split
    return rows


def _not_channels(node: fx.Node) -> tuple[int, ...]:
    """The dims a batch norm's statistics sum over: all but the channels (its first argument,
    the input or the gradient, has the input's shape)."""
    return tuple(d for d in range(val(node.args[0]).ndim) if d != 1)


def _channels(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``[N, C, ...]``."""
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _count(node: fx.Node, x_position: int) -> int:
    whole = val(node.args[x_position])
    return whole.numel() // whole.shape[1]


@register_split(_FORWARD, index=0, dim=lambda node: 0, reduces=("sum", "sum"), reduced_dims=_not_channels)
def _batch_norm_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    x, weight, bias, running_mean, running_var, _, momentum, eps = args
    count, dims = _count(node, 0), list(_not_channels(node))
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = split.all_reduce(wide.sum(dims), "sum") / count
    centred = wide - _channels(mean, x.ndim)
    var = split.all_reduce((centred * centred).sum(dims), "sum") / count
    rstd = torch.rsqrt(var + eps)
    out = centred * _channels(rstd, x.ndim)
    if weight is not None:
        out = out * _channels(weight, x.ndim)
    if bias is not None:
        out = out + _channels(bias, x.ndim)
    new_mean = momentum * mean + (1 - momentum) * running_mean
    new_var = momentum * var * (count / (count - 1)) + (1 - momentum) * running_var
    return out.to(x.dtype), mean, rstd, new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)


@register_split(_BACKWARD, index=1, dim=lambda node: 0, reduces=("sum", "sum"), reduced_dims=_not_channels)
def _batch_norm_backward_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    """``grad_x = w · rstd · (g − Σg / n − x̂ · Σ(g · x̂) / n)``, ``grad_weight = Σ(g · x̂)``,
    ``grad_bias = Σg``, the sums over the whole batch."""
    grad, x, weight, _, _, mean, rstd, _, _, mask = args
    count, dims = _count(node, 1), list(_not_channels(node))
    wide = torch.promote_types(x.dtype, torch.float32)
    g = grad.to(wide)
    normalised = (x.to(wide) - _channels(mean, x.ndim)) * _channels(rstd, x.ndim)
    sum_g = split.all_reduce(g.sum(dims), "sum")
    sum_gx = split.all_reduce((g * normalised).sum(dims), "sum")
    scale = rstd if weight is None else rstd * weight
    grad_x = _channels(scale, x.ndim) * (
        g - _channels(sum_g / count, x.ndim) - normalised * _channels(sum_gx / count, x.ndim)
    )
    affine_dtype = x.dtype if weight is None else weight.dtype
    return (
        grad_x.to(x.dtype) if mask[0] else None,
        sum_gx.to(affine_dtype) if mask[1] else None,
        sum_g.to(affine_dtype) if mask[2] else None,
    )
