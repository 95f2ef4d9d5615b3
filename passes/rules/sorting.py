"""Selections by value along a dim: top-k, sort, argmax and argmin."""

import torch
from autopar.passes.rules import Row, register, val
from torch import fx

from autopar.core.placement import R, S

aten = torch.ops.aten


@register(aten.topk.default)
def topk_rule(node: fx.Node) -> list[Row]:
    """``(values, indices) = topk(x, k, dim)``: the ``k`` largest along ``dim``."""
    x = val(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % x.ndim
    rows: list[Row] = [((R, R), (R,))]  # whole selection on every rank
    rows += [((S(d), S(d)), (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim: independent selections
    return rows


@register(aten.sort.default)
def sort_rule(node: fx.Node) -> list[Row]:
    """``(values, indices) = sort(x, dim, descending)``."""
    x = val(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)) % max(x.ndim, 1)
    rows: list[Row] = [((R, R), (R,))]  # whole sort on every rank
    rows += [((S(d), S(d)), (S(d),)) for d in range(x.ndim) if d != dim]  # split another dim: independent sorts
    return rows


@register(aten.argmax.default, aten.argmin.default)
def argmax_rule(node: fx.Node) -> list[Row]:
    """``argmax(x, dim, keepdim)``; without ``dim``, of the flattened tensor."""
    x = val(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rows: list[Row] = [((R,), (R,))]
    if dim is None or x.ndim == 0:
        return rows
    dim %= x.ndim
    rows += [
        ((S(d if keepdim or d < dim else d - 1),), (S(d),)) for d in range(x.ndim) if d != dim
    ]  # split another dim
    return rows
