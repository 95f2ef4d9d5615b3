"""Embedding lookups and gathers: split the indices, or the embedding dim."""

import torch
from torch import fx

from autopar.placement import P, R, S
from autopar.passes.rules import Row, register, val

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding_rule(node: fx.Node) -> list[Row]:
    """``out[*idx.shape, D] = embedding(weight[V, D], idx)``."""
    idx = val(node.args[1])
    rows: list[Row] = [((R,), (R, R))]
    rows += [((S(d),), (R, S(d))) for d in range(idx.ndim)]  # split the indices
    rows.append(((S(idx.ndim),), (S(1), R)))  # split the embedding dim
    return rows


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(node: fx.Node) -> list[Row]:
    """``grad_weight[V, D] = embedding_dense_backward(grad_out, idx, V, padding_idx, scale)``."""
    idx = val(node.args[1])
    rows: list[Row] = [((R,), (R, R)), ((P,), (P, R))]  # linear in grad_out
    rows += [((P,), (S(d), S(d))) for d in range(idx.ndim)]  # split indices -> partial sums
    rows.append(((S(1),), (S(idx.ndim), R)))  # split the embedding dim
    return rows


@register(aten.gather.default, aten.scatter.value, aten.scatter.src)
def gather_rule(node: fx.Node) -> list[Row]:
    """``gather(x, dim, index)`` / ``scatter(x, dim, index, value)``: split a dim other than
    ``dim`` on the input, the index (and a source tensor) and the output together."""
    x = val(node.args[0])
    index = val(node.args[2])
    dim = node.args[1] % x.ndim
    num_in = 3 if node.target is aten.scatter.src else 2
    rows: list[Row] = [((R,), (R,) * num_in)]
    for d in range(x.ndim):
        if d != dim and x.shape[d] == index.shape[d]:
            rows.append(((S(d),), (S(d),) * num_in))
    if node.target is aten.scatter.src:
        rows.append(((P,), (P, R, P)))  # partial input and source, one index: the result is a partial sum
    return rows
