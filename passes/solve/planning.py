"""Turn the solver's choice into a :class:`~autopar.core.plan.ShardingPlan`."""

import dataclasses
from collections import defaultdict

from autopar.cost_model.estimate import CostModel, MemoryTerms
from autopar.cost_model.hardware import Host
from autopar.passes.analysis.capture import Captured, gradient_values, module_paths
from autopar.passes.propagation.buckets import ParameterGather, bucket_s, gradient_buckets, parameter_gathers
from autopar.passes.solve.remat import ActivationSpace, activation_bytes, kept_bytes, kept_ops, refilled_bytes
from autopar.passes.solve.solver import Solution

from autopar.core.kinds import Activation, CollectivePhase, NodeKind
from autopar.core.mesh import Mesh
from autopar.core.plan import Collective, MemoryEstimate, NodePlan, PlannedBucket, PlannedMove, ShardingPlan
from autopar.core.strategy import Strategy, StrategySpace, ref_name

_MOVED_IN: dict[NodeKind, CollectivePhase] = {"param": "backward", "output": "output"}
"""The phase of the moves into a node of these kinds, where it is not the node's own: a
parameter reads its gradient in the backward, and the graph's results are made whole for the
caller."""


def planned_moves(space: StrategySpace, chosen: dict[str, Strategy], recomputed: frozenset[str] = frozenset()):
    """Every distinct move of a tensor to other placements that the step makes, with its
    consumer and phase, in the order the rewriter makes them.

    Yields ``(ref, src, dst, consumer, phase)``. A tensor moved to the same placements for
    several consumers is moved once in the forward and once in the backward: the backward
    moves what its ops and its recomputations read itself. Parameters' and buffers' reads of
    their gradients and new values come last.
    """
    by_name = space.index()
    seen: set = set()
    done: set[str] = set()

    def move(ref, dst, consumer, phase: CollectivePhase, in_backward):
        src = chosen[ref[0]].outputs[ref[1]]
        if src != dst and (in_backward, ref, dst) not in seen:
            seen.add((in_backward, ref, dst))
            yield ref, src, dst, consumer, phase

    def recompute(name):
        done.add(name)
        node = by_name[name]
        for j, ref in enumerate(node.args):
            if ref[0] in recomputed and ref[0] not in done:
                yield from recompute(ref[0])
            yield from move(ref, chosen[name].inputs[j], node, "recompute", True)

    for n in sorted(space.nodes, key=lambda n: n.kind in ("param", "buffer")):
        phase = _MOVED_IN.get(n.kind, n.phase)
        for j, ref in enumerate(n.args):
            in_backward = by_name[ref[0]].phase == "backward" or (n.kind == "op" and n.phase == "backward")
            again = in_backward and ref[0] in recomputed
            if again and ref[0] not in done:
                yield from recompute(ref[0])
            yield from move(ref, chosen[n.name].inputs[j], n, "recompute" if again else phase, in_backward)


