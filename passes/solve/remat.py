"""Which forward values the backward keeps, which it recomputes and which go to host memory.

The backward of a training step reads forward values. Every forward op of the joint graph is
*kept* (its outputs stay in memory from the forward until the backward has read them),
*recomputed* (the backward runs it again, with the collectives its operands need, just before
the first backward op that reads it) or *offloaded* (its outputs are copied to host memory as
soon as they are made, and copied back when a backward op first reads them), and the solver
picks one for each, with the layouts. Offload is offered when the hardware profile has a host
link (a GPU's PCIe); on a CPU host the device memory is the host memory.

Recomputation stays inside a *segment*: one layer of a stack (``layers.3``), or else the
top-level module an op comes from (``tok_emb``, ``head``; ``""`` for the root). A recomputed op
reads operands of its own segment kept or recomputed, and operands of other segments kept: the
inputs of a layer are its checkpoints, as in per-layer activation checkpointing, so a backward
only ever holds one segment's recomputed values at a time. Ops that draw random numbers are
never recomputed, but may be offloaded. Views are never offloaded (they hold no memory): a view
of an offloaded op is made again in the backward, from the reloaded op.

A view holds no memory of its own: keeping it keeps the op it views. A view of a parameter that
the backward reads is always made again in the backward, from the parameter, so that a
parameter gathered for the forward is not held until the backward.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from autopar.cost_model.estimate import CostModel
from autopar.passes.analysis.capture import Captured, backward_segment_starts, module_paths

from autopar.core.graph import is_layer, segment_of
from autopar.core.strategy import StrategySpace

Recompute = Literal["auto", "none", "layers"]
"""``recompute=`` on plan and compile: ``"auto"`` lets the solver recompute or offload what the
memory budget asks for (nothing without a budget); ``"none"`` keeps every activation;
``"layers"`` recomputes everything inside each layer of a stack from the layer's input, as
activation checkpointing of every block does, and decides the rest as ``"auto"``."""

RECOMPUTE_OPTIONS: tuple[Recompute, ...] = get_args(Recompute)
"""The values of :data:`Recompute`, which ``recompute=`` is checked against."""


@dataclass(frozen=True, slots=True)
class ActivationSpace:
    """The keep-or-recompute choice of every forward op."""

    nodes: tuple[str, ...]
    """Forward ops, in graph order."""
    segment: dict[str, str]
    saved: frozenset[str]
    """Ops whose outputs the backward reads: each is kept or recomputed."""
    recomputable: frozenset[str]
    operands: dict[str, tuple[str, ...]]
    """The forward ops each op reads (placeholders are always at hand)."""
    bytes: dict[str, list[float]]
    """Per strategy of the op, the bytes of the outputs it holds when kept: those the backward
    reads or views (of those forward ops read, when the backward reads none); 0 for views."""
    never_kept: frozenset[str]
    """Ops that must be recomputed when needed (``recompute="layers"``)."""
    views: dict[str, str]
    """View ops of a forward op's output → that op: keeping the view keeps it."""
    extra: dict[str, tuple[list[float], tuple[str, ...]]]
    """For ops the backward reads, the bytes of their other outputs that forward ops read, per
    strategy, and those forward ops: the outputs are kept too when one of them is recomputed
    (the output of a layer norm, whose backward reads only its statistics)."""
    param_views: frozenset[str]
    """Views of parameters the backward reads (a weight's transpose): always made again in the
    backward, so that a parameter gathered for the forward is not held until the backward."""
    offloadable: frozenset[str] = frozenset()
    """Ops whose held outputs may go to host memory (empty without a host link)."""
    backward_segment: dict[str, str] = field(default_factory=dict)
    """Backward ops → the segment of the forward op they differentiate, for the backward ops
    of segments that have forward ops."""
    backward_order: tuple[str, ...] = ()
    """Segments in the order the backward reaches them (runs its first op of the segment)."""
    released: dict[str, int] = field(default_factory=dict)
    """Per forward op, the last *moment* its kept outputs are alive at. Moment ``k`` is the
    start of the backward of segment ``backward_order[k]``, and one more is the end of the
    backward; an op's outputs are alive until the last of its readers' (backward ops, and
    forward ops, which the backward of their segment may recompute) and its views' readers'
    backwards is done (the runtime frees each saved tensor after its last read)."""
    grad_made: dict[str, int] = field(default_factory=dict)
    """Per parameter, the first moment its gradient (or part of it) is alive at: the one after
    the start of the backward the step reaches first among its readers' segments'."""
    made: dict[str, list[float]] = field(default_factory=dict)
    """Per op and strategy, the bytes of all its outputs (0 for views)."""
    alive: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per op, the ops of its phase (forward or backward) whose outputs are alive while it runs
    (its own among them): made by then and read by it, by a later op of the phase, or by a view
    read later. Without the views, which hold no memory of their own."""
    copied: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """Per view that may read the op it views in a larger layout than the op makes (a gathered
    copy, which the view keeps when kept): the bytes it reads, per strategy of the view, and
    the bytes made, per strategy of the op."""
    freed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per backward op of a segment, the forward ops whose outputs the segment's backward has
    read for the last time before it runs (the runtime has freed them)."""
    stage_starts: frozenset[str] = frozenset()
    """In pipeline stages, the segments each stage's backward reaches first: their stage's
    program runs no backward before them to copy their outputs back beside."""

    @property
    def moments(self) -> int:
        """How many moments the memory budget holds at (1 when no segment has a backward)."""
        return len(self.backward_order) + 1 if self.backward_order else 1

    def crosses(self, name: str, operand: str) -> bool:
        return self.segment[name] != self.segment[operand]

    def reloaded_during(self) -> dict[str, str]:
        """Per segment, the segment beside whose backward its offloaded outputs are copied back
        when prefetched: the one the backward reaches just before it. The segment the backward
        reaches first has none, nor, in pipeline stages, those each stage's backward reaches first."""
        order = self.backward_order
        return {s: before for s, before in zip(order[1:], order) if s not in self.stage_starts}


