"""Whether a model computes each sample of its batch on its own: what cutting the batch into
micro-batches, as pipeline stages do, needs to give one device's loss and gradients.

The forward is walked with every input split along dim 0, the batch (``Shard(0)``), and every
parameter, buffer and constant whole (``Replicate``). Each op takes the sharding rule's row
(:mod:`autopar.passes.rules`) whose inputs are its operands' placements as they are: a rank
holding one micro-batch then computes the op's outputs for that micro-batch without reading any
other sample. Sums over the batch come out ``Partial``: only linear ops may read them, and the
loss must be one, so that the micro-batches' losses add up to the batch's. An op with no such
row (a contrastive loss's products of every sample with every other, batch statistics, a ratio
or product of two sums over the batch, tokens sorted across the batch), a row whose op
all-reduces over the split (:class:`~autopar.passes.rules.SplitOp`), or an op with no rule stops
the walk, and micro-batches are refused. The backward of a forward so computed is too.

A whole value may be read split along a dim only where it holds the same values at every index
of that dim (:func:`_uniform_dims`): a mask, position ids or a class token expanded along the
batch, which the micro-batch's graph makes at its own size with the same values; not ``arange``
over the batch, whose slices differ from what the micro-batch makes, unless it indexes the batch's
dim of a value split along it to pick each sample's own rows (``x[arange(batch), last_token]``, the
pooling of Hugging Face's sequence classifiers: :func:`_per_sample_gather`). A random draw (a dropout
mask drawn whole) counts as such a value: each micro-batch draws its own. The count a mean
cross-entropy divides by, which the runtime sums over the micro-batches and gives every one
whole (:func:`~autopar.passes.analysis.stages.loss_divisor`), must be such a sum.
"""

import operator
from collections.abc import Callable

import torch
from autopar.passes.analysis.batch_sized import Difference, averaged, batch_sized_value
from autopar.passes.analysis.capture import Captured, captured_backward, module_paths
from autopar.passes.analysis.stages import CASTS, DIVISIONS, loss_divisor
from autopar.passes.rules import SplitOp, rule_for, split_op, tensor_args
from torch import fx

from autopar.core.errors import InputError
from autopar.core.placement import P, Placement, R, Shard

aten = torch.ops.aten
_SAME_DIMS = (aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default, aten.slice.Tensor)
"""Ops whose output has its operand's dims, each a copy or a part of the operand's."""
_FILLS = (
    aten.ones.default,
    aten.zeros.default,
    aten.full.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.ones_like.default,
    aten.zeros_like.default,
    aten.full_like.default,
    aten.scalar_tensor.default,
)
"""Ops making a tensor of one value."""


def mixing_op(captured: Captured, divisor: str | None = None) -> tuple[fx.Node, str] | None:
    """The first value of the forward of ``captured`` that is not computed sample by sample, as
    the module docstring says, and why; ``None`` when there is none. ``divisor`` names the node
    of the loss's divisor (:func:`~autopar.passes.analysis.stages.loss_divisor`)."""
    backward = captured_backward(captured)
    kinds = dict(zip(captured.placeholders, captured.inputs))
    batch = _batch(captured)
    placed: dict[fx.Node, tuple[Placement, ...]] = {}
    uniform: dict[fx.Node, frozenset[int]] = {}
    means: set[fx.Node] = set()
    for node in captured.graph.graph.nodes:
        if node in backward or node.op == "output":
            continue
        value = node.meta.get("val")
        if node.op == "placeholder":
            placed[node] = (Shard(0) if kinds[node].kind == "input" else R,)
        elif node.op == "get_attr":
            placed[node] = (R,)
        elif node.target is operator.getitem:
            placed[node] = (placed[node.args[0]][node.args[1]],)
        elif node.op == "call_function":
            operands = tuple(placed[a][0] for a in tensor_args(node))
            count = len(value) if isinstance(value, (list, tuple)) else 1
            if all(p == R for p in operands):
                placed[node] = (R,) * count
                uniform[node] = _uniform_dims(node, uniform)
            elif _per_sample_gather(node, placed, uniform, batch):
                placed[node] = (Shard(0),)
            elif rule_for(node.target) is None:
                return node, "has no sharding rule to show it (add one in passes/rules/)"
            else:
                outs = _local_row(node, operands, batch, uniform)
                if outs is None:
                    return (
                        node,
                        "reads several samples of the batch together, or the rules cannot show that it does not",
                    )
                placed[node] = tuple(R if p is None else p for p in outs)
                if placed[node][0] == P and _is_mean(node, placed, means, batch):
                    means.add(node)
        if node.name == divisor:
            if placed[node][0] != P:
                return node, "divides the loss by something other than a sum over the batch's samples"
            placed[node] = (R,)  # the runtime gives every micro-batch the batch's
        if isinstance(value, torch.Tensor) and node not in uniform:
            uniform[node] = frozenset(d for d, n in enumerate(value.shape) if n == 1)
    loss = next(
        v for v, k in zip(captured.graph.graph.output_node().args[0], captured.outputs) if k and k.kind == "output"
    )
    if placed[loss][0] != P:
        return loss, "is a loss that is no sum over the batch's samples"
    if divisor is None and loss not in means:
        return loss, "is a loss that is no mean over the batch's samples (nor a count-weighted one)"
    return None