def build_plan(
    captured: Captured,
    space: StrategySpace,
    solution: Solution,
    costs: CostModel,
    compute: dict[str, list[float]],
    memory: MemoryTerms,
    activations: ActivationSpace,
    *,
    hardware_name: str,
    pinned: tuple[str, ...],
    memory_budget_bytes: int | None,
    stage_s: dict[str, float],
) -> ShardingPlan:
    """The plan of ``solution``; ``compute`` is each node's compute time under each strategy
    (:meth:`~autopar.cost_model.estimate.CostModel.compute_costs`)."""
    mesh = costs.mesh
    by_name = space.index()
    choice, recomputed = solution.choice, solution.recomputed
    chosen = {name: by_name[name].strategies[k] for name, k in choice.items()}
    host = costs.host()
    nodes = _node_plans(captured, space, solution, chosen, costs, compute, activations, host)
    gathers = parameter_gathers(
        captured,
        chosen,
        recomputed,
        set(solution.host_params),
        mesh,
        costs.links,
        costs.bucket_bytes,
        costs.bucket_groups,
    )
    buckets: list[PlannedBucket] = []
    moves: dict[tuple, PlannedMove] = {}
    collectives = tuple(_collectives(space, chosen, recomputed, costs, mesh, gathers, buckets, moves))
    in_flight = max((c.bytes for c in collectives if c.consumer == "gradients"), default=0)
    gradients = [(ref, chosen[ref[0]].outputs[ref[1]]) for _, _, ref in gradient_values(captured, space.aliases)]
    return ShardingPlan(
        mesh=mesh,
        hardware=hardware_name,
        links=costs.links,
        graph_hash=captured.graph_hash,
        graph_lines=captured.graph_lines,
        placements={n.target: chosen[n.name].outputs[0] for n in space.nodes if n.kind in ("param", "buffer")},
        inputs={n.target: chosen[n.name].outputs[0] for n in space.nodes if n.kind == "input"},
        pinned=pinned,
        nodes=nodes,
        collectives=collectives,
        bucket_bytes=costs.bucket_bytes,
        compute_s=sum(n.compute_s for n in nodes),
        communication_s=sum(c.time_s for c in collectives),
        memory=_plan_memory(memory, activations, solution, host, in_flight),
        memory_budget_bytes=memory_budget_bytes,
        solver=solution.info,
        stage_s=stage_s,
        recompute_s=sum(compute[name][choice[name]] for name in recomputed),
        node_overhead_s=sum(costs.node_overhead_s(n.name, chosen[n.name]) for n in space.nodes if n.kind == "op")
        + sum(costs.node_overhead_s(name, chosen[name]) for name in recomputed),
        overhead_s=costs.step_overhead_s(sum(n.kind == "param" for n in space.nodes)),
        offload_s=offload_s(activations, solution, memory, host, {n: c[choice[n]] for n, c in compute.items()}),
        host_optimizer=tuple(by_name[name].target for name in sorted(solution.host_optimizer)),
        host_params=tuple(by_name[name].target for name in sorted(solution.host_params)),
        optimizer_slots=memory.optimizer_slots,
        prefetched=tuple(s for s in dict.fromkeys(activations.segment.values()) if s in solution.prefetched),
        buckets=tuple(buckets),
        moves=tuple(moves.values()),
        accumulation_add_s=sum(costs.addition_s(ref, p) for ref, p in gradients),
        accumulated_bytes=sum(costs.local_bytes(ref, p) for ref, p in gradients),
    )


def _node_plans(
    captured: Captured,
    space: StrategySpace,
    solution: Solution,
    chosen: dict[str, Strategy],
    costs: CostModel,
    compute: dict[str, list[float]],
    activations: ActivationSpace,
    host: Host | None,
) -> tuple[NodePlan, ...]:
    """The plan of every op of ``space``, with how the step holds its outputs for the backward."""
    choice, recomputed, offloaded = solution.choice, solution.recomputed, solution.offloaded
    modules = module_paths(captured)
    needed = kept_ops(activations, recomputed, offloaded)

    def activation(name: str) -> tuple[Activation, int, float]:
        if name in recomputed:
            return "recompute", int(activations.bytes[name][choice[name]]), 0.0
        if name in offloaded:
            size = activations.bytes[name][choice[name]]
            return "offload", int(size), 2 * host.copy_s(size)
        if name in needed:
            return "keep", kept_bytes(activations, name, choice, recomputed), 0.0
        return "", 0, 0.0

    return tuple(
        NodePlan(
            n.name,
            n.target,
            modules.get(n.name, ""),
            n.phase,
            chosen[n.name].outputs,
            chosen[n.name].inputs,
            compute[n.name][choice[n.name]],
            *activation(n.name),
            costs.op_work(n.name)[1] or "",
            costs.rank_flops(n.name, chosen[n.name]),
        )
        for n in space.nodes
        if n.kind == "op"
    )


def _plan_memory(
    memory: MemoryTerms, activations: ActivationSpace, solution: Solution, host: Host | None, in_flight: int
) -> MemoryEstimate:
    """The memory estimate of ``solution``, with the ``in_flight`` bytes of gradient buckets."""
    choice, recomputed, offloaded = solution.choice, solution.recomputed, solution.offloaded
    kept_total, recomputed_total, offloaded_total = activation_bytes(
        activations, choice, recomputed, offloaded, solution.prefetched
    )
    return dataclasses.replace(
        memory.estimate(
            choice,
            (frozenset(activations.nodes), kept_total, recomputed_total, offloaded_total),
            solution.host_optimizer,
            solution.host_params,
        ),
        bucket_bytes=in_flight,
        host_capacity_bytes=_host_capacity(host),
        moment_bytes=moment_bytes(
            memory,
            activations,
            choice,
            recomputed,
            offloaded,
            solution.prefetched,
            solution.host_optimizer,
            solution.host_params,
            in_flight,
        ),
    )


