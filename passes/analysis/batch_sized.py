"""Whether a model's graph on one micro-batch is its graph on the whole batch at the micro-batch's
size: what running each micro-batch through the first graph, as pipeline stages do, needs to
give one device's numbers, beside the samples being computed apart
(:mod:`autopar.passes.propagation.samples`).

A value the model computes from the batch's size (``torch.full((n, 1), float(x.shape[0]))``,
``x * x.shape[0]``, a constant tensor of it, ``x[:, :x.shape[0]]``) is a number in the graph: the
graph of a micro-batch holds the micro-batch's size where one device's holds the batch's, and
every sample would be computed with the wrong number, silently. The forwards of the two captures
are compared node by node: the same ops in the same order, reading the same nodes, with the same
arguments, but for

- sizes: the arguments of a tensor's shape, its pieces or its repeats (``size``, ``shape``,
  ``split_size``, ``repeats``, a slice's or an ``arange``'s ``end``, :data:`SIZE_ARGUMENTS`),
  which may be larger on the batch by the ratio of the batches' sizes, as long as every tensor
  of the forward is, on one dim at most, by exactly that ratio (an ``x[:, :x.shape[0]]`` grows on
  two dims); an index, a count or an offset (``select``'s ``index``, ``topk``'s ``k``, a pad)
  must be equal;
- a mean's count: the divisor of a sum of every element of a tensor, by their number.

Numbers elsewhere (a fill's value, a scalar operand, a constant tensor, a sub-graph's code) must
be equal. A size becomes a number also where an op reads no sample, only whole values
(parameters, fills, constants), and its result holds fewer elements per element of an
operand's on the batch than on the micro-batch: a sum of ``ones(x.shape[0])``, a mean or an
element of ``arange(x.shape[0])``. Such an op is refused too; one reading samples keeps them
apart or not (:mod:`~autopar.passes.propagation.samples`). The nodes only gradients read are not
compared: autograd derives them from the forward (custom backwards are refused at capture), and
their numbers from the forward's sizes (a mean's backward scales by one over its count). Constant
tensors held on the meta device or as fake tensors are compared by shape and dtype only.
"""

import functools
import math
from dataclasses import dataclass

import torch
from autopar.passes.analysis.capture import Captured, backward_nodes
from autopar.passes.analysis.stages import CASTS, DIVISIONS
from torch import fx

aten = torch.ops.aten
SIZE_ARGUMENTS = frozenset({"size", "sizes", "shape", "split_size", "split_sizes", "repeats", "end", "length"})
"""Names of the integer arguments that give a tensor's shape, its pieces or its repeats."""
SUMS = (aten.sum.default, aten.sum.dim_IntList, torch.ops.prims.sum.default)
"""Ops summing a tensor's elements."""
_SHAPED = (
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.ones_like.default,
    aten.zeros_like.default,
    aten.full_like.default,
    aten.empty_like.default,
)
"""Ops that read their operand's dtype, device and, for the ``_like`` ones, shape, not its values."""


@dataclass(frozen=True)
class Difference:
    """Where the micro-batch's forward differs from the batch's: its ``node``, how (``why``), and
    whether the two run other ops (``ops``) or the same ops on other numbers."""

    node: fx.Node
    why: str
    ops: bool


def batch_sized_value(micro: Captured, whole: Captured, sizes: tuple[int, int]) -> Difference | None:
    """The first node of the forward of ``micro`` (the model captured on part of the batch)
    whose op, arguments or shape differ from those of ``whole`` (captured on the batch) other
    than as the module docstring allows; ``None`` when there is none. ``sizes``: the two
    captures' batch sizes."""
    ours, theirs = _forward(micro), _forward(whole)
    if len(ours) != len(theirs):
        first = next((a for a, b in zip(ours, theirs) if (a.op, a.target) != (b.op, b.target)), ours[-1])
        counts = f"is one of {len(ours)} forward nodes on the micro-batch, {len(theirs)} on the batch"
        return Difference(first, counts, True)
    pair = dict(zip(ours, theirs))
    samples = backward_nodes(
        micro.graph.graph, {n for n, k in zip(micro.placeholders, micro.inputs) if k.kind == "input"}
    )
    for node, other in pair.items():
        if (node.op, node.target) != (other.op, other.target):
            return Difference(node, f"is {other.op} {other.target} on the batch", True)
        if node.op == "get_attr":
            why = _constant_differs(_attribute(micro.graph, node.target), _attribute(whole.graph, other.target))
            if why:
                return Difference(node, why, False)
            continue
        counted = averaged(node) is not None and averaged(other) is not None
        for i, (name, ours_arg, theirs_arg, size) in enumerate(_arguments(node, other)):
            if counted and i == 1:
                continue
            if not _same(ours_arg, theirs_arg, size, sizes, pair):
                shown = f"takes {name}={_shown(ours_arg)} on the micro-batch and {_shown(theirs_arg)} on the batch"
                return Difference(node, shown, False)
        grown = _growths(node, other, sizes)
        if grown is None:
            return Difference(node, "grows on more than one dim, or not by the ratio of the batches' sizes", False)
        if isinstance(node.target, torch._ops.OpOverload) and node not in samples and node.target not in _SHAPED:
            read = [max(_growths(a, pair[a], sizes) or (1,)) for a in node.all_input_nodes]
            if read and max(grown, default=1) < max(read):
                return Difference(
                    node, "reduces a value the size of the batch, which reads no sample, over the batch", False
                )
    return None