def _batch(captured: Captured) -> int:
    """The batch's size: dim 0 of the first input."""
    return next(n.meta["val"].shape[0] for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "input")


_LINEAR = (aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default)
"""Ops that keep a mean over the batch one when every partial sum they read is."""


def _is_mean(node: fx.Node, placed: dict, means: set[fx.Node], batch: int) -> bool:
    """Whether the partial sum ``node`` is a mean over the batch's samples, which the
    micro-batches' means average to: a sum of every element of a tensor split along the batch
    divided by their number, or such means cast, added up, and scaled by numbers that are no
    multiple of the micro-batch's size ``batch`` (``loss * x.shape[0]`` would scale a micro-batch's
    mean by its own size, not the batch's). A plain sum over the batch averaged so would be the
    batch's over the micro-batch count."""
    summed = [a for a in tensor_args(node) if placed[a][0] == P]
    if len(summed) != 1 or summed[0] is not node.args[0]:
        return node.target in _LINEAR and bool(summed) and all(a in means for a in summed)
    source, scalar = node.args[0], node.args[1] if len(node.args) > 1 else None
    if node.target in CASTS or node.target in _LINEAR:
        return source in means
    if node.target not in (*DIVISIONS, aten.mul.Tensor, aten.mul.Scalar) or not isinstance(scalar, (int, float)):
        return False
    if source in means:
        return batch < 2 or scalar % batch != 0
    reduced = averaged(node)
    return reduced is not None and isinstance(placed[reduced][0], Shard)


