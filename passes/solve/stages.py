"""Pipeline stages for a plan: where to cut the model, and what each stage costs.

The plan inside the stages is the integer program's, made for one micro-batch on the mesh
without the pipeline axis. The cuts fall between the model's layers and the modules outside its
stacks (:func:`~autopar.passes.analysis.stages.layer_order`): these, each weighed by the modelled
time of its ops and of the collectives they wait for under that plan, are cut into as many runs
of consecutive layers as the pipeline axis has positions, the slowest run as fast as it can be
(a linear-partition dynamic program over the layers). Each micro-batch then takes the slowest
stage's time per step of the schedule (:attr:`~autopar.core.pipeline.Stages.step_s`).
"""

import dataclasses
import math
from collections.abc import Sequence

from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.stages import assign_stages, cut_units, layer_order

from autopar.core.errors import InputError
from autopar.core.mesh import Mesh
from autopar.core.pipeline import Pipeline, Stages
from autopar.core.plan import ShardingPlan


def with_stages(plan: ShardingPlan, captured: Captured, pipeline: Pipeline, mesh: Mesh) -> ShardingPlan:
    """``plan`` (made for one micro-batch on the mesh inside the stages) cut into the stages of
    ``pipeline`` over ``mesh``."""
    count = mesh.shape[mesh.axis_names.index(pipeline.axis)]
    layers = layer_order(captured)
    if len(layers) < count:
        raise InputError(
            f"the pipeline axis {pipeline.axis!r} has {count} positions, but the model has {len(layers)} layers and "
            f"top-level modules to cut between ({', '.join(layers) or 'none'}); each stage needs one. Fix: a smaller "
            "pipeline axis, a model of more layers, or compile without pipeline="
        )
    weight = _layer_times(plan, layers, cut_units(captured))
    runs = balanced_runs([weight[layer] for layer in layers], count)
    segments = tuple(tuple(layers[i] for i in run) for run in runs)
    staged = assign_stages(captured, segments)
    times = [0.0] * count
    for node in plan.nodes:
        if node.name in staged.stage_of:
            times[staged.stage_of[node.name]] += node.compute_s
    for c in plan.collectives:
        if c.consumer in staged.stage_of:
            times[staged.stage_of[c.consumer]] += c.time_s
    stages = Stages(
        axis=pipeline.axis,
        mesh=mesh,
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        segments=segments,
        compute_s=tuple(times),
    )
    return dataclasses.replace(plan, stages=stages)


def _layer_times(plan: ShardingPlan, layers: Sequence[str], units: dict[str, str]) -> dict[str, float]:
    """Modelled time of each unit's ops (forward and backward) and of the collectives they wait for."""
    times = dict.fromkeys(layers, 0.0)
    for node in plan.nodes:
        if units.get(node.name) in times:
            times[units[node.name]] += node.compute_s
    for c in plan.collectives:
        if units.get(c.consumer) in times:
            times[units[c.consumer]] += c.time_s
    return times


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
