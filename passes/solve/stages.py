"""Pipeline stages for a plan: where to cut the model, and what each stage costs.

The cuts fall between the model's layers and the modules outside its stacks
(:func:`~autopar.passes.analysis.stages.layer_order`): these, each weighed by its FLOPs, are cut
into as many runs of consecutive units as there are stages (the pipeline axis's positions, times
the stages each runs under the interleaved schedule), the heaviest run as
light as it can be (a linear-partition dynamic program over the units). The plan inside the
stages is then the integer program's for one micro-batch on the mesh without the pipeline axis,
its gradient buckets each of one stage, each position of the pipeline axis held to the memory
budget (:mod:`autopar.passes.solve.stage_memory`). Each micro-batch takes the busiest position's
time per step of the schedule (:attr:`~autopar.core.pipeline.Stages.step_s`).
"""

import dataclasses
import math
from collections.abc import Sequence

from autopar.cost_model.compute import node_work
from autopar.passes.analysis.capture import Captured, gradient_values
from autopar.passes.analysis.stages import Staged, cut_units, layer_order
from autopar.passes.propagation.redistribute import local_shape

from autopar.core.errors import InfeasiblePlanError, InputError
from autopar.core.explain import format_bytes
from autopar.core.mesh import Link, Mesh
from autopar.core.pipeline import Pipeline, Send, Stages, held_activations
from autopar.core.plan import ShardingPlan
from autopar.core.strategy import getitem_aliases


def cut_stages(captured: Captured, count: int) -> tuple[tuple[str, ...], ...]:
    """The units of ``captured`` (:func:`~autopar.passes.analysis.stages.layer_order`) cut into
    ``count`` runs of consecutive units whose largest FLOPs (forward and backward, as
    :mod:`torch.utils.flop_counter` counts them) are the least they can be."""
    layers = layer_order(captured)
    if len(layers) < count:
        raise InputError(
            f"{count} pipeline stages need as many layers or modules to cut between, and the model has "
            f"{len(layers)} ({', '.join(layers) or 'none'}). Fix: a smaller pipeline axis, a model of more layers, "
            "or compile without pipeline="
        )
    units = cut_units(captured)
    work = dict.fromkeys(layers, 0.0)
    for node in captured.graph.graph.nodes:
        if units.get(node.name) in work:
            work[units[node.name]] += node_work(node)[0]
    return tuple(tuple(layers[i] for i in run) for run in balanced_runs([work[u] for u in layers], count))


def check_tied(staged: Staged, captured: Captured, positions: int) -> None:
    """Refuse a weight with a gradient tied across two stages that run at one of the
    ``positions`` of the pipeline axis (interleaved): the runtime holds one copy of it per rank and
    sends its gradient between positions only."""
    graded = captured.graded
    for name, readers in staged.shared.items():
        together = sorted(s for s in readers if any(s != t and s % positions == t % positions for t in readers))
        if name in graded and together:
            raise InputError(
                f"{name} is tied across stages {', '.join(map(str, together))}, which the interleaved schedule puts "
                "on the same ranks; a weight tied across two stages of one rank is not supported yet. Fix: another "
                "stages_per_rank, or the 1f1b schedule"
            )


def with_stages(
    plan: ShardingPlan,
    captured: Captured,
    staged: Staged,
    segments: tuple[tuple[str, ...], ...],
    pipeline: Pipeline,
    mesh: Mesh,
    link: Link,
    budget: int | None = None,
) -> ShardingPlan:
    """``plan`` (made for one micro-batch on the mesh inside the stages) with the stages
    ``segments`` (placed as ``staged``) of ``pipeline`` over ``mesh``, whose sends cross ``link``;
    refused where a position's predicted peak is over ``budget``."""
    count = len(segments)
    where = staged.stage_of
    positions = count // pipeline.stages_per_rank
    compute, synced = _stage_times(plan, captured, staged, segments)
    held = _held_bytes(plan, captured, staged, pipeline.microbatches, positions)
    adds = [0.0] * count
    if pipeline.microbatches > 1:
        summed, adds = _gradient_sums(plan, captured, staged, positions, count)
        held = [a + b for a, b in zip(held, summed)]
    tied, tied_sends = _tied_sends(plan, captured, staged, link, count, positions)
    sent, sends = _send_times(plan, captured, staged, link, count, positions)
    stages = Stages(
        axis=pipeline.axis,
        mesh=mesh,
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        stages_per_rank=pipeline.stages_per_rank,
        segments=segments,
        compute_s=tuple(compute),
        send_s=tuple(sent),
        sync_s=tuple(a + b for a, b in zip(synced, tied)),
        accumulate_s=tuple((pipeline.microbatches - 1) * a for a in adds),
        peak_bytes=tuple(_peaks(plan, pipeline, where, held, count)),
        sends=tuple(sends + tied_sends),
    )
    worst = max(range(positions), key=lambda r: stages.peak_bytes[r])
    if budget is not None and stages.peak_bytes[worst] > budget:
        held_units = ", ".join(u for s in stages.on_position(worst) for u in segments[s])
        raise InfeasiblePlanError(
            f"the ranks at position {worst} of the pipeline axis ({held_units}) need "
            f"{format_bytes(stages.peak_bytes[worst])} per device, over the budget of {format_bytes(budget)}. Fix: "
            "more stages or micro-batches, the 1f1b schedule, or a larger memory_budget"
        )
    return dataclasses.replace(plan, stages=stages)


