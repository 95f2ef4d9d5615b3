"""Whether a model computes each sample of its batch on its own: what cutting the batch into
micro-batches, as pipeline stages do, needs to give one device's loss and gradients.

The forward is walked with every input split along dim 0, the batch (``Shard(0)``), and every
parameter, buffer and constant whole (``Replicate``). Each op takes the sharding rule's row
(:mod:`autopar.passes.rules`) whose inputs are its operands' placements as they are: a rank
holding one micro-batch then computes the op's outputs for that micro-batch without reading any
other sample. Sums over the batch come out ``Partial``: only linear ops may read them, so that
the micro-batches' losses add up to the batch's. An op with no such row (a contrastive loss's
products of every sample with every other, batch statistics, a ratio or product of two sums over
the batch, an expert capacity shared by the batch's tokens), a row whose op all-reduces over the
split (:class:`~autopar.passes.rules.SplitOp`), or an op with no rule stops the walk: it is
named, and micro-batches are refused. The backward of a forward so computed is too, so the walk
stops at the backward. A value the runtime computes from the whole batch instead (the count a
mean cross-entropy divides by, :func:`~autopar.passes.analysis.stages.loss_divisor`) is whole.
"""

import operator

import torch
from autopar.passes.analysis.capture import Captured, captured_backward, module_paths
from autopar.passes.rules import SplitOp, rule_for, split_op, tensor_args
from torch import fx

from autopar.core.errors import InputError
from autopar.core.placement import P, R, Shard


def mixing_op(captured: Captured, whole: frozenset[str] = frozenset()) -> fx.Node | None:
    """The first forward op of ``captured`` that reads more than one sample of the batch to make
    a value, as the module docstring says, or ``None``; ``whole`` names nodes whose value the
    runtime gives whole."""
    backward = captured_backward(captured)
    kinds = dict(zip(captured.placeholders, captured.inputs))
    placed: dict[fx.Node, tuple] = {}
    batch = next((n.meta["val"].shape[0] for n, k in kinds.items() if k.kind == "input" and n.meta["val"].ndim), 0)
    for node in captured.graph.graph.nodes:
        if node in backward:
            continue
        if node.op == "placeholder":
            value = node.meta.get("val")
            batched = kinds[node].kind == "input" and isinstance(value, torch.Tensor) and value.ndim > 0
            placed[node] = (Shard(0) if batched else R,)
        elif node.op == "get_attr":
            placed[node] = (R,)
        elif node.op == "call_function" and node.target is operator.getitem:
            placed[node] = (placed[node.args[0]][node.args[1]],)
        elif node.op == "call_function":
            operands = tuple(placed[a][0] for a in tensor_args(node))
            outputs = node.meta.get("val")
            count = len(outputs) if isinstance(outputs, (list, tuple)) else 1
            if node.name in whole or all(p == R for p in operands):
                placed[node] = (R,) * count
                continue
            outs = _local_row(node, operands, batch)
            if outs is None:
                return node
            placed[node] = tuple(R if p is None else p for p in outs)
        elif node.op == "output":
            for value, kind in zip(node.args[0], captured.outputs):
                if kind is not None and kind.kind == "output" and isinstance(value, fx.Node):
                    if placed[value][0] not in (P, R):
                        return value
    return None


def _local_row(node: fx.Node, operands: tuple, batch: int):
    """The outputs' placements under the rule's row of ``node`` that takes ``operands`` as they
    are and needs no all-reduce, or ``None``. A whole operand may also be read split along a dim
    as long as the batch (``batch``): a value every sample shares, expanded along the batch (a
    causal mask, position ids, a class token), whose slice is what the micro-batch's graph
    makes. Rows reading fewest operands so come first."""
    rule = rule_for(node.target)
    if rule is None:
        return None
    split = split_op(node.target)
    shapes = [a.meta["val"].shape for a in tensor_args(node)]
    found = []
    for outs, ins in rule(node):
        sliced = 0
        for have, need, shape in zip(operands, ins, shapes):
            if have == need:
                continue
            if have != R or not isinstance(need, Shard) or shape[need.dim] != batch:
                break
            sliced += 1
        else:
            if split is None or not _reduces_over_split(split, node, outs, ins):
                found.append((sliced, outs))
    return min(found, key=lambda f: f[0])[1] if found else None


def _reduces_over_split(split: SplitOp, node: fx.Node, outs, ins) -> bool:
    """Whether the row splits the dim ``split`` reduces or indexes, which all-reduces over it."""
    p = (outs if split.output else ins)[split.index]
    return isinstance(p, Shard) and p.dim == split.dim(node)


def check_samples_apart(captured: Captured, microbatches: int, whole: frozenset[str] = frozenset()) -> None:
    """Refuse to cut the batch into ``microbatches`` (more than one) when the model's forward
    mixes its samples (:func:`mixing_op`): the micro-batches' losses would not add up to the
    batch's."""
    if microbatches <= 1:
        return
    node = mixing_op(captured, whole)
    if node is None:
        return
    where = module_paths(captured).get(node.name, "")
    raise InputError(
        f"{node.name} ({node.target}{' in ' + where if where else ''}) reads several samples of the batch together, "
        f"or autopar cannot show that it does not, so the loss of {microbatches} micro-batches could differ from the "
        "batch's (a contrastive loss over the batch, batch statistics, a product of means over the batch, tokens "
        "sorted across the batch). Fix: Pipeline(microbatches=1), or compile without pipeline="
    )
