"""Scans along a dim: cumulative sums."""

import torch
from autopar.passes.rules import Row, register, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


@register(aten.cumsum.default)
def cumsum_rule(node: fx.Node) -> list[Row]:
    """``cumsum(x, dim)``; a running sum is linear in ``x``."""
    x = val(node.args[0])
    dim = node.args[1] % max(x.ndim, 1)  # a 0-d tensor takes dim 0 or -1
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]  # whole scan; partial sums scan into partial sums
    rows += [((S(d),), (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim: independent scans
    return rows
