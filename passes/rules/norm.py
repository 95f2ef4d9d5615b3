"""Normalisations: layer norm, group norm and (log-)softmax, forward and backward.

A (log-)softmax can split the dim it normalises (the vocabulary of a language model's logits):
each rank takes the maximum and the sum of exponentials over its piece, all-reduces them over
the axes that split the dim, and normalises its piece; the backward all-reduces one sum.
"""

import torch
from autopar.passes.rules import Row, Split, register, register_batch_arg, register_split, tensor_args, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


@register(aten.native_layer_norm.default)
def layer_norm_rule(node: fx.Node) -> list[Row]:
    """``(out, mean, rstd) = native_layer_norm(x, normalized_shape, weight, bias, eps)``."""
    x = val(node.args[0])
    num_batch_dims = x.ndim - len(node.args[1])
    num_affine = len(tensor_args(node)) - 1
    rows: list[Row] = [((R, R, R), (R,) * (1 + num_affine))]
    for d in range(num_batch_dims):  # split a batch dim; the affine weights stay whole
        rows.append(((S(d), S(d), S(d)), (S(d),) + (R,) * num_affine))
    return rows


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(node: fx.Node) -> list[Row]:
    """``(grad_x, grad_weight, grad_bias) = native_layer_norm_backward(grad_out, x,
    normalized_shape, mean, rstd, weight, bias, output_mask)``."""
    x = val(node.args[1])
    num_batch_dims = x.ndim - len(node.args[2])
    outs = val(node)
    num_affine = len(tensor_args(node)) - 4

    def out_row(grad_x, grad_affine):
        return tuple(None if o is None else (grad_x if i == 0 else grad_affine) for i, o in enumerate(outs))

    rows: list[Row] = [(out_row(R, R), (R,) * (4 + num_affine))]
    for d in range(num_batch_dims):  # split a batch dim -> weight gradients are partial sums
        rows.append((out_row(S(d), P), (S(d),) * 4 + (R,) * num_affine))
    rows.append((out_row(P, P), (P,) + (R,) * (3 + num_affine)))  # linear in grad_out
    return rows


register_batch_arg(3, aten.native_group_norm.default)  # N
register_batch_arg(5, aten.native_group_norm_backward.default)  # N


@register(aten.native_group_norm.default)
def group_norm_rule(node: fx.Node) -> list[Row]:
    """``(out, mean, rstd) = native_group_norm(x, weight, bias, N, C, HxW, group, eps)``, ``mean``
    and ``rstd`` ``[N, group]``: the batch splits (each rank passes its piece's ``N``); the
    affine weights stay whole."""
    num_affine = len(tensor_args(node)) - 1
    return [((R, R, R), (R,) * (1 + num_affine)), ((S(0), S(0), S(0)), (S(0),) + (R,) * num_affine)]


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(node: fx.Node) -> list[Row]:
    """``(grad_x, grad_weight, grad_bias) = native_group_norm_backward(grad_out, x, mean, rstd,
    weight, N, C, HxW, group, output_mask)``: the batch splits, the weight gradients then partial
    sums; linear in ``grad_out``."""
    outs = val(node)
    num_affine = len(tensor_args(node)) - 4

    def out_row(grad_x, grad_affine):
        return tuple(None if o is None else (grad_x if i == 0 else grad_affine) for i, o in enumerate(outs))

    return [
        (out_row(R, R), (R,) * (4 + num_affine)),
        (out_row(S(0), P), (S(0),) * 4 + (R,) * num_affine),
        (out_row(P, P), (P,) + (R,) * (3 + num_affine)),
    ]


@register(aten._log_softmax.default, aten._softmax.default)
def softmax_rule(node: fx.Node) -> list[Row]:
    x = val(node.args[0])
    return [((R,), (R,))] + [((S(d),), (S(d),)) for d in range(x.ndim)]  # the softmax dim too: _softmax_split


@register(aten._safe_softmax.default)
def safe_softmax_rule(node: fx.Node) -> list[Row]:
    """``_safe_softmax(x, dim, dtype)``: a softmax that gives 0 where a row is all ``-inf``."""
    x = val(node.args[0])
    dim = node.args[1] % x.ndim
    return [((R,), (R,))] + [((S(d),), (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim


def _softmax_dim(node: fx.Node) -> int:
    return node.args[1] % val(node.args[0]).ndim


@register_split(aten._log_softmax.default, aten._softmax.default, index=0, dim=_softmax_dim, reduces=("max", "sum"))
def _softmax_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    x, dim, half_to_float = args
    out_dtype = torch.float32 if half_to_float else x.dtype
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    shifted = x - split.all_reduce(x.amax(dim, keepdim=True), "max")
    total = split.all_reduce(shifted.exp().sum(dim, keepdim=True), "sum")
    if node.target is aten._log_softmax.default:
        return (shifted - total.log()).to(out_dtype)
    return (shifted.exp() / total).to(out_dtype)


@register(aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)
def softmax_backward_rule(node: fx.Node) -> list[Row]:
    """``grad_x = _log_softmax_backward_data(grad_out, out, dim, dtype)``."""
    x = val(node.args[1])
    rows: list[Row] = [((R,), (R, R)), ((P,), (P, R))]  # linear in grad_out
    rows += [((S(d),), (S(d), S(d))) for d in range(x.ndim)]  # the softmax dim too: _softmax_backward_split
    return rows


@register_split(
    aten._log_softmax_backward_data.default,
    aten._softmax_backward_data.default,
    index=1,
    dim=lambda node: node.args[2] % val(node.args[1]).ndim,
    reduces=("sum",),
)
def _softmax_backward_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    """``grad_x = grad - exp(out) * sum(grad)`` for log-softmax, ``out * (grad - sum(grad * out))``
    for softmax, the sums over the whole dim."""
    grad, out, dim, input_dtype = args
    wide = torch.promote_types(grad.dtype, torch.float32)
    grad, out = grad.to(wide), out.to(wide)
    if node.target is aten._log_softmax_backward_data.default:
        result = grad - out.exp() * split.all_reduce(grad.sum(dim, keepdim=True), "sum")
    else:
        result = out * (grad - split.all_reduce((grad * out).sum(dim, keepdim=True), "sum"))
    return result.to(input_dtype)
