"""Ops that write values into a tensor: ``index_put`` (advanced-index assignment and the
gradient of advanced indexing), ``slice_scatter``, ``select_scatter``, ``copy`` and ``fill``
(the functional forms of ``x[:, 1:] = y``, ``x[:, 0] = v`` and ``x.fill_(v)``)."""

import torch
from autopar.passes.rules import Row, register, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


@register(aten.index_put.default)
def index_put_rule(node: fx.Node) -> list[Row]:
    """``index_put(x, indices, values, accumulate)``: ``x[indices] = values`` (``+=`` when
    accumulating). ``indices`` holds one index tensor or ``None`` per leading dim of ``x``;
    with the index tensors on adjacent dims ``k .. k+j``, ``values`` has ``x``'s dims before
    ``k``, then the index tensors' broadcast dims, then ``x``'s dims after ``k+j``."""
    x, indices, values = val(node.args[0]), node.args[1], val(node.args[2])
    accumulate = len(node.args) > 3 and node.args[3]
    given = [i for i, t in enumerate(indices) if t is not None]
    num_index = len(given)
    rows: list[Row] = [((R,), (R,) * (num_index + 2))]  # every rank writes the whole tensor
    if x.is_floating_point():
        rows.append(((P,), (P,) + (R,) * num_index + (P,)))  # linear in x and values together
    if not given or given != list(range(given[0], given[-1] + 1)):
        return rows  # index tensors apart: values put their broadcast dims first; whole only
    first = given[0]
    index_shape = torch.broadcast_shapes(*(val(indices[i]).shape for i in given))
    expected = (*x.shape[:first], *index_shape, *x.shape[first + num_index :])
    if tuple(values.shape) != expected:
        return rows  # values broadcast into place: whole only
    for d in range(x.ndim):
        if first <= d < first + num_index:
            continue
        vd = d if d < first else d - num_index + len(index_shape)
        rows.append(((S(d),), (S(d),) + (R,) * num_index + (S(vd),)))  # split a dim nothing indexes
    if accumulate and x.is_floating_point() and all(val(indices[i]).shape == index_shape for i in given):
        for d in range(len(index_shape)):  # split the positions written: each rank adds its share
            rows.append(((P,), (P,) + (S(d),) * num_index + (S(first + d),)))
    return rows


@register(aten.slice_scatter.default)
def slice_scatter_rule(node: fx.Node) -> list[Row]:
    """``slice_scatter(x, src, dim, start, end, step)``: ``x`` with ``src`` written into a slice of ``dim``."""
    x = val(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % x.ndim
    rows: list[Row] = [((R,), (R, R))]
    if x.is_floating_point():
        rows.append(((P,), (P, P)))  # linear in both together
    rows += [((S(d),), (S(d), S(d))) for d in range(x.ndim) if d != dim]  # split another dim
    return rows


@register(aten.select_scatter.default)
def select_scatter_rule(node: fx.Node) -> list[Row]:
    """``select_scatter(x, src, dim, index)``: ``x`` with ``src`` written at ``index`` of ``dim``."""
    x = val(node.args[0])
    dim = node.args[2] % x.ndim
    rows: list[Row] = [((R,), (R, R))]
    if x.is_floating_point():
        rows.append(((P,), (P, P)))  # linear in both together
    rows += [((S(d),), (S(d), S(d - 1 if d > dim else d))) for d in range(x.ndim) if d != dim]  # split another dim
    return rows


@register(aten.copy.default)
def copy_rule(node: fx.Node) -> list[Row]:
    """``copy(x, src)``: ``src`` broadcast to ``x``'s shape (``x``'s values are not read)."""
    x, src = val(node.args[0]), val(node.args[1])
    rows: list[Row] = [((R,), (R, R))]
    if src.is_floating_point() and x.is_floating_point():
        rows.append(((P,), (R, P)))  # linear in src
    for d in range(x.ndim):
        sd = d - (x.ndim - src.ndim)
        broadcast = sd < 0 or (src.shape[sd] == 1 and x.shape[d] != 1)
        rows.append(((S(d),), (S(d), R if broadcast else S(sd))))  # split a dim of both
    return rows


@register(aten.fill.Tensor)
def fill_rule(node: fx.Node) -> list[Row]:
    """``fill(x, value)``: ``x``'s shape filled with the 0-dim ``value``."""
    x = val(node.args[0])
    return [((R,), (R, R))] + [((S(d),), (S(d), R)) for d in range(x.ndim)]  # make only the local piece
