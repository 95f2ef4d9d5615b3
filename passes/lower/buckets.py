"""The buckets of a per-rank program as the plan lists them (:attr:`ShardingPlan.buckets`): its
gradients reduced together, with the collectives the plan priced for each, and its parameters
gathered together, with what makes or first reads each, for the rewriter
(:mod:`autopar.passes.lower.rewrite`) to launch them. Nothing is worked out again: a plan that
does not fit the graph is refused, naming the fix."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.passes.propagation.buckets import Bucket, ParameterGather, bucket_of, bucketed_steps, collectives_of
from torch import fx

from autopar.core.errors import RewriteError
from autopar.core.move import Step
from autopar.core.placement import format_placements
from autopar.core.plan import ShardingPlan


@dataclass(frozen=True)
class LoweredBuckets:
    """The gradient buckets of a per-rank program and the parameter gathers, with what makes
    each gradient: ``keys[i]`` is the move ``(in backward, value, placements)`` of the ``i``-th
    bucketed gradient and ``steps[i]`` its first collective; ``filled_by`` lists per op the buckets it
    makes a gradient of; ``made_by`` per op the outputs (gradients moving alone) it makes, and
    ``reduced_with`` per bucketed move the outputs it gives."""

    keys: list
    steps: list
    buckets: list[Bucket]
    gathered_by: dict
    producers: list[set[str]]
    filled_by: dict[str, list[int]]
    made_by: dict[str, list[int]]
    reduced_with: dict[tuple, list[int]]

    @classmethod
    def of(cls, captured, plan, states, unreduced, *, strategies, aliases, backward) -> "LoweredBuckets":
        """The buckets ``plan`` lists (no gradient buckets where the gradients stay ``unreduced``)."""
        graph = captured.graph.graph
        grad_of = {
            k.name: v
            for k, v in zip(captured.outputs, graph.output_node().args[0])
            if k is not None and k.kind == "grad" and isinstance(v, fx.Node)
        }
        keys, steps, buckets = (
            ([], [], []) if unreduced else _gradient_buckets(plan, states, grad_of, strategies, aliases, backward)
        )
        gathers = _parameter_gathers(plan, states)
        inputs = {n.name for n in captured.placeholders}
        producers = [{keys[i][1][0] for i in b.members} - inputs for b in buckets]
        filled_by: dict[str, list[int]] = {}
        for b, names in enumerate(producers):
            for name in names:
                filled_by.setdefault(name, []).append(b)
        in_bucket = set(keys)
        made_by: dict[str, list[int]] = {}
        reduced_with: dict[tuple, list[int]] = {}
        for i, value in enumerate(graph.output_node().args[0]):
            kind = captured.outputs[i]
            if kind is not None and kind.kind == "grad" and isinstance(value, fx.Node) and value in backward:
                ref = aliases.get(value.name, (value.name, 0))
                key = (True, ref, strategies[states[kind.name].name].outputs[0])
                if key in in_bucket:
                    reduced_with.setdefault(key, []).append(i)
                else:
                    made_by.setdefault(ref[0], []).append(i)
        gathered_by = {key: g for g in gathers for key in g.keys}
        return cls(keys, steps, buckets, gathered_by, producers, filled_by, made_by, reduced_with)


def _gradient_buckets(
    plan: ShardingPlan, states: dict[str, fx.Node], grad_of: dict[str, fx.Node], strategies, aliases, backward
) -> tuple[list, list[Step], list[Bucket]]:
    """The gradient buckets the plan lists, in its order, with the collectives it priced: each
    bucketed move's key ``(in backward, gradient, parameter's placements)`` and first collective
    step, and the buckets; refused where the plan does not fit the graph. The rewriter makes each
    bucket's collectives as soon as the backward has made all of its gradients."""
    keys: list = []
    steps: list[Step] = []
    buckets: list[Bucket] = []
    for planned in (b for b in plan.buckets if b.of == "gradients"):
        chains, members = [], []
        held = set(_held(plan, planned.members, grad_of))
        for name, planned_dst, chain in zip(planned.members, planned.placements, planned.steps):
            if name not in held:
                continue
            if name not in grad_of:
                raise RewriteError(f"the plan reduces a gradient of {name!r}, which the model has not. Fix: plan again")
            param, value = states[name], grad_of[name]
            ref = aliases.get(value.name, (value.name, 0))
            dst = strategies[param.name].outputs[0]
            if dst != planned_dst:
                raise RewriteError(
                    f"the plan reduces the gradient of {name} in a bucket into {format_placements(planned_dst)}, "
                    f"but places {name} as {format_placements(dst)}. Fix: plan again"
                )
            if not bucketed_steps(chain) or (chains and collectives_of(chain) != collectives_of(chains[0])):
                raise RewriteError(
                    f"the plan reduces the gradient of {name} in a bucket by {collectives_of(chain)}, which is not "
                    "what that bucket runs. Fix: plan again"
                )
            members.append(len(keys))
            keys.append((value in backward, ref, dst))
            steps.append(chain[0])
            chains.append(chain)
        if members:
            buckets.append(bucket_of(chains, members))
    return keys, steps, buckets


def _held(plan: ShardingPlan, members: Sequence[str], held: Mapping[str, object]) -> list[str]:
    """The members of a planned bucket this program holds: all of them, or with pipeline stages
    all or none (a stage's program holds its own stage's buckets)."""
    if plan.stages is None:
        return list(members)
    mine = [name for name in members if name in held]
    if mine and len(mine) != len(members):
        raise RewriteError(
            f"the plan's bucket of {', '.join(members)} spans pipeline stages, which cannot run it as one "
            "collective. Fix: plan again"
        )
    return mine


def _parameter_gathers(plan: ShardingPlan, states: dict[str, fx.Node]) -> list[ParameterGather]:
    """The buckets of parameters gathered together that the plan lists, with the all-gather it
    priced for each, each made when the first op of its layer and phase reads one of them."""
    found = []
    for planned in (b for b in plan.buckets if b.of == "parameters"):
        keys, steps = [], []
        held = set(_held(plan, planned.members, states))
        for name, dst, (gather,) in zip(planned.members, planned.placements, planned.steps):
            if name not in held:
                continue
            if name not in states:
                raise RewriteError(f"the plan gathers a parameter {name!r}, which the model has not. Fix: plan again")
            if gather.kind != "all_gather" or (steps and gather.axis != steps[0].axis):
                raise RewriteError(
                    f"the plan gathers {name} in a bucket by {collectives_of((gather,))}, not one all-gather. "
                    "Fix: plan again"
                )
            keys.append((planned.phase != "forward", (states[name].name, 0), dst))
            steps.append(gather)
        if not steps:
            continue
        bucket = bucket_of([(s,) for s in steps], range(len(steps)))
        found.append(ParameterGather(bucket, tuple(keys), tuple(steps), planned.phase, planned.segment))
    return found
