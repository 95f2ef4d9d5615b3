"""Rewrite the joint graph into one rank's program: local shapes and functional collectives.

The rewriter interprets the captured joint graph on the rank's local pieces, following the plan:
before each op it moves every argument into the placements the op's strategy needs, by the
steps the plan priced (:attr:`~autopar.core.plan.ShardingPlan.moves`), then runs the op on local tensors with shape
arguments made local. ``make_fx`` traces that interpretation on fake tensors into a plain aten
graph whose collectives are ``torch.ops._c10d_functional`` ops, so Inductor can compile it.

The backward makes its own moves: a forward value a backward op needs in other placements is
moved again in the backward (a parameter all-gathered for the forward is all-gathered again
for the backward, as FSDP does), so that only forward values in their own placements are kept
between the two. An op whose strategy splits a dim it reduces or indexes (a vocabulary-parallel
embedding or cross-entropy) runs as its :class:`~autopar.passes.rules.SplitOp` says, with the
offset of the rank's piece and all-reduces over the axes that split the dim. Ops the plan
recomputes run again when a backward op first reads them, on their kept operands (or operands
recomputed the same way). The outputs of ops the plan offloads are copied to host memory as soon
as they are made (``autopar::offload``, :mod:`autopar.core.offload_ops`) and copied back
(``autopar::reload``) when a backward op or a recomputation first reads them; those of the
segments the plan prefetches are copied back one segment ahead instead, when the backward
starts the segment whose backward runs before theirs (its first backward op), so that the
copies run beside that segment's backward. The first read waits for the copy
(``autopar::reload_wait``). Parameters the plan
keeps in host memory come in as host tensors, are copied to the device when the forward first
reads them and again when the backward does, and their gradients go out to the host (below). Backward moves,
recomputations and reloads, and the ops of the captured backward
(:func:`~autopar.passes.analysis.capture.captured_backward`), carry ``IN_BACKWARD`` in
``node.meta["custom"]``, so that the partitioner puts them in the backward.

The parameters a layer reads whole where they are split along one mesh axis are gathered
together, one all-gather per layer and phase, when the layer first reads one of them. Each
parameter's gradient moves into the parameter's placements; the moves that are one all-reduce
or reduce-scatter (or all-reduces over several mesh axes) run in buckets, one collective per
bucket and mesh axis, the buckets of both kinds being those the plan lists
(``ShardingPlan.buckets``, :mod:`autopar.passes.propagation.buckets`), each gradient bucket
launched as soon as the backward has made all of its gradients and waited for when the next
bucket is launched (or at the backward's end), so that it runs beside the backward; the others
move one by one as soon as the backward has made the gradient, so that a split parameter's
whole gradient is not held until the step's end. The gradient of a parameter in host memory is
copied there as soon as it is in its placements.

For gradient accumulation (``no_sync``) the program is made in two more forms
(:data:`Gradients`): one returning each gradient as the backward makes it, before any of its
moves (a partial sum where the parameter is replicated); one taking those gradients, summed over
the micro-batches before, as inputs of its backward, and adding each to the gradient the
backward makes before moving it. The moves are linear, so the sum moved once is the sum of the
moved gradients, with one set of collectives for all the micro-batches.
"""

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx.traceback as fx_traceback
from autopar.passes.analysis.capture import (
    Captured,
    backward_segment_starts,
    captured_backward,
    gradient_values,
    module_paths,
)
from autopar.passes.lower.buckets import LoweredBuckets
from autopar.passes.propagation.buckets import Bucket
from autopar.passes.propagation.propagate import placement_problem, propagate
from autopar.passes.propagation.rank_ops import Rank, local_call
from autopar.passes.propagation.redistribute import local_shape
from autopar.passes.rules import tensor_args
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.core.errors import InputError, RewriteError
from autopar.core.graph import segment_of
from autopar.core.kinds import Phase
from autopar.core.move import Step
from autopar.core.offload_ops import offload, reload, reload_wait
from autopar.core.placement import Placements, R, format_placements
from autopar.core.plan import ShardingPlan
from autopar.core.strategy import Strategy, ValueRef, getitem_aliases, ref_name

