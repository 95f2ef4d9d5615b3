"""The standard hand-written layouts, as complete plans of the solver's program: the plan
returned when the search stops at its time limit with none, or only with slower ones.

- **Data parallel**: parameters and buffers replicated (DDP).
- **Fully sharded**: every parameter split along its first dim over every mesh axis that
  divides it (FSDP, ZeRO-3).
- On a mesh of several axes, **sharded over one axis** and replicated over the others (HSDP).

The parameters and buffers are fixed as the layout says (inputs come whole, as every plan has
them unless pinned); every other node then takes, in graph order, the strategy that costs least
given its operands' layouts (its compute plus moving each operand, by the cost model's
transitions): the batch splits where slicing it makes the ops cheaper. Tensor-parallel layouts
(Megatron's column and row splits) depend on which matmuls pair up, which these generic rules
cannot see: the search finds them.
"""

import math
from collections.abc import Callable, Iterator

from autopar.core.mesh import Mesh
from autopar.core.placement import Placements, Replicate, Shard
from autopar.core.strategy import NodeSpace, StrategySpace, ValueRef

TransitionCost = Callable[[ValueRef, Placements, Placements], float]


def standard_layouts(
    space: StrategySpace, mesh: Mesh, node_costs: dict[str, list[float]], transition_s: TransitionCost
) -> Iterator[tuple[str, dict[str, int]]]:
    """``(name, strategy index of every node)`` of each standard layout the pins allow."""
    splits = [("data parallel", ()), ("fully sharded", tuple(range(mesh.ndim)))]
    if mesh.ndim > 1:
        splits += [(f"sharded over {mesh.axis_names[a]}", (a,)) for a in range(mesh.ndim)]
    for name, axes in splits:
        fixed = {
            n.name: _closest(n, axes if n.kind == "param" else ())
            for n in space.nodes
            if n.kind in ("param", "buffer", "input")
        }
        choice = _complete(space, fixed, node_costs, transition_s)
        if choice is not None:
            yield name, choice


def _closest(node: NodeSpace, axes: tuple[int, ...]) -> int:
    """The strategy of a placeholder splitting its first dim over as many of ``axes`` as it
    can, replicated elsewhere (its first strategy when none is of that form: a pin, an input)."""

    def split_axes(k: int) -> int | None:
        placements = node.strategies[k].outputs[0]
        if placements is None:
            return None
        if any(not isinstance(p, Replicate) and not (a in axes and p == Shard(0)) for a, p in enumerate(placements)):
            return None
        return sum(p == Shard(0) for p in placements)

    ranked = [(s, k) for k in range(len(node.strategies)) if (s := split_axes(k)) is not None]
    return max(ranked, key=lambda sk: (sk[0], -sk[1]))[1] if ranked else 0


def _complete(
    space: StrategySpace, fixed: dict[str, int], node_costs: dict[str, list[float]], transition_s: TransitionCost
) -> dict[str, int] | None:
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
