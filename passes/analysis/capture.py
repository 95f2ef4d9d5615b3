"""Capture a model's training step as one joint forward+backward aten graph on fake tensors.

``torch.export`` traces the module (it copes with Python-level checks that a plain AOT trace
rejects), then AOT autograd builds the joint graph: placeholders for parameters, buffers, user
inputs and the tangents of the outputs; outputs for the new values of buffers the forward
updates in place (batch norm's running statistics), the forward results and the parameters'
gradients. Every node carries its fake value in ``node.meta["val"]``.

Batch norm is decomposed into sums over the batch and spatial dims, so a batch split turns its
statistics into partial sums that the plan all-reduces: batch norm is synchronised across the
ranks that split the batch, and every rank's running statistics stay those of one device.

Models written by others (Hugging Face transformers) return dataclasses: those registered as
pytree nodes (transformers' ``ModelOutput``) are taken as they are, and other dataclasses are
registered on first sight (``torch.export.register_dataclass``), so the parallel model returns
the same type. Every leaf of the output must be a tensor; anything else (a key-value cache) is
refused by its path in the output.
"""

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import logging
import math
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from autopar.passes.analysis.hooks import refuse_backward_hooks, refusing_custom_backwards, warn_of_forward_hooks
from torch import fx
from torch._decomp import get_decompositions
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.core.errors import CaptureError, InputError
from autopar.core.graph import segment_of
from autopar.core.kinds import GraphInputKind, GraphOutputKind

log = logging.getLogger(__name__)

aten = torch.ops.aten