def _stage_times(
    plan: ShardingPlan, captured: Captured, staged: Staged, segments: tuple[tuple[str, ...], ...]
) -> tuple[list[float], list[float]]:
    """Each stage's seconds per micro-batch and per step: every part of the micro-batch's plan
    that its predicted step adds up, on the stage that runs it. Per micro-batch, its ops'
    compute (twice for the ops its backward recomputes), the collectives its ops need, the
    gathers of the parameters its layers read, and its share of the plan's copies to host memory and
    back that compute does not hide (:attr:`~autopar.core.plan.ShardingPlan.offload_s`), by the
    seconds of the copies of the activations it offloads; per step, the collectives of its
    parameters' gradients, which run once, after the last micro-batch (a bucket holds one stage's
    gradients; the plan lists its collectives bucket by bucket, one per collective of its members'
    moves)."""
    where, count = staged.stage_of, len(segments)
    holder = {k.name: where.get(n.name, 0) for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "param"}
    layer_stage = {unit: s for s, units in enumerate(segments) for unit in units}
    per_micro, per_step, copies = [0.0] * count, [0.0] * count, [0.0] * count
    for node in plan.nodes:
        if node.name in where:
            per_micro[where[node.name]] += node.compute_s * (2 if node.activation == "recompute" else 1)
            copies[where[node.name]] += node.copy_s
    for stage, seconds in enumerate(copies):
        per_micro[stage] += plan.offload_s * seconds / sum(copies) if seconds else 0.0
    bucketed = iter([c for c in plan.collectives if c.consumer == "gradients"])
    for bucket in (b for b in plan.buckets if b.of == "gradients"):
        for _ in bucket.steps[0]:  # every member moves by the same collectives, one per mesh axis
            per_step[holder[bucket.members[0]]] += next(bucketed).time_s
    gathers = iter([b for b in plan.buckets if b.of == "parameters"])
    for c in plan.collectives:
        if c.consumer == "gradients":
            continue
        if c.consumer.startswith("parameters of "):  # for the ops of one layer, or of the root module
            bucket = next(gathers)
            per_micro[layer_stage.get(bucket.segment, holder[bucket.members[0]])] += c.time_s
        elif c.consumer == "output":
            per_micro[staged.output_stage] += c.time_s
        elif c.consumer in where:
            (per_step if c.gradient else per_micro)[where[c.consumer]] += c.time_s
        else:
            raise InfeasiblePlanError(
                f"the plan's {c.kind} of {c.tensor} for {c.consumer} belongs to no pipeline stage, so the stages "
                "cannot price it. Fix: compile without pipeline=, and report the model"
            )
    return per_micro, per_step


def _send_times(
    plan: ShardingPlan, captured: Captured, staged: Staged, link: Link, count: int, positions: int
) -> tuple[list[float], list[Send]]:
    """Each stage's sends of one micro-batch, with the sends: every value it sends, as its op
    lays it out, once per stage that reads it at another position."""
    nodes = {n.name: n for n in captured.graph.graph.nodes}
    aliases = getitem_aliases(captured.graph.graph)
    by_name = {n.name: n for n in plan.nodes}
    times, sends = [0.0] * count, []
    for c in staged.crossings:
        if c.src % positions == c.dst % positions:  # two stages of one position: handed over, not sent
            continue
        ref = aliases.get(c.value, (c.value, 0))
        layout = by_name[ref[0]].outputs[ref[1]]
        val = nodes[c.value].meta["val"]
        nbytes = math.prod(local_shape(tuple(val.shape), layout, plan.mesh)) * val.element_size()
        times[c.src] += link.send_s(nbytes)
        sends.append(Send(c.src % positions, c.dst % positions, nbytes))
    return times, sends