def activation_space(
    captured: Captured, space: StrategySpace, costs: CostModel, recompute: Recompute, *, offload: bool = False
) -> ActivationSpace:
    """The choices for ``space`` under the ``recompute`` option (see :data:`Recompute`),
    with offload to host memory when ``offload``."""
    graph_nodes = {n.name: n for n in captured.graph.graph.nodes}
    by_name = space.index()
    paths = module_paths(captured)
    forward = [n for n in space.nodes if n.kind == "op" and n.phase == "forward"]
    backward = [n for n in space.nodes if n.kind == "op" and n.phase == "backward"]
    names = {n.name for n in forward}
    read_back, read_forward = _reads(space, names)
    readers_in = {name: set().union(*by_index.values()) for name, by_index in read_forward.items()}
    segment = {n.name: segment_of(paths.get(n.name, "")) for n in forward}
    views = _views(forward, graph_nodes)
    backward_views = _views(backward, graph_nodes)
    param_views = _param_views(forward, read_back, views, by_name)
    recomputable, never_kept = _recompute_choices(
        forward, graph_nodes, recompute, segment, readers_in, param_views, _overwritten(captured)
    )
    kept, extra = _kept_sizes(forward, costs, read_back, read_forward, views)
    offloadable = {
        n.name
        for n in forward
        if offload and recompute != "none" and n.name not in views and n.name not in never_kept and any(kept[n.name])
    }
    backward_segment = _backward_segments(backward, paths, set(segment.values()))
    order = tuple(backward_segment_starts(captured, paths))
    released, grad_made = _moments(space, forward, segment, backward_segment, views, order)
    return ActivationSpace(
        tuple(n.name for n in forward),
        segment,
        frozenset(read_back),
        frozenset(recomputable),
        {n.name: tuple(dict.fromkeys(a for a, _ in n.args if a in names)) for n in forward},
        kept,
        frozenset(never_kept),
        {v: base for v, (base, _) in views.items() if base in names},
        extra,
        frozenset(param_views),
        frozenset(offloadable),
        backward_segment,
        order,
        released,
        grad_made,
        {**_made(forward, views, costs), **_made(backward, backward_views, costs)},
        {**_alive(forward, readers_in, views), **_alive(backward, _readers(backward), backward_views)},
        _copied(forward, views, param_views, names, by_name, costs),
        _freed(backward, backward_segment, views, names),
    )


def in_stages(acts: ActivationSpace, stage_of: Mapping[str, int]) -> ActivationSpace:
    """``acts`` for a graph whose nodes run in the pipeline stages ``stage_of`` (by name): the
    segments whose stage differs from that of the segment the backward reaches before them
    start their stage's backward, so their copies back are not prefetched."""
    stage = {acts.segment[name]: stage_of[name] for name in acts.nodes if name in stage_of}
    order = acts.backward_order
    starts = frozenset(s for s, before in zip(order[1:], order) if stage.get(s) != stage.get(before))
    return dataclasses.replace(acts, stage_starts=starts)


