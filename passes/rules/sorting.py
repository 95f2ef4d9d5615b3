"""Selections by value along a dim: top-k."""

import torch
from torch import fx

from autopar.placement import R, S
from autopar.passes.rules import Row, register, val

aten = torch.ops.aten


@register(aten.topk.default)
def topk_rule(node: fx.Node) -> list[Row]:
    """``(values, indices) = topk(x, k, dim)``: the ``k`` largest along ``dim``."""
    x = val(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % x.ndim
    rows: list[Row] = [((R, R), (R,))]  # whole selection on every rank
    rows += [((S(d), S(d)), (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim: independent selections
    return rows
