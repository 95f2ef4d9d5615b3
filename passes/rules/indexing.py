"""Embedding lookups, gathers and advanced indexing: split the indices, or a dim they do not index."""

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
    dim = node.args[1] % max(x.ndim, 1)  # a 0-d tensor takes dim 0 or -1
    num_in = 3 if node.target is aten.scatter.src else 2
    rows: list[Row] = [((R,), (R,) * num_in)]
    for d in range(x.ndim):
        if d != dim and x.shape[d] == index.shape[d]:
            rows.append(((S(d),), (S(d),) * num_in))
    if node.target is aten.scatter.src:
        rows.append(((P,), (P, R, P)))  # partial input and source, one index: the result is a partial sum
    return rows


@register(aten.index.Tensor)
def index_rule(node: fx.Node) -> list[Row]:
    """``x[i0, i1, ...]`` with index tensors (``None`` for a whole dim): the index tensors,
    broadcast together to ``m`` dims, pick entries of the dims they index. Those ``m`` dims take
    the place of the indexed dims in the output when these are adjacent, else they come first;
    the dims of ``x`` that are not indexed follow in order."""
    x, out = val(node.args[0]), val(node)
    indices = list(node.args[1])
    indexed = [d for d, i in enumerate(indices) if i is not None]
    index_vals = [val(i) for i in indices if i is not None]
    m = out.ndim - (x.ndim - len(indexed))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    first = indexed[0] if adjacent else 0  # output dim of the first broadcast index dim
    kept = [d for d in range(x.ndim) if d not in indexed]
    k = len(index_vals)
    rows: list[Row] = [((R,), (R,) * (1 + k))]
    if x.is_floating_point():
        rows.append(((P,), (P,) + (R,) * k))  # picking entries is linear in x
    for j, d in enumerate(kept):
        e = (d if d < first else d - len(indexed) + m) if adjacent else m + j
        rows.append(((S(e),), (S(d),) + (R,) * k))  # split a dim that is not indexed
    for b in range(m):
        if out.shape[first + b] > 1:
            ins = tuple(_broadcast_split(i, b - m) for i in index_vals)
            rows.append(((S(first + b),), (R,) + ins))  # split the indices; each rank reads x whole
    return rows


def _broadcast_split(t: torch.Tensor, dim_from_end: int):
    """``t`` split along the broadcast dim ``dim_from_end`` (negative), or whole where ``t`` is
    broadcast along it."""
    d = t.ndim + dim_from_end
    return S(d) if d >= 0 and t.shape[d] > 1 else R