def holding_positions(captured: Captured, staged: Staged, positions: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's placeholder → the positions of the pipeline axis holding it (a weight tied
    across stages: each position with a stage reading it holds a copy)."""
    return {
        node.name: tuple(
            sorted({s % positions for s in staged.shared.get(kind.name, (staged.stage_of.get(node.name, 0),))})
        )
        for node, kind in zip(captured.placeholders, captured.inputs)
        if kind.kind == "param"
    }


def reading_positions(captured: Captured, staged: Staged, positions: int) -> dict[str, tuple[int, ...]]:
    """Each model input's placeholder → the positions of the pipeline axis whose stages read it
    (each holds every micro-batch's piece of it for the step)."""
    return {
        node.name: tuple(sorted({staged.stage_of[u.name] % positions for u in node.users if u.name in staged.stage_of}))
        for node, kind in zip(captured.placeholders, captured.inputs)
        if kind.kind == "input"
    }


def _held_bytes(plan: ShardingPlan, captured: Captured, staged: Staged, microbatches: int, positions: int) -> list[int]:
    """The bytes per device each position of the pipeline axis holds for the whole step: its
    parameters with their gradients and optimizer state (a weight tied across stages at each
    position holding a copy), and every micro-batch's pieces of the model inputs it reads
    (:func:`with_stages` adds the gradients' sums of several micro-batches, :func:`_gradient_sums`)."""
    held = [0] * positions
    graded, holding = captured.graded, holding_positions(captured, staged, positions)
    reading = reading_positions(captured, staged, positions)
    for node, kind in zip(captured.placeholders, captured.inputs):
        if kind.kind == "param":
            copies = 2 + plan.optimizer_slots if kind.name in graded else 1  # a frozen one has no gradient or state
            for position in holding[node.name]:
                held[position] += _local_bytes(plan, node, plan.placements[kind.name]) * copies
        elif kind.kind == "input":
            for position in reading[node.name]:
                held[position] += _local_bytes(plan, node, plan.inputs[kind.name]) * microbatches
    return held


def _gradient_sums(
    plan: ShardingPlan, captured: Captured, staged: Staged, positions: int, count: int
) -> tuple[list[int], list[float]]:
    """What the sums of the micro-batches' gradients cost: the bytes per device each position
    holds for them (its parameters' gradients as the backward makes them, before their
    collectives, twice: the sums, and a micro-batch's gradients, which its backward returns
    beside them before they are added in; a weight tied across stages at the position whose stage
    makes its gradient, which the others get once made), and each stage's seconds of adding one
    micro-batch's gradients into them (:attr:`~autopar.core.plan.ShardingPlan.accumulation_add_s`,
    shared by the gradients' bytes: an addition reads and writes its bytes, by the roofline)."""
    aliases = getitem_aliases(captured.graph.graph)
    by_name = {n.name: n for n in plan.nodes}
    placeholder = {k.name: n.name for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "param"}
    held, added = [0] * positions, [0] * count
    for param, value, ref in gradient_values(captured, aliases):
        if ref[0] not in by_name:  # a gradient no op makes (a constant) is never summed
            continue
        nbytes = _local_bytes(plan, value, by_name[ref[0]].outputs[ref[1]])
        stage = staged.stage_of.get(placeholder[param], 0)
        held[stage % positions] += 2 * nbytes
        added[stage] += nbytes
    total = sum(added)
    return held, [plan.accumulation_add_s * b / total if total else 0.0 for b in added]


def _local_bytes(plan: ShardingPlan, placeholder, placements) -> int:
    val = placeholder.meta["val"]
    return math.prod(local_shape(tuple(val.shape), placements, plan.mesh)) * val.element_size()


def _tied_sends(
    plan: ShardingPlan, captured: Captured, staged: Staged, link: Link, count: int, positions: int
) -> tuple[list[float], list[Send]]:
    """Each stage's sends, once per step, of the gradients of weights tied across stages that it
    makes, to the other positions holding copies; with the sends."""
    times, sends = [0.0] * count, []
    graded, holding = captured.graded, holding_positions(captured, staged, positions)
    for node, kind in zip(captured.placeholders, captured.inputs):
        if kind.name in staged.shared and kind.name in graded:
            holder = staged.stage_of[node.name]
            nbytes = _local_bytes(plan, node, plan.placements[kind.name])
            for position in sorted(set(holding[node.name]) - {holder % positions}):
                times[holder] += link.send_s(nbytes)
                sends.append(Send(holder % positions, position, nbytes, tied=True))
    return times, sends


def _peaks(plan: ShardingPlan, pipeline: Pipeline, where: dict[str, int], held: list[int], count: int) -> list[int]:
    """Each position's peak, as :mod:`autopar.passes.solve.stage_memory` bounds it: what it
    holds for the step (its parameters' state, its inputs' micro-batches), the activations its
    schedule holds at its fullest, the largest temporary and the most a segment's backward
    recomputes or copies back."""
    kept = [0] * count
    for node in plan.nodes:
        if node.activation == "keep" and node.name in where:
            kept[where[node.name]] += node.activation_bytes
    positions = len(held)
    return [
        held[r]
        + held_activations(pipeline.schedule, r, positions, pipeline.microbatches, kept, pipeline.stages_per_rank)
        + plan.memory.transient_bytes
        + plan.memory.recomputed_bytes
        for r in range(positions)
    ]


def balanced_runs(weights: Sequence[float], count: int) -> list[list[int]]:
    """``range(len(weights))`` cut into ``count`` non-empty runs of consecutive indices whose
    largest total weight is the least it can be (ties: the earliest cuts)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the least largest run total cutting the first i weights into k runs
    best = [[math.inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for i in range(k, n - (count - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    runs, i = [], n
    for k in range(count, 0, -1):
        j = cut[k][i]
        runs.append(list(range(j, i)))
        i = j
    return runs[::-1]
