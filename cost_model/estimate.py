"""Prices a strategy space: compute per node strategy, transitions per edge, memory per plan."""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from autopar.cost_model.compute import compute_s, math_format, node_work, work_divisor
from autopar.cost_model.hardware import Host, Profile, mesh_links
from autopar.cost_model.op_timing import OpTimer
from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.liveness import ADAM_SLOTS
from autopar.passes.propagation.buckets import (
    BUCKET_BYTES,
    BucketShare,
    bucket_fixed_s,
    collectives_of,
    gradient_chain,
    piece_s,
)
from autopar.passes.propagation.redistribute import local_shape, one_step_moves, step_s, transition
from autopar.passes.rules import split_op

from autopar.core.mesh import Mesh
from autopar.core.move import Step
from autopar.core.placement import Placements, R
from autopar.core.plan import MemoryEstimate
from autopar.core.strategy import Strategy, StrategySpace, ValueRef


def _reduces(src: Placements, dst: Placements) -> bool:
    return any(p.is_partial() and not q.is_partial() for p, q in zip(src, dst))


class CostModel:
    """Costs of one captured graph on one mesh and hardware profile, with gradients reduced in
    buckets of ``bucket_bytes`` (:mod:`autopar.passes.propagation.buckets`). The values named in
    ``unreduced`` are never reduced across ranks (their moves off a partial sum cost infinite
    seconds, which the solver never pays): a gradient before its cast to the parameter's dtype,
    where the policy reduces in that dtype."""

    def __init__(
        self,
        captured: Captured,
        mesh: Mesh,
        hardware: Profile,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        unreduced: frozenset[str] = frozenset(),
        gradient_share: float = 1.0,
        bucket_groups: Mapping[str, int] | None = None,
    ):
        self.mesh = mesh
        self.gradient_share = gradient_share
        """The share of its gradients' collectives a step of this graph pays: for one micro-batch
        of a step in pipeline stages, which reduces the gradients once for all, their weight
        against the micro-batch's work in the step (:func:`~autopar.stage_search.least_step_s`)."""
        self.bucket_groups = dict(bucket_groups or {})
        """Parameter name → group: only gradients of one group share a bucket (a pipeline stage's
        parameters, which the stage's ranks alone hold)."""
        self.unreduced = unreduced
        self.hardware = hardware
        self.links = mesh_links(hardware, mesh)
        self.bucket_bytes = bucket_bytes
        self.graph_nodes = {n.name: n for n in captured.graph.graph.nodes}
        self.fitted = hardware.fitted
        self.timer = OpTimer(mesh, working_set=step_working_set(captured, mesh)) if self.fitted.timed_ops else None
        self.scale = self.fitted.step_scale
        self._transitions: dict[tuple, float] = {}  # by the value's kind and layouts: repeated layers ask again
        self._kinds: dict[ValueRef, tuple] = {}  # by value: its shape, dtype and whether it must stay unreduced
        self._local_bytes: dict[tuple, int] = {}
        self._bytes_of: dict[tuple, int] = {}  # by value and layout, before the shape is looked up
        self._values: dict[ValueRef, torch.Tensor] = {}
        self._work: dict[str, tuple[tuple[float, float], str | None]] = {}

    def value(self, ref: ValueRef) -> torch.Tensor:
        found = self._values.get(ref)
        if found is None:
            val = self.graph_nodes[ref[0]].meta["val"]
            found = self._values[ref] = val[ref[1]] if isinstance(val, (list, tuple)) else val
        return found

    def compute_costs(self, space: StrategySpace) -> dict[str, list[float]]:
        """Node → compute seconds under each of its strategies: timed on this host when the
        profile says it is the host that runs (:mod:`~autopar.cost_model.op_timing`), else
        the roofline; scaled by the profile's ``step_scale``, but for the node overhead a
        timed op adds (:meth:`node_overhead_s`), measured as a program runs it."""
        costs = {}
        for n in space.nodes:
            if n.kind != "op":
                costs[n.name] = [0.0] * len(n.strategies)
                continue
            node = self.graph_nodes[n.name]
            work, fmt = self.op_work(n.name)
            costs[n.name] = []
            for s in n.strategies:
                timed = self._timed(node, s)
                costs[n.name].append(
                    self.scale * compute_s(work, s, self.mesh, self.hardware, fmt)
                    if timed is None
                    else self.scale * timed + self._per_node_s()
                )
        return costs

    def op_work(self, name: str) -> tuple[tuple[float, float], str | None]:
        """Node ``name``'s whole work (:func:`~autopar.cost_model.compute.node_work`) and the
        number format of its multiply-adds (:func:`~autopar.cost_model.compute.math_format`),
        found once: every plan priced asks again."""
        found = self._work.get(name)
        if found is None:
            node = self.graph_nodes[name]
            found = self._work[name] = node_work(node), math_format(node)
        return found

    def rank_flops(self, name: str, strategy: Strategy) -> float:
        """FLOPs one rank runs for node ``name`` under ``strategy``, counted as
        :mod:`torch.utils.flop_counter` counts them (0 for ops it has no formula for)."""
        (flops, _), fmt = self.op_work(name)
        return 0.0 if fmt is None else flops / work_divisor(strategy, self.mesh)

    def node_overhead_s(self, name: str, strategy: Strategy) -> float:
        """What node ``name`` under ``strategy`` costs beyond its op, where the op is timed
        (:meth:`_per_node_s`); 0 for an op priced by the roofline, whose profile has no node
        overhead."""
        return 0.0 if self._timed(self.graph_nodes[name], strategy) is None else self._per_node_s()

    def _per_node_s(self) -> float:
        """The profile's node overhead under the ranks' contention."""
        return self.fitted.node_overhead_s * self.fitted.contention

    def host(self) -> Host | None:
        """What offloading to host memory costs,
        or ``None`` when the profile has no host link (a CPU computes in host memory)."""
        link = self.hardware.host_link
        return None if link is None else Host(link, self.hardware.host_update_s, self.hardware.host_bytes_per_device())

    def step_overhead_s(self, num_params: int) -> float:
        """The profile's time per step around the per-rank program, for ``num_params``
        parameters, under the ranks' contention (the same under every plan, so the solver
        leaves it out; measured as a step runs it, so not stretched by the step scale)."""
        fitted = self.fitted
        return (fitted.step_overhead_s + num_params * fitted.param_overhead_s) * fitted.contention

    def _timed(self, node, strategy: Strategy) -> float | None:
        """Seconds of ``node``'s op under ``strategy`` timed on this host, under the ranks'
        contention; ``None`` where it is not timed."""
        if self.timer is None:
            return None
        seconds = self.timer.node_s(node, strategy)
        return None if seconds is None else seconds * self.fitted.contention

    def node_costs(self, space: StrategySpace, compute: dict[str, list[float]]) -> dict[str, list[float]]:
        """Node → seconds under each of its strategies: its ``compute`` (:meth:`compute_costs`),
        and the all-reduces of an op that splits a dim it reduces (:meth:`split_steps`)."""
        return {
            n.name: [
                c + sum(self.step_s(s) for s in self.split_steps(n.name, strategy)) if n.kind == "op" else c
                for c, strategy in zip(compute[n.name], n.strategies)
            ]
            for n in space.nodes
        }

    def with_accumulation(self, space: StrategySpace, node_costs: dict[str, list[float]], additions: int) -> None:
        """Add to ``node_costs`` what a step of ``additions`` micro-batches after the first pays
        for adding each gradient into the sum of the micro-batches' (:meth:`addition_s`, at the
        layout its producer makes it in), on the gradient's producer, weighted by
        :attr:`gradient_share` as the gradients' collectives are: it is paid once per step."""
        by_name = space.index()
        for n in space.nodes:
            if n.kind == "param" and n.args:
                ref = n.args[0]
                producer = by_name[ref[0]]
                node_costs[producer.name] = [
                    c + self.gradient_share * additions * self.addition_s(ref, s.outputs[ref[1]])
                    for c, s in zip(node_costs[producer.name], producer.strategies)
                ]

    def split_steps(self, name: str, strategy: Strategy) -> tuple[Step, ...]:
        """The all-reduces node ``name`` makes itself under ``strategy``, when the strategy
        splits a dim the op reduces (:class:`~autopar.passes.rules.SplitOp`)."""
        node = self.graph_nodes[name]
        split = split_op(node.target)
        axes = split.axes(node, strategy) if split is not None else ()
        if not axes or not split.reduces:
            return ()
        reduced = split.reduced(node)
        layout = tuple(R if axis in axes else p for axis, p in enumerate(split.placements(strategy)))
        nbytes = math.prod(local_shape(tuple(reduced.shape), layout, self.mesh)) * reduced.element_size()
        return tuple(Step("all_reduce", axis, bytes=nbytes) for _ in split.reduces for axis in axes)

    def steps(self, ref: ValueRef, src: Placements, dst: Placements) -> tuple[Step, ...]:
        value = self.value(ref)
        return transition(
            src, dst, tuple(value.shape), value.element_size(), value.dtype.is_floating_point, self.mesh, self.links
        )

    def step_s(self, step: Step) -> float:
        return step_s(step, self.mesh, self.links)

    def addition_s(self, ref: ValueRef, placements: Placements) -> float:
        """Seconds of adding a piece of value ``ref`` laid out as ``placements`` into another
        (reading both, writing one), by the roofline: a micro-batch's gradient added to the sum
        of those before under gradient accumulation."""
        nbytes = self.local_bytes(ref, placements)
        return self.scale * self.hardware.compute_s(nbytes / self.value(ref).element_size(), 3 * nbytes)

    def value_kind(self, ref: ValueRef) -> tuple:
        """What the cost of moving value ``ref`` depends on: its shape, its dtype and whether it
        must not be reduced (:attr:`unreduced`)."""
        kind = self._kinds.get(ref)
        if kind is None:
            value = self.value(ref)
            kind = self._kinds[ref] = (tuple(value.shape), value.dtype, ref[0] in self.unreduced)
        return kind

    def transition_s(self, ref: ValueRef, src: Placements, dst: Placements) -> float:
        kind = self._kinds.get(ref) or self.value_kind(ref)
        found = self._transitions.get((kind, src, dst))
        if found is None:
            found = self._transitions[kind, src, dst] = (
                math.inf if kind[2] and _reduces(src, dst) else sum(self.step_s(s) for s in self.steps(ref, src, dst))
            )
        return found

    def gradient_s(self, ref: ValueRef, src: Placements, dst: Placements) -> tuple[float, BucketShare | None]:
        """Moving parameter gradient ``ref`` into its parameter's placements: a move that joins a
        bucket (:func:`~autopar.passes.propagation.buckets.gradient_chain`) costs its bandwidth terms and local
        ops here (:func:`~autopar.passes.propagation.buckets.piece_s`) and its share of the bucket's fixed
        cost, returned beside it; any other move costs what
        :meth:`transition_s` says, and ``None``."""
        return self._bucketed(ref, self.steps(ref, src, dst), self.gradient_chain(ref, src, dst), self.gradient_share)

    def gradient_chain(self, ref: ValueRef, src: Placements, dst: Placements) -> tuple[Step, ...] | None:
        """The collectives by which gradient ``ref`` joins a bucket moving from ``src`` to ``dst``
        (:func:`~autopar.passes.propagation.buckets.gradient_chain`), or ``None``."""
        value = self.value(ref)
        return gradient_chain(
            src,
            dst,
            tuple(value.shape),
            value.element_size(),
            value.dtype.is_floating_point,
            self.mesh,
            self.links,
            self.bucket_bytes,
        )

    def gather_s(self, ref: ValueRef, src: Placements, dst: Placements) -> tuple[float, BucketShare | None]:
        """Moving parameter ``ref`` into placements an op reads it in, as :meth:`gradient_s` does
        for gradients: a move that is one all-gather joins the bucket of its layer and phase
        (:func:`~autopar.passes.propagation.buckets.parameter_gathers`) and costs its bandwidth term and local
        ops here, its share of the bucket's fixed cost beside it."""
        steps = self.steps(ref, src, dst)
        return self._bucketed(ref, steps, steps if len(steps) == 1 and steps[0].kind == "all_gather" else None)

    def _bucketed(
        self, ref: ValueRef, steps: tuple[Step, ...], chain: tuple[Step, ...] | None, weight: float = 1.0
    ) -> tuple[float, BucketShare | None]:
        if chain is None:
            return weight * sum(self.step_s(s) for s in steps), None
        fixed = bucket_fixed_s(chain, self.mesh, self.links)
        group = (collectives_of(chain), self.value(ref).dtype)
        share = BucketShare(group, min(1.0, chain[0].bytes / self.bucket_bytes), weight * fixed)
        return weight * piece_s(chain, self.mesh, self.links), share

    def one_step_moves(self, ref: ValueRef) -> tuple[tuple[Placements, Placements, float], ...]:
        """Every move of ``ref`` between valid layouts that differ on one mesh axis, priced."""
        value = self.value(ref)
        moves = one_step_moves(
            tuple(value.shape), value.element_size(), value.dtype.is_floating_point, self.mesh, self.links
        )
        if ref[0] in self.unreduced:
            return tuple(move for move in moves if not _reduces(move[0], move[1]))
        return moves

    def local_bytes(self, ref: ValueRef, placements: Placements) -> int:
        found = self._bytes_of.get((ref, placements))
        if found is None:
            value = self.value(ref)
            key = (tuple(value.shape), value.dtype, placements)
            if key not in self._local_bytes:
                self._local_bytes[key] = math.prod(local_shape(key[0], placements, self.mesh)) * value.element_size()
            found = self._bytes_of[ref, placements] = self._local_bytes[key]
        return found


