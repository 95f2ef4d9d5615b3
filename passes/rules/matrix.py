"""Matrix multiplications: mm, addmm, bmm, baddbmm."""

import torch
from autopar.passes.rules import Row, register, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


@register(aten.mm.default)
def mm_rule(node: fx.Node) -> list[Row]:
    """``a[M, K] @ b[K, N]``."""
    return [
        ((R,), (R, R)),  # whole matmul on every rank
        ((S(0),), (S(0), R)),  # split rows of a -> rows of the result
        ((S(1),), (R, S(1))),  # split columns of b -> columns of the result
        ((P,), (S(1), S(0))),  # split the contracting dim -> partial sums
        ((P,), (P, R)),  # partial a, linear in a
        ((P,), (R, P)),  # partial b, linear in b
    ]


@register(aten.addmm.default)
def addmm_rule(node: fx.Node) -> list[Row]:
    """``bias + a[M, K] @ b[K, N]``; ``bias`` is ``[N]`` or ``[M, N]``."""
    bias_is_row = val(node.args[0]).ndim < 2
    return [
        ((R,), (R, R, R)),
        ((S(0),), (R if bias_is_row else S(0), S(0), R)),  # split rows of a
        ((S(1),), (S(0) if bias_is_row else S(1), R, S(1))),  # split columns of b and the bias
        ((P,), (P, S(1), S(0))),  # split the contracting dim; the bias is added on one rank only
        ((P,), (P, P, R)),  # partial a and bias
        ((P,), (P, R, P)),  # partial b and bias
    ]


@register(aten.bmm.default)
def bmm_rule(node: fx.Node) -> list[Row]:
    """``a[B, M, K] @ b[B, K, N]``."""
    return [
        ((R,), (R, R)),
        ((S(0),), (S(0), S(0))),  # split the batch
        ((S(1),), (S(1), R)),  # split rows of a
        ((S(2),), (R, S(2))),  # split columns of b
        ((P,), (S(2), S(1))),  # split the contracting dim -> partial sums
        ((P,), (P, R)),
        ((P,), (R, P)),
    ]


@register(aten.baddbmm.default)
def baddbmm_rule(node: fx.Node) -> list[Row]:
    """``beta · x + alpha · a[B, M, K] @ b[B, K, N]``, ``x`` broadcast to ``[B, M, N]`` (BLOOM's
    ALiBi bias added to the attention scores)."""
    x, out = val(node.args[0]), val(node)

    def along(d: int):  # x's placement for output dim d split: its own dim, or whole where broadcast
        e = d - (out.ndim - x.ndim)
        return R if e < 0 or (x.shape[e] == 1 and out.shape[d] != 1) else S(e)

    return [
        ((R,), (R, R, R)),
        ((S(0),), (along(0), S(0), S(0))),  # split the batch
        ((S(1),), (along(1), S(1), R)),  # split rows of a
        ((S(2),), (along(2), R, S(2))),  # split columns of b
        ((P,), (P, S(2), S(1))),  # split the contracting dim; x is added on one rank only
        ((P,), (P, P, R)),  # partial a and x
        ((P,), (P, R, P)),  # partial b and x
    ]
