"""Sharding rules: for each aten operator, the placements it can run under on ONE mesh axis.

A rule is a pure function of a node's tensor metadata (``node.meta["val"]`` of the node and of
its arguments) returning rows. A row is ``(outs, ins)``: one placement per output of the op
(``None`` for outputs that are not tensors) and one per tensor argument, in the order of
:func:`tensor_args`. Every row means "if the arguments arrive with these placements on this axis,
running the op on the local pieces yields outputs with these placements". The propagation pass
expands the rows to N-D meshes and drops layouts that do not divide evenly.

Most rows mean that each rank runs the op itself on its pieces. A row that splits a dim the op
reduces or indexes (the vocabulary of an embedding table or of a cross-entropy's logits) needs
more: the rank's piece does not hold every entry the op reads. Such ops register a
:class:`SplitOp` beside their rule: how a rank computes them from its piece, the offset of that
piece and all-reduces over the mesh axes that split the dim.

Rule modules, one per op family, register themselves on import; registering an op twice raises.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from autopar.core.placement import Placement, Placements, Shard
from autopar.core.strategy import Strategy

Row = tuple[tuple[Placement | None, ...], tuple[Placement, ...]]
Rule = Callable[[fx.Node], list[Row]]

ReduceOp = Literal["sum", "max"]
"""How a :class:`SplitOp`'s all-reduce combines the ranks' pieces (the functional collectives'
name of the reduction)."""

_RULES: dict[object, Rule] = {}
_SHAPE_ARGS: dict[object, tuple[int, int]] = {}
_BATCH_ARGS: dict[object, tuple[int, int]] = {}
_SPLIT_OPS: dict[object, "SplitOp"] = {}
_ARG_LAYOUTS: dict[object, Callable[[list], list]] = {}


class Split(Protocol):
    """What a rank knows, inside a :class:`SplitOp`, about the axes that split the op's dim."""

    offset: int
    """Where the rank's piece of the dim starts in the whole dim."""
    size: int
    """The length of the rank's piece."""

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """``t`` reduced (``"sum"`` or ``"max"``) over the ranks that hold the other pieces."""


@dataclass(frozen=True, slots=True)
class SplitOp:
    """How a rank computes an op under a row that splits dim ``dim(node)`` of one of its tensors:
    tensor argument ``index`` (in :func:`tensor_args` order), or output ``index`` when ``output``."""

    index: int
    output: bool
    dim: Callable[[fx.Node], int]
    run: Callable[[fx.Node, list, dict, Split], object]
    """``run(node, args, kwargs, split)``: the op's local result from local arguments."""
    reduces: tuple[ReduceOp, ...] = ()
    """The all-reduces ``run`` makes, in order, each on a tensor of the split tensor's shape with
    the dims ``reduced_dims`` reduced to 1 (in float32 at least)."""
    reduced_dims: Callable[[fx.Node], tuple[int, ...]] | None = None
    """The dims each all-reduce's tensor lacks (reduced to 1); ``None``: the split dim alone."""

    def value(self, node: fx.Node) -> torch.Tensor:
        """The split tensor, whole."""
        if self.output:
            out = val(node)
            return out[self.index] if isinstance(out, (list, tuple)) else out
        return val(tensor_args(node)[self.index])

    def axes(self, node: fx.Node, strategy: Strategy) -> tuple[int, ...]:
        """The mesh axes that split the dim under ``strategy``, outer first; none: the op runs
        as itself."""
        dim = self.dim(node)
        return tuple(a for a, p in enumerate(self.placements(strategy)) if isinstance(p, Shard) and p.dim == dim)

    def placements(self, strategy: Strategy) -> Placements:
        return (strategy.outputs if self.output else strategy.inputs)[self.index]

    def reduced(self, node: fx.Node) -> torch.Tensor:
        """The whole tensor each all-reduce reduces (a meta tensor)."""
        value = self.value(node)
        shape = list(value.shape)
        for d in self.reduced_dims(node) if self.reduced_dims is not None else (self.dim(node),):
            shape[d] = 1
        return torch.empty(shape, dtype=torch.promote_types(value.dtype, torch.float32), device="meta")


