"""Normalisations: layer norm and (log-)softmax, forward and backward."""

import torch
from torch import fx

from autopar.placement import P, R, S
from autopar.passes.rules import Row, register, tensor_args, val

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


@register(aten._log_softmax.default, aten._softmax.default)
def softmax_rule(node: fx.Node) -> list[Row]:
    x = val(node.args[0])
    dim = node.args[1] % x.ndim
    return [((R,), (R,))] + [((S(d),), (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim


@register(aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)
def softmax_backward_rule(node: fx.Node) -> list[Row]:
    """``grad_x = _log_softmax_backward_data(grad_out, out, dim, dtype)``."""
    x = val(node.args[1])
    dim = node.args[2] % x.ndim
    rows: list[Row] = [((R,), (R, R)), ((P,), (P, R))]  # linear in grad_out
    rows += [((S(d),), (S(d), S(d))) for d in range(x.ndim) if d != dim]  # split another dim
    return rows