def _var_mean_by_sums(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    """``var_mean`` as two sums over ``dim`` (the mean, then the squared deviations from it):
    split along a reduced dim, each sum becomes a partial sum that one all-reduce makes whole."""
    dims = list(range(x.ndim)) if not dim else sorted(d % x.ndim for d in dim)
    count = math.prod(x.shape[d] for d in dims)
    mean = torch.sum(x, dims, keepdim=True) / count
    centered = x - mean
    var = torch.sum(centered * centered, dims, keepdim=keepdim) / (count - (1 if correction is None else correction))
    return var, (mean if keepdim else mean.squeeze(dims))


def _dropout_drawn_whole(x: torch.Tensor, p: float, train: bool | None):
    """``native_dropout`` as torch's CPU kernel computes it: a mask the shape of ``x`` drawn by
    ``bernoulli`` from the generator, ``x * mask * 1/(1-p)``. The draw is its own node, which
    runs whole on every rank (:func:`autopar.passes.rules.pointwise.drawn_whole_rule`), so each
    rank draws the mask one device draws and keeps its piece."""
    if train is not None and not train:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    kept = 1.0 - p
    mask = aten.bernoulli.p(torch.empty(x.shape, dtype=x.dtype, device=x.device), kept)
    return x * mask * (0.0 if kept == 0 else 1.0 / kept), mask.to(torch.bool)


# Losses, means and batch norm outside training (or without running statistics) are decomposed
# into sums, divisions, gathers and masks so that a batch split turns them into partial sums that
# one all-reduce makes whole; batch norm in training stays one op (passes/rules/batch_norm.py).
_DECOMPOSITIONS = {
    **get_decompositions(
        [
            aten.nll_loss_forward,
            aten.nll_loss_backward,
            aten.mse_loss,
            aten.mse_loss_backward,
            aten.mean.dim,
            aten.mean.default,
            aten._native_batch_norm_legit,
            aten._native_batch_norm_legit_no_training,
        ]
    ),
    aten.var_mean.correction: _var_mean_by_sums,
    aten.native_dropout.default: _dropout_drawn_whole,
}


@dataclass(frozen=True, slots=True)
class InputKind:
    """What a placeholder of the joint graph stands for."""

    kind: GraphInputKind
    """``"param"``, ``"buffer"``, ``"input"`` or ``"tangent"``."""
    name: str
    """Qualified name of a parameter or buffer, the forward argument's name for an input,
    ``"output<i>"`` for the tangent of forward output ``i``, the node of the joint graph for a
    value another pipeline stage sends."""
    value: tuple[str, int] | None = None
    """For a value another stage sends: the op output it is, whose planned placements it
    arrives in."""

    @property
    def is_tangent(self) -> bool:
        """Whether the backward takes it (a tangent, or a gradient another stage sends)."""
        return self.kind in ("tangent", "recv_grad")


@dataclass(frozen=True, slots=True)
class OutputKind:
    """What an output of the joint graph stands for."""

    kind: GraphOutputKind
    """``"output"`` (a forward result), ``"grad"`` (a parameter's gradient) or ``"buffer"`` (the
    new value of a buffer the forward updates in place, written back after each forward)."""
    name: str
    """``"output<i>"``, or the qualified name of the parameter or buffer, or the node of the
    joint graph a pipeline stage sends."""

    @property
    def in_backward(self) -> bool:
        """Whether the backward makes it (a gradient, or a gradient sent to another stage)."""
        return self.kind in ("grad", "send_grad")


@dataclass(frozen=True, slots=True)
class Captured:
    """The joint graph and the meaning of its inputs and outputs."""

    graph: fx.GraphModule
    inputs: tuple[InputKind, ...]
    """One entry per placeholder, in order."""
    outputs: tuple[OutputKind | None, ...]
    """One entry per graph output; ``None`` where the output is unused (inputs' gradients)."""
    out_spec: object
    """Pytree spec that rebuilds the model's return value from the forward outputs."""
    graph_hash: str
    """Fingerprint of :attr:`graph_lines`, used to refuse stale plans."""
    capture_s: float
    """Wall time the capture took."""
    graph_lines: tuple[str, ...] = ()
    """One line per node of the graph (:func:`graph_lines`), whose fingerprint is :attr:`graph_hash`."""

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.graph.nodes if n.op == "placeholder"]

    @property
    def num_forward_outputs(self) -> int:
        return sum(1 for o in self.outputs if o is not None and o.kind == "output")

    @property
    def graded(self) -> frozenset[str]:
        """The parameters whose gradient the graph makes, by name (not the frozen ones)."""
        return frozenset(k.name for k in self.outputs if k is not None and k.kind == "grad")

    @property
    def updated_buffers(self) -> list[str]:
        """The buffers the forward updates in place (batch norm's running statistics), by name."""
        return [k.name for k in self.outputs if k is not None and k.kind == "buffer"]