def register(*ops) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of every operator in ``ops``: operator objects, or the
    qualified names (``"namespace.op.overload"``) of operators that a library registers with
    torch only once it is imported."""

    def wrap(fn: Rule) -> Rule:
        for op in ops:
            if op in _RULES:
                raise ValueError(f"a sharding rule for {op} is already registered ({_RULES[op].__qualname__})")
            _RULES[op] = fn
        return fn

    return wrap


def register_split(
    *ops,
    index: int,
    dim: Callable[[fx.Node], int],
    output: bool = False,
    reduces: tuple[ReduceOp, ...] = (),
    reduced_dims: Callable[[fx.Node], tuple[int, ...]] | None = None,
) -> Callable:
    """Register the decorated ``run(node, args, kwargs, split)`` as the :class:`SplitOp` of ``ops``."""

    def wrap(run):
        for op in ops:
            if op in _SPLIT_OPS:
                raise ValueError(f"a split computation for {op} is already registered")
            _SPLIT_OPS[op] = SplitOp(index, output, dim, run, reduces, reduced_dims)
        return run

    return wrap


def split_op(op) -> SplitOp | None:
    _load()
    return _SPLIT_OPS.get(op)


def register_shape_arg(position: int, *ops, output: int = 0) -> None:
    """Mark argument ``position`` of ``ops`` as the shape of the op's output ``output``: on a
    rank it becomes that output's local shape."""
    for op in ops:
        _SHAPE_ARGS[op] = (position, output)


def register_batch_arg(position: int, *ops, tensor: int = 0) -> None:
    """Mark argument ``position`` of ``ops`` as the batch size of tensor argument ``tensor`` (its
    dim 0, in :func:`tensor_args` order): on a rank it becomes that tensor's local dim 0 (group
    norm takes its ``N`` so)."""
    for op in ops:
        _BATCH_ARGS[op] = (position, tensor)


def batch_arg(op) -> tuple[int, int] | None:
    """``(argument position, tensor argument index)`` of ``op``'s batch-size argument, if it has one."""
    _load()
    return _BATCH_ARGS.get(op)


def shape_arg(op) -> tuple[int, int] | None:
    """``(argument position, output index)`` of ``op``'s output-shape argument, if it has one."""
    _load()
    return _SHAPE_ARGS.get(op)


def register_arg_layout(*ops) -> Callable:
    """Register the decorated ``fix(args) -> args``: an op's positional arguments on a rank,
    given the memory layouts its kernel needs. A piece moved between ranks or copied back from
    host memory comes contiguous, whatever layout the op that made it gave it."""

    def wrap(fix):
        for op in ops:
            if op in _ARG_LAYOUTS:
                raise ValueError(f"argument layouts for {op} are already registered")
            _ARG_LAYOUTS[op] = fix
        return fix

    return wrap


def arg_layout(op) -> Callable[[list], list] | None:
    """The argument-layout fix of ``op`` (:func:`register_arg_layout`), if it has one."""
    _load()
    return _ARG_LAYOUTS.get(op)


def rule_for(op) -> Rule | None:
    """The rule of ``op``; pointwise-tagged aten ops without their own rule get the generic
    pointwise rule."""
    _load()
    found = _RULES.get(op) or _RULES.get(str(op))
    if found is None and isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        from autopar.passes.rules.pointwise import pointwise_rule

        return pointwise_rule
    return found


def carries(op) -> bool:
    """Whether ``op``'s rule is an elementwise or a view rule: the op moves or combines values
    position by position, so a split it maps from an operand to its output is carried along,
    not computed on (:mod:`autopar.passes.propagation.transit`)."""
    rule = rule_for(op)
    return rule is not None and rule.__module__.rsplit(".", 1)[-1] in ("pointwise", "view")


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
            attention,
            batch_norm,
            conv,
            factory,
            grouped,
            indexing,
            matrix,
            metadata,
            norm,
            pointwise,
            pool,
            reduction,
            scan,
            scatter,
            sorting,
            view,
        )