def step_working_set(captured: Captured, mesh: Mesh, optimizer_slots: int = ADAM_SLOTS) -> int:
    """Bytes a training step touches on this host between two reads of one weight: on every
    rank, the model's parameters whole (gathered where a plan shards them), their gradients and
    ``optimizer_slots`` optimizer states each (2 for Adam), which the optimizer step walks through
    after the backward (:class:`~autopar.cost_model.op_timing.OpTimer` times large ops on copies
    spanning it)."""
    params = sum(
        n.meta["val"].nbytes for n, kind in zip(captured.placeholders, captured.inputs) if kind.kind == "param"
    )
    return (2 + optimizer_slots) * params * mesh.size


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Per-device memory as a function of the chosen strategies, by part: for each part, node
    name → bytes under each of the node's strategies. The solver counts them at each moment of
    the step (:func:`autopar.passes.solve.memory_program.memory_budget`)."""

    params: dict[str, list[float]]
    grads: dict[str, list[float]]
    optimizer: dict[str, list[float]]
    activations: dict[str, list[float]]
    """Forward values the backward reads, charged to the node producing them."""
    temporaries: dict[str, list[float]]
    """Each op's largest output."""
    moved: dict[str, list[tuple[tuple[str, int], list[float], list[float]]]] = field(default_factory=dict)
    """Per op, for each value it reads: the value, its bytes in the op's layout under each of
    the op's strategies, and its bytes as made under each of its producer's. A read in another
    layout than the value's holds a moved copy while the op runs."""
    optimizer_slots: int = ADAM_SLOTS
    """Tensors of its parameter's size the optimizer keeps per parameter, in ``optimizer``."""
    made_grads: dict[str, tuple[str, list[float]]] = field(default_factory=dict)
    """Per parameter, its gradient's producer and the gradient's bytes as made under each of the
    producer's strategies, before any collective moves it into the parameter's placements: what
    the sums of the micro-batches' gradients hold (a pipeline's step, ``no_sync()``)."""

    def moved_bytes(self, name: str, choice: dict[str, int]) -> float:
        """The bytes of the copies op ``name`` reads that are larger than the values they copy."""
        return sum(max(0.0, read[choice[name]] - made[choice[ref[0]]]) for ref, read, made in self.moved.get(name, ()))

    def estimate(
        self,
        choice: dict[str, int],
        activations: tuple[frozenset[str], int, int, int] | None = None,
        host_optimizer: frozenset[str] = frozenset(),
        host_params: frozenset[str] = frozenset(),
    ) -> MemoryEstimate:
        """The parts under ``choice``. ``activations`` = (ops priced by a keep, recompute or
        offload choice, their kept, recomputed and offloaded bytes) replaces those ops'
        activations, and their outputs are no temporaries (they are held while the backward
        needs them); the optimizer state of the ``host_optimizer`` parameters, and the
        ``host_params`` with their gradients, are in host memory."""

        def total(part, exclude=frozenset()):
            return int(sum(sizes[choice[name]] for name, sizes in part.items() if name not in exclude))

        chosen, kept, recomputed, offloaded = activations if activations is not None else (frozenset(), 0, 0, 0)
        temporaries = max(
            (sizes[choice[name]] for name, sizes in self.temporaries.items() if name not in chosen), default=0
        )
        on_host = sum(
            total(part) - total(part, names)
            for part, names in ((self.optimizer, host_optimizer), (self.params, host_params), (self.grads, host_params))
        )
        return MemoryEstimate(
            total(self.params, host_params),
            total(self.grads, host_params),
            total(self.optimizer, host_optimizer),
            total(self.activations, chosen) + kept,
            int(temporaries),
            recomputed,
            offloaded + on_host,
        )


