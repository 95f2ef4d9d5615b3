"""Convolutions, forward and backward: split the batch, the output channels or the input
channels.

``convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``
takes ``input[N, C_in, *spatial]`` and ``weight[C_out, C_in / groups, *kernel]``
(``weight[C_in, C_out / groups, *kernel]`` when transposed). Spatial dims are not split: a
piece of an image would need its neighbours' border rows. Channel splits are offered for
ungrouped convolutions only (a grouped one would need its group count made local).
"""

import torch
from autopar.passes.rules import Row, register, register_shape_arg, tensor_args, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten

register_shape_arg(3, aten.convolution_backward.default, output=2)  # bias_sizes: the bias gradient's shape


def _weight_dims(transposed: bool) -> tuple[int, int]:
    """The weight's (output-channel, input-channel) dims."""
    return (1, 0) if transposed else (0, 1)


@register(aten.convolution.default)
def convolution_rule(node: fx.Node) -> list[Row]:
    """``out = convolution(input, weight, bias, ..., transposed, output_padding, groups)``."""
    has_bias = len(tensor_args(node)) == 3
    transposed, groups = node.args[6], node.args[8]
    out_dim, in_dim = _weight_dims(transposed)

    def ins(x, w, b):
        return (x, w, b) if has_bias else (x, w)

    rows: list[Row] = [
        ((R,), ins(R, R, R)),  # whole convolution on every rank
        ((S(0),), ins(S(0), R, R)),  # split the batch: each image is convolved on one rank
        ((P,), ins(P, R, P)),  # partial input and bias, linear in both
        ((P,), ins(R, P, P)),  # partial weight and bias, linear in both
    ]
    if groups == 1:
        rows += [
            ((S(1),), ins(R, S(out_dim), S(0))),  # split the filters -> output channels
            (
                (P,),
                ins(S(1), S(in_dim), P),
            ),  # split the input channels (contracted) -> partial sums; the bias on one rank
        ]
    return rows


@register(aten.convolution_backward.default)
def convolution_backward_rule(node: fx.Node) -> list[Row]:
    """``(grad_input, grad_weight, grad_bias) = convolution_backward(grad_out, input, weight,
    bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask)``;
    an output the mask leaves out is ``None``."""
    transposed, groups = node.args[7], node.args[9]
    out_dim, in_dim = _weight_dims(transposed)
    outs = val(node)

    def out_row(grad_input, grad_weight, grad_bias):
        return tuple(None if o is None else p for o, p in zip(outs, (grad_input, grad_weight, grad_bias)))

    rows: list[Row] = [
        (out_row(R, R, R), (R, R, R)),
        (out_row(S(0), P, P), (S(0), S(0), R)),  # split the batch -> weight and bias gradients are partial sums
        (out_row(P, P, P), (P, R, R)),  # linear in grad_out
    ]
    if groups == 1:
        rows += [
            # split the output channels: grad_input sums over them -> partial sum
            (out_row(P, S(out_dim), S(0)), (S(1), R, S(out_dim))),
            # split the input channels: each rank's part of grad_input and of the weight gradient
            (out_row(S(1), S(in_dim), R), (R, S(1), S(in_dim))),
        ]
    return rows