def moment_bytes(
    memory: MemoryTerms,
    acts: ActivationSpace,
    choice: dict[str, int],
    recomputed: frozenset[str],
    offloaded: frozenset[str],
    prefetched: frozenset[str],
    host_optimizer: frozenset[str],
    host_params: frozenset[str],
    bucket: int = 0,
) -> int:
    """What the solver counts alive at the fullest moment of the training step
    (:func:`~autopar.passes.solve.memory_program.memory_budget`): parameters and optimizer state not
    in host memory (those in host memory in the backward that makes their gradients), the
    gradients made by then, the activations kept until then and the
    values the moment's segment recomputes or reloads, with the most its backward holds beyond
    that while one of its ops runs (what it made, less the forward values it has read for the
    last time; with the copies of operands that op gathers), and once the backward has begun the
    ``bucket`` of gradients in flight; or at the
    optimizer step, what the backward's end holds with two of the largest parameter; or in the
    forward, while one of its ops runs, the activations kept by then and the values alive
    beside them."""
    kept = {
        name: kept_bytes(acts, name, choice, recomputed) for name in kept_ops(acts, recomputed, offloaded) - recomputed
    }
    held = _held_bytes(memory, acts, choice, kept, host_optimizer, host_params)
    during = defaultdict(float, refilled_bytes(acts, choice, recomputed, offloaded, prefetched))
    for segment, size in _backward_peaks(memory, acts, choice, kept).items():
        during[segment] += size
    elsewhere = sum(size for segment, size in during.items() if segment not in acts.backward_order)
    # each segment's backward starting, then the last one's ending
    at = (*acts.backward_order, *acts.backward_order[-1:])
    moments = [held[k] + elsewhere + during[segment] + (bucket if k else 0) for k, segment in enumerate(at)]
    stepped = 2 * max(
        (
            sizes[choice[name]]
            for name, sizes in memory.params.items()
            if name in memory.optimizer and name not in host_optimizer
        ),
        default=0,
    )
    return int(
        max(
            *(moments or [held[0] + elsewhere + bucket]),
            held[0] + elsewhere + _forward_peak(memory, acts, choice, kept),
            held[-1] + elsewhere + stepped,
        )
    )


def _held_bytes(
    memory: MemoryTerms,
    acts: ActivationSpace,
    choice: dict[str, int],
    kept: dict[str, int],
    host_optimizer: frozenset[str],
    host_params: frozenset[str],
) -> list[float]:
    """Per moment, the bytes of the parameters, optimizer state, gradients and activations held
    at it (``kept`` are the bytes each kept op holds)."""
    last = acts.moments - 1
    held = [0.0] * acts.moments

    def add(first: int, end: int, size: float) -> None:
        for k in range(first, end + 1):
            held[k] += size

    for name, sizes in memory.params.items():
        add(0, last, 0 if name in host_params else sizes[choice[name]])
    for name, sizes in memory.optimizer.items():
        add(0, last, 0 if name in host_optimizer else sizes[choice[name]])
    for name, sizes in memory.grads.items():
        made = acts.grad_made.get(name, 0)
        add(made, last, 0 if name in host_params else sizes[choice[name]])
        if name in host_params:  # copied in for the backward that makes its gradient, which goes out
            add(max(made - 1, 0), max(made - 1, 0), sizes[choice[name]] + memory.params[name][choice[name]])
    for name, sizes in memory.activations.items():
        if name not in acts.segment:
            add(0, acts.released.get(name, last), sizes[choice[name]])
    for name, size in kept.items():
        add(0, acts.released.get(name, last), size)
    return held


def _backward_peaks(
    memory: MemoryTerms, acts: ActivationSpace, choice: dict[str, int], kept: dict[str, int]
) -> dict[str | None, float]:
    """Per segment, the most its backward holds beyond what it was given while one of its ops
    runs (``None`` for backward ops of no segment of :attr:`ActivationSpace.backward_order`)."""
    largest: dict = defaultdict(float)
    for name, sizes in memory.temporaries.items():
        if name not in acts.segment:
            segment = acts.backward_segment.get(name)
            segment = segment if segment in acts.backward_order else None
            made = sum(acts.made[u][choice[u]] for u in acts.alive[name]) - sum(
                acts.bytes[u][choice[u]] if acts.segment[u] == segment else kept.get(u, 0)
                for u in acts.freed.get(name, ())
            )
            largest[segment] = max(largest[segment], made + memory.moved_bytes(name, choice))
    return largest


