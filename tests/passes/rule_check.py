"""The ground-truth check of one rule row on a 2-way mesh axis, shared by the rule validators.

The node's real inputs are cut into the two ranks' pieces as the row says (split, copied, or cut
into two summands for a partial sum), the op runs on each rank's pieces with local shape
arguments, and the pieces of the outputs are put back together (concatenated, checked equal, or
summed) and compared with the op's output on the whole tensors. An op whose row splits a dim it
reduces or indexes runs as its ``SplitOp`` says, the two ranks in two threads that all-reduce
through :class:`TwoRanks`.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from autopar.passes.propagation.propagate import placement_problem
from autopar.passes.propagation.rank_ops import local_call, piece_of
from autopar.passes.rules import split_op, tensor_args
from torch import fx

from autopar.core.mesh import Mesh
from autopar.core.placement import Partial, Replicate, Shard
from autopar.core.strategy import Strategy

MESH = Mesh((2,))


class Recorder(fx.Interpreter):
    """Runs a graph and keeps every node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = out
        return out


def pieces(value: torch.Tensor, placement, gen):
    if isinstance(placement, Shard):
        return [c.contiguous() for c in torch.chunk(value, 2, placement.dim)]  # as the rewriter slices
    if isinstance(placement, Replicate):
        return [value, value]
    share = torch.rand(value.shape, generator=gen, dtype=value.dtype)
    finite = torch.isfinite(value)  # an infinite entry (a mask's -inf) is one rank's summand, the other's is 0
    first = torch.where(finite, value * share, value)
    return [first, torch.where(finite, value - first, 0)]


def combine(parts, placement):
    if isinstance(placement, Shard):
        return torch.cat(parts, placement.dim)
    if isinstance(placement, Partial):
        return parts[0] + parts[1]
    assert torch.equal(parts[0], parts[1]), "a replicated output differs between ranks"
    return parts[0]


class TwoRanks:
    """The two ranks of the axis, meeting at each all-reduce."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.slots: list = [None, None]

    def all_reduce(self, rank: int, t: torch.Tensor, op: str) -> torch.Tensor:
        self.slots[rank] = t
        self.barrier.wait()
        pair = torch.stack(self.slots)
        self.barrier.wait()  # both have read the slots before either writes the next reduction
        return pair.sum(0) if op == "sum" else pair.amax(0)


class RankSplit:
    """One rank's :class:`~autopar.passes.rules.Split` of a dim of length ``whole``."""

    def __init__(self, ranks: TwoRanks, rank: int, whole: int):
        self.ranks, self.rank = ranks, rank
        self.offset, self.size = piece_of(whole, (0,), MESH, (rank,))

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return self.ranks.all_reduce(self.rank, t, op)


def joint_args(model: torch.nn.Module, captured, inputs) -> list[torch.Tensor]:
    """Real values for ``captured``'s placeholders: ``model``'s parameters and buffers, the
    ``inputs``, and tangents of ones."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    user = iter(inputs)
    args = []
    for node, kind in zip(captured.placeholders, captured.inputs):
        if kind.kind in ("param", "buffer"):
            args.append(state[kind.name].detach())
        elif kind.kind == "input":
            args.append(next(user))
        else:
            args.append(torch.ones(node.meta["val"].shape, dtype=node.meta["val"].dtype))
    return args


def _scale(value: torch.Tensor) -> float:
    """The largest finite magnitude in ``value``, at least 1: sums over many terms (a weight
    gradient) round to a fraction of the terms' size, not of the small entries'."""
    if not value.is_floating_point() or value.numel() == 0:
        return 1.0
    finite = value[torch.isfinite(value)]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def check_row(node, values, row, gen, *, rtol: float = 1e-4, atol: float = 1e-5, skip: tuple[int, ...] = ()) -> bool:
    """True if the row was checked, False if the shapes do not allow it on 2 ranks (a dim that
    does not split evenly, a partial sum of integers). The outputs numbered in ``skip`` are not
    compared (a kernel's random-number state, which each call makes anew)."""
    outs, ins = row
    args = tensor_args(node)
    out_vals = values[node] if isinstance(values[node], (list, tuple)) else [values[node]]
    metas = [a.meta["val"] for a in args] + [o for o in out_vals]
    places = list(ins) + list(outs)
    if any(p is not None and t is not None and placement_problem(t, (p,), MESH) for t, p in zip(metas, places)):
        return False
    arg_pieces = [pieces(values[a], p, gen) for a, p in zip(args, ins)]
    strategy = Strategy(tuple(None if o is None else (o,) for o in outs), tuple((p,) for p in ins))
    split = split_op(node.target)
    splits = split is not None and split.axes(node, strategy)
    ranks = TwoRanks()

    def run(rank: int) -> list:
        result = local_call(
            node, [p[rank] for p in arg_pieces], strategy, MESH, lambda axes, whole: RankSplit(ranks, rank, whole)
        )()
        return result if isinstance(result, (list, tuple)) else [result]

    if splits:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(run, range(2)))
    else:
        results = [run(0), run(1)]
    for i, placement in enumerate(outs):
        if placement is None or out_vals[i] is None or i in skip:
            continue
        got = combine([results[0][i], results[1][i]], placement)
        torch.testing.assert_close(
            got,
            out_vals[i],
            rtol=rtol,
            atol=atol * _scale(out_vals[i]),
            msg=lambda m: f"{node.name} ({node.target}) row {row}: {m}",
        )
    return True
