"""Find repeated layers, so that the solver gives every copy of a layer one set of variables.

Models stack blocks (``layers.0`` … ``layers.31``, ``encoder.layer.5``, ``decoder.block.2``,
``transformer.h.7``; a model may hold several stacks). The nodes of the joint graph that come
from ``<prefix>.<i>`` (forward ops by their module, backward ops by the forward op they
differentiate, parameters by name) form layer ``i`` of stack ``<prefix>``.

The layers of a stack fall into classes of identical layers: node by node in graph order, the
ops, shapes, strategies, costs and memory agree, and every value read inside the layer comes
from the same position in it. Layers are compared by that signature, not with the first layer,
so a first layer whose input needs no gradient (it computes none), a last layer that feeds the
output or the loss, or a layer with an extra op keeps its own variables while the others share.
Every layer of a class takes the choice of the class's first layer (its representative), so the
program grows with the distinct layers instead of all of them.

Given complete plans (``alike``: the standard layouts), layers share a class only where every one
of them gives their nodes the same strategies, so that the classes do not keep the program from
any of those plans. Layers identical in every other way then fall into one class per pattern the
plans repeat: an MLP of single linear layers that Megatron splits by column and by row in turn
gets two classes, the even and the odd layers, instead of one that could not alternate.

A layer alike to no other of its stack (the first or the last, mostly) is aligned with the
representative of the stack's largest class (the stack's first layer when no two are alike),
op by op (:class:`difflib.SequenceMatcher` over each node's kind, phase, op, strategies and
value shapes): each node of a matched run whose operands with a counterpart are its
counterpart's operands takes its counterpart's choice, and only the ops that differ keep their
own. The costs and memory of
every copy add up on the shared variables, whatever they are, so a node may share with one
that costs otherwise; the program then asks the aligned ops to take the layouts of the layers
they match, as the layers of a class do, and its size stays that of one layer and the ops
that differ at every depth. A layer shares so only when most of its ops match (``ALIGNED_AT_LEAST``).
Alignment does not ask the plans of ``alike`` to agree: a layout completed op by op may treat a
first layer's ops otherwise for its other input, and holding it exactly would leave that layer
unaligned, nearly doubling the program of a uniform stack.
"""

import difflib
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.cost_model.estimate import MemoryTerms
from autopar.passes.analysis.capture import Captured, module_paths

from autopar.core.strategy import NodeSpace, StrategySpace

ALIGNED_AT_LEAST = 0.9
"""The share of a layer's nodes that must match its representative's for them to share: a layer
matching in a few ops only (an MLP's first layer, whose matmuls differ in shape from the others')
would gain little from sharing them and lose the plan that suits its own shapes."""

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class LayerClasses:
    """Which nodes take which node's choice, and how the layers grouped."""

    template: dict[str, str]
    """Each node of a layer that is not its class's representative → its counterpart there."""
    num_classes: int
    """Classes of two or more identical layers."""
    num_shared_layers: int
    """Layers that take their representative's choice (the layers of those classes, less one each)."""
    num_aligned_layers: int = 0
    """Layers alike to no other whose ops that match a representative's take its choices."""


def repeated_layers(
    captured: Captured,
    space: StrategySpace,
    node_costs: dict[str, list[float]],
    memory: MemoryTerms,
    alike: Sequence[Mapping[str, int]] = (),
) -> LayerClasses:
    """Group the layers of every stack into classes of identical layers that each plan of
    ``alike`` (every node's strategy index) treats alike (see the module)."""
    paths = module_paths(captured)
    groups: dict[tuple[str, int], list[NodeSpace]] = defaultdict(list)
    for n in space.nodes:
        where = n.target if n.kind in ("param", "buffer") else paths.get(n.name) if n.kind == "op" else None
        match = _LAYER.match(where) if where else None
        if match:
            groups[match.group(1), int(match.group(2))].append(n)
    values = {node.name: node.meta.get("val") for node in captured.graph.graph.nodes}
    classes: dict[tuple, list[list[NodeSpace]]] = defaultdict(list)
    for (prefix, _), layer in sorted(groups.items()):
        classes[prefix, _layer_signature(layer, values, node_costs, memory, alike)].append(layer)
    template: dict[str, str] = {}
    num_classes = num_shared = num_aligned = 0
    largest: dict[str, list[NodeSpace]] = {}
    for (prefix, _), layers in classes.items():
        if len(layers) < 2:
            continue
        num_classes += 1
        num_shared += len(layers) - 1
        for layer in layers[1:]:
            template.update((n.name, t.name) for n, t in zip(layer, layers[0]))
        if len(layers) > len(largest.get(prefix, ())):
            largest[prefix] = layers
    first = {prefix: layer for (prefix, _), layer in sorted(groups.items(), reverse=True)}
    for (prefix, _), layers in classes.items():
        representative = largest[prefix][0] if prefix in largest else first[prefix]
        if len(layers) == 1 and layers[0] is not representative:
            aligned = _aligned(layers[0], representative, values)
            if len(aligned) >= ALIGNED_AT_LEAST * len(layers[0]):
                template.update(aligned)
                num_aligned += 1
    return LayerClasses(template, num_classes, num_shared, num_aligned)


def _aligned(layer: Sequence[NodeSpace], representative: Sequence[NodeSpace], values: dict) -> dict[str, str]:
    """The nodes of ``layer`` that take a choice of ``representative``'s (see the module)."""

    def key(n: NodeSpace) -> tuple:
        return n.kind, n.phase, n.target if n.kind == "op" else None, n.strategies, _signature(values.get(n.name))

    matcher = difflib.SequenceMatcher(None, [key(n) for n in representative], [key(n) for n in layer], autojunk=False)
    pairs = {
        layer[j].name: representative[i]
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag == "equal"
        for i, j in zip(range(i1, i2), range(j1, j2))
    }
    by_name = {n.name: n for n in layer}
    return {
        name: counterpart.name
        for name, counterpart in pairs.items()
        if all(  # an operand with a counterpart reads the counterpart's operand
            index == their_index and (operand not in pairs or pairs[operand].name == theirs)
            for (operand, index), (theirs, their_index) in zip(by_name[name].args, counterpart.args)
        )
    }


def _layer_signature(
    layer: Sequence[NodeSpace], values: dict, node_costs, memory: MemoryTerms, alike: Sequence[Mapping[str, int]]
) -> tuple:
    """What must agree for two layers to share a choice: per node, its kind, phase, op,
    strategies, value shapes, costs, memory, where each value it reads comes from (a position
    in the layer, or outside it) and its strategy in each plan of ``alike``."""
    position = {n.name: k for k, n in enumerate(layer)}
    parts = (memory.params, memory.grads, memory.optimizer, memory.activations, memory.temporaries)
    return tuple(
        (
            n.kind,
            n.phase,
            n.target if n.kind == "op" else None,
            n.strategies,
            _signature(values.get(n.name)),
            tuple(node_costs[n.name]),
            tuple(_hashable(part.get(n.name)) for part in parts),
            tuple((position.get(name), index) for name, index in n.args),
            tuple(plan.get(n.name) for plan in alike),
        )
        for n in layer
    )


def _hashable(value) -> object:
    return tuple(value) if isinstance(value, list) else value


def _signature(value) -> object:
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), value.dtype
    return type(value).__name__
