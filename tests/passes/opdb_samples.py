"""Rule rows checked on PyTorch's own operator samples (``op_db`` of
``torch.testing._internal.common_methods_invocations``).

Which OpInfos exercise which aten op is found by tracing, not by name: the first float32 CPU
sample of every OpInfo is traced with :func:`make_fx`, forward and backward (``autograd.grad``
of the outputs against random output gradients), and the aten ops in the graph are collected.
For every op with a rule (registered, or pointwise by tag), up to ``INFOS_PER_OP`` OpInfos
that reach it are taken, and up to ``SAMPLES_PER_INFO`` samples of each; every node of their
graphs whose op has a rule gets every row checked by :func:`~tests.passes.rule_check.check_row`.
A few registered ops that no op_db trace reaches get a targeted sample of their own
(:func:`_targeted_samples`). Wrong rows are collected, not raised, so that a failure lists all.

What is skipped, by a stated rule, and counted:

- a sample whose OpInfo does not run in float32 on CPU, or whose call or trace raises;
- a sample whose graph mutates a tensor in place (recorded values would not be the inputs the
  node saw);
- a sample with NaN, infinite or near-overflow (1e30 and up: a stand-in for infinity such as
  the float32 maximum) values anywhere in its graph: NaN is not equal to itself, and summands
  of such values lose the result to overflow and cancellation;
- a node of an op whose output is random or uninitialised (``nondeterministic_seeded`` tag,
  ``empty``, ``empty_like``): no whole-tensor result to compare with;
- a layer norm (forward or backward) over one element: ill-conditioned, see ``LAYER_NORMS``;
- a row whose dims do not split evenly in two, or that asks for a partial sum of integers.
"""

import functools
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from autopar.passes.rules import registered_ops, rule_for, tensor_args
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from tests.passes.rule_check import Recorder, check_row

INFOS_PER_OP = 3
SAMPLES_PER_INFO = 2
aten = torch.ops.aten
UNINITIALISED = {aten.empty.memory_format, aten.empty_like.default}
# op -> position of the normalized shape: over one element, x - mean is rounding noise that the
# backward multiplies by 1/sqrt(eps), so summands of its gradient do not add up to 1e-5
LAYER_NORMS = {aten.native_layer_norm.default: 1, aten.native_layer_norm_backward.default: 2}


@dataclass(kw_only=True, slots=True)
class OpDbReport:
    """What the op_db validation checked and skipped."""

    ops_with_rule: int
    """registered ops (pointwise ops ride on the generic rule and are counted apart)"""
    registered_validated: set = field(default_factory=set)
    """registered ops with at least one row checked on an op_db sample"""
    pointwise_validated: set = field(default_factory=set)
    """pointwise-tagged ops without their own rule, checked through the generic rule"""
    infos_used: int = 0
    samples: int = 0
    nodes: int = 0
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)
    """reason -> count, for samples, nodes and rows"""
    failures: list = field(default_factory=list)
    """one line per wrong row: the OpInfo, the node, the row and what differed"""

    def summary(self) -> str:
        skips = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return (
            f"op_db: {len(self.registered_validated)} of {self.ops_with_rule} registered ops and "
            f"{len(self.pointwise_validated)} pointwise ops validated on {self.samples} samples of "
            f"{self.infos_used} OpInfos: {self.rows} rows on {self.nodes} nodes; skipped: {skips}"
        )


def _traced(info, sample, gen):
    """``(graph, inputs)`` of the sample's call and its backward; raises where either fails."""
    flat, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]

    def call(tensors):
        filled = list(flat)
        for i, t in zip(where, tensors):
            filled[i] = t
        inp, args, kwargs = tree_unflatten(filled, spec)
        return info.op(inp, *args, **kwargs)

    inputs = [flat[i] for i in where]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [o for o in tree_flatten(call(inputs))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = [torch.randn(o.shape, generator=gen) for o in outs]
        wrt = [i for i, t in enumerate(inputs) if t.requires_grad]

        def forward_backward(*tensors):
            tensors = list(tensors)
            result = call(tensors[: len(inputs)])
            diff = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if diff and wrt:
                torch.autograd.grad(diff, [tensors[i] for i in wrt], tensors[len(inputs) :], allow_unused=True)
            return result

        gm = make_fx(forward_backward)(*inputs, *grads)
    return gm, [t.detach() for t in inputs] + grads


def _samples(info, report):
    if not info.supports_dtype(torch.float32, "cpu"):
        report.skipped["OpInfos without float32 on CPU"] += 1
        return []
    try:
        return list(info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd))
    except Exception:  # noqa: BLE001  (any failure of a sample generator is a skip)
        report.skipped["OpInfos whose samples raise"] += 1
        return []