IN_BACKWARD: dict[str, Phase] = {"autopar": "backward"}
"""The ``node.meta["custom"]`` of per-rank nodes that run in the backward: the backward's ops,
and the moves and recomputations of forward values for it."""
RECOMPUTED = {**IN_BACKWARD, "autopar_recompute": True}
"""The ``node.meta["custom"]`` of per-rank nodes that recompute forward values for the backward."""
Gradients = Literal["reduced", "unreduced", "accumulated"]
"""What a per-rank program does with the gradients: ``"reduced"`` moves each into its
parameter's placements; ``"unreduced"`` returns each as the backward makes it (a micro-batch
under ``no_sync``); ``"accumulated"`` takes the unreduced gradients of the micro-batches before as
backward inputs and adds them before moving."""
PART = "autopar_part"
"""The key in ``node.meta["custom"]`` of a per-rank node's part of the step: 0 up to the first
backward op of the first layer the backward reaches, then one more at each layer's first
backward op, so that the backward can run layer by layer."""


def plan_strategies(captured: Captured, plan: ShardingPlan) -> dict[str, Strategy]:
    """The plan's strategy of every op and placeholder of ``captured``."""
    mesh = plan.mesh
    strategies = {n.name: Strategy(n.outputs, n.inputs) for n in plan.nodes}
    for node, kind in zip(captured.placeholders, captured.inputs):
        names = {"param": plan.placements, "buffer": plan.placements, "input": plan.inputs}.get(kind.kind)
        if kind.value is not None:  # sent by another pipeline stage, as its op makes it
            layout = strategies[kind.value[0]].outputs[kind.value[1]]
        else:
            layout = names[kind.name] if names is not None else (R,) * mesh.ndim
        strategies[node.name] = Strategy((layout,), (layout,))
    return strategies


def runs_planned_ops(captured: Captured, plan: ShardingPlan) -> bool:
    """Whether ``captured`` runs the ops ``plan`` was made for, node by node (a model captured at
    other input sizes may not: its code may branch on a size, and in eval mode dropout and batch
    norm run otherwise)."""
    aliases = getitem_aliases(captured.graph.graph)
    ops = [
        (n.name, str(n.target)) for n in captured.graph.graph.nodes if n.op == "call_function" and n.name not in aliases
    ]
    return ops == [(n.name, n.op) for n in plan.nodes]


def check_fits(captured: Captured, plan: ShardingPlan) -> None:
    """Refuse to lower ``plan`` for ``captured``, the planned model captured at other input
    sizes (with the same ops, :func:`runs_planned_ops`), where a planned layout cannot lay out
    the new shapes (a split dim the mesh axes do not divide, a reshape that maps dims
    otherwise)."""
    space = propagate(captured, plan.mesh, fallback=True)
    ops = [n for n in space.nodes if n.kind == "op"]
    strategies = plan_strategies(captured, plan)
    for node, kind in zip(captured.placeholders, captured.inputs):
        if kind.kind in ("param", "buffer", "input"):
            problem = placement_problem(node.meta["val"], strategies[node.name].outputs[0], plan.mesh)
            if problem is not None:
                raise InputError(
                    f"{kind.kind} '{kind.name}' of shape {tuple(node.meta['val'].shape)} "
                    "cannot be laid out as planned: "
                    f"{problem}. Fix: pass sizes the plan's splits divide (drop a smaller last batch, e.g. "
                    "DataLoader(drop_last=True)), or compile with pins that leave this dim whole"
                )
    graph_nodes = {n.name: n for n in captured.graph.graph.nodes}
    for node in ops:
        if strategies[node.name] not in node.strategies:
            raise InputError(
                f"at these input sizes {node.name} ({node.target}) cannot run as planned: "
                f"{_misfit(graph_nodes[node.name], strategies[node.name], plan.mesh)}. Fix: pass sizes the plan's "
                "splits divide (drop a smaller last batch, e.g. DataLoader(drop_last=True)), or compile again for them"
            )


