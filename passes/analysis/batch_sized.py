"""Whether a model's graph on one micro-batch is its graph on the whole batch at the micro-batch's
size: what running each micro-batch through the first graph, as pipeline stages do, needs to
give one device's numbers, beside the samples being computed apart
(:mod:`autopar.passes.propagation.samples`).

A value the model computes from the batch's size (``torch.full((n, 1), float(x.shape[0]))``,
``x * x.shape[0]``, a constant tensor of it) is a number in the graph: the graph of a micro-batch
holds the micro-batch's size where one device's holds the batch's, and every sample would be
computed with the wrong number, silently. The forwards of the two captures are compared node by
node: the same ops in the same order, reading the same nodes, with the same arguments, but for
sizes (arguments the op's schema types ``int`` or ``SymInt``, or lists of them, and an
``arange``'s end), which may be larger in the batch's graph by the ratio of the two batches'
sizes. Numbers elsewhere (a fill's value, a scalar operand, a constant tensor) must be equal.
A size becomes a number where an op reads no sample, only whole values (parameters, fills,
constants), and its result holds fewer elements per element of an operand's in the batch's
graph than in the micro-batch's: a sum of ``ones(x.shape[0])``, a mean or an element of
``arange(x.shape[0])``, a product contracting a dim of the batch's size. Such an op is refused
too; one reading samples keeps them apart or not (:mod:`~autopar.passes.propagation.samples`). The loss is exempt: a
mean's divisor, the count of its values, is the batch's over the micro-batch count, and the
runtime averages the micro-batches' means (:func:`~autopar.passes.analysis.stages.loss_divisor`,
whose other losses :func:`~autopar.passes.propagation.samples.mixing_op` refuses). The nodes only
gradients read are not compared: autograd derives them from the forward (custom backwards are
refused at capture), and their numbers from the forward's sizes (a mean's backward scales by one
over its count).
"""

import functools
import math
import re
from dataclasses import dataclass

import torch
from autopar.passes.analysis.capture import Captured
from torch import fx

from autopar.core.graph import ancestors

_SIZE_TYPE = re.compile(r"\b(SymInt|int)\b")
_SHAPED = tuple(
    getattr(torch.ops.aten, name).default
    for name in ("new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided")
) + tuple(getattr(torch.ops.aten, name).default for name in ("ones_like", "zeros_like", "full_like", "empty_like"))
"""Ops that read their operand's dtype, device and, for the ``_like`` ones, shape, not its values."""
_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


@dataclass(frozen=True)
class Difference:
    """Where the micro-batch's forward differs from the batch's: its ``node``, how (``why``), and
    whether the two run other ops (``ops``) or the same ops on other numbers."""

    node: fx.Node
    why: str
    ops: bool


def batch_sized_value(micro: Captured, whole: Captured, sizes: tuple[int, int]) -> Difference | None:
    """The first node of the forward of ``micro`` (the model captured on part of the batch)
    whose op or arguments differ from those of ``whole`` (captured on the batch) other than as
    the module docstring allows; ``None`` when there is none. ``sizes``: the two captures' batch
    sizes."""
    ours, theirs = _forward(micro), _forward(whole)
    if len(ours) != len(theirs):
        first = next((a for a, b in zip(ours, theirs) if (a.op, a.target) != (b.op, b.target)), ours[-1])
        counts = f"is one of {len(ours)} forward nodes on the micro-batch, {len(theirs)} on the batch"
        return Difference(first, counts, True)
    pair = dict(zip(ours, theirs))
    loss = _loss(micro)
    samples = _samples(micro)
    for node, other in pair.items():
        if (node.op, node.target) != (other.op, other.target):
            return Difference(node, f"is {other.op} {other.target} on the batch", True)
        if node is loss:
            continue
        if node.op == "get_attr":
            why = _constant_differs(_attribute(micro.graph, node.target), _attribute(whole.graph, other.target))
            if why:
                return Difference(node, why, False)
            continue
        for name, ours_arg, theirs_arg, size in _arguments(node, other):
            if not _same(ours_arg, theirs_arg, size, sizes, pair):
                shown = f"takes {name}={_shown(ours_arg)} on the micro-batch and {_shown(theirs_arg)} on the batch"
                return Difference(node, shown, False)
        if isinstance(node.target, torch._ops.OpOverload) and node not in samples and node.target not in _SHAPED:
            read = [_growth(a, pair[a]) for a in node.all_input_nodes]
            if read and _growth(node, other) < max(read):
                return Difference(
                    node, "reduces a value the size of the batch, which reads no sample, over the batch", False
                )
    return None