def _views(ops, graph_nodes: dict[str, torch.fx.Node]) -> dict[str, tuple[str, int]]:
    """Per view op of ``ops``, the output it views."""
    return {n.name: n.args[0] for n in ops if _is_view(graph_nodes[n.name]) and n.args}


def _recompute_choices(
    forward,
    graph_nodes: dict[str, torch.fx.Node],
    recompute: Recompute,
    segment: dict[str, str],
    readers_in: dict[str, set[str]],
    param_views: set[str],
    overwritten: set[str],
) -> tuple[set[str], set[str]]:
    """:attr:`ActivationSpace.recomputable` and :attr:`ActivationSpace.never_kept`: under
    ``"layers"``, an op of a layer that no op of another segment reads is never kept. An op
    reading a buffer the step overwrites in place (batch norm's running statistics) is never
    recomputed: by the backward, the buffer holds its new value."""
    recomputable = {
        n.name
        for n in forward
        if recompute != "none"
        and _deterministic(graph_nodes[n.name])
        and not any(a.name in overwritten for a in graph_nodes[n.name].all_input_nodes)
    } | param_views
    never_kept = set(param_views)
    if recompute == "layers":
        for name in recomputable:
            crossing = any(segment[r] != segment[name] for r in readers_in.get(name, ()))
            if is_layer(segment[name]) and not crossing:
                never_kept.add(name)
    return recomputable, never_kept


def _kept_sizes(
    forward, costs: CostModel, read_back: dict[str, set[int]], read_forward: dict[str, dict[int, set[str]]], views: dict
) -> tuple[dict[str, list[float]], dict[str, tuple[list[float], tuple[str, ...]]]]:
    """:attr:`ActivationSpace.bytes` and :attr:`ActivationSpace.extra`."""
    held = _held_outputs(forward, read_back, views)

    def sizes(n, outputs) -> list[float]:
        return [float(sum(costs.local_bytes((n.name, i), s.outputs[i]) for i in outputs)) for s in n.strategies]

    extra = {}
    for n in forward:
        others = set(read_forward.get(n.name, {})) - held.get(n.name, set())
        if n.name in held and others and n.name not in views:
            readers = set().union(*(read_forward[n.name][i] for i in others))
            extra[n.name] = sizes(n, others), tuple(sorted(readers))
    kept = {
        n.name: [0.0] * len(n.strategies)
        if n.name in views
        else sizes(n, held.get(n.name) or set(read_forward.get(n.name, {})))
        for n in forward
    }
    return kept, extra


def _backward_segments(backward, paths: dict[str, str], segments: set[str]) -> dict[str, str]:
    """:attr:`ActivationSpace.backward_segment`: the ``backward`` ops of one of ``segments``."""
    backward_segment = {n.name: segment_of(paths[n.name]) for n in backward if n.name in paths}
    return {name: s for name, s in backward_segment.items() if s in segments}


def _made(ops, views: dict, costs: CostModel) -> dict[str, list[float]]:
    """:attr:`ActivationSpace.made` of ``ops``, whose ``views`` hold nothing."""
    return {
        n.name: [0.0] * len(n.strategies)
        if n.name in views
        else [
            float(sum(costs.local_bytes((n.name, i), p) for i, p in enumerate(s.outputs) if p is not None))
            for s in n.strategies
        ]
        for n in ops
    }


def _copied(
    forward, views: dict, param_views: set[str], names: set[str], by_name, costs: CostModel
) -> dict[str, tuple[list[float], list[float]]]:
    """:attr:`ActivationSpace.copied`."""
    copied = {}
    for n in forward:
        if n.name in views and n.name not in param_views and views[n.name][0] in names:
            base, index = views[n.name]
            read = [float(costs.local_bytes((base, index), s.inputs[0])) for s in n.strategies]
            made_as = [float(costs.local_bytes((base, index), s.outputs[index])) for s in by_name[base].strategies]
            if max(read) > min(made_as):
                copied[n.name] = read, made_as
    return copied


