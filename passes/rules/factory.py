"""Tensors made from nothing: constants, ranges, filled tensors."""

import torch
from torch import fx

from autopar.placement import R, S
from autopar.passes.rules import Row, register, register_shape_arg, val

aten = torch.ops.aten

_FILLED = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)
register_shape_arg(0, *_FILLED)


@register(aten.scalar_tensor.default, aten.arange.default, aten.arange.start, aten.arange.start_step)
def constant_rule(node: fx.Node) -> list[Row]:
    return [((R,), ())]  # cheap to make whole on every rank


@register(*_FILLED)
def filled_rule(node: fx.Node) -> list[Row]:
    out = val(node)
    return [((R,), ())] + [((S(d),), ()) for d in range(out.ndim)]  # make only the local piece