@torch.enable_grad()
def capture(
    model: torch.nn.Module,
    example_inputs: tuple,
    param_dtype: torch.dtype | None = None,
    keywords: tuple[str, ...] = (),
    fixed: Mapping[str, object] | None = None,
) -> Captured:
    """Trace ``model(*example_inputs)`` into its joint training graph (with gradients on, also
    when called under ``torch.no_grad()``, as a first call in evaluation is). The last
    ``len(keywords)`` inputs are passed by those keywords (``model(input_ids=..., labels=...)``,
    as Hugging Face models are called), and the graph's inputs take their names; ``fixed``
    passes other keyword arguments as they are (``return_loss=True``), traced into the graph.

    With ``param_dtype``, the forward computes with copies of the floating-point parameters
    cast to it (:class:`_Called`): the graph reads the parameters in their own dtype, casts
    them, and their gradients come back in their own dtype through the casts' backward, so that
    gradients are reduced in it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"autopar needs a torch.nn.Module, got {type(model).__name__}")
    bad = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)]
    if bad:
        raise TypeError(
            f"example inputs must be tensors; positions {bad} are not. Bind other arguments "
            "with functools.partial or module attributes before calling autopar"
        )
    names = _input_names(model, len(example_inputs) - len(keywords)) + list(keywords)
    started = time.perf_counter()
    model, example_inputs = _off_meta(model, tuple(example_inputs))
    refuse_backward_hooks(model)
    warn_of_forward_hooks(model)
    hook = model.register_forward_hook(_check_outputs)
    called = param_dtype is not None or keywords or fixed
    traced = _Called(model, param_dtype, keywords, fixed or {}) if called else model
    try:
        with refusing_custom_backwards(model):
            exported = torch.export.export(traced, tuple(example_inputs), strict=False)
        refuse_backward_hooks(model)  # one the forward registered
    except CaptureError:
        raise
    except Exception as exc:  # torch.export raises many unrelated exception types
        raise CaptureError(_capture_message(model, "torch.export", exc, names)) from exc
    finally:
        hook.remove()
    with contextlib.ExitStack() as stack:
        try:
            joint = aot_export_joint_with_descriptors(
                stack, exported.module(), tuple(example_inputs), decompositions=_DECOMPOSITIONS
            )
        except Exception as exc:
            raise CaptureError(_capture_message(model, "AOT autograd", exc, names)) from exc
        graph = joint.graph_module
        out_spec = joint.out_spec
    output_descs = graph.graph.output_node().meta["desc"]
    _refuse_unsupported_mutations(model, output_descs, names)
    inputs = tuple(_input_kind(n.meta["desc"], names) for n in graph.graph.nodes if n.op == "placeholder")
    outputs = tuple(_output_kind(d) for d in output_descs)
    if not any(i.kind == "tangent" for i in inputs):
        raise CaptureError(
            f"{type(model).__name__}'s outputs do not depend on any parameter, so there is no "
            "training step to parallelize; return the loss from forward()"
        )
    inputs, outputs = _merge_tied(graph, inputs, outputs, _tied_names(model))
    _strided_as_views(graph)
    lines = graph_lines(graph)
    captured = Captured(graph, inputs, outputs, out_spec, fingerprint(lines), time.perf_counter() - started, lines)
    log.debug("captured %s: %d nodes", type(model).__name__, len(graph.graph.nodes))
    return captured


class _Called(torch.nn.Module):
    """``model`` called with its last ``len(keywords)`` arguments by those keywords and the
    ``fixed`` keyword arguments, and with a ``dtype``, run on copies of its floating-point
    parameters, and on its floating-point inputs, cast to it. It holds the model's children,
    parameters and buffers under the model's own names (so the graph's inputs keep them) and
    calls the model with the casts in place of the parameters. Batch norm's weight and bias keep
    their dtype, as its running statistics do: its kernel takes an input of lower precision, not
    parameters of another dtype than its statistics (FSDP's policies leave batch norm out too)."""

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype | None,
        keywords: tuple[str, ...] = (),
        fixed: Mapping[str, object] | None = None,
    ):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model._parameters.items():
            self.register_parameter(name, p)
        for name, b in model._buffers.items():
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        object.__setattr__(self, "_model", model)  # not a child: its tensors are this module's own
        self._dtype, self._keywords, self._fixed = dtype, keywords, dict(fixed or {})
        self._kept = {
            f"{path}.{name}" if path else name
            for path, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            for name, _ in module.named_parameters(recurse=False)
        }

    def forward(self, *args):
        by_keyword = len(args) - len(self._keywords)
        if self._dtype is None:
            with self._own_top_level():
                return self._model(*args[:by_keyword], **dict(zip(self._keywords, args[by_keyword:])), **self._fixed)
        # this module's own tensors, which the trace replaces, in place of the model's (whose own
        # table still holds the real ones of its top level: CLIP's logit scale)
        state = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        for name, p in self.named_parameters():
            if p.is_floating_point() and name not in self._kept:
                state[name] = p.to(self._dtype)
        args = tuple(x.to(self._dtype) if x.is_floating_point() else x for x in args)
        keywords = {**dict(zip(self._keywords, args[by_keyword:])), **self._fixed}
        return torch.func.functional_call(self._model, state, args[:by_keyword], keywords)

    @contextlib.contextmanager
    def _own_top_level(self):
        """The model's top-level parameters and buffers read as this module's, which the trace
        replaces (its children are this module's own)."""
        model = self._model
        saved = dict(model._parameters), dict(model._buffers)
        model._parameters.update({name: self._parameters[name] for name in saved[0]})
        model._buffers.update({name: self._buffers[name] for name in saved[1]})
        try:
            yield
        finally:
            model._parameters.update(saved[0])
            model._buffers.update(saved[1])


