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
import functools
import logging

from autopar.core.placement import Shard
from autopar.core.strategy import NodeSpace

log = logging.getLogger(__name__)

_Dim = tuple[str, int, int]  # (producer, output index, dim)
_Side = tuple[tuple[int, int], ...]  # (operand or output index, dim) pairs of one strategy on one mesh axis


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


@functools.cache
def _sharded(placements) -> tuple[tuple[int, int], ...]:
    """``(mesh axis, dim)`` of every split of ``placements`` (a
    :class:`~autopar.core.placement.Layout`, one object per value, or ``None``)."""
    return tuple((axis, p.dim) for axis, p in enumerate(placements or ()) if isinstance(p, Shard))


def _node_splits(node: NodeSpace) -> set[tuple[_Side, _Side]]:
    """The distinct ``(operand splits, output splits)`` the strategies of ``node`` make on one
    mesh axis, as ``(index, dim)`` pairs."""
    found: set[tuple[_Side, _Side]] = set()
    for s in node.strategies:
        ins = [(axis, j, d) for j, p in enumerate(s.inputs) for axis, d in _sharded(p)]
        outs = [(axis, o, d) for o, p in enumerate(s.outputs) for axis, d in _sharded(p)]
        for axis in {a for a, _, _ in ins} | {a for a, _, _ in outs}:
            found.add(
                (
                    tuple((j, d) for a, j, d in ins if a == axis),
                    tuple((o, d) for a, o, d in outs if a == axis),
                )
            )
    return found


def drop_transit_splits(nodes: list[NodeSpace], carrying: set[str]) -> list[NodeSpace]:
    """``nodes`` with every op strategy that makes a transit split (module docstring) removed.
    ``carrying`` names the op nodes whose rules are elementwise or view rules. Placeholders
    and the output keep all their strategies, and an op keeps its whole strategy list when
    every one of them would go."""
    by_strategies: dict[int, set] = {}  # ops of repeated layers share one tuple of strategies
    splits = {}
    for n in nodes:
        if n.kind in ("op", "param", "buffer", "input", "tangent"):
            if id(n.strategies) not in by_strategies:
                by_strategies[id(n.strategies)] = _node_splits(n)
            splits[n.name] = by_strategies[id(n.strategies)]
    classes = _Classes()
    native: list[_Dim] = []
    for n in nodes:
        for ins, outs in splits.get(n.name, ()):
            out_dims = [(n.name, o, d) for o, d in outs]
            if n.kind != "op":
                native += out_dims
            elif outs:
                in_dims = [(n.args[j][0], n.args[j][1], d) for j, d in ins]
                if n.name in carrying:
                    classes.union(in_dims + out_dims)
                else:
                    native += in_dims + out_dims
    roots = {classes.find(d) for d in native}

    kept: list[NodeSpace] = []
    dropped = 0
    for n in nodes:
        if n.kind == "op":
            transit_in = {
                (j, d) for ins, _ in splits[n.name] for j, d in ins if classes.find((*n.args[j], d)) not in roots
            }
            transit_out = {
                (o, d) for _, outs in splits[n.name] for o, d in outs if classes.find((n.name, o, d)) not in roots
            }
            if not transit_in and not transit_out:
                kept.append(n)
                continue
            strategies = tuple(
                s
                for s in n.strategies
                if not any((j, d) in transit_in for j, p in enumerate(s.inputs) for _, d in _sharded(p))
                and not any((o, d) in transit_out for o, p in enumerate(s.outputs) for _, d in _sharded(p))
            )
            if strategies and len(strategies) < len(n.strategies):
                dropped += len(n.strategies) - len(strategies)
                n = dataclasses.replace(n, strategies=strategies)
        kept.append(n)
    if dropped:
        log.info("dropped %d strategies that split only dims elementwise ops carry (transit splits)", dropped)
    return kept