def _graph(info, sample, gen, report):
    try:
        gm, inputs = _traced(info, sample, gen)
    except Exception:  # noqa: BLE001  (any failure of the op or of make_fx is a skip)
        report.skipped["samples whose call or trace raises"] += 1
        return None
    if any(
        n.op == "call_function" and getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
        for n in gm.graph.nodes
    ):
        report.skipped["samples that mutate in place"] += 1
        return None
    return gm, inputs


def _rule_ops(gm) -> set:
    return {
        n.target
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and rule_for(n.target)
    }


def _checked(info, node, values, row, gen, report) -> bool:
    try:
        return check_row(node, values, row, gen)
    except Exception as e:  # noqa: BLE001  (a wrong row: the result differs, or the op rejects the pieces)
        shapes = [tuple(a.meta["val"].shape) for a in tensor_args(node)]
        report.failures.append(f"{info.name}: {node.target} on {shapes}, row {row}: {str(e).splitlines()[0]}")
        return True


def _check_graph(info, gm, inputs, registered, gen, report) -> None:
    recorder = Recorder(gm)
    with torch.no_grad():
        recorder.run(*inputs)
        flat = tree_flatten(list(recorder.values.values()))[0]
        if any(isinstance(v, torch.Tensor) and v.is_floating_point() and not (v.abs() < 1e30).all() for v in flat):
            report.skipped["samples with NaN, infinite or near-overflow values"] += 1
            return
        report.samples += 1
        for node in gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            rule = rule_for(node.target)
            if rule is None:
                continue
            if node.target in UNINITIALISED or torch.Tag.nondeterministic_seeded in node.target.tags:
                report.skipped["nodes with random or uninitialised outputs"] += 1
                continue
            if node.target in LAYER_NORMS and math.prod(node.args[LAYER_NORMS[node.target]]) == 1:
                report.skipped["layer norms over one element"] += 1
                continue
            try:
                rows = rule(node)
            except Exception as e:  # noqa: BLE001  (a rule that raises is a failure, listed with the rest)
                shapes = [tuple(a.meta["val"].shape) for a in tensor_args(node)]
                report.failures.append(f"{info.name}: the rule of {node.target} on {shapes} raises {e!r}")
                continue
            done = [_checked(info, node, recorder.values, row, gen, report) for row in rows]
            report.nodes += 1
            report.rows += sum(done)
            report.skipped["rows that do not split evenly in two"] += done.count(False)
            if any(done):
                (report.registered_validated if node.target in registered else report.pointwise_validated).add(
                    node.target
                )


def _targeted_samples():
    """Registered ops that no op_db sample reaches in a make_fx trace (composite ops it
    decomposes, calls with no tensor argument): ``(op, args)`` called directly."""
    x = torch.randn(4, 1, 6)
    return [
        (aten.alias.default, (x,)),
        (aten.reshape.default, (x, [2, 2, 6])),
        (aten.squeeze.default, (x,)),
        (aten.arange.start, (2, 10)),
    ]


def _direct_graph(op, args):
    """A one-node graph calling ``op`` on ``args``, its nodes carrying their values as meta."""
    graph = torch.fx.Graph()
    flat, spec = tree_flatten(args)
    nodes = []
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            a = graph.placeholder(f"x{i}")
            a.meta["val"] = flat[i]
        nodes.append(a)
    call = graph.call_function(op, tree_unflatten(nodes, spec))
    call.meta["val"] = op(*args)
    graph.output(call)
    return torch.fx.GraphModule({}, graph), [a for a in flat if isinstance(a, torch.Tensor)]


@functools.cache
def validate_op_db() -> OpDbReport:
    """Check every row of every rule reached by op_db samples (cached: two tests read it)."""
    from torch.testing._internal.common_methods_invocations import op_db

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    registered = set(registered_ops())
    report = OpDbReport(ops_with_rule=len(registered))
    first, reaching = {}, {}
    for info in op_db:
        samples = _samples(info, report)
        traced = _graph(info, samples[0], gen, report) if samples else None
        if traced is None:
            continue
        first[info.name] = (info, samples, traced)
        for op in _rule_ops(traced[0]):
            reaching.setdefault(op, []).append(info.name)
    chosen = {name for names in reaching.values() for name in names[:INFOS_PER_OP]}
    for name in sorted(chosen):
        info, samples, traced = first[name]
        report.infos_used += 1
        for i, sample in enumerate(samples[:SAMPLES_PER_INFO]):
            traced = traced if i == 0 else _graph(info, sample, gen, report)
            if traced is not None:
                _check_graph(info, *traced, registered, gen, report)
    for op, args in _targeted_samples():
        _check_graph(_Targeted(str(op)), *_direct_graph(op, args), registered, gen, report)
    return report


@dataclass(frozen=True, slots=True)
class _Targeted:
    name: str
