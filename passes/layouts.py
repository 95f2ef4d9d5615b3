"""The standard hand-written layouts, as complete plans of the solver's program: the plans the
integer program starts from, and the plan returned when the search finds none in time.

- **Data parallel**: the forward's inputs split along their first dim (the batch) over every
  mesh axis that divides it, parameters and buffers replicated (DDP).
- **Fully sharded**: the batch split likewise, every parameter split along its first dim over
  every axis that divides it (FSDP, ZeRO-3); the ops gather what they read.
- On a 2-D mesh, each of these on one axis with the other axis replicated, too.

The inputs, parameters and buffers are fixed as the layout says; every other node then takes,
in graph order, the strategy that costs least given its operands' layouts (its compute plus
moving each operand, by the cost model's transitions). Tensor-parallel layouts (Megatron's
column and row splits) depend on which matmuls pair up, which these generic rules cannot see:
the search finds them.
"""

import math
from collections.abc import Callable, Iterator

from autopar.mesh import Mesh
from autopar.placement import Placements, Replicate, Shard
from autopar.passes.strategy import NodeSpace, StrategySpace, ValueRef

TransitionCost = Callable[[ValueRef, Placements, Placements], float]


def standard_layouts(space: StrategySpace, mesh: Mesh, node_costs: dict[str, list[float]],
                     transition_s: TransitionCost) -> Iterator[tuple[str, dict[str, int]]]:
    """``(name, strategy index of every node)`` of each standard layout the pins allow."""
    axes_sets = [tuple(range(mesh.ndim))] + ([(a,) for a in range(mesh.ndim)] if mesh.ndim > 1 else [])
    for kind in ("data parallel", "fully sharded"):
        for axes in axes_sets:
            name = kind if len(axes) == mesh.ndim else f"{kind} on {mesh.axis_names[axes[0]]}"
            choice = _complete(space, _fixed(space, kind, axes), node_costs, transition_s)
            if choice is not None:
                yield name, choice


def _fixed(space: StrategySpace, kind: str, axes: tuple[int, ...]) -> dict[str, int]:
    """The inputs', parameters' and buffers' strategies under layout ``kind`` on ``axes``."""
    fixed = {}
    for n in space.nodes:
        if n.kind == "input":
            fixed[n.name] = _closest(n, axes)
        elif n.kind in ("param", "buffer"):
            fixed[n.name] = _closest(n, axes if kind == "fully sharded" and n.kind == "param" else ())
    return fixed


def _closest(node: NodeSpace, axes: tuple[int, ...]) -> int:
    """The strategy of a placeholder splitting its first dim over as many of ``axes`` as it
    can, replicated elsewhere (its first strategy when none is of that form: a pin)."""
    def split_axes(k: int) -> int | None:
        placements = node.strategies[k].outputs[0]
        if placements is None:
            return None
        if any(not isinstance(p, Replicate) and not (a in axes and p == Shard(0)) for a, p in enumerate(placements)):
            return None
        return sum(p == Shard(0) for p in placements)

    ranked = [(s, k) for k in range(len(node.strategies)) if (s := split_axes(k)) is not None]
    return max(ranked, key=lambda sk: (sk[0], -sk[1]))[1] if ranked else 0


def _complete(space: StrategySpace, fixed: dict[str, int], node_costs: dict[str, list[float]],
              transition_s: TransitionCost) -> dict[str, int] | None:
    """Every node's strategy: ``fixed`` ones as given, the others, in graph order, the cheapest
    given the layouts their operands already have (operands not yet placed, such as a
    parameter's gradient, are left out). ``None`` when some node has no strategy of finite cost."""
    by_name = space.index()
    choice: dict[str, int] = {}
    for n in space.nodes:
        if n.name in fixed:
            choice[n.name] = fixed[n.name]
            continue
        best, best_s = None, math.inf
        for k, strategy in enumerate(n.strategies):
            seconds = node_costs[n.name][k]
            for (name, index), needed in zip(n.args, strategy.inputs):
                if name in choice:
                    made = by_name[name].strategies[choice[name]].outputs[index]
                    if made != needed:
                        seconds += transition_s((name, index), made, needed)
            if seconds < best_s:
                best, best_s = k, seconds
        if best is None:
            return None
        choice[n.name] = best
    return choice