def _check_outputs(model: torch.nn.Module, args, output) -> None:
    """Forward hook run while ``torch.export`` traces: registers the dataclasses in the output
    as pytree nodes, then refuses every leaf that is not a tensor, naming its path."""
    while True:
        new = {
            type(leaf)
            for leaf in pytree.tree_leaves(output)
            if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)
        }
        if not new:
            break
        for cls in new:
            torch.export.register_dataclass(cls)
    bad = [
        f"output{pytree.keystr(path)} of type {type(leaf).__name__}"
        for path, leaf in pytree.tree_leaves_with_path(output)
        if not isinstance(leaf, torch.Tensor)
    ]
    if bad:
        raise CaptureError(
            f"{type(model).__name__}'s forward() returns values that are not tensors: {'; '.join(bad)}. "
            "autopar returns tensors, in tuples, lists, dicts and dataclasses. Fix: return only "
            "tensors (the loss); a model that returns a key-value cache for generation "
            "(Hugging Face: past_key_values) must have it turned off, with use_cache=False in its "
            "configuration"
        )


def _strided_as_views(graph: fx.GraphModule) -> None:
    """Make ``as_strided`` reads and ``as_strided_scatter`` writes of the whole of a contiguous
    tensor, laid out contiguously, the views they are: ``view(x, size)``, and ``src`` viewed as
    ``x``'s shape. AOT autograd replays views through them (the backward of
    ``adaptive_avg_pool1d`` on a transposed tensor, Swin's pooler), and views have sharding
    rules where raw strides have none."""

    def whole(x: torch.Tensor, size, stride, offset=None) -> bool:
        contiguous = torch.empty(size, device="meta").stride()
        return (
            x.is_contiguous()
            and x.storage_offset() == 0
            and (offset or 0) == 0
            and math.prod(size) == x.numel()
            and all(n == 1 or a == b for n, a, b in zip(size, stride, contiguous))  # a dim of 1 has any stride
        )

    for node in list(graph.graph.nodes):
        if node.kwargs:
            continue
        if node.target is aten.as_strided.default and whole(node.args[0].meta["val"], *node.args[1:]):
            view_of, shape = node.args[0], list(node.args[1])
        elif node.target is aten.as_strided_scatter.default and whole(node.args[0].meta["val"], *node.args[2:]):
            source, target = node.args[1].meta["val"], node.args[0].meta["val"]
            if not source.is_contiguous() or (source.dtype, source.device) != (target.dtype, target.device):
                continue  # a strided copy of another layout, dtype or device
            view_of, shape = node.args[1], list(node.args[0].meta["val"].shape)
        else:
            continue
        with graph.graph.inserting_before(node):
            view = graph.graph.call_function(aten.view.default, (view_of, shape))
        view.meta.update(node.meta)
        node.replace_all_uses_with(view)
        graph.graph.erase_node(node)
    graph.recompile()


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that alias another parameter (a tied output head) → the first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _merge_tied(graph: fx.GraphModule, inputs: tuple, outputs: tuple, tied: dict[str, str]) -> tuple[tuple, tuple]:
    """One placeholder per tied parameter: the graph reads the first name everywhere, and that
    name's gradient is the sum of the gradients of every use, as autograd makes it."""
    if not tied:
        return inputs, outputs
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    by_name = {k.name: n for n, k in zip(placeholders, inputs) if k.kind == "param"}
    output_node = graph.graph.output_node()
    results = list(output_node.args[0])
    grads = {k.name: i for i, k in enumerate(outputs) if k is not None and k.kind == "grad"}
    dropped_outputs = set()
    for alias, name in tied.items():
        if alias not in by_name:
            continue
        by_name[alias].replace_all_uses_with(by_name[name])
        if alias in grads:
            extra = results[grads[alias]]
            dropped_outputs.add(grads[alias])
            if name in grads and isinstance(extra, fx.Node):
                if not isinstance(results[grads[name]], fx.Node):  # every use went through the alias
                    results[grads[name]] = extra
                    continue
                with graph.graph.inserting_before(output_node):
                    total = graph.graph.call_function(torch.ops.aten.add.Tensor, (results[grads[name]], extra))
                total.meta["val"] = extra.meta["val"]
                results[grads[name]] = total
    keep = [i for i in range(len(results)) if i not in dropped_outputs]
    output_node.args = (tuple(results[i] for i in keep),)
    output_node.meta["desc"] = [output_node.meta["desc"][i] for i in keep]
    dropped = {id(by_name[a]) for a in tied if a in by_name}
    kept_inputs = tuple(k for n, k in zip(placeholders, inputs) if id(n) not in dropped)
    for alias in tied:
        if alias in by_name:
            graph.graph.erase_node(by_name[alias])
    graph.graph.set_codegen(fx.graph.CodeGen())  # positional inputs and outputs: the input pytree lost a leaf
    graph.recompile()
    return kept_inputs, tuple(outputs[i] for i in keep)


