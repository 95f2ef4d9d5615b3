"""Op times measured on this host, for a profile calibrated on the machine that trains.

A roofline misses what a CPU (or any device) really does with an op: transcendental functions in
GELU and its backward, attention kernels, per-call overhead that depends on the op. When the
host that plans is the device that runs (a profile written by ``autopar calibrate`` says so with
``timed_ops``), the cost model times each op instead, as Alpa and nnScaler profile theirs:
every distinct ``(op, local argument shapes and dtypes, other arguments)`` a strategy gives runs
on tensors of those shapes, the way the per-rank program runs it
(:func:`autopar.passes.rewrite.local_call`), and the median per call is kept. Integer and
boolean arguments are zeros (a valid index everywhere), floating ones uniform in [0, 1).

Ops whose pieces would take more than ``TIMED_BYTES_LIMIT`` keep the roofline estimate, as do
ops that do not run on such inputs (the error is logged at debug level).
"""

import logging
import math
import statistics
import time

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from autopar.mesh import Mesh
from autopar.passes.redistribute import local_shape
from autopar.passes.rewrite import local_call, piece_of
from autopar.passes.rules import tensor_args
from autopar.passes.strategy import Strategy

log = logging.getLogger(__name__)

TIMED_BYTES_LIMIT = 256 * 2**20
"""Largest total size of an op's local arguments that is timed."""
_BATCH_S = 2e-4
"""Each timing covers enough calls to last about this long."""


class _Alone:
    """A :class:`~autopar.passes.rules.Split` for timing: the first rank's piece, no peers."""

    def __init__(self, offset: int, size: int):
        self.offset, self.size = offset, size

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t


class OpTimer:
    """Times ops under strategies on this host, each distinct call once."""

    def __init__(self, mesh: Mesh, repeats: int = 3):
        self.mesh = mesh
        self.repeats = repeats
        self.times: dict[tuple, float | None] = {}

    def node_s(self, node: fx.Node, strategy: Strategy) -> float | None:
        """Seconds per call of ``node`` under ``strategy`` on one rank, or ``None`` where it is
        not timed."""
        args = tensor_args(node)
        shapes = [local_shape(tuple(a.meta["val"].shape), p, self.mesh) for a, p in zip(args, strategy.inputs)]
        dtypes = [a.meta["val"].dtype for a in args]
        if sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)) > TIMED_BYTES_LIMIT:
            return None
        others = repr([a for a in tree_flatten((node.args, node.kwargs))[0] if not isinstance(a, fx.Node)])
        key = (node.target, tuple(shapes), tuple(dtypes), others, strategy.outputs)
        if key not in self.times:
            self.times[key] = self._time(node, strategy, shapes, dtypes)
        return self.times[key]

    def _time(self, node: fx.Node, strategy: Strategy, shapes, dtypes) -> float | None:
        local = [_like(a.meta["val"], s) for a, s in zip(tensor_args(node), shapes)]

        try:
            with torch.no_grad():
                first = (0,) * self.mesh.ndim
                call = local_call(node, local, strategy, self.mesh,
                                  lambda axes, whole: _Alone(*piece_of(whole, axes, self.mesh, first)))
                started = time.perf_counter()
                call()
                once = max(time.perf_counter() - started, 1e-7)
                calls = max(1, min(100, int(_BATCH_S / once)))
                samples = []
                for _ in range(self.repeats):
                    started = time.perf_counter()
                    for _ in range(calls):
                        call()
                    samples.append((time.perf_counter() - started) / calls)
        except Exception as exc:  # an op that does not run on synthetic inputs keeps its roofline cost
            log.debug("could not time %s on %s: %s", node.target, shapes, exc)
            return None
        return statistics.median(samples)


def _like(whole: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of ``shape`` laid out in memory as ``whole`` is (a transposed operand stays
    transposed)."""
    order = sorted(range(whole.ndim), key=lambda d: -whole.stride()[d]) if whole.ndim else []
    t = torch.empty_permuted(shape, order, dtype=whole.dtype)
    return t.uniform_() if whole.dtype.is_floating_point else t.zero_()

