"""Pooling over the last two (spatial) dims, forward and backward: split any dim before them.

A window never crosses a batch or channel boundary, so batch and channel splits pool locally;
max pooling's indices count positions within one image plane and stay valid on the piece.
Average pooling, and every backward, is linear in its input and gradient: partial sums stay
partial.
"""

import torch
from autopar.passes.rules import Row, register, tensor_args, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


def _outer_dims(node: fx.Node) -> range:
    """The dims before the two pooled ones."""
    return range(val(tensor_args(node)[0]).ndim - 2)


@register(aten.max_pool2d_with_indices.default)
def max_pool_rule(node: fx.Node) -> list[Row]:
    """``(out, indices) = max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)``."""
    rows: list[Row] = [((R, R), (R,))]
    rows += [((S(d), S(d)), (S(d),)) for d in _outer_dims(node)]  # split a batch or channel dim
    return rows


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool_backward_rule(node: fx.Node) -> list[Row]:
    """``grad_x = max_pool2d_with_indices_backward(grad_out, x, kernel, stride, padding,
    dilation, ceil_mode, indices)``: scatters ``grad_out`` to the positions in ``indices``."""
    rows: list[Row] = [((R,), (R, R, R)), ((P,), (P, R, R))]  # linear in grad_out
    rows += [((S(d),), (S(d), S(d), S(d))) for d in _outer_dims(node)]  # split a batch or channel dim
    return rows


@register(aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default)
def avg_pool_rule(node: fx.Node) -> list[Row]:
    """``out = avg_pool2d(x, ...)`` or ``_adaptive_avg_pool2d(x, output_size)``."""
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]  # an average of partial sums is a partial sum
    rows += [((S(d),), (S(d),)) for d in _outer_dims(node)]  # split a batch or channel dim
    return rows


@register(aten.avg_pool2d_backward.default, aten._adaptive_avg_pool2d_backward.default)
def avg_pool_backward_rule(node: fx.Node) -> list[Row]:
    """``grad_x = avg_pool2d_backward(grad_out, x, ...)`` or ``_adaptive_avg_pool2d_backward(grad_out, x)``:
    ``x`` gives only the shape."""
    rows: list[Row] = [((R,), (R, R)), ((P,), (P, R))]  # linear in grad_out
    rows += [((S(d),), (S(d), S(d))) for d in _outer_dims(node)]  # split a batch or channel dim
    return rows
