"""Sharding rules: for each aten operator, the placements it can run under on ONE mesh axis.

A rule is a pure function of a node's tensor metadata (``node.meta["val"]`` of the node and of
its arguments) returning rows. A row is ``(outs, ins)``: one placement per output of the op
(``None`` for outputs that are not tensors) and one per tensor argument, in the order of
:func:`tensor_args`. Every row means "if the arguments arrive with these placements on this axis,
running the op on the local pieces yields outputs with these placements". The propagation pass
expands the rows to N-D meshes and drops layouts that do not divide evenly.

Rule modules, one per op family, register themselves on import; registering an op twice raises.
"""

from collections.abc import Callable

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from autopar.placement import Placement

Row = tuple[tuple[Placement | None, ...], tuple[Placement, ...]]
Rule = Callable[[fx.Node], list[Row]]

_RULES: dict[object, Rule] = {}
_SHAPE_ARGS: dict[object, tuple[int, int]] = {}


def register(*ops) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of every operator in ``ops``."""

    def wrap(fn: Rule) -> Rule:
        for op in ops:
            if op in _RULES:
                raise ValueError(f"a sharding rule for {op} is already registered ({_RULES[op].__qualname__})")
            _RULES[op] = fn
        return fn

    return wrap


def register_shape_arg(position: int, *ops, output: int = 0) -> None:
    """Mark argument ``position`` of ``ops`` as the shape of the op's output ``output``: on a
    rank it becomes that output's local shape."""
    for op in ops:
        _SHAPE_ARGS[op] = (position, output)


def shape_arg(op) -> tuple[int, int] | None:
    """``(argument position, output index)`` of ``op``'s output-shape argument, if it has one."""
    _load()
    return _SHAPE_ARGS.get(op)


def rule_for(op) -> Rule | None:
    """The rule of ``op``; pointwise-tagged aten ops without their own rule get the generic
    pointwise rule."""
    _load()
    found = _RULES.get(op)
    if found is None and isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        from autopar.passes.rules.pointwise import pointwise_rule

        return pointwise_rule
    return found


def registered_ops() -> list[object]:
    _load()
    return list(_RULES)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's arguments that are tensors, flattened in (args, kwargs) order."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from autopar.passes.rules import (  # noqa: F401  (modules register their rules on import)
            attention, conv, factory, indexing, matrix, metadata, norm, pointwise, pool, reduction, scan,
            sorting, view,
        )
