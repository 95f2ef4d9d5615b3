"""Pointwise operators, with broadcasting, and the arguments they are linear in."""

from typing import Literal

import torch
from autopar.passes.rules import Row, register, tensor_args, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten
prims = torch.ops.prims

Linear = Literal["all", "one"]
"""Which tensor arguments of an op may carry a partial sum: every one together (sums add up), or
exactly one of them."""

_ACTIVATION_BACKWARDS = (
    aten.softplus_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.mish_backward.default,
)
"""Gradients of activations, ``grad · f'(x)`` elementwise (linear in ``grad``), that torch
does not tag pointwise."""

# op -> which tensor arguments may carry a partial sum (the others must be replicated):
# a :data:`Linear`, or an index set of arguments that must be partial together.
_LINEAR: dict[object, Linear | set[int]] = {
    aten.add.Tensor: "all",
    aten.sub.Tensor: "all",
    aten.mul.Tensor: "one",
    aten.mul.Scalar: "all",
    aten.div.Tensor: {0},
    aten.div.Scalar: "all",
    prims.div.default: {0},
    aten.neg.default: "all",
    aten.threshold_backward.default: {0},
    aten.hardtanh_backward.default: {0},
    aten.gelu_backward.default: {0},
    **dict.fromkeys(_ACTIVATION_BACKWARDS, {0}),
    aten.where.self: {1, 2},
    aten.detach.default: "all",
    aten.clone.default: "all",
    aten.alias.default: "all",
    aten._to_copy.default: "all",
    aten.lift_fresh_copy.default: "all",
}

_IDENTITY = (
    aten.detach.default,
    aten.clone.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.lift_fresh_copy.default,
)


def pointwise_rule(node: fx.Node) -> list[Row]:
    """Elementwise ops: each output dim may be split, taking the matching dim of every argument
    that is not broadcast along it (broadcast arguments stay replicated)."""
    outs = val(node) if isinstance(val(node), (list, tuple)) else [val(node)]
    out = outs[0]  # several outputs (frexp's mantissa and exponent) have one shape
    args = [val(a) for a in tensor_args(node)]
    rows: list[Row] = [((R,), tuple(R for _ in args))]  # every rank computes the whole tensor
    for dim in range(out.ndim):
        ins = []
        for arg in args:
            arg_dim = dim - (out.ndim - arg.ndim)
            broadcast = arg_dim < 0 or (arg.shape[arg_dim] == 1 and out.shape[dim] != 1)
            ins.append(R if broadcast else S(arg_dim))
        rows.append(((S(dim),), tuple(ins)))  # split output dim `dim` and the matching input dims
    rows.extend(_partial_rows(node, len(args)))
    return [((placements[0],) * len(outs), ins) for placements, ins in rows]


def _partial_rows(node: fx.Node, num_args: int) -> list[Row]:
    linear = _LINEAR.get(node.target)
    if linear is None or num_args == 0:
        return []
    if linear == "all":
        if node.target in (aten.add.Tensor, aten.sub.Tensor) and num_args < 2 and node.args[1] != 0:
            return []  # x + scalar is not linear in x, unless the scalar is 0 (Python's sum() starts there)
        return [((P,), tuple(P for _ in range(num_args)))]  # partial sums in, partial sum out
    positions = tensor_positions(node)
    if linear == "one":
        return [((P,), tuple(P if i == k else R for i in range(num_args))) for k in range(num_args)]
    ins = tuple(P if positions[i] in linear else R for i in range(num_args))
    if P not in ins:
        return []
    return [((P,), ins)]  # linear in the partial arguments, the others replicated


def tensor_positions(node: fx.Node) -> list[int]:
    """Positional index of each tensor argument of ``node``."""
    return [
        i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


# elementwise ops that torch does not tag pointwise, ReLU6's backward (MobileNetV2's activation) among them
register(
    *_IDENTITY,
    *_ACTIVATION_BACKWARDS,
    aten.hardswish.default,
    prims.div.default,
    aten.floor_divide.default,
    aten.hardtanh_backward.default,
)(pointwise_rule)


@register(aten.bernoulli.p)
def drawn_whole_rule(node: fx.Node) -> list[Row]:
    """A random draw runs whole on every rank, each drawing what one device draws from the same
    generator state; readers that need a piece slice it locally (dropout's mask)."""
    return [((R,), (R,))]