def _forward(captured: Captured) -> list[fx.Node]:
    """The nodes the forward's results (the loss, other outputs, buffers written back) are
    computed from, in graph order: what autograd did not add."""
    results = captured.graph.graph.output_node().args[0]
    read: set[fx.Node] = set()
    for value, kind in zip(results, captured.outputs):
        if kind is not None and kind.kind != "grad" and isinstance(value, fx.Node) and value not in read:
            read |= ancestors(value)
    return [n for n in captured.graph.graph.nodes if n in read]


def _samples(captured: Captured) -> set[fx.Node]:
    """The nodes computed from the inputs (the samples)."""
    found = {n for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "input"}
    for node in captured.graph.graph.nodes:
        if node not in found and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _growth(node: fx.Node, other: fx.Node) -> float:
    """How many times more elements ``other`` (of the batch's graph) holds than ``node`` (the
    micro-batch's): the most of any of its tensors; 1 for a node holding none."""
    ours, theirs = node.meta.get("val"), other.meta.get("val")
    pairs = (
        zip(ours, theirs) if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)) else [(ours, theirs)]
    )
    ratios = [
        b.numel() / a.numel()
        for a, b in pairs
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.numel()
    ]
    return max(ratios, default=1.0)


def _loss(captured: Captured) -> fx.Node | None:
    outputs = captured.graph.graph.output_node().args[0]
    return next((v for v, k in zip(outputs, captured.outputs) if k and k.kind == "output"), None)


def _arguments(node: fx.Node, other: fx.Node):
    """``(name, node's argument, other's argument, whether the schema types it a size)`` for each
    argument, positional then by keyword."""
    schema = getattr(node.target, "_schema", None)
    arguments = schema.arguments if schema is not None else []
    for i, (a, b) in enumerate(zip(node.args, other.args)):
        formal = arguments[i] if i < len(arguments) else None
        yield (formal.name if formal else str(i)), a, b, _is_size(node, formal)
    if len(node.args) != len(other.args):
        yield "arguments", len(node.args), len(other.args), False
    by_name = {a.name: a for a in arguments}
    for key in sorted(set(node.kwargs) | set(other.kwargs)):
        yield key, node.kwargs.get(key), other.kwargs.get(key), _is_size(node, by_name.get(key))


def _is_size(node: fx.Node, formal) -> bool:
    """Whether ``formal`` types a size of ``node``'s: an ``int`` or ``SymInt`` (or list of
    them), or an ``arange``'s end."""
    if formal is None:
        return False
    return bool(_SIZE_TYPE.search(str(formal.type))) or (node.target in _ARANGES and formal.name == "end")


def _same(a, b, size: bool, sizes: tuple[int, int], pair: dict) -> bool:
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


def _constant_differs(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How two constant tensors of the graphs differ (their values only where both are real)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if type(a) is type(b) else "is a constant of another type on the batch"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"is a constant of shape {tuple(a.shape)} on the micro-batch and {tuple(b.shape)} on the batch"
    fake = torch._subclasses.fake_tensor.is_fake
    if a.device.type == "meta" or b.device.type == "meta" or fake(a) or fake(b):
        return None
    if not (torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))):
        return "is a constant tensor whose values differ on the micro-batch and on the batch"
    return None


def _attribute(module: torch.nn.Module, target: str):
    return functools.reduce(getattr, target.split("."), module)


def _shown(value) -> str:
    return repr(value) if not isinstance(value, fx.Node) else value.name
