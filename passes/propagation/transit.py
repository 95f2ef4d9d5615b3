"""Drop the splits that only elementwise and view ops carry: the image rows and columns of a
convolutional net.

Every strategy of an op says, per mesh axis, which operand dims it reads split and which
output dims it gives split. An elementwise op or a view (the pointwise and view rules) only
carries a split along: its operand's dim ``i`` becomes its output's dim ``j``. Joining the dims
that these ops carry into one another groups every tensor dim of the graph into a *class*
(union-find over ``(tensor, dim)``). A class is **native** when a split of it is available or
used without a move:

- it holds a dim of a parameter, buffer or input (their placements are the plan's choice);
- or some other op (a matmul, a convolution, a norm, an embedding, a sum keeping the dim)
  splits a dim of it on an axis where it gives an output split: it computes on the pieces
  and hands on a split value.

A split of a class that is not native (a *transit* split) can only be made by a move into it
(a slice, an all-to-all or a reduce-scatter) and read by ops that need the tensor otherwise
(an all-gather before the next convolution) or that sum it away. It runs the elementwise ops
between on pieces, which splitting the batch or the channels does too, from moves that cost as
much or less because the ops around them take those splits. A convolutional net's spatial dims
are of this kind: convolutions, pooling and batch norm do not split them.
Offering them multiplies the layouts of every activation on a 2-D mesh from 16 to 36 and the
program's moves more than fourfold, for plans the batch and channel splits match. What is lost
is elementwise work and activation memory split along such a dim where neither the batch nor
the channels can be split.
"""

import dataclasses
import logging

from autopar.core.placement import Shard
from autopar.core.strategy import NodeSpace, Strategy

log = logging.getLogger(__name__)

_Dim = tuple[str, int, int]  # (producer, output index, dim)


class _Classes:
    """Union-find over tensor dims."""

    def __init__(self) -> None:
        self.parent: dict[_Dim, _Dim] = {}

    def find(self, dim: _Dim) -> _Dim:
        root = self.parent.setdefault(dim, dim)
        while root != self.parent[root]:
            root = self.parent[root]
        while dim != root:  # path compression
            self.parent[dim], dim = root, self.parent[dim]
        return root

    def union(self, dims: list[_Dim]) -> None:
        roots = [self.find(d) for d in dims]
        for root in roots[1:]:
            self.parent[root] = roots[0]


def _splits(node: NodeSpace, strategy: Strategy, axis: int) -> tuple[list[_Dim], list[_Dim]]:
    """The operand dims and the output dims ``strategy`` splits on mesh axis ``axis``."""
    ins = [(ref[0], ref[1], p[axis].dim) for ref, p in zip(node.args, strategy.inputs) if isinstance(p[axis], Shard)]
    outs = [
        (node.name, o, p[axis].dim)
        for o, p in enumerate(strategy.outputs)
        if p is not None and isinstance(p[axis], Shard)
    ]
    return ins, outs


def drop_transit_splits(nodes: list[NodeSpace], carrying: set[str], num_axes: int) -> list[NodeSpace]:
    """``nodes`` with every op strategy that makes a transit split (module docstring) removed.
    ``carrying`` names the op nodes whose rules are elementwise or view rules. Placeholders
    and the output keep all their strategies, and an op keeps its whole strategy list when
    every one of them would go."""
    classes = _Classes()
    native: list[_Dim] = []
    for n in nodes:
        if n.kind in ("param", "buffer", "input", "tangent"):
            for s in n.strategies:
                for axis in range(num_axes):
                    native += _splits(n, s, axis)[1]
        if n.kind != "op":
            continue
        for s in n.strategies:
            for axis in range(num_axes):
                ins, outs = _splits(n, s, axis)
                if n.name in carrying and outs:
                    classes.union(ins + outs)
                elif outs:
                    native += ins + outs
    roots = {classes.find(d) for d in native}

    def transit(s: Strategy, n: NodeSpace) -> bool:
        return any(
            classes.find(d) not in roots for axis in range(num_axes) for side in _splits(n, s, axis) for d in side
        )

    kept: list[NodeSpace] = []
    dropped = 0
    for n in nodes:
        if n.kind == "op":
            strategies = tuple(s for s in n.strategies if not transit(s, n))
            if strategies and len(strategies) < len(n.strategies):
                dropped += len(n.strategies) - len(strategies)
                n = dataclasses.replace(n, strategies=strategies)
        kept.append(n)
    if dropped:
        log.info("dropped %d strategies that split only dims elementwise ops carry (transit splits)", dropped)
    return kept
