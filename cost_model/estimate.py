"""Prices a strategy space: compute per node strategy, transitions per edge, memory per plan."""

import functools
import math

import torch

from autopar.cost_model.comm import step_time_s
from autopar.cost_model.compute import compute_s, node_work
from autopar.cost_model.hardware import Profile
from autopar.mesh import Mesh
from autopar.passes.capture import Captured
from autopar.passes.redistribute import Step, local_shape, transition
from autopar.passes.strategy import StrategySpace, ValueRef
from autopar.placement import Placements
from autopar.plan import MemoryEstimate


class CostModel:
    """Costs of one captured graph on one mesh and hardware profile."""

    def __init__(self, captured: Captured, mesh: Mesh, hardware: Profile):
        self.mesh = mesh
        self.hardware = hardware
        self.graph_nodes = {n.name: n for n in captured.graph.graph.nodes}

    def value(self, ref: ValueRef) -> torch.Tensor:
        val = self.graph_nodes[ref[0]].meta["val"]
        return val[ref[1]] if isinstance(val, (list, tuple)) else val

    def node_costs(self, space: StrategySpace) -> dict[str, list[float]]:
        costs = {}
        for n in space.nodes:
            work = node_work(self.graph_nodes[n.name]) if n.kind == "op" else (0.0, 0.0)
            costs[n.name] = [compute_s(work, s, self.mesh, self.hardware) for s in n.strategies]
        return costs

    def steps(self, ref: ValueRef, src: Placements, dst: Placements) -> tuple[Step, ...]:
        value = self.value(ref)
        return _transition(src, dst, tuple(value.shape), value.element_size(), self.mesh)

    def transition_s(self, ref: ValueRef, src: Placements, dst: Placements) -> float:
        if src == dst:
            return 0.0
        return sum(step_time_s(s, self.mesh, self.hardware) for s in self.steps(ref, src, dst))

    def local_bytes(self, ref: ValueRef, placements: Placements) -> int:
        value = self.value(ref)
        return math.prod(local_shape(tuple(value.shape), placements, self.mesh)) * value.element_size()


@functools.lru_cache(maxsize=65536)
def _transition(src, dst, shape, itemsize, mesh) -> tuple[Step, ...]:
    return transition(src, dst, shape, itemsize, mesh)


def estimate_memory(space: StrategySpace, choice: dict[str, int], costs: CostModel,
                    *, optimizer_slots: int = 2) -> MemoryEstimate:
    """Per-device peak: parameters, their gradients and ``optimizer_slots`` optimizer states
    each (2 for Adam), the forward values the backward reads, and the largest temporary."""
    by_name = space.index()
    chosen = {name: by_name[name].strategies[k] for name, k in choice.items()}
    params = grads = 0
    for n in space.nodes:
        if n.kind in ("param", "buffer"):
            size = costs.local_bytes((n.name, 0), chosen[n.name].outputs[0])
            params += size
            grads += size if n.args else 0
    saved: set[ValueRef] = set()
    for n in space.nodes:
        if n.phase == "backward" and n.kind == "op":
            saved.update(ref for ref in n.args if by_name[ref[0]].phase == "forward" and by_name[ref[0]].kind in ("op", "input"))
    activations = sum(costs.local_bytes(ref, chosen[ref[0]].outputs[ref[1]]) for ref in saved)
    transient = max(
        (costs.local_bytes((n.name, i), p) for n in space.nodes if n.kind == "op"
         for i, p in enumerate(chosen[n.name].outputs) if p is not None),
        default=0,
    )
    return MemoryEstimate(params, grads, optimizer_slots * grads, activations, transient)