def _off_meta(model: torch.nn.Module, example_inputs: tuple) -> tuple[torch.nn.Module, tuple]:
    """A model built under ``torch.device("meta")`` (one too big for any single device) is
    traced as a copy on fake CPU tensors of the same shapes: meta tensors have no autograd for
    some ops (the loss), so their joint graph would lack the backward. ``to_empty`` makes each
    module a new parameter, so tied parameters are tied again in the copy."""
    tensors = [*model.parameters(), *model.buffers(), *example_inputs]
    if not any(t.is_meta for t in tensors):
        return model, example_inputs
    fake = copy.deepcopy(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = fake.to_empty(device="cpu")
        inputs = tuple(torch.empty_like(t, device="cpu") if t.is_meta else mode.from_tensor(t) for t in example_inputs)
    for alias, name in _tied_names(model).items():
        owner, _, attr = alias.rpartition(".")
        setattr(fake.get_submodule(owner), attr, fake.get_parameter(name))
    return fake, inputs


def backward_nodes(graph: fx.Graph, tangents: set[fx.Node]) -> set[fx.Node]:
    """The tangent placeholders and every op that depends on them: the backward of a joint
    graph. Everything else can run in the forward."""
    found = set(tangents)
    for node in graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def captured_backward(captured: Captured) -> set[fx.Node]:
    """:func:`backward_nodes` of the captured joint graph."""
    return backward_nodes(
        captured.graph.graph, {n for n, k in zip(captured.placeholders, captured.inputs) if k.is_tangent}
    )


def gradient_values(
    captured: Captured, aliases: dict[str, tuple[str, int]]
) -> list[tuple[str, fx.Node, tuple[str, int]]]:
    """Each gradient output of ``captured`` that is a value of the graph, in output order: its
    parameter's qualified name, its node and the value it is (``aliases``: the graph's getitem
    aliases)."""
    return [
        (kind.name, value, aliases.get(value.name, (value.name, 0)))
        for kind, value in zip(captured.outputs, captured.graph.graph.output_node().args[0])
        if kind is not None and kind.kind == "grad" and isinstance(value, fx.Node)
    ]


def gradients_before_cast(captured: Captured) -> dict[str, torch.dtype]:
    """The values each parameter's gradient is in before the backward casts it to the
    parameter's dtype (under a mixed-precision policy), by node name, with that dtype: from the
    cast's operand back through the one-operand ops (transposes, views, a bias's sum) to the op
    that makes it, as long as nothing else reads them (an activation's gradient that other ops
    read is not this gradient's alone). Reducing one of them across ranks reduces the gradient
    in the compute dtype."""
    found: dict[str, torch.dtype] = {}
    for _, value, _ in gradient_values(captured, {}):
        if not value.all_input_nodes:
            continue
        wanted = value.meta["val"].dtype
        node = value.all_input_nodes[0]
        while (
            node.op == "call_function"
            and isinstance(node.meta.get("val"), torch.Tensor)
            and node.meta["val"].dtype != wanted
            and len(node.users) == 1
        ):
            found[node.name] = wanted
            if len(node.all_input_nodes) != 1:
                break
            node = node.all_input_nodes[0]
    return found


def module_paths(captured: Captured) -> dict[str, str]:
    """The qualified name of the module each op node comes from; backward ops take the module
    of the forward op they differentiate (same autograd sequence number). Gradient additions
    (a value used in several places gets its gradients summed; their sequence number names no
    useful module) take the module of their last operand that has one, the contribution being
    added."""
    paths: dict[str, str] = {}
    by_seq: dict[int, str] = {}
    nodes = [n for n in captured.graph.graph.nodes if n.op == "call_function"]
    for node in nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            paths[node.name] = list(stack.values())[-1][0]
            if "seq_nr" in node.meta:
                by_seq.setdefault(node.meta["seq_nr"], paths[node.name])
    for node in nodes:
        if node.name in paths:
            continue
        if _GRADIENT_ADDITION in node.meta.get("stack_trace", ""):
            operand = next((a.name for a in reversed(node.all_input_nodes) if paths.get(a.name)), None)
            if operand is not None:
                paths[node.name] = paths[operand]
                continue
        if node.meta.get("seq_nr") in by_seq:
            paths[node.name] = by_seq[node.meta["seq_nr"]]
    return paths


def backward_segment_starts(captured: Captured, paths: dict[str, str]) -> dict[str, str]:
    """Per segment of forward ops, its first backward op (an op of the backward whose module,
    :func:`module_paths` ``paths``, is in the segment), in the order the backward reaches the
    segments."""
    graph = captured.graph.graph
    backward = captured_backward(captured)
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    forward = {segment_of(paths.get(n.name, "")) for n in ops if n not in backward}
    starts: dict[str, str] = {}
    for node in ops:
        if node in backward and node.name in paths and segment_of(paths[node.name]) in forward:
            starts.setdefault(segment_of(paths[node.name]), node.name)
    return starts


_GRADIENT_ADDITION = "Gradient addition node"
"""How autograd marks, in a node's stack trace, the sum of a value's gradients from its uses."""


SETTINGS = (type(None), bool, int, float, str)
"""What a call may pass by keyword besides tensors: settings the capture traces into the graph."""


def split_keywords(keywords: Mapping[str, object]) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A call's keyword arguments as its tensors and its settings (:data:`SETTINGS`); any other
    value is refused."""
    tensors = {k: v for k, v in keywords.items() if isinstance(v, torch.Tensor)}
    fixed = {k: v for k, v in keywords.items() if not isinstance(v, torch.Tensor)}
    other = [f"{k} is a {type(v).__name__}" for k, v in fixed.items() if not isinstance(v, SETTINGS)]
    if other:
        raise InputError(
            f"the compiled model takes tensors, and settings (None, bool, int, float, str) by keyword: "
            f"{'; '.join(other)}. Fix: pass each input as a tensor (torch.tensor(...))"
        )
    return tensors, fixed


def keyword_order(model: torch.nn.Module, names) -> tuple[str, ...]:
    """``names`` of ``model.forward``'s arguments in the order the capture takes them: the
    signature's, then by name (one order on every rank, however each call orders its keywords)."""
    order = {name: i for i, name in enumerate(inspect.signature(model.forward).parameters)}
    return tuple(sorted(names, key=lambda name: (order.get(name, len(order)), name)))


def _input_names(model: torch.nn.Module, count: int) -> list[str]:
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return [params[i] if i < len(params) else f"arg{i}" for i in range(count)]


def _input_kind(desc, names: list[str]) -> InputKind:
    if isinstance(desc, ParamAOTInput):
        return InputKind("param", desc.target)
    if isinstance(desc, BufferAOTInput):
        return InputKind("buffer", desc.target)
    if isinstance(desc, PlainAOTInput):
        return InputKind("input", names[desc.idx])
    if isinstance(desc, TangentAOTInput) and isinstance(desc.output, PlainAOTOutput):
        return InputKind("tangent", f"output{desc.output.idx}")
    raise CaptureError(f"unexpected graph input {desc!r}; autopar supports plain tensors, parameters and buffers")


def _output_kind(desc) -> OutputKind | None:
    if isinstance(desc, PlainAOTOutput):
        return OutputKind("output", f"output{desc.idx}")
    if isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, ParamAOTInput):
        return OutputKind("grad", desc.grad_of.target)
    if isinstance(desc, InputMutationAOTOutput) and isinstance(desc.mutated_input, BufferAOTInput):
        return OutputKind("buffer", desc.mutated_input.target)
    return None


