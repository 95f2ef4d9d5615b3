"""What one rank runs: its collectives and its local ops.

:class:`Rank` emits the functional collectives (``torch.ops._c10d_functional``) and the local
ops around them that move a tensor between placements on one rank, and packs gradient and
parameter buckets, while ``make_fx`` traces the rewriter's interpretation
(:mod:`autopar.passes.lower.rewrite`). :func:`local_call` runs one op of the joint graph on a rank's
local pieces, as the rewriter does and as :mod:`autopar.cost_model.op_timing` times it, and
:func:`graph_collectives` reads the collectives back from a traced per-rank graph.
"""

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from autopar.passes.propagation.redistribute import local_shape
from autopar.passes.rules import ReduceOp, Split, arg_layout, batch_arg, shape_arg, split_op
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.core.errors import RewriteError
from autopar.core.kinds import CollectiveKind
from autopar.core.mesh import Mesh
from autopar.core.move import Step
from autopar.core.strategy import Strategy

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# a local piece may arrive with other strides than the whole tensor had (after a collective or
# a slice), so views become reshapes, which copy only when the strides require it
_AS_RESHAPE = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


class Rank:
    """Emits the local ops and collectives of one rank while ``make_fx`` traces."""

    def __init__(self, mesh: Mesh, coordinate: Sequence[int], group_names: Sequence[str]):
        self.mesh = mesh
        self.coordinate = coordinate
        self.group_names = group_names

    def move(self, t: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
        """``t`` moved by ``steps``, one mesh axis each (a move the plan priced)."""
        for step in steps:
            t = getattr(self, step.kind)(t, step)
        return t

    def _n_group(self, step: Step) -> tuple[int, str]:
        return self.mesh.shape[step.axis], self.group_names[step.axis]

    def all_reduce(self, t, step):
        _, group = self._n_group(step)
        return c10d.wait_tensor(c10d.all_reduce(t.contiguous(), "sum", group))

    def all_gather(self, t, step):
        n, group = self._n_group(step)
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(t.contiguous(), n, group))
        return gathered if step.dim == 0 else side_by_side(gathered.unflatten(0, (n, -1)), step.dim)

    def reduce_scatter(self, t, step):
        n, group = self._n_group(step)
        if step.dim != 0:
            t = stacked_pieces(t, n, step.dim).flatten(0, 1)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(t.contiguous(), "sum", n, group))

    def all_to_all(self, t, step):
        n, group = self._n_group(step)
        send = stacked_pieces(t, n, step.to_dim).flatten(0, 1).contiguous()
        splits = [send.shape[0] // n] * n
        received = c10d.wait_tensor(c10d.all_to_all_single(send, splits, splits, group))
        return side_by_side(received.unflatten(0, (n, -1)), step.dim)

    def slice(self, t, step):
        n = self.mesh.shape[step.axis]
        size = t.shape[step.dim] // n
        return t.narrow(step.dim, self.coordinate[step.axis] * size, size).contiguous()

    def zero(self, t, step):
        return t if self.coordinate[step.axis] == 0 else torch.zeros_like(t)

    def split(self, axes: tuple[int, ...], whole: int) -> "_Split":
        """The rank's piece of a dim of length ``whole`` split by mesh ``axes`` (outer first)."""
        return _Split(*piece_of(whole, axes, self.mesh, self.coordinate), [self.group_names[a] for a in axes])

    def bucket(
        self, pieces: list[torch.Tensor], steps: list[Step], step: Step, then: Sequence[Step] = ()
    ) -> list[torch.Tensor]:
        """Move ``pieces``, whose moves start with ``steps``, with the bucket's collective
        ``step`` and the all-reduces ``then`` over further mesh axes."""
        return self.start_bucket(pieces, steps, step, then)()

    def start_bucket(
        self, pieces: list[torch.Tensor], steps: list[Step], step: Step, then: Sequence[Step] = ()
    ) -> Callable[[], list[torch.Tensor]]:
        """Launch :meth:`bucket`'s collectives (waiting only between one mesh axis and the
        next); the function returned waits for the last and unpacks the pieces."""
        n, group = self._n_group(step)
        if step.kind == "all_gather":  # each rank's pieces, concatenated: row r of the result is rank r's
            flat = torch.cat([p.reshape(-1) for p in pieces])
            launched = c10d.all_gather_into_tensor(flat, n, group)

            def gathered() -> list[torch.Tensor]:
                rows = c10d.wait_tensor(launched).view(n, -1)
                split = rows.split([p.numel() for p in pieces], 1)
                return [side_by_side(piece.reshape(n, *p.shape), s.dim) for p, s, piece in zip(pieces, steps, split)]

            return gathered
        if step.kind == "all_reduce":
            launched = c10d.all_reduce(torch.cat([p.reshape(-1) for p in pieces]), "sum", group)
            for further in then:
                launched = c10d.all_reduce(c10d.wait_tensor(launched), "sum", self._n_group(further)[1])

            def reduced() -> list[torch.Tensor]:
                flat = c10d.wait_tensor(launched)
                return [r.view(p.shape) for r, p in zip(flat.split([p.numel() for p in pieces]), pieces)]

            return reduced
        shards = [stacked_pieces(p, n, s.dim) for p, s in zip(pieces, steps)]
        rows = torch.cat([stacked.reshape(n, -1) for stacked in shards], 1)  # row r: rank r's shards
        launched = c10d.reduce_scatter_tensor(rows.reshape(-1), "sum", n, group)

        def scattered() -> list[torch.Tensor]:
            mine = c10d.wait_tensor(launched)
            return [m.view(s.shape[1:]) for m, s in zip(mine.split([s[0].numel() for s in shards]), shards)]

        return scattered


def stacked_pieces(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``t``'s ``n`` equal pieces along ``dim``, stacked along a new dim 0 (a view): two ops
    whatever ``n``, where ``torch.chunk`` traces one per piece (the per-rank program of the 8B
    shape's budgeted plan on 64x8 has 3,712 nodes this way, 5,346 with chunks)."""
    return t.unflatten(dim, (n, -1)).movedim(dim, 0)


def side_by_side(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """The pieces stacked along dim 0 of ``stacked``, put side by side along ``dim`` of a piece:
    the inverse of :func:`stacked_pieces`."""
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def piece_of(whole: int, axes: Sequence[int], mesh: Mesh, coordinate: Sequence[int]) -> tuple[int, int]:
    """``(offset, size)`` of the piece of a dim of length ``whole`` that the rank at
    ``coordinate`` holds when mesh ``axes`` split it, outer first."""
    size, offset = whole, 0
    for axis in axes:
        size //= mesh.shape[axis]
        offset += coordinate[axis] * size
    return offset, size


class _Split:
    """A :class:`~autopar.passes.rules.Split` on one rank."""

    def __init__(self, offset: int, size: int, groups: list[str]):
        self.offset, self.size, self.groups = offset, size, groups

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        for group in self.groups:
            t = c10d.wait_tensor(c10d.all_reduce(t.contiguous(), op, group))
        return t


_GRAPH_COLLECTIVES: dict[object, tuple[CollectiveKind, Literal["in", "out"]]] = {
    c10d.all_reduce.default: ("all_reduce", "in"),
    c10d.all_gather_into_tensor.default: ("all_gather", "out"),
    c10d.reduce_scatter_tensor.default: ("reduce_scatter", "in"),
    c10d.all_to_all_single.default: ("all_to_all", "in"),
}


def graph_collectives(gm: fx.GraphModule, group_names: Sequence[str]) -> list[tuple[CollectiveKind, int, int]]:
    """``(kind, mesh axis, bytes per rank)`` of every collective in a per-rank graph, read from
    the graph itself, with bytes counted as :class:`~autopar.core.move.Step` does."""
    axis_of = {name: axis for axis, name in enumerate(group_names)}
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _GRAPH_COLLECTIVES:
            kind, side = _GRAPH_COLLECTIVES[node.target]
            value = node.meta["val"] if side == "out" else node.args[0].meta["val"]
            found.append((kind, axis_of[node.args[-1]], value.numel() * value.element_size()))
    return found


def _value(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def local_call(
    node: fx.Node,
    local_args: list[torch.Tensor],
    strategy: Strategy,
    mesh: Mesh,
    split_of: Callable[[tuple[int, ...], int], Split],
) -> Callable[[], object]:
    """A function computing ``node``'s outputs on one rank from its local arguments (in
    :func:`~autopar.passes.rules.tensor_args` order) under ``strategy``. An op whose strategy
    splits a dim it reduces or indexes runs as its :class:`~autopar.passes.rules.SplitOp` says,
    with ``split_of(axes, whole length)``; any other op runs as itself on local shapes."""
    args, kwargs = local_call_args(node, local_args, strategy, mesh)
    split = split_op(node.target)
    axes = split.axes(node, strategy) if split is not None else ()
    if axes:
        piece = split_of(axes, split.value(node).shape[split.dim(node)])
        return lambda: split.run(node, args, kwargs, piece)
    target, args = _local_op(node, args)
    return lambda: target(*args, **kwargs)


def _local_op(node: fx.Node, args: list):
    """The op and arguments a rank runs for ``node``: views as reshapes, a squeeze of every
    size-1 dim as a squeeze of the dims of size 1 in the whole tensor (a split dim's piece may
    have size 1 on a rank), and arguments in the memory layout the op's kernel needs
    (:func:`~autopar.passes.rules.register_arg_layout`)."""
    if (fix := arg_layout(node.target)) is not None:
        args = fix(args)
    if node.target is aten.squeeze.default:
        whole = _value(node.args[0]).shape
        return aten.squeeze.dims, [args[0], [d for d, n in enumerate(whole) if n == 1]]
    return _AS_RESHAPE.get(node.target, node.target), args


def local_call_args(node: fx.Node, local_args: list[torch.Tensor], strategy: Strategy, mesh: Mesh):
    """``node``'s ``(args, kwargs)`` on one rank: tensor arguments replaced by ``local_args``
    (in :func:`~autopar.passes.rules.tensor_args` order), an output-shape argument by the
    local output shape, a batch-size argument by its tensor's local batch."""
    flat, spec = tree_flatten((node.args, node.kwargs))
    it = iter(local_args)
    flat = [next(it) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else a for a in flat]
    if any(isinstance(a, fx.Node) for a in flat):
        raise RewriteError(
            f"node {node.name} ({node.target}) takes a non-tensor graph value; autopar needs static shapes"
        )
    args, kwargs = tree_unflatten(flat, spec)
    args = list(args)
    batch = batch_arg(node.target)
    if batch is not None:
        position, tensor = batch
        args[position] = local_args[tensor].shape[0]
    found = shape_arg(node.target)
    if found is not None:
        position, index = found
        outs = _value(node)
        whole = outs[index] if isinstance(outs, (list, tuple)) else outs
        if whole is not None:
            args[position] = list(local_shape(tuple(whole.shape), strategy.outputs[index], mesh))
    return args, kwargs