def _misfit(node: fx.Node, strategy: Strategy, mesh) -> str:
    """Why ``strategy`` does not fit ``node``'s shapes: the first of its tensors whose planned
    placements cannot lay it out, or else its shapes (the op maps dims otherwise at these sizes)."""
    values = [a.meta["val"] for a in tensor_args(node)]
    for what, value, placements in [
        *(("its input of shape", v, p) for v, p in zip(values, strategy.inputs)),
        *(("its output of shape", v, p) for v, p in zip(_outputs(node), strategy.outputs)),
    ]:
        problem = None if placements is None or value is None else placement_problem(value, placements, mesh)
        if problem is not None:
            return f"{what} {tuple(value.shape)}, planned {format_placements(placements)}: {problem}"
    return "the op maps its dims otherwise at shapes " + ", ".join(str(tuple(v.shape)) for v in values)


def _outputs(node: fx.Node) -> list:
    val = node.meta.get("val")
    return [v if isinstance(v, torch.Tensor) else None for v in (val if isinstance(val, (tuple, list)) else [val])]


def placeholder_layouts(captured: Captured, plan: ShardingPlan) -> list[Placements]:
    strategies = plan_strategies(captured, plan)
    return [strategies[n.name].outputs[0] for n in captured.placeholders]


def rewrite(
    captured: Captured,
    plan: ShardingPlan,
    *,
    coordinate: Sequence[int],
    group_names: Sequence[str],
    gradients: Gradients = "reduced",
) -> fx.GraphModule:
    """The per-rank joint graph of the rank at ``coordinate``.

    Its placeholders are the local pieces of the joint graph's inputs (in the plan's
    placements), then, for ``gradients="accumulated"``, one per gradient output
    (:func:`unreduced_gradients`); its outputs are the forward results whole, each parameter's
    gradient in the parameter's placement (as made, for ``"unreduced"``) and the new value of
    each buffer the forward updates in the buffer's.
    """
    lowering = _Lowering.of(captured, plan, Rank(plan.mesh, coordinate, group_names), gradients)
    mesh = plan.mesh
    fake_mode = FakeTensorMode()
    with fake_mode:
        fakes = [
            torch.empty(
                local_shape(tuple(n.meta["val"].shape), p, mesh),
                dtype=n.meta["val"].dtype,
                device="cpu" if n.name in lowering.host_params else n.meta["val"].device,
            )
            for n, p in zip(captured.placeholders, lowering.layouts)
        ]
        if gradients == "accumulated":
            fakes += [
                torch.empty(local_shape(tuple(v.shape), p, mesh), dtype=v.dtype, device=v.device)
                for v, p in ((node.meta["val"], p) for node, _, p in lowering.unreduced)
            ]
    try:
        with fx_traceback.preserve_node_meta():
            gm = make_fx(lambda *local_inputs: _RankProgram(lowering).trace(local_inputs), tracing_mode="fake")(*fakes)
    except Exception as exc:
        raise RewriteError(
            f"could not build the per-rank graph at mesh coordinate {tuple(coordinate)}: "
            f"{type(exc).__name__}: {exc}\nFix: plan again with fallback=True, or pin the failing tensor replicated"
        ) from exc
    return gm


def unreduced_gradients(captured: Captured, plan: ShardingPlan) -> list[tuple[fx.Node, ValueRef, Placements]]:
    """Each gradient output of ``captured`` that is a value of the graph, in output order: its
    node, the value it is and the placements the backward makes it in under ``plan`` (those of
    the ``"unreduced"`` program's gradients)."""
    return _unreduced(captured, plan_strategies(captured, plan), getitem_aliases(captured.graph.graph))


