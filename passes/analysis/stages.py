"""Which pipeline stage runs each node of the joint graph, and each stage's own graph.

The stages hold consecutive units (:func:`cut_units`: the layers of stacks and the modules
outside them): forward ops run on the stage of their unit, backward ops on the stage of the
forward op they differentiate (:func:`~autopar.passes.analysis.capture.module_paths`). The
model's own code between units runs where its operands are: a forward op on the latest stage
it reads from (values only flow forward), a backward op on the earliest (gradients only flow
back). Forward ops that read nothing but inputs, parameters and constants (positions, masks,
the targets' reshapes) run on the first stage that reads them. A parameter or buffer lives on
the stages whose ops read it: on one, or as copies on several (a weight tied across stages,
like an embedding shared with the output head), whose gradient one of them makes.

Every other value one stage makes and another reads crosses between them (:class:`Crossing`):
:func:`stage_graph` gives each stage a graph with a placeholder per value it receives and an
output per value it sends, the names of the joint graph kept, so that the plan's strategies
apply to it node by node.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from autopar.passes.analysis.capture import Captured, InputKind, OutputKind, captured_backward, module_paths
from torch import fx

from autopar.core.errors import InputError
from autopar.core.graph import ancestors, is_layer, segment_of


def cut_units(captured: Captured) -> dict[str, str]:
    """The unit each op belongs to for cutting stages, by node name: its layer where it is in a
    stack (``blocks.3``), else its own module (``lm_head``, ``model.embed_tokens``). Ops of a
    module that holds other units (the root module's code, a wrapper's, the loss a model
    computes in its own ``forward``) belong to none: they run where their operands are."""
    paths = module_paths(captured)
    units = {}
    for name, path in paths.items():
        segment = segment_of(path)
        units[name] = segment if is_layer(segment) else path
    holders = {u for u in set(units.values()) for v in set(units.values()) if v.startswith(u + ".")}
    return {name: unit for name, unit in units.items() if unit and unit not in holders}


def layer_order(captured: Captured) -> list[str]:
    """The units of :func:`cut_units` in the order the model's forward first runs them: the
    stages are cut between them."""
    units, backward = cut_units(captured), captured_backward(captured)
    order: dict[str, None] = {}
    for node in captured.graph.graph.nodes:
        if node.op == "call_function" and node not in backward and node.name in units:
            order.setdefault(units[node.name])
    return list(order)


@dataclass(frozen=True, slots=True)
class Crossing:
    """A value one stage makes and another reads."""

    value: str
    """The node of the joint graph."""
    src: int
    dst: int
    backward: bool
    """A gradient sent back in the backward (else an activation sent on in the forward)."""


@dataclass(frozen=True)
class Staged:
    """The stage of every node of a joint graph."""

    stage_of: dict[str, int]
    """Ops, parameters, buffers and tangents by name (inputs and constants: every stage's)."""
    crossings: tuple[Crossing, ...]
    """In the order the joint graph makes the values."""
    output_stage: int
    """The stage that makes the model's result."""
    shared: dict[str, tuple[int, ...]]
    """Parameters and buffers more than one stage reads (by qualified name: a weight tied across
    stages), with the stages reading them. Each holds a copy; the stage in ``stage_of`` (the one
    making a parameter's gradient, else the first) holds the one that counts, and sends the
    gradient to the others once per step, so that every copy steps alike."""


def assign_stages(captured: Captured, segments: Sequence[Sequence[str]]) -> Staged:
    """Place every node of ``captured`` on one of the stages holding ``segments`` (the layers
    of each stage, :func:`layer_order`'s cut into consecutive runs)."""
    graph = captured.graph.graph
    units, backward = cut_units(captured), captured_backward(captured)
    of_segment = {seg: s for s, segs in enumerate(segments) for seg in segs}
    kinds = dict(zip(captured.placeholders, captured.inputs))
    outputs = list(graph.output_node().args[0])
    stage: dict[fx.Node, int] = {}
    deferred: list[fx.Node] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        own = of_segment.get(units.get(node.name))
        operands = [a for a in node.all_input_nodes if a in stage]
        if node.target.__name__ == "getitem":
            if node.args[0] in stage:
                stage[node] = stage[node.args[0]]
        elif node not in backward:
            if own is None and not operands:
                deferred.append(node)
            else:
                stage[node] = max([own or 0, *(stage[a] for a in operands)])
        else:
            flowing = [stage[a] for a in operands if a in backward]
            for tangent in (a for a in node.all_input_nodes if kinds.get(a) and kinds[a].kind == "tangent"):
                flowing.append(stage[outputs[int(kinds[tangent].name.removeprefix("output"))]])
            candidates = [s for s in (own, *flowing) if s is not None]
            stage[node] = min(candidates) if candidates else len(segments) - 1
    for node in reversed(deferred):  # where they are first read: later readers receive them
        if not node.users:  # a check of a value's metadata, which no stage needs to run
            continue
        stage[node] = min(_reader_stages(node, stage), default=0)
        for user in node.users:
            if user.target.__name__ == "getitem":
                stage[user] = stage[node]
    gradient = {k.name: v for k, v in zip(captured.outputs, outputs) if k is not None and k.kind == "grad"}
    shared: dict[str, tuple[int, ...]] = {}
    for node, kind in kinds.items():
        if kind.kind == "tangent":
            stage[node] = stage[outputs[int(kind.name.removeprefix("output"))]]
        elif kind.kind in ("param", "buffer"):
            readers = sorted({stage[u] for u in node.users if u in stage})
            made = gradient.get(kind.name)
            stage[node] = stage[made] if made in stage else (readers[0] if readers else 0)
            if readers and stage[node] not in readers:
                raise InputError(
                    f"the gradient of {kind.name} is made on pipeline stage {stage[node]}, which does not read it "
                    f"(stages {readers} do). Fix: cut the stages elsewhere, or compile without pipeline="
                )
            if len(readers) > 1:
                shared[kind.name] = tuple(readers)
    _check_outputs(captured, stage)
    made = [o for o, k in zip(outputs, captured.outputs) if k is not None and k.kind == "output"]
    return Staged(
        stage_of={n.name: s for n, s in stage.items()},
        crossings=_crossings(graph, stage, backward),
        output_stage=stage[made[0]] if made and made[0] in stage else len(segments) - 1,
        shared=shared,
    )


def _reader_stages(node: fx.Node, stage: dict[fx.Node, int]) -> list[int]:
    """The stages of the ops reading ``node`` (through the picks of its outputs)."""
    found = []
    for user in node.users:
        if user.op == "call_function" and user.target.__name__ == "getitem":
            found += _reader_stages(user, stage)
        elif user in stage:
            found.append(stage[user])
    return found


def _crossings(graph: fx.Graph, stage: dict, backward: set) -> tuple[Crossing, ...]:
    found: dict[tuple[str, int], Crossing] = {}
    for node in graph.nodes:
        if node not in stage or node.op == "placeholder":
            continue
        for user in node.users:
            if user not in stage or stage[user] == stage[node]:
                continue
            src, dst, grad = stage[node], stage[user], node in backward
            if (dst < src) != grad:
                raise InputError(
                    f"{user.name} on pipeline stage {dst} reads {node.name}, which stage {src} makes in the "
                    f"{'backward' if grad else 'forward'}: pipelining sends activations to later stages and "
                    "gradients to earlier ones only. Fix: cut the stages elsewhere, or compile without pipeline="
                )
            found.setdefault((node.name, dst), Crossing(node.name, src, dst, grad))
    return tuple(found.values())


def _check_outputs(captured: Captured, stage: dict) -> None:
    """A parameter's gradient and a buffer's new value are made on the stage holding it."""
    holder = {k.name: stage.get(n) for n, k in zip(captured.placeholders, captured.inputs) if k.kind != "input"}
    for kind, value in zip(captured.outputs, captured.graph.graph.output_node().args[0]):
        if kind is None or kind.kind == "output" or not isinstance(value, fx.Node) or value.op == "placeholder":
            continue
        if stage.get(value) != holder.get(kind.name):
            raise InputError(
                f"the {'gradient' if kind.kind == 'grad' else 'new value'} of {kind.name} is made on pipeline stage "
                f"{stage.get(value)}, not on stage {holder.get(kind.name)}, which holds it. Fix: cut the stages "
                "elsewhere, or compile without pipeline="
            )


def stage_graph(
    captured: Captured, staged: Staged, s: int, aliases: dict, given: frozenset[str] = frozenset()
) -> Captured:
    """Stage ``s``'s part of ``captured``: its ops (but those named in ``given``, whose values
    the runtime gives it, kind ``given``), the inputs, parameters, buffers and tangents they
    read, a placeholder per value it receives (kind ``recv``, or ``recv_grad`` for a gradient,
    laid out as the value ``aliases`` resolves it to) and an output per value it sends (kind
    ``send`` or ``send_grad``), with the outputs of the joint graph it makes."""
    graph = captured.graph.graph
    mine = {n for n in graph.nodes if staged.stage_of.get(n.name) == s and n.op == "call_function"}
    handed = sorted((n for n in mine if n.name in given), key=lambda n: n.name)
    mine -= set(handed)
    received = [c for c in staged.crossings if c.dst == s]
    read = {a for n in mine for a in n.all_input_nodes if a.op in ("placeholder", "get_attr")}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[InputKind] = []
    for node, kind in zip(captured.placeholders, captured.inputs):
        if node in read or staged.stage_of.get(node.name) == s and kind.kind != "input":
            env[node] = g.node_copy(node)
            inputs.append(kind)
    nodes = {n.name: n for n in graph.nodes}
    takes = [(c.value, "recv") for c in received if not c.backward] + [(n.name, "given") for n in handed]
    for name, kind in takes + [(c.value, "recv_grad") for c in received if c.backward]:
        env[nodes[name]] = placeholder = g.placeholder(name)
        placeholder.meta = dict(nodes[name].meta)
        inputs.append(InputKind(kind, name, aliases.get(name, (name, 0))))
    for node in graph.nodes:
        if node.op == "get_attr" and node in read:
            env[node] = g.node_copy(node)
        elif node in mine:
            env[node] = g.node_copy(node, lambda n: env[n])
    results, kinds = [], []
    for kind, value in zip(captured.outputs, graph.output_node().args[0]):
        if kind is not None and isinstance(value, fx.Node) and value in env and value.op != "placeholder":
            results.append(env[value])
            kinds.append(kind)
    for c in staged.crossings:
        if c.src == s and OutputKind("send_grad" if c.backward else "send", c.value) not in kinds:
            results.append(env[nodes[c.value]])
            kinds.append(OutputKind("send_grad" if c.backward else "send", c.value))
    g.output(tuple(results))
    part = fx.GraphModule(captured.graph, g)
    return Captured(part, tuple(inputs), tuple(kinds), None, captured.graph_hash, 0.0, ())


DIVISIONS = (torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar, torch.ops.prims.div.default)
"""The ops a captured graph divides by (a mean's count, a loss's divisor)."""
CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
"""The ops a captured graph changes a value's dtype with."""


def loss_divisor(captured: Captured) -> tuple[fx.GraphModule, str] | None:
    """How the loss of a batch is the micro-batches': ``None`` where it is a mean over a fixed
    number of values (the mean of the micro-batches' losses), else a graph computing its divisor
    from a micro-batch's inputs (a mean cross-entropy's count of targets, before any cast) and the
    divisor's node (the batch's loss is each micro-batch's dividend over the batch's divisor, added up);
    refused for any other loss, and for models returning more than one scalar loss."""
    kinds = dict(zip(captured.placeholders, captured.inputs))
    results = [
        v for v, k in zip(captured.graph.graph.output_node().args[0], captured.outputs) if k and k.kind == "output"
    ]
    loss = results[0] if len(results) == 1 else None
    if loss is None or loss.meta["val"].ndim != 0:
        raise InputError(
            "with pipeline stages the model must return one scalar loss, which the stages' micro-batches add up to; "
            f"it returns {len(results)} results. Fix: return the loss alone, or compile without pipeline="
        )
    aten = torch.ops.aten
    divides = loss.target in DIVISIONS
    if loss.target in (aten.mean.default, aten.mean.dim) or (divides and isinstance(loss.args[1], (int, float))):
        return None  # a mean over a fixed count (mse_loss decomposes to a sum over its numel)
    divisor = loss.args[1] if divides else None
    read = ancestors(divisor) if isinstance(divisor, fx.Node) else None
    if read is None or any(a in kinds and kinds[a].kind != "input" for a in read):
        raise InputError(
            f"with pipeline stages the loss must be a mean over the batch (it is made by {loss.target}), so that "
            "the micro-batches' losses add up to the batch's. Fix: return a mean loss (torch.mean, "
            "F.cross_entropy with reduction='mean'), or compile without pipeline="
        )
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in captured.graph.graph.nodes:
        if node.op == "placeholder" and kinds[node].kind == "input":
            env[node] = g.node_copy(node)
        elif node in read and node.op != "placeholder":
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(env[_before_cast(divisor)])
    return fx.GraphModule(captured.graph, g), divisor.name


def _before_cast(node: fx.Node) -> fx.Node:
    """The value ``node`` casts (a count cast to the loss's dtype), or ``node`` itself: the
    micro-batches' parts add up before the one cast, as one device casts the batch's."""
    return node.args[0] if node.target in CASTS and isinstance(node.args[0], fx.Node) else node


def check_stageable(captured: Captured) -> tuple[fx.GraphModule, str] | None:
    """Refuse a model pipeline stages cannot run as one device does: one whose loss is no mean
    (:func:`loss_divisor`, which it returns), or whose forward updates buffers (once per
    micro-batch instead of once per batch)."""
    updated = captured.updated_buffers
    if updated:
        raise InputError(
            f"the forward updates buffers in place ({', '.join(updated)}: batch norm's running statistics, "
            "counters), which pipeline stages would update once per micro-batch instead of once per batch. "
            "Fix: compile without pipeline="
        )
    return loss_divisor(captured)