def memory_terms(space: StrategySpace, costs: CostModel, *, optimizer_slots: int = ADAM_SLOTS) -> MemoryTerms:
    """Parameters, their gradients and ``optimizer_slots`` optimizer states each (2 for Adam),
    the forward values the backward reads with the batch's pieces (the runtime holds them for the
    step), and the largest temporary."""
    by_name = space.index()
    params, grads, optimizer, activations, temporaries = {}, {}, {}, {}, {}
    gradients: dict[str, ValueRef] = {}
    saved: dict[str, set[int]] = {}
    for n in space.nodes:
        if n.phase == "backward" and n.kind == "op":
            for name, index in n.args:
                if by_name[name].phase == "forward" and by_name[name].kind in ("op", "input"):
                    saved.setdefault(name, set()).add(index)
    for n in space.nodes:
        if n.kind in ("param", "buffer"):
            sizes = [float(costs.local_bytes((n.name, 0), s.outputs[0])) for s in n.strategies]
            params[n.name] = sizes
            if n.kind == "param" and n.args:  # an updated buffer reads its new value, but has no gradient
                grads[n.name] = sizes
                optimizer[n.name] = [optimizer_slots * b for b in sizes]
                gradients[n.name] = n.args[0]
        if n.name in saved or n.kind == "input":  # the batch's pieces are held for the whole step, read or not
            read = saved.get(n.name, set()) | ({0} if n.kind == "input" else set())
            activations[n.name] = [
                float(sum(costs.local_bytes((n.name, i), s.outputs[i]) for i in read)) for s in n.strategies
            ]
        if n.kind == "op":
            temporaries[n.name] = [
                float(
                    max(
                        (costs.local_bytes((n.name, i), p) for i, p in enumerate(s.outputs) if p is not None), default=0
                    )
                )
                for s in n.strategies
            ]
    made: dict[
        ValueRef, list[float]
    ] = {}  # a value's bytes under each of its producer's strategies, for all its readers

    def made_as(ref: ValueRef) -> list[float]:
        if ref not in made:
            made[ref] = [float(costs.local_bytes(ref, s.outputs[ref[1]])) for s in by_name[ref[0]].strategies]
        return made[ref]

    moved = {
        n.name: [
            (ref, [float(costs.local_bytes(ref, s.inputs[j])) for s in n.strategies], made_as(ref))
            for j, ref in enumerate(n.args)
            if ref[0] != n.name
        ]
        for n in space.nodes
        if n.kind == "op"
    }
    made_grads = {name: (ref[0], made_as(ref)) for name, ref in gradients.items()}
    return MemoryTerms(params, grads, optimizer, activations, temporaries, moved, optimizer_slots, made_grads)