def _forward_peak(memory: MemoryTerms, acts: ActivationSpace, choice: dict[str, int], kept: dict[str, int]) -> float:
    """The most the forward holds while one of its ops runs beyond what it keeps, less what the
    ops after the one running keep."""
    forward = later = 0.0
    for name in reversed(acts.nodes):
        alive = sum(acts.made[u][choice[u]] - kept.get(u, 0) for u in acts.alive[name])
        forward = max(forward, alive + memory.moved_bytes(name, choice) - later)
        later += kept.get(name, 0)
    return forward


def offload_s(
    acts: ActivationSpace, solution: Solution, memory: MemoryTerms, host: Host | None, compute: dict[str, float]
) -> float:
    """Seconds per step that offloading costs, as the solver prices them
    (:mod:`autopar.passes.solve.memory_choices`): what of the copies out is left when the forward's
    compute ends, each segment's copies back (when prefetched, what of them is left when the
    backward of the segment after it ends), for each parameter stepped on the host its gradient out, its piece back and
    the host's update, and for each parameter in host memory one more copy in."""
    if host is None:
        return 0.0
    choice = solution.choice
    out: dict[str, float] = {}
    for name in solution.offloaded:
        out[acts.segment[name]] = out.get(acts.segment[name], 0.0) + host.copy_s(acts.bytes[name][choice[name]])
    work: dict[str, float] = {}
    for name in acts.nodes:
        work[acts.segment[name]] = work.get(acts.segment[name], 0.0) + compute[name]
    backward_work: dict[str, float] = {}
    for name, segment in acts.backward_segment.items():
        backward_work[segment] = backward_work.get(segment, 0.0) + compute[name]
    backlog = 0.0
    for segment in work:  # in forward order
        backlog = max(0.0, backlog + out.get(segment, 0.0) - work[segment])
    total = backlog
    during = acts.reloaded_during()
    for segment, seconds in out.items():
        beside = backward_work.get(during.get(segment), 0.0) if segment in solution.prefetched else 0.0
        total += max(0.0, seconds - beside)
    for name in solution.host_optimizer:
        grad, size = memory.grads[name][choice[name]], memory.optimizer[name][choice[name]]
        total += host.optimizer_s(grad, size)
    for name in solution.host_params:
        total += host.copy_s(memory.params[name][choice[name]])
    return total


def _host_capacity(host: Host | None) -> int:
    return int(host.capacity_bytes) if host is not None and host.capacity_bytes < float("inf") else 0


def _collectives(
    space: StrategySpace,
    chosen,
    recomputed: frozenset[str],
    costs: CostModel,
    mesh: Mesh,
    gathers: list[ParameterGather],
    buckets: list[PlannedBucket],
    moves: dict[tuple, PlannedMove],
):
    """The collectives of every planned move (each move outside a bucket going to ``moves``),
    then the all-reduces ops make themselves
    (:meth:`~autopar.cost_model.estimate.CostModel.split_steps`, again when recomputed), then one
    per bucket of the gradient moves that are bucketed
    (:func:`~autopar.passes.propagation.buckets.gradient_buckets`) and one per bucket of parameters
    gathered together (``gathers``), as the rewriter runs them, each with the local ops the
    rewriter runs around it. What each bucket moves goes to ``buckets``, which the rewriter runs."""
    gradients = []  # (steps, dtype, src, dst, parameter) of each bucketed gradient move, in parameter order
    yield from _move_collectives(space, chosen, recomputed, costs, mesh, gathers, gradients, moves)
    yield from _split_collectives(space, chosen, recomputed, costs, mesh)
    yield from _gradient_bucket_collectives(gradients, costs, mesh, buckets)
    yield from _gather_collectives(gathers, chosen, costs, mesh, space.index(), buckets)


