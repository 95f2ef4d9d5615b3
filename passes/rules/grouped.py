"""Grouped matrix products of mixture-of-experts layers: each expert's weight multiplies the
rows of the tokens routed to it. Hugging Face transformers runs them as its own operator
``transformers.grouped_mm_fallback`` (registered by name: the operator exists once transformers
is imported)."""

from autopar.passes.rules import Row, register
from torch import fx

from autopar.core.placement import P, R, S

GROUPED_MM = "transformers.grouped_mm_fallback.default"
GROUPED_MM_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


@register(GROUPED_MM)
def grouped_mm_rule(node: fx.Node) -> list[Row]:
    """``out[S, O] = grouped_mm(x[S, I], w[E, I, O], offs[E])``: the rows of ``x`` from
    ``offs[e-1]`` to ``offs[e]`` times expert ``e``'s weight. The token dim cannot split: the
    offsets index it whole."""
    return [
        ((R,), (R, R, R)),  # every rank runs every expert
        ((S(1),), (R, S(2), R)),  # split the output features: each rank its columns of every expert
        ((P,), (S(1), S(1), R)),  # split the input features -> partial sums
        ((P,), (P, R, R)),  # linear in x
        ((P,), (R, P, R)),  # linear in w
    ]


@register(GROUPED_MM_BACKWARD)
def grouped_mm_backward_rule(node: fx.Node) -> list[Row]:
    """``(grad_x, grad_w) = grouped_mm_backward(x, w, offs, grad_out)``."""
    return [
        ((R, R), (R, R, R, R)),
        ((P, S(2)), (R, S(2), R, S(1))),  # output features split: grad_x sums over them
        ((S(1), S(1)), (S(1), S(1), R, R)),  # input features split
        ((P, P), (R, R, R, P)),  # linear in grad_out
    ]