def _moments(
    space: StrategySpace,
    forward,
    segment: dict[str, str],
    backward_segment: dict[str, str],
    views: dict,
    order: tuple[str, ...],
) -> tuple[dict[str, int], dict[str, int]]:
    """:attr:`ActivationSpace.released` and :attr:`ActivationSpace.grad_made`. A reader in no
    segment of ``order`` keeps an op alive to the end and makes a gradient from the start."""
    at = {s: i for i, s in enumerate(order)}
    last = len(order)
    released = {n.name: 0 for n in forward}
    grad_made: dict[str, int] = {}
    for n in space.nodes:
        if n.kind != "op":
            continue
        moment = at.get(backward_segment.get(n.name) if n.phase == "backward" else segment.get(n.name), last)
        for name, _ in n.args:
            if name in released:
                released[name] = max(released[name], moment)
            elif n.phase == "forward":
                grad_made[name] = min(grad_made.get(name, last), moment + 1 if moment < last else 0)
    for n in reversed(forward):  # a view's readers keep the op it views
        if n.name in views and views[n.name][0] in released:
            base = views[n.name][0]
            released[base] = max(released[base], released[n.name])
    params = {n.name for n in space.nodes if n.kind == "param"}
    return released, {name: grad_made.get(name, 0) for name in params}


def _readers(ops) -> dict[str, set[str]]:
    """Per op of ``ops``, the ops of ``ops`` that read it."""
    names = {n.name for n in ops}
    readers: dict[str, set[str]] = {}
    for n in ops:
        for name, _ in n.args:
            if name in names:
                readers.setdefault(name, set()).add(n.name)
    return readers


def _freed(backward, backward_segment: dict[str, str], views: dict, forward: set[str]) -> dict[str, tuple[str, ...]]:
    """:attr:`ActivationSpace.freed`: a backward op reading a view reads what it views."""
    last: dict[str, int] = {}
    for i, n in enumerate(backward):
        for name, _ in n.args:
            while name in forward:
                last[name] = i
                name = views[name][0] if name in views else None
    ending: dict[int, list[str]] = {}
    for name, i in last.items():
        ending.setdefault(i, []).append(name)
    done: dict[str, list[str]] = {}
    freed: dict[str, tuple[str, ...]] = {}
    for i, n in enumerate(backward):
        segment = backward_segment.get(n.name)
        if segment is None:
            continue
        freed[n.name] = tuple(done.get(segment, ()))
        done.setdefault(segment, []).extend(sorted(ending.get(i, ())))
    return freed


def _alive(ops, readers: dict[str, set[str]], views: dict) -> dict[str, tuple[str, ...]]:
    """:attr:`ActivationSpace.alive` of the ``ops`` of one phase, in graph order, from each
    op's ``readers`` in the phase and the ``views`` (view → ``(base, output)``)."""
    at = {n.name: i for i, n in enumerate(ops)}
    last = {n.name: max((at[r] for r in readers.get(n.name, ()) if r in at), default=at[n.name]) for n in ops}
    for n in reversed(ops):  # a view's readers read the op it views
        base = views.get(n.name, (None,))[0]
        if base in last:
            last[base] = max(last[base], last[n.name])
    alive: dict[str, tuple[str, ...]] = {}
    holding: list[str] = []
    for i, n in enumerate(ops):
        if n.name not in views:
            holding.append(n.name)
        alive[n.name] = tuple(holding)
        holding = [name for name in holding if last[name] > i]
    return alive


def _reads(space: StrategySpace, names: set[str]) -> tuple[dict[str, set[int]], dict[str, dict[int, set[str]]]]:
    """Which outputs of the forward ops ``names`` backward ops read, and which forward ops read
    each output."""
    read_back: dict[str, set[int]] = {}
    read_forward: dict[str, dict[int, set[str]]] = {}
    for n in space.nodes:
        for name, index in n.args:
            if name in names and n.kind == "op" and n.phase == "backward":
                read_back.setdefault(name, set()).add(index)
            elif name in names and n.kind == "op":
                read_forward.setdefault(name, {}).setdefault(index, set()).add(n.name)
    return read_back, read_forward


def _param_views(forward, read_back: dict, views: dict, by_name) -> set[str]:
    """Views the backward reads whose chain of views starts at a parameter, and the views on
    that chain."""
    found = set()
    for n in reversed(forward):
        if n.name in views and (n.name in read_back or n.name in found):
            base = views[n.name][0]
            if _view_root(base, views, by_name).kind == "param":
                found.add(n.name)
                if base in views:
                    found.add(base)
    return found


def _view_root(name: str, views: dict, by_name):
    while name in views:
        name = views[name][0]
    return by_name[name]


def _held_outputs(forward, read_back: dict[str, set[int]], views: dict) -> dict[str, set[int]]:
    """The outputs a kept op holds: those the backward reads, and those a view the backward
    reads (or a view of such a view) looks into."""
    held = {name: set(indices) for name, indices in read_back.items()}
    for n in reversed(forward):
        if n.name in views and n.name in held:
            base, index = views[n.name]
            held.setdefault(base, set()).add(index)
    return held


