"""Tensors made from nothing: constants, ranges, filled tensors."""

import torch
from autopar.passes.rules import Row, register, register_shape_arg, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten

_FILLED = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)
register_shape_arg(0, *_FILLED)
register_shape_arg(1, aten.new_zeros.default, aten.new_ones.default)


@register(aten.scalar_tensor.default, aten.arange.default, aten.arange.start, aten.arange.start_step)
def constant_rule(node: fx.Node) -> list[Row]:
    return [((R,), ())]  # cheap to make whole on every rank


@register(*_FILLED)
def filled_rule(node: fx.Node) -> list[Row]:
    out = val(node)
    return [((R,), ())] + [((S(d),), ()) for d in range(out.ndim)]  # make only the local piece


@register(aten.new_zeros.default, aten.new_ones.default)
def new_filled_rule(node: fx.Node) -> list[Row]:
    """``new_zeros(x, size)``, ``new_ones(x, size)``: filled tensors taking only their dtype and
    device from ``x``."""
    x, out = val(node.args[0]), val(node)
    rows: list[Row] = [((R,), (R,))]
    rows += [((S(d),), (R,)) for d in range(out.ndim)]  # make only the local piece
    rows += [((S(d),), (S(d),)) for d in range(min(x.ndim, out.ndim))]  # x split alike: only its dtype is read
    if node.target is aten.new_zeros.default and x.is_floating_point() and out.is_floating_point():
        rows.append(((P,), (P,)))  # zeros are a partial sum of zeros
    return rows