def _uniform_dims(node: fx.Node, uniform: dict[fx.Node, frozenset[int]]) -> frozenset[int]:
    """The dims along which the whole value of ``node`` (every operand whole) holds the same
    values at every index: every dim of a constant fill; those of size 1; those an expand makes
    from size 1; and those where every operand of an elementwise op, the operand of a copy, a
    slice, a cumulative sum along another dim or a concatenation along another dim, or every index
    tensor reading a dim of an indexed table that varies, holds them so."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return frozenset()
    ones = frozenset(d for d, n in enumerate(value.shape) if n == 1)
    args = tensor_args(node)
    target = node.target

    def of(a: fx.Node, lead: int = 0) -> set[int]:  # ``a``'s uniform dims behind ``lead`` broadcast ones
        shape = a.meta["val"].shape
        return (
            set(range(lead))
            | {d + lead for d in uniform.get(a, ())}
            | {d + lead for d, n in enumerate(shape) if n == 1}
        )

    if target in _FILLS or _drawn(target):  # a draw: a micro-batch's own stands for its slice (its own masks)
        return frozenset(range(value.ndim))
    if target == aten.expand.default:
        lead = value.ndim - args[0].meta["val"].ndim
        return ones | of(args[0], lead)
    if target in _SAME_DIMS:
        return ones | of(args[0])
    if target == aten.unsqueeze.default:
        dim = node.args[1] % value.ndim
        return ones | {d + (d >= dim) for d in of(args[0])}
    if target in (aten.cumsum.default, aten.cat.default) and value.ndim:
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % value.ndim
        return ones | (set.intersection(*(of(a) for a in args)) - {dim})
    if target == aten.embedding.default:  # each row of indices picks a row of the whole table
        return ones | of(args[1])
    if target == aten.index.Tensor and args[0] is node.args[0] and all(i is not None for i in node.args[1]):
        table, indices = node.args[0], node.args[1]
        lead = value.ndim - (table.meta["val"].ndim - len(indices))
        held = set(range(lead))
        for k, index in enumerate(indices):  # an index into a dim the table holds the same reads the same
            if k not in of(table):
                held &= of(index, lead - index.meta["val"].ndim)
        return ones | held | {d + lead - len(indices) for d in of(table) if d >= len(indices)}
    if _elementwise(target) and args:
        return ones | set.intersection(*(of(a, value.ndim - a.meta["val"].ndim) for a in args))
    return ones


def _per_sample_gather(
    node: fx.Node, placed: dict[fx.Node, tuple[Placement, ...]], uniform: dict[fx.Node, frozenset[int]], batch: int
) -> bool:
    """Whether ``node`` picks from each sample of a table split along the batch by that sample's own
    indices: ``table[arange(batch), index, ...]``, each index after the ``arange`` one per sample (split
    along the batch) or the same for every sample, as Hugging Face's sequence classifiers pool each
    sequence's last token. A micro-batch's graph makes the ``arange`` at its own size, so it picks its
    own samples' rows; any other index into the batch's dim (a shifted or reversed ``arange``) does not."""
    if node.target != aten.index.Tensor or batch < 2:
        return False
    table, indices = node.args[0], list(node.args[1])
    if len(indices) < 2 or any(i is None for i in indices) or placed[table][0] != Shard(0):
        return False
    if table.meta["val"].shape[0] != batch or not _counts_to(indices[0], batch):
        return False
    for index in indices[1:]:
        shape = tuple(index.meta["val"].shape)
        if shape not in ((), (1,), (batch,)) or index.meta["val"].dtype not in (torch.int32, torch.int64):
            return False
        if placed[index][0] != Shard(0) and not (placed[index][0] == R and (shape != (batch,) or 0 in uniform[index])):
            return False
    return True


def _counts_to(node: fx.Node, batch: int) -> bool:
    """Whether ``node`` is ``arange(batch)``: 0, 1, ..., batch - 1."""
    args = tuple(node.args)
    counts = (
        (node.target == aten.arange.default and args == (batch,))
        or (node.target == aten.arange.start and args == (0, batch))
        or (node.target == aten.arange.start_step and args in ((0, batch), (0, batch, 1)))
    )
    return counts and tuple(node.meta["val"].shape) == (batch,)


def _drawn(op) -> bool:
    """Whether ``op`` draws random values (a dropout mask drawn whole)."""
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def _elementwise(op) -> bool:
    """Whether ``op`` computes each output element from the operands' elements at its position,
    with no random draw."""
    rule = rule_for(op)
    return rule is not None and rule.__module__.endswith(".pointwise") and not _drawn(op)


def _local_row(
    node: fx.Node, operands: tuple[Placement, ...], batch: int, uniform: dict[fx.Node, frozenset[int]]
) -> tuple[Placement | None, ...] | None:
    """The outputs' placements under the rule's row of ``node`` that takes ``operands`` as they
    are and needs no all-reduce, or ``None``. A whole operand may also be read split along a dim
    of the batch's size that it holds the same at every index of (``uniform``), and an empty one (a
    cache's first ``torch.cat``) as any row reads it; of the rows that do, the one slicing the fewest
    whole operands wins, and none may give a sum over the batch."""
    split = split_op(node.target)
    args = tensor_args(node)
    found = []
    for outs, ins in rule_for(node.target)(node):
        if len(ins) != len(operands):
            continue
        sliced = 0
        for have, need, arg in zip(operands, ins, args):
            if have == need or (have == R and arg.meta["val"].numel() == 0):
                continue  # an empty operand (a cache's first cat) holds no sample: whole or split, it is empty
            if have != R or not isinstance(need, Shard) or need.dim >= arg.meta["val"].ndim:
                break
            if batch < 2 or arg.meta["val"].shape[need.dim] != batch or need.dim not in uniform.get(arg, ()):
                break  # one sample a micro-batch: a dim of the batch's size is one of size 1
            sliced += 1
        else:
            if sliced and any(p == P for p in outs):
                continue
            if split is None or not _reduces_over_split(split, node, outs, ins):
                found.append((sliced, outs))
    return min(found, key=lambda f: f[0])[1] if found else None


def _reduces_over_split(split: SplitOp, node: fx.Node, outs: tuple, ins: tuple) -> bool:
    """Whether the row splits the dim ``split`` reduces or indexes, which all-reduces over it."""
    p = (outs if split.output else ins)[split.index]
    return isinstance(p, Shard) and p.dim == split.dim(node)


def check_samples_apart(
    captured: Captured,
    microbatches: int,
    divisor: tuple | None = None,
    capture_at: Callable[[int], Captured] | None = None,
) -> None:
    """Refuse to cut the batch into ``microbatches`` (more than one) when the forward is not
    shown to compute its samples apart (:func:`mixing_op`; ``divisor`` is
    :func:`~autopar.passes.analysis.stages.loss_divisor`'s), or, given ``capture_at`` (``m`` ->
    the model captured on the first of ``m`` micro-batches), when the micro-batch's graph is not
    the batch's at its size (:func:`~autopar.passes.analysis.batch_sized.batch_sized_value`):
    the micro-batches' losses could differ from the batch's.

    A micro-batch of one sample shows neither: every value in it is one sample's, and torch.export
    drops the ops on dims of one (views, slices), so that its graph loses the batch's dim and is
    not the batch's op for op. The model is then shown to compute its samples apart on two
    samples (``capture_at``; the whole batch if it has fewer than four), and its graph of one sample
    compared with the batch's, or, where they run other ops, its graph of two (a value computed
    from the batch's size only when that is one is not caught there; with fewer than four samples
    there is no graph of two to compare, and the micro-batches are refused). Without ``capture_at``
    (a plan lowered again at another size, checked when it was made) one sample is taken as shown."""
    if microbatches <= 1:
        return
    size = _batch(captured)
    probe = captured
    if size == 1:
        if capture_at is None:
            return
        probe = capture_at(microbatches // 2 if microbatches >= 4 else 1)
        divisor = loss_divisor(probe)
    found = mixing_op(probe, divisor[1] if divisor else None)
    if found is not None:
        node, why = found
        where = module_paths(probe).get(node.name, "")
        raise InputError(
            f"{node.name} ({node.target}{' in ' + where if where else ''}) {why}, so the loss of {microbatches} "
            "micro-batches could differ from the batch's (a contrastive loss over the batch, batch statistics, a "
            "product of means over the batch, tokens sorted across the batch). Fix: Pipeline(microbatches=1), or "
            "compile without pipeline="
        )
    sized = _batch_sized(captured, probe, size * microbatches, capture_at) if capture_at is not None else None
    if sized is not None:
        where = module_paths(captured).get(sized.node.name, "")
        what, fix = (
            (
                "the model runs other ops on a micro-batch than on the batch, so it cannot be shown to compute each "
                "micro-batch as the batch",
                "fewer micro-batches",
            )
            if sized.ops
            else (
                f"the model computes a value from the batch's size, which each of {microbatches} micro-batches "
                "would compute from its own (a fill or a scale of x.shape[0])",
                "compute it from a size other than the batch's",
            )
        )
        raise InputError(
            f"{sized.node.name} ({sized.node.target}{' in ' + where if where else ''}) {sized.why}: {what}. Fix: "
            f"{fix}, Pipeline(microbatches=1), or compile without pipeline="
        )


def _batch_sized(
    captured: Captured, probe: Captured, batch: int, capture_at: Callable[[int], Captured]
) -> Difference | None:
    """:func:`~autopar.passes.analysis.batch_sized.batch_sized_value` of the micro-batch's graph
    against the batch's (of ``batch`` samples), or of ``probe`` (two samples, or the batch
    itself), as :func:`check_samples_apart` says."""
    whole = probe if _batch(probe) == batch else capture_at(1)
    found = batch_sized_value(captured, whole, (_batch(captured), batch))
    if found is None or not found.ops or probe is captured or probe is whole:
        return found
    return batch_sized_value(probe, whole, (_batch(probe), batch))
