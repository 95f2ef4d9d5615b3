"""Sums over dimensions, and histograms (sums of counts)."""

import torch
from autopar.passes.rules import Row, register, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten
prims = torch.ops.prims


def _reduced_dims(node: fx.Node) -> tuple[list[int], bool]:
    x = val(node.args[0])
    if node.target is aten.sum.default:
        return list(range(x.ndim)), False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        dims = list(range(x.ndim))
    keepdim = node.target is aten.sum.dim_IntList and (
        node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    )
    return sorted(d % max(x.ndim, 1) for d in dims), bool(keepdim)


@register(aten.sum.dim_IntList, aten.sum.default, prims.sum.default)
def sum_rule(node: fx.Node) -> list[Row]:
    x = val(node.args[0])
    dims, keepdim = _reduced_dims(node)
    rows: list[Row] = [((R,), (R,)), ((P,), (P,))]  # replicated; partial sums stay partial
    for d in range(x.ndim):
        if d in dims:
            rows.append(((P,), (S(d),)))  # summing over a split dim -> partial sums
        else:
            out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
            rows.append(((S(out_dim),), (S(d),)))  # a kept dim stays split
    return rows


@register(aten.histc.default)
def histc_rule(node: fx.Node) -> list[Row]:
    """``histc(x, bins, min, max)``: counts of ``x``'s values in ``bins`` ranges."""
    x = val(node.args[0])
    return [((R,), (R,))] + [((P,), (S(d),)) for d in range(x.ndim)]  # counting a split dim -> partial counts