def _unreduced(captured: Captured, strategies: dict[str, Strategy], aliases: dict) -> list:
    """:func:`unreduced_gradients` from the plan's strategies and the graph's aliases."""
    return [(value, ref, strategies[ref[0]].outputs[ref[1]]) for _, value, ref in gradient_values(captured, aliases)]


def _accumulated_at(unreduced: list, nodes: dict[str, fx.Node], backward: set[fx.Node]) -> dict[str, list[int]]:
    """Per backward op, the gradients (indices into ``unreduced``) it makes, to which the
    ``"accumulated"`` program adds the sums of the micro-batches before; refused for a gradient
    that another op reads too, or that the backward does not make."""
    at: dict[str, list[int]] = {}
    for i, (node, ref, _) in enumerate(unreduced):
        producer = nodes[ref[0]]
        readers = [u for u in node.users if u.op != "output"]
        if producer not in backward or producer.op != "call_function" or readers:
            raise RewriteError(
                f"gradient {node.name} is {'read by ' + readers[0].name if readers else 'not made by the backward'}, "
                "so gradients accumulated under no_sync cannot be added to it before its collectives. Fix: "
                "accumulate without no_sync (each micro-batch then reduces its gradients)"
            )
        at.setdefault(ref[0], []).append(i)
    return at


@dataclass(frozen=True)
class _Lowering:
    """What the per-rank program of a plan is made from, worked out before tracing it: each
    node's strategy, what the backward recomputes, copies to the host and back (and from which
    op it starts copying back), the layers' parts, and the gradient buckets and parameter
    gathers with the ops that fill them."""

    captured: Captured
    plan: ShardingPlan
    rank: Rank
    strategies: dict[str, Strategy]
    aliases: dict[str, ValueRef]
    layouts: list[Placements]
    """The placements of each placeholder, in order."""
    nodes: dict[str, fx.Node]
    recomputed: set[str]
    backward: set[fx.Node]
    to_host_of: dict[str, list[ValueRef]]
    """Per offloaded op, its outputs the backward reads."""
    prefetch_at: dict[str, list[ValueRef]]
    part_of: dict[str, int]
    host_params: set[str]
    devices: dict[str, torch.device]
    states: dict[str, fx.Node]
    """The placeholder of each parameter and buffer, by qualified name."""
    buckets: LoweredBuckets
    gradients: Gradients
    unreduced: list[tuple[fx.Node, ValueRef, Placements]]
    """:func:`unreduced_gradients`."""
    accumulated_at: dict[str, list[int]]
    """For ``"accumulated"``: per backward op, the gradients it makes that take the accumulated sums."""
    moves: dict[tuple[str, Placements, Placements], tuple[Step, ...]]
    """The steps of each move the plan priced outside a bucket (:attr:`ShardingPlan.moves`), by
    tensor, source and destination."""

    @classmethod
    def of(cls, captured: Captured, plan: ShardingPlan, rank: Rank, gradients: Gradients) -> "_Lowering":
        strategies = plan_strategies(captured, plan)
        graph = captured.graph.graph
        aliases = getitem_aliases(graph)
        recomputed = {n.name for n in plan.nodes if n.activation == "recompute"}
        offloaded = {n.name for n in plan.nodes if n.activation == "offload"}
        backward = captured_backward(captured)
        to_host = {
            aliases.get(a.name, (a.name, 0))
            for n in graph.nodes
            if n in backward or n.name in recomputed
            for a in n.all_input_nodes
        }
        to_host_of: dict[str, list[ValueRef]] = {}
        for ref in sorted(to_host):
            if ref[0] in offloaded:
                to_host_of.setdefault(ref[0], []).append(ref)
        paths = module_paths(captured)
        starts = backward_segment_starts(captured, paths)
        prefetch_at = _prefetches(
            starts, {ref for refs in to_host_of.values() for ref in refs}, paths, set(plan.prefetched)
        )
        host_params = {
            n.name
            for n, k in zip(captured.placeholders, captured.inputs)
            if k.kind == "param" and k.name in plan.host_params
        }
        states = {k.name: n for n, k in zip(captured.placeholders, captured.inputs) if k.kind in ("param", "buffer")}
        lowering = dict(strategies=strategies, aliases=aliases, recomputed=recomputed, backward=backward)
        nodes = {n.name: n for n in graph.nodes}
        unreduced = _unreduced(captured, strategies, aliases) if gradients != "reduced" else []
        return cls(
            captured,
            plan,
            rank,
            layouts=[strategies[n.name].outputs[0] for n in captured.placeholders],
            nodes=nodes,
            to_host_of=to_host_of,
            prefetch_at=prefetch_at,
            part_of={name: i + 1 for i, name in enumerate(starts.values())},
            host_params=host_params,
            devices={n.name: n.meta["val"].device for n in captured.placeholders},
            states=states,
            buckets=LoweredBuckets.of(
                captured,
                plan,
                states,
                gradients == "unreduced",
                strategies=strategies,
                aliases=aliases,
                backward=backward,
            ),
            gradients=gradients,
            unreduced=unreduced,
            accumulated_at=_accumulated_at(unreduced, nodes, backward) if gradients == "accumulated" else {},
            moves={(m.tensor, m.src, m.dst): m.steps for m in plan.moves},
            **lowering,
        )

    def steps(self, ref: ValueRef, src: Placements, dst: Placements) -> tuple[Step, ...]:
        """The steps the plan priced for moving ``ref`` from ``src`` to ``dst``; refused when the
        plan priced no such move, as the program would then run work the plan does not count."""
        found = self.moves.get((ref_name(ref), src, dst))
        if found is None:
            raise RewriteError(
                f"the program moves {ref_name(ref)} from {format_placements(src)} to {format_placements(dst)}, "
                "a move the plan did not price (a plan made for another graph or another autopar). Fix: plan again"
            )
        return found


