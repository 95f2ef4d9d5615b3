"""The strategy space: every way each node of the joint graph can be laid out on the mesh."""

from dataclasses import dataclass

from torch import fx

from autopar.core.kinds import NodeKind, Phase
from autopar.core.placement import Placements, layout

ValueRef = tuple[str, int]
"""A tensor of the graph: (name of the node producing it, index among that node's outputs)."""


def ref_name(ref: ValueRef) -> str:
    """How the plan names a tensor of the graph: ``node``, or ``node[i]`` for an output past
    the first."""
    return ref[0] if ref[1] == 0 else f"{ref[0]}[{ref[1]}]"


def getitem_aliases(graph: fx.Graph) -> dict[str, ValueRef]:
    """Nodes that only pick one output of a multi-output op (``getitem``), by name."""
    return {
        node.name: (node.args[0].name, node.args[1])
        for node in graph.nodes
        if node.op == "call_function" and node.target.__name__ == "getitem"
    }


@dataclass(frozen=True, slots=True)
class Strategy:
    """One layout of a node: its outputs' placements and the placements it needs on its inputs."""

    outputs: tuple[Placements | None, ...]
    """One entry per output of the op (``None`` where the output is not a tensor)."""
    inputs: tuple[Placements, ...]
    """One entry per tensor argument, in the order of ``NodeSpace.args``."""

    def __post_init__(self):  # as :class:`~autopar.core.placement.Layout`s, which hash in constant time
        object.__setattr__(self, "outputs", tuple(None if p is None else layout(p) for p in self.outputs))
        object.__setattr__(self, "inputs", tuple(layout(p) for p in self.inputs))


@dataclass(frozen=True, slots=True)
class NodeSpace:
    """The strategies of one node."""

    name: str
    """Node name in the joint graph (``"output"`` for the graph's results)."""
    kind: NodeKind
    """``"op"``, ``"param"``, ``"buffer"``, ``"input"``, ``"tangent"``, ``"constant"`` (a tensor
    literal of the model's code, whole on every rank) or ``"output"``."""
    target: str
    """The operator, or the parameter / input name for placeholders."""
    args: tuple[ValueRef, ...]
    """The tensors the node reads, matching ``Strategy.inputs``. A parameter reads its own
    gradient here, and a buffer the forward updates in place its new value: the strategy
    requires either in the parameter's or buffer's placement."""
    strategies: tuple[Strategy, ...]
    phase: Phase
    """``"forward"`` or ``"backward"``: whether the node depends on the outputs' tangents."""


@dataclass(frozen=True, slots=True)
class StrategySpace:
    """Every node's strategies; the solver picks one per node."""

    nodes: tuple[NodeSpace, ...]
    aliases: dict[str, ValueRef]
    """Nodes that only select an output of another node (``getitem``), by name."""

    def index(self) -> dict[str, NodeSpace]:
        return {n.name: n for n in self.nodes}
