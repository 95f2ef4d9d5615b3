"""Find repeated layers, so that the solver gives every copy of a layer one set of variables.

Models stack identical blocks (``layers.0`` … ``layers.31``). The nodes of the joint graph that
come from ``<prefix>.<i>`` (forward ops by their module, backward ops by the forward op they
differentiate, parameters by name) form layer ``i``. A layer matches the first layer of its
stack when, node by node in graph order, the ops, shapes, strategies, costs and memory agree
and every value read inside the layer comes from the same position in it. Matching layers then
share the first layer's choice, so the program grows with the distinct layers instead of all of
them. Layers that differ keep their own variables.
"""

import re
from collections import defaultdict
from collections.abc import Sequence

from autopar.cost_model.estimate import MemoryTerms
from autopar.passes.capture import Captured, module_paths
from autopar.passes.strategy import NodeSpace, StrategySpace

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def repeated_layers(captured: Captured, space: StrategySpace, node_costs: dict[str, list[float]],
                    memory: MemoryTerms) -> dict[str, str]:
    """Each node of a repeated layer → its counterpart in the first layer of the stack.

    Nodes outside any stack, and the nodes of the first layer itself, are not in the map.
    """
    paths = module_paths(captured)
    groups: dict[tuple[str, int], list[NodeSpace]] = defaultdict(list)
    for n in space.nodes:
        where = n.target if n.kind in ("param", "buffer") else paths.get(n.name) if n.kind == "op" else None
        match = _LAYER.match(where) if where else None
        if match:
            groups[match.group(1), int(match.group(2))].append(n)
    stacks: dict[str, list[int]] = defaultdict(list)
    for prefix, index in groups:
        stacks[prefix].append(index)
    values = {node.name: node.meta.get("val") for node in captured.graph.graph.nodes}
    template: dict[str, str] = {}
    for prefix, indices in stacks.items():
        first = groups[prefix, min(indices)]
        for index in sorted(indices)[1:]:
            layer = groups[prefix, index]
            if _same_layer(layer, first, values, node_costs, memory):
                template.update((n.name, t.name) for n, t in zip(layer, first))
    return template


def _same_layer(layer: Sequence[NodeSpace], first: Sequence[NodeSpace], values: dict, node_costs, memory) -> bool:
    if len(layer) != len(first):
        return False
    position = {n.name: k for k, n in enumerate(layer)}
    first_position = {n.name: k for k, n in enumerate(first)}
    for n, t in zip(layer, first):
        if (n.kind, n.phase, n.strategies, len(n.args)) != (t.kind, t.phase, t.strategies, len(t.args)):
            return False
        if n.kind == "op" and n.target != t.target:
            return False
        if _signature(values.get(n.name)) != _signature(values.get(t.name)) or node_costs[n.name] != node_costs[t.name]:
            return False
        for part in (memory.params, memory.grads, memory.optimizer, memory.activations, memory.temporaries):
            if part.get(n.name) != part.get(t.name):
                return False
        for (name, index), (first_name, first_index) in zip(n.args, t.args):
            if index != first_index or position.get(name) != first_position.get(first_name):
                return False
    return True


def _signature(value) -> object:
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), value.dtype
    return type(value).__name__