class _RankProgram:
    """One rank's program as :func:`rewrite` traces it, with one method per kind of step:
    running an op on local pieces, fetching an operand in the placements it needs (moving it,
    or gathering a layer's parameters together), recomputing, copying back from the host, and
    reducing a gradient bucket. Its state is what the trace has made so far."""

    def __init__(self, lowering: _Lowering):
        self.low = lowering
        self.env: dict[ValueRef, tuple[torch.Tensor, Placements]] = {}
        self.again: dict[ValueRef, tuple[torch.Tensor, Placements]] = {}  # recomputed or copied back
        self.on_host: dict[ValueRef, tuple[torch.Tensor, Placements]] = {}
        self.brought: dict[tuple[bool, ValueRef], torch.Tensor] = {}  # parameters from host memory, per phase
        self.waited: set[ValueRef] = set()  # reloads the backward has waited for
        self.moved: dict[tuple[bool, ValueRef, Placements], torch.Tensor] = {}  # (in backward, value, placements)
        self.in_flight: list[tuple[Bucket, Callable]] = []  # the bucket launched last, not yet waited for
        self.outputs: dict[int, torch.Tensor | None] = {}

    def trace(self, local_inputs: Sequence[torch.Tensor]) -> list:
        low, captured = self.low, self.low.captured
        graph, mesh = captured.graph.graph, low.plan.mesh
        left = [set(p) for p in low.buckets.producers]  # per bucket, the ops still to make one of its gradients
        for i, node in enumerate(captured.placeholders):
            self.env[node.name, 0] = local_inputs[i], low.layouts[i]
        self.accumulated = list(local_inputs[len(captured.placeholders) :])
        for node in graph.nodes:
            if node.op == "get_attr":  # a constant of the graph, whole on every rank
                self.env[node.name, 0] = getattr(captured.graph, node.target), (R,) * mesh.ndim
        for b, names in enumerate(left):
            if not names:
                self.reduce(low.buckets.buckets[b])
        part = 0
        for node in graph.nodes:
            part = low.part_of.get(node.name, part)
            with fx_traceback.annotate({PART: part}):
                for ref in low.prefetch_at.get(node.name, ()):
                    self.start_reload(ref)
                if node.op == "call_function" and node.name not in low.aliases:
                    self.step(node, left)
        self.finish_reduce()
        for i, (kind, value) in enumerate(zip(captured.outputs, graph.output_node().args[0])):
            if i in self.outputs:
                continue
            if kind is None or not isinstance(value, fx.Node):
                self.outputs[i] = None
            elif kind.kind == "output":
                self.outputs[i] = self.fetch(value, (R,) * mesh.ndim)
            elif kind.kind in ("send", "send_grad"):  # to another pipeline stage, as made
                ref = low.aliases.get(value.name, (value.name, 0))
                self.outputs[i] = self.fetch(value, low.strategies[ref[0]].outputs[ref[1]], value in low.backward)
            else:
                self.outputs[i] = self.state_output(i)
        return [self.outputs[i] for i in range(len(captured.outputs))]

    def step(self, node: fx.Node, left: list[set[str]]) -> None:
        """Run one op of the joint graph, copy what the plan offloads of it to the host, and
        launch the buckets and outputs its gradients complete."""
        low = self.low
        in_backward = node in low.backward
        with fx_traceback.annotate(IN_BACKWARD) if in_backward else contextlib.nullcontext():
            self.run(node, self.env, in_backward)
            for i in low.accumulated_at.get(node.name, ()):
                ref = low.unreduced[i][1]
                made, layout = self.env[ref]
                self.env[ref] = made + self.accumulated[i], layout
        for ref in low.to_host_of.get(node.name, ()):
            t, layout = self.env[ref]
            self.on_host[ref] = offload(t), layout
        for b in low.buckets.filled_by.get(node.name, ()):
            left[b].discard(node.name)
            if not left[b]:
                self.reduce(low.buckets.buckets[b])
        for i in low.buckets.made_by.get(node.name, ()):
            self.outputs[i] = self.state_output(i)

    def fetch(self, arg: fx.Node, dst: Placements, in_backward: bool = False) -> torch.Tensor:
        """``arg`` in placements ``dst``, for a forward op or, ``in_backward``, for a backward op
        or a recomputation, which read recomputed values and move in the backward."""
        low = self.low
        ref = low.aliases.get(arg.name, (arg.name, 0))
        if in_backward and ref[0] in low.recomputed:
            if ref not in self.again:
                self.recompute(low.nodes[ref[0]])
            t, src = self.again[ref]
        elif in_backward and ref in self.on_host:
            self.start_reload(ref)
            t, src = self.again[ref]
            if ref not in self.waited:
                with fx_traceback.annotate(IN_BACKWARD):
                    reload_wait(t)
                self.waited.add(ref)
        else:
            t, src = self.env[ref]
            if ref[0] in low.host_params:
                t = self.bring(t, ref, in_backward)
        if src == dst:
            return t
        key = (in_backward, ref, dst)
        if key not in self.moved:
            with fx_traceback.annotate(IN_BACKWARD) if in_backward else contextlib.nullcontext():
                if key in low.buckets.gathered_by:
                    gather = low.buckets.gathered_by[key]
                    pieces = low.rank.bucket(
                        [self.env[k[1]][0] for k in gather.keys], list(gather.steps), gather.bucket.step
                    )
                    self.moved.update(zip(gather.keys, pieces))
                else:
                    self.moved[key] = low.rank.move(t, low.steps(ref, src, dst))
        return self.moved[key]

    def start_reload(self, ref: ValueRef) -> None:
        if ref not in self.again and ref in self.on_host:
            with fx_traceback.annotate(IN_BACKWARD):
                host, layout = self.on_host[ref]
                self.again[ref] = reload(host, self.env[ref][0].device), layout

    def bring(self, host: torch.Tensor, ref: ValueRef, in_backward: bool) -> torch.Tensor:
        """A parameter living in host memory, copied to the device for the phase that reads it."""
        if (in_backward, ref) not in self.brought:
            with fx_traceback.annotate(IN_BACKWARD) if in_backward else contextlib.nullcontext():
                self.brought[in_backward, ref] = reload(host, self.low.devices[ref[0]])
                reload_wait(self.brought[in_backward, ref])
        return self.brought[in_backward, ref]

    def run(self, node: fx.Node, store: dict, in_backward: bool) -> None:
        strategy = self.low.strategies[node.name]
        local_args = [self.fetch(a, p, in_backward) for a, p in zip(tensor_args(node), strategy.inputs)]
        result = local_call(node, local_args, strategy, self.low.plan.mesh, self.low.rank.split)()
        results = result if isinstance(result, (list, tuple)) else [result]
        for i, (value, layout) in enumerate(zip(results, strategy.outputs)):
            store[node.name, i] = value, layout

    def recompute(self, node: fx.Node) -> None:
        with fx_traceback.annotate(RECOMPUTED):
            self.run(node, self.again, True)

    def reduce(self, bucket: Bucket) -> None:
        """Launch one bucket's collectives on its gradients as this rank made them, after
        waiting for the bucket launched before it, so that each runs beside the backward until
        the next is launched."""
        self.finish_reduce()
        keys, steps = self.low.buckets.keys, self.low.buckets.steps
        with fx_traceback.annotate(IN_BACKWARD):
            finish = self.low.rank.start_bucket(
                [self.env[keys[i][1]][0] for i in bucket.members],
                [steps[i] for i in bucket.members],
                bucket.step,
                bucket.then,
            )
        self.in_flight.append((bucket, finish))

    def finish_reduce(self) -> None:
        """Wait for the bucket in flight; its gradients then find their moves made."""
        keys, reduced_with = self.low.buckets.keys, self.low.buckets.reduced_with
        while self.in_flight:
            bucket, finish = self.in_flight.pop()
            with fx_traceback.annotate(IN_BACKWARD):
                reduced = finish()
            for i, piece in zip(bucket.members, reduced):
                self.moved[keys[i]] = piece
            for i in bucket.members:
                for j in reduced_with.get(keys[i], ()):
                    self.outputs[j] = self.state_output(j)

    def state_output(self, i: int) -> torch.Tensor:
        """Output ``i``, a parameter's gradient or an updated buffer's new value, in that
        parameter's or buffer's placements; the gradient of a parameter in host memory goes there."""
        low = self.low
        kind, value = low.captured.outputs[i], low.captured.graph.graph.output_node().args[0][i]
        state = low.states[kind.name]
        if kind.kind == "grad" and low.gradients == "unreduced":
            return self.env[low.aliases.get(value.name, (value.name, 0))][0]
        result = self.fetch(value, low.strategies[state.name].outputs[0], value in low.backward)
        return offload(result) if kind.kind == "grad" and state.name in low.host_params else result


def _prefetches(
    starts: dict[str, str], offloaded: set[ValueRef], paths: dict[str, str], prefetched: set[str]
) -> dict[str, list[ValueRef]]:
    """Per backward op, the ``offloaded`` values of the ``prefetched`` segments to start copying
    back before it runs: a segment's values when the backward starts the segment it reaches
    just before (``starts``: :func:`~autopar.passes.analysis.capture.backward_segment_starts`). A value
    the backward reads before that is copied back at its first read."""
    order = list(starts)
    at: dict[str, list[ValueRef]] = {}
    for ref in sorted(offloaded):
        segment = segment_of(paths.get(ref[0], ""))
        if segment in prefetched and segment in starts and order.index(segment) > 0:
            at.setdefault(starts[order[order.index(segment) - 1]], []).append(ref)
    return at