def _is_view(node: torch.fx.Node) -> bool:
    return getattr(node.target, "is_view", False) or node.target is torch.ops.aten._unsafe_view.default


def _overwritten(captured: Captured) -> set[str]:
    """The placeholders of the buffers the forward updates in place."""
    updated = set(captured.updated_buffers)
    return {n.name for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "buffer" and k.name in updated}


def _deterministic(node: torch.fx.Node) -> bool:
    """Whether running ``node`` again gives the same values: it draws no random numbers, or
    only for a dropout it runs with probability 0 (attention)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return True
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    value = (
        node.args[i]
        if len(node.args) > i
        else node.kwargs.get("dropout_p", node.target._schema.arguments[i].default_value)
    )
    return value == 0


def backward_view_reads(acts: ActivationSpace, space: StrategySpace) -> dict[str, tuple[str, int]]:
    """Each view of :attr:`ActivationSpace.param_views` and the tensor it reads (the parameter,
    or the view it views): the backward makes the view again, so reads that tensor, and moves
    it, there (a weight's transpose made again for the transpose the backward reads)."""
    by_name = space.index()
    return {v: by_name[v].args[0] for v in sorted(acts.param_views)}


def kept_ops(acts: ActivationSpace, recomputed: frozenset[str], offloaded: frozenset[str] = frozenset()) -> set[str]:
    """The ops whose outputs stay on the device from the forward to the backward: those the
    backward reads, and the operands of recomputed ops, unless recomputed or offloaded."""
    kept = set(acts.saved).union(*(acts.operands[r] for r in recomputed)) - recomputed - offloaded
    bases = list(kept)
    while bases:
        base = acts.views.get(bases.pop())
        if base is not None and base not in kept:
            kept.add(base)
            bases.append(base)
    return kept


def activation_bytes(
    acts: ActivationSpace,
    choice: dict[str, int],
    recomputed: frozenset[str],
    offloaded: frozenset[str] = frozenset(),
    prefetched: frozenset[str] = frozenset(),
) -> tuple[int, int, int]:
    """``(kept, recomputed, offloaded)`` bytes per device: every kept op's outputs; the largest
    of a segment's recomputed and reloaded outputs (:func:`refilled_bytes`); and the offloaded
    outputs, which wait in host memory."""
    needed = kept_ops(acts, recomputed, offloaded)
    kept = sum(
        kept_bytes(acts, name, choice, recomputed)
        for name in acts.nodes
        if name in needed and name not in recomputed and name not in offloaded
    )
    host = sum(acts.bytes[name][choice[name]] for name in acts.nodes if name in offloaded)
    refilled = refilled_bytes(acts, choice, recomputed, offloaded, prefetched)
    return int(kept), int(max(refilled.values(), default=0.0)), int(host)


def refilled_bytes(
    acts: ActivationSpace,
    choice: dict[str, int],
    recomputed: frozenset[str],
    offloaded: frozenset[str] = frozenset(),
    prefetched: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """Per segment, the bytes alive during its backward that the backward makes again: its
    recomputed and reloaded outputs, with those of the segment before it when they are
    ``prefetched`` (copied back during its backward)."""
    per_segment: dict[str, float] = {}
    reloaded: dict[str, float] = {}
    during = acts.reloaded_during()
    for name in acts.nodes:
        size = acts.bytes[name][choice[name]]
        if name in recomputed or name in offloaded:
            per_segment[acts.segment[name]] = per_segment.get(acts.segment[name], 0.0) + size
        if name in offloaded and acts.segment[name] in prefetched and acts.segment[name] in during:
            target = during[acts.segment[name]]
            reloaded[target] = reloaded.get(target, 0.0) + size
    return {s: per_segment.get(s, 0.0) + reloaded.get(s, 0.0) for s in sorted(set(per_segment) | set(reloaded))}


def kept_bytes(acts: ActivationSpace, name: str, choice: dict[str, int], recomputed: frozenset[str]) -> int:
    """Bytes a kept op holds from the forward to the backward: the outputs the backward reads,
    those a recomputed op reads, and the copy a view looks into beyond the output it views."""
    size = acts.bytes[name][choice[name]]
    if name in acts.extra and recomputed.intersection(acts.extra[name][1]):
        size += acts.extra[name][0][choice[name]]
    if name in acts.copied:
        read, made = acts.copied[name]
        size += max(0.0, read[choice[name]] - made[choice[acts.views[name]]])
    return int(size)
