"""Tensors made from nothing: constants, ranges, filled tensors."""

import torch
from torch import fx

from autopar.placement import R, S
from autopar.passes.rules import Row, register, val

aten = torch.ops.aten

# op -> position of its shape argument; the rewriter passes the local shape there
SHAPE_ARG = {aten.full.default: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0}


@register(aten.scalar_tensor.default, aten.arange.default, aten.arange.start, aten.arange.start_step)
def constant_rule(node: fx.Node) -> list[Row]:
    return [((R,), ())]  # cheap to make whole on every rank


@register(*SHAPE_ARG)
def filled_rule(node: fx.Node) -> list[Row]:
    out = val(node)
    return [((R,), ())] + [((S(d),), ()) for d in range(out.ndim)]  # make only the local piece