def _move_collectives(
    space: StrategySpace,
    chosen,
    recomputed: frozenset[str],
    costs: CostModel,
    mesh: Mesh,
    gathers: list[ParameterGather],
    gradients: list,
    moves: dict[tuple, PlannedMove],
):
    """The collectives of the planned moves that are neither gathered with a bucket of
    parameters nor bucketed, each such move going to ``moves`` once; the bucketed gradient
    moves go to ``gradients``."""
    in_gathers = {key for g in gathers for key in g.keys}
    for ref, src, dst, consumer, phase in planned_moves(space, chosen, recomputed):
        if (phase != "forward", ref, dst) in in_gathers:
            continue
        steps = costs.steps(ref, src, dst)
        bucketed = costs.gradient_chain(ref, src, dst) if consumer.kind == "param" else None
        if bucketed is not None:
            gradients.append((bucketed, costs.value(ref).dtype, src, dst, consumer.target))
            continue
        moves.setdefault((ref, src, dst), PlannedMove(ref_name(ref), src, dst, steps))
        for step in steps:
            if step.is_collective:
                yield Collective(
                    kind=step.kind,
                    axis=mesh.axis_names[step.axis],
                    bytes=step.bytes,
                    phase=phase,
                    time_s=costs.step_s(step),
                    tensor=ref_name(ref),
                    consumer=consumer.name,
                    src=(src,),
                    dst=(dst,),
                    gradient=consumer.kind == "param",
                )


def _split_collectives(space: StrategySpace, chosen, recomputed: frozenset[str], costs: CostModel, mesh: Mesh):
    """The all-reduces ops make themselves, again when recomputed."""
    for n in space.nodes:
        steps = costs.split_steps(n.name, chosen[n.name]) if n.kind == "op" else ()
        layout = (chosen[n.name].inputs[0],) if steps else ()
        phases: tuple[CollectivePhase, ...] = (n.phase, "recompute") if n.name in recomputed else (n.phase,)
        for phase in phases:
            for step in steps:
                yield Collective(
                    kind=step.kind,
                    axis=mesh.axis_names[step.axis],
                    bytes=step.bytes,
                    phase=phase,
                    time_s=costs.step_s(step),
                    tensor=n.name,
                    consumer=n.name,
                    src=layout,
                    dst=layout,
                )


def _gradient_bucket_collectives(gradients: list, costs: CostModel, mesh: Mesh, buckets: list[PlannedBucket]):
    """One collective per bucket of the bucketed gradient moves ``gradients``, whose members
    go to ``buckets``; gradients of parameters on different pipeline stages never share one."""
    groups = costs.bucket_groups
    for bucket in gradient_buckets([(*g[:2], groups.get(g[4], 0)) for g in gradients], costs.bucket_bytes):
        members = [gradients[i] for i in bucket.members]
        buckets.append(
            PlannedBucket(
                "gradients",
                "backward",
                "",
                tuple(m[4] for m in members),
                tuple(m[3] for m in members),
                tuple(m[0] for m in members),
            )
        )
        for k, step in enumerate(bucket.steps):  # the packing and the pieces' copies go with the first
            yield Collective(
                kind=step.kind,
                axis=mesh.axis_names[step.axis],
                bytes=step.bytes,
                phase="backward",
                time_s=bucket_s((step,), [m[0][:1] for m in members], mesh, costs.links)
                if k == 0
                else costs.step_s(step),
                tensor=f"bucket of {len(members)} gradients",
                consumer="gradients",
                src=tuple(dict.fromkeys(m[2] for m in members)),
                dst=tuple(dict.fromkeys(m[3] for m in members)),
                gradient=True,
            )


def _gather_collectives(
    gathers: list[ParameterGather], chosen, costs: CostModel, mesh: Mesh, by_name: dict, buckets: list[PlannedBucket]
):
    """One all-gather per bucket of parameters gathered together, whose members go to ``buckets``."""
    for g in gathers:
        buckets.append(
            PlannedBucket(
                "parameters",
                g.phase,
                g.segment,
                tuple(by_name[k[1][0]].target for k in g.keys),
                tuple(k[2] for k in g.keys),
                tuple((s,) for s in g.steps),
            )
        )
        yield Collective(
            kind="all_gather",
            axis=mesh.axis_names[g.bucket.step.axis],
            bytes=g.bucket.step.bytes,
            phase=g.phase,
            time_s=bucket_s((g.bucket.step,), [(s,) for s in g.steps], mesh, costs.links),
            tensor=f"bucket of {len(g.keys)} parameters",
            consumer=f"parameters of {g.segment or '(root)'}",
            src=tuple(dict.fromkeys(chosen[k[1][0]].outputs[0] for k in g.keys)),
            dst=tuple(dict.fromkeys(k[2] for k in g.keys)),
        )
