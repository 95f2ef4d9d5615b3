"""Turn the solver's choice into a :class:`~autopar.plan.ShardingPlan`."""

from autopar.cost_model.estimate import CostModel, MemoryTerms
from autopar.mesh import Mesh
from autopar.placement import format_placement, format_placements
from autopar.plan import Collective, NodePlan, ShardingPlan
from autopar.passes.capture import Captured, module_paths
from autopar.passes.solver import Solution
from autopar.passes.strategy import Strategy, StrategySpace, ValueRef


def edge_transitions(space: StrategySpace, chosen: dict[str, Strategy]):
    """Every distinct (tensor, target placements) move the plan needs, with its consumer.

    Yields ``(ref, src, dst, consumer)``; a tensor moved to the same placements for several
    consumers is moved once. The rewriter walks the same moves.
    """
    seen = set()
    for n in space.nodes:
        for j, ref in enumerate(n.args):
            src = chosen[ref[0]].outputs[ref[1]]
            dst = chosen[n.name].inputs[j]
            if src != dst and (ref, dst) not in seen:
                seen.add((ref, dst))
                yield ref, src, dst, n


def build_plan(captured: Captured, space: StrategySpace, solution: Solution, costs: CostModel,
               memory: MemoryTerms, *, hardware_name: str, pinned: tuple[str, ...],
               memory_budget_bytes: int | None, stage_s: dict[str, float]) -> ShardingPlan:
    mesh = costs.mesh
    by_name = space.index()
    chosen = {name: by_name[name].strategies[k] for name, k in solution.choice.items()}
    node_costs = costs.node_costs(space)
    modules = module_paths(captured)
    nodes = tuple(
        NodePlan(n.name, n.target, modules.get(n.name, ""), n.phase,
                 tuple(None if p is None else format_placements(p) for p in chosen[n.name].outputs),
                 tuple(format_placements(p) for p in chosen[n.name].inputs),
                 node_costs[n.name][solution.choice[n.name]])
        for n in space.nodes if n.kind == "op"
    )
    collectives = tuple(_collectives(space, chosen, costs, mesh))
    placements = {n.target: _fmt(chosen[n.name]) for n in space.nodes if n.kind in ("param", "buffer")}
    inputs = {n.target: _fmt(chosen[n.name]) for n in space.nodes if n.kind == "input"}
    return ShardingPlan(
        mesh=mesh,
        hardware=hardware_name,
        links=costs.links,
        graph_hash=captured.graph_hash,
        placements=placements,
        inputs=inputs,
        pinned=pinned,
        nodes=nodes,
        collectives=collectives,
        compute_s=sum(n.compute_s for n in nodes),
        communication_s=sum(c.time_s for c in collectives),
        memory=memory.estimate(solution.choice),
        memory_budget_bytes=memory_budget_bytes,
        solver=solution.info,
        stage_s=stage_s,
    )


def _fmt(strategy: Strategy) -> tuple[str, ...]:
    return tuple(format_placement(p) for p in strategy.outputs[0])


def _collectives(space: StrategySpace, chosen, costs: CostModel, mesh: Mesh):
    for ref, src, dst, consumer in edge_transitions(space, chosen):
        phase = {"param": "backward", "output": "output"}.get(consumer.kind, consumer.phase)
        for step in costs.steps(ref, src, dst):
            if step.is_collective:
                yield Collective(
                    kind=step.kind, axis=mesh.axis_names[step.axis], bytes=step.bytes, phase=phase,
                    time_s=costs.step_s(step), tensor=_ref_name(ref),
                    consumer=consumer.name, src=format_placements(src), dst=format_placements(dst),
                )


def _ref_name(ref: ValueRef) -> str:
    return ref[0] if ref[1] == 0 else f"{ref[0]}[{ref[1]}]"