def _forward(captured: Captured) -> list[fx.Node]:
    """The nodes the forward's results (the loss, other outputs, buffers written back) are
    computed from, in graph order: what autograd did not add."""
    results = captured.graph.graph.output_node().args[0]
    read = {
        v for v, k in zip(results, captured.outputs) if k is not None and k.kind != "grad" and isinstance(v, fx.Node)
    }
    for node in reversed(captured.graph.graph.nodes):
        if node in read:
            read.update(node.all_input_nodes)
    return [n for n in captured.graph.graph.nodes if n in read]


def averaged(node: fx.Node) -> fx.Node | None:
    """The tensor whose mean ``node`` is, where it divides a sum of every element of that tensor
    (perhaps cast) by their number."""
    if node.target not in DIVISIONS or len(node.args) < 2 or not isinstance(node.args[1], (int, float)):
        return None
    source = node.args[0]
    while isinstance(source, fx.Node) and source.target in CASTS:  # a sum cast before its division
        source = source.args[0]
    if not isinstance(source, fx.Node) or source.target not in SUMS or source.meta["val"].ndim != 0:
        return None
    reduced = source.args[0]
    return reduced if node.args[1] == reduced.meta["val"].numel() else None


def _arguments(node: fx.Node, other: fx.Node):
    """``(name, node's argument, other's argument, whether it is a size)`` for each argument,
    positional then by keyword."""
    schema = getattr(node.target, "_schema", None)
    arguments = schema.arguments if schema is not None else []
    for i, (a, b) in enumerate(zip(node.args, other.args)):
        formal = arguments[i] if i < len(arguments) else None
        yield (formal.name if formal else str(i)), a, b, formal is not None and formal.name in SIZE_ARGUMENTS
    if len(node.args) != len(other.args):
        yield "arguments", len(node.args), len(other.args), False
    for key in sorted(set(node.kwargs) | set(other.kwargs)):
        yield key, node.kwargs.get(key), other.kwargs.get(key), key in SIZE_ARGUMENTS


def _same(a, b, size: bool, sizes: tuple[int, int], pair: dict) -> bool:
    """Whether argument ``a`` of the micro-batch's node stands for ``b`` of the batch's: the paired
    node, equal numbers (NaN as NaN), or, for a ``size``, an integer larger by the ratio of the
    batches' ``sizes``; lists element by element."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return isinstance(a, fx.Node) and pair.get(a) is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, size, sizes, pair) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            return True
        return size and isinstance(a, int) and isinstance(b, int) and a * sizes[1] == b * sizes[0]
    return type(a) is type(b) and a == b


def _growths(node: fx.Node, other: fx.Node, sizes: tuple[int, int]) -> list[float] | None:
    """How many times more elements each tensor of ``other`` (the batch's) holds than ``node``'s
    (the micro-batch's); ``None`` where one grows on more than one dim or by other than the ratio
    of the batches' ``sizes``."""
    ours, theirs = node.meta.get("val"), other.meta.get("val")
    many = isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple))
    growths = []
    for a, b in zip(ours, theirs) if many else [(ours, theirs)]:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if a.ndim != b.ndim:
            return None
        grown = [(m, n) for m, n in zip(a.shape, b.shape) if m != n]
        if len(grown) > 1 or any(m * sizes[1] != n * sizes[0] for m, n in grown):
            return None
        growths.append(sizes[1] / sizes[0] if grown else 1.0)
    return growths


def _constant_differs(a, b) -> str | None:
    """How two constants of the graphs differ: tensors by shape, dtype and (where both are real)
    values, NaN equal to NaN; sub-graphs by their code."""
    if isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule):
        return None if a.code == b.code else "is a sub-graph whose code differs on the micro-batch and on the batch"
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if type(a) is type(b) else "is a constant of another type on the batch"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"is a constant of shape {tuple(a.shape)} on the micro-batch and {tuple(b.shape)} on the batch"
    fake = torch._subclasses.fake_tensor.is_fake
    if a.device.type == "meta" or b.device.type == "meta" or fake(a) or fake(b):
        return None
    if not (
        torch.equal(a, b)
        or (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()))
    ):
        return "is a constant tensor whose values differ on the micro-batch and on the batch"
    return None


def _attribute(module: torch.nn.Module, target: str):
    """The attribute a ``get_attr`` node reads."""
    return functools.reduce(getattr, target.split("."), module)


def _shown(value) -> str:
    return repr(value) if not isinstance(value, fx.Node) else value.name
