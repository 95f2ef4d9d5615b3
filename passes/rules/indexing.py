"""Embedding lookups, gathers and advanced indexing: split the indices, or a dim they do not index.

An embedding table split along its rows (vocabulary parallel) and a gather or scatter along a
split dim index a dim the rank holds only a piece of: the rank looks up the indices that fall
in its piece and contributes zeros for the others, so the results are partial sums (a scatter
writes only into its piece). This is how a vocabulary-parallel cross-entropy reads the target's
log-probability from logits split along the vocabulary.
"""

import torch
from autopar.passes.rules import Row, Split, register, register_split, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding_rule(node: fx.Node) -> list[Row]:
    """``out[*idx.shape, D] = embedding(weight[V, D], idx)``."""
    idx = val(node.args[1])
    rows: list[Row] = [((R,), (R, R))]
    rows += [((S(d),), (R, S(d))) for d in range(idx.ndim)]  # split the indices
    rows.append(((S(idx.ndim),), (S(1), R)))  # split the embedding dim
    rows.append(((P,), (S(0), R)))  # split the vocabulary: each rank looks up the rows it holds
    return rows


def _local_index(index: torch.Tensor, split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index into the rank's piece of the split dim, whether it falls in the piece)``; an
    index outside the piece points at entry 0."""
    local = index - split.offset
    inside = (local >= 0) & (local < split.size)
    return torch.where(inside, local, 0), inside


@register_split(aten.embedding.default, index=0, dim=lambda node: 0)
def _embedding_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    weight, idx = args[0], args[1]
    local, inside = _local_index(idx, split)
    return aten.embedding.default(weight, local) * inside.unsqueeze(-1).to(weight.dtype)


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(node: fx.Node) -> list[Row]:
    """``grad_weight[V, D] = embedding_dense_backward(grad_out, idx, V, padding_idx, scale)``."""
    idx = val(node.args[1])
    rows: list[Row] = [((R,), (R, R)), ((P,), (P, R))]  # linear in grad_out
    rows += [((P,), (S(d), S(d))) for d in range(idx.ndim)]  # split indices -> partial sums
    rows.append(((S(1),), (S(idx.ndim), R)))  # split the embedding dim
    if not node.args[4]:  # scale_grad_by_freq counts each index over the whole batch
        rows.append(((S(0),), (R, R)))  # split the vocabulary: each rank adds up the rows it holds
    return rows


@register_split(aten.embedding_dense_backward.default, index=0, output=True, dim=lambda node: 0)
def _embedding_backward_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    grad, idx, num_weights, padding_idx, scale_grad_by_freq = args
    local, inside = _local_index(idx, split)
    padding = padding_idx - split.offset if 0 <= padding_idx - split.offset < split.size else -1
    grad = grad * inside.unsqueeze(-1).to(grad.dtype)
    return aten.embedding_dense_backward.default(grad, local, split.size, padding, scale_grad_by_freq)


@register(aten.gather.default, aten.scatter.value, aten.scatter.src, aten.scatter_add.default)
def gather_rule(node: fx.Node) -> list[Row]:
    """``gather(x, dim, index)`` / ``scatter(x, dim, index, value)`` / ``scatter(x, dim, index,
    src)`` / ``scatter_add(x, dim, index, src)``: split a dim other than ``dim`` on the input,
    the index (and a source tensor, where it is as long there) and the output together."""
    x = val(node.args[0])
    index = val(node.args[2])
    dim = _gathered_dim(node)
    with_source = node.target in (aten.scatter.src, aten.scatter_add.default)
    num_in = 3 if with_source else 2
    rows: list[Row] = [((R,), (R,) * num_in)]
    for d in range(x.ndim):
        if d != dim and x.shape[d] == index.shape[d] and (not with_source or val(node.args[3]).shape[d] == x.shape[d]):
            rows.append(((S(d),), (S(d),) * num_in))
    if with_source:
        rows.append(((P,), (P, R, P)))  # partial input and source, one index: the result is a partial sum
    elif node.target is aten.gather.default:
        if x.is_floating_point():
            rows.append(((P,), (S(dim), R)))  # split the gathered dim: each rank reads the entries it holds
    else:
        rows.append(((S(dim),), (S(dim), R)))  # split the scattered dim: each rank writes into its piece
    return rows


def _gathered_dim(node: fx.Node) -> int:
    return node.args[1] % max(val(node.args[0]).ndim, 1)  # a 0-d tensor takes dim 0 or -1


@register_split(aten.gather.default, index=0, dim=_gathered_dim)
def _gather_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    x, dim, index = args
    local, inside = _local_index(index, split)
    return torch.where(inside, aten.gather.default(x, dim, local), 0)


@register_split(aten.scatter.value, index=0, dim=_gathered_dim)
def _scatter_split(node: fx.Node, args: list, kwargs: dict, split: Split):
    x, dim, index, value = args
    local, inside = _local_index(index, split)
    if index.shape[dim] == 1:  # one write per row: an index outside the piece writes back what entry 0 holds
        kept = aten.gather.default(x, dim, local)
        return aten.scatter.src(
            x, dim, local, torch.where(inside, torch.as_tensor(value, dtype=x.dtype, device=x.device), kept)
        )
    written = torch.zeros(x.shape, dtype=torch.int32, device=x.device).scatter_add(dim, local, inside.to(torch.int32))
    return torch.where(written > 0, torch.as_tensor(value, dtype=x.dtype, device=x.device), x)


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