def _refuse_unsupported_mutations(model: torch.nn.Module, output_descs, names: list[str]) -> None:
    """In-place updates of buffers are written back after each forward; those of parameters
    and inputs are refused, every one named."""
    refused = []
    for desc in output_descs:
        if not isinstance(desc, InputMutationAOTOutput) or isinstance(desc.mutated_input, BufferAOTInput):
            continue
        mutated = desc.mutated_input
        if isinstance(mutated, ParamAOTInput):
            refused.append(f"parameter {mutated.target}")
        elif isinstance(mutated, PlainAOTInput):
            refused.append(f"input {names[mutated.idx]}")
        else:
            refused.append(repr(mutated))
    if refused:
        raise CaptureError(
            f"{type(model).__name__}'s forward() updates {', '.join(refused)} in place; autopar writes "
            "back in-place updates of buffers only (batch norm's running statistics, counters). "
            "Fix: keep state the forward updates in a buffer (self.register_buffer), and compute "
            "new tensors from inputs and parameters instead of updating them in place "
            "(x = x * 2, not x.mul_(2))"
        )


def _capture_message(model: torch.nn.Module, stage: str, exc: Exception, names: list[str]) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"{stage} could not trace {type(model).__name__}: {type(exc).__name__}: {first}\n"
        f"The example inputs were passed as forward({', '.join(names)}).\n"
        "autopar captures the whole training step as one graph, so forward() must be traceable "
        "by torch.export. Fixes: replace data-dependent Python control flow (an `if` on a tensor "
        "value, .item(), .tolist()) with tensor ops or torch.cond; return tensors (or tuples, "
        "lists, dicts and dataclasses of them) from forward(); pass tensors as inputs, in order or "
        "by keyword (a Hugging Face model's input_ids=, labels=)."
    )


def graph_lines(graph: fx.GraphModule) -> tuple[str, ...]:
    """One line per node saying everything that changes what the program computes: the op,
    every argument (other nodes by name, and the values of dims, scalars, flags, dtypes) and
    the shape, dtype and device type of each value it makes. Devices of models planned on the
    meta device are left out, so that a plan made there serves the real model."""
    return tuple(
        f"{node.name} = {node.op} {node.target}({_describe(node.args)}, {_describe(node.kwargs)}) "
        f"-> {_describe(node.meta.get('val'))}"
        for node in graph.graph.nodes
    )


def fingerprint(lines: tuple[str, ...]) -> str:
    """A short hash of :func:`graph_lines`."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _describe(value) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, torch.Tensor):
        device = "" if value.device.type == "meta" else f" {value.device.type}"
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}{device}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)
