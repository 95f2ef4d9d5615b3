"""Op times measured on this host, for a profile calibrated on the machine that trains.

A roofline misses what a CPU (or any device) really does with an op: transcendental functions in
GELU and its backward, attention kernels, per-call overhead that depends on the op. When the
host that plans is the device that runs (a profile written by ``autopar calibrate`` says so with
``fitted.timed_ops``), the cost model times each op instead, as Alpa and nnScaler profile theirs:
every distinct ``(op, local argument shapes and dtypes, other arguments)`` a strategy gives runs
on tensors of those shapes, the way the per-rank program runs it
(:func:`autopar.passes.propagation.rank_ops.local_call`), and the median per call is kept. Integer and
boolean arguments are zeros (a valid index everywhere), floating ones uniform in [0, 1).

An op whose arguments and outputs overflow a core's L2 cache is timed on copies of its arguments
that together span the training step's working set on this host (every rank's parameters,
gradients and optimizer state: what a step touches between two reads of one weight), calls
cycling through them, so that each call reads its arguments from the level of the memory
hierarchy where a step finds them: a cache that holds the working set, or memory past the
last-level cache. Where the cache really ends varies by host, and cycling through the working set
measures it instead of assuming it: Linux reports 480 MiB of last-level cache on this one, but
a thin matmul through a 4 MiB weight took 0.44–0.48 ms a call cycling through 4 to 48 MiB of
copies and 0.75 ms through 128 MiB or more.

Ops whose pieces would take more than ``TIMED_BYTES_LIMIT`` keep the roofline estimate, as do
ops that do not run on such inputs (the error is logged at debug level).
"""

import functools
import logging
import math
import resource
import statistics
import time
from pathlib import Path

import torch
from autopar.passes.propagation.rank_ops import local_call, piece_of
from autopar.passes.propagation.redistribute import local_shape
from autopar.passes.rules import tensor_args
from torch import fx
from torch.utils._pytree import tree_flatten

from autopar.core.mesh import Mesh
from autopar.core.strategy import Strategy

log = logging.getLogger(__name__)

TIMED_BYTES_LIMIT = 256 * 2**20
"""Largest total size of an op's local arguments that is timed."""
_BATCH_S = 2e-4
"""Each timing covers enough calls to last about this long."""
_MAX_COPIES = 64
"""Most copies of an op's arguments that a timing cycles through."""
_MAX_WARMUP_CALLS = 16
"""Most untimed calls of an op, after one through each copy, before it is timed
(:func:`_warm_up`)."""
_MAX_SAMPLES = 12
"""Most samples of an op taken to find its clean ones (:func:`_samples`)."""


@functools.cache
def cache_bytes() -> tuple[int, int]:
    """``(a core's L2 cache, the last-level cache)`` in bytes, as Linux's sysfs gives them
    for the first CPU (1 MiB and 32 MiB where it gives none)."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        sizes[level] = int(size.rstrip("KMG")) * unit
    return sizes.get(2, 2**20), sizes[max(sizes)] if sizes else 32 * 2**20


class _Alone:
    """A :class:`~autopar.passes.rules.Split` for timing: the first rank's piece, no peers."""

    def __init__(self, offset: int, size: int):
        self.offset, self.size = offset, size

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t


class OpTimer:
    """Times ops under strategies on this host, each distinct call once per process (plans
    made one after another price an op alike), ops that overflow L2 reading their arguments
    from copies spanning the step's ``working_set`` bytes (:meth:`_copies`). A ``fresh`` timer
    keeps times of its own and times every call again, leaving the process's times untouched."""

    times: dict[tuple, float | None] = {}
    """Seconds per distinct call, shared by every timer of the process."""

    def __init__(self, mesh: Mesh, repeats: int = 3, *, working_set: int = 0, fresh: bool = False):
        if fresh:
            self.times = {}
        self.mesh = mesh
        self.repeats = repeats
        self.working_set = working_set

    def node_s(self, node: fx.Node, strategy: Strategy) -> float | None:
        """Seconds per call of ``node`` under ``strategy`` on one rank, or ``None`` where it is
        not timed."""
        args = tensor_args(node)
        shapes = [local_shape(tuple(a.meta["val"].shape), p, self.mesh) for a, p in zip(args, strategy.inputs)]
        dtypes = [a.meta["val"].dtype for a in args]
        if sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)) > TIMED_BYTES_LIMIT:
            return None
        others = repr([a for a in tree_flatten((node.args, node.kwargs))[0] if not isinstance(a, fx.Node)])
        wholes = tuple(tuple(a.meta["val"].shape) for a in args)
        key = (node.target, wholes, tuple(shapes), tuple(dtypes), others, strategy, self.mesh, self.working_set)
        if key not in self.times:
            self.times[key] = self._time(node, strategy, shapes, dtypes)
        return self.times[key]

    def _time(self, node: fx.Node, strategy: Strategy, shapes, dtypes) -> float | None:
        local = [_like(a.meta["val"], s) for a, s in zip(tensor_args(node), shapes)]
        first = (0,) * self.mesh.ndim

        def call_on(args):
            return local_call(
                node, args, strategy, self.mesh, lambda axes, whole: _Alone(*piece_of(whole, axes, self.mesh, first))
            )

        try:
            with torch.no_grad():
                call = call_on(local)
                copies = self._copies(local, call(), self.working_set)
                calls = [call, *(call_on([t.clone() for t in local]) for _ in range(copies - 1))]
                _warm_up(calls)
                started = time.perf_counter()
                call()
                once = max(time.perf_counter() - started, 1e-7)
                batch = max(1, min(100, int(_BATCH_S / once)))
                samples = _samples(calls, batch, self.repeats)
        except Exception as exc:  # an op that does not run on synthetic inputs keeps its roofline cost
            log.debug("could not time %s on %s: %s", node.target, shapes, exc)
            return None
        return statistics.median(samples)

    @staticmethod
    def _copies(args: list[torch.Tensor], outputs, working_set: int) -> int:
        """How many copies of ``args`` a timing cycles through: one for an op whose arguments
        and outputs fit in L2, else enough to span ``working_set`` bytes, up to one copy past
        the last-level cache (more would read from memory alike) and ``_MAX_COPIES``."""
        l2, last_level = cache_bytes()
        inputs = sum(t.nbytes for t in args)
        made = sum(t.nbytes for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor))
        if inputs == 0 or inputs + made <= l2:
            return 1
        return max(1, min(_MAX_COPIES, math.ceil(min(working_set, last_level + inputs) / inputs)))


def _samples(calls: list, batch: int, repeats: int) -> list[float]:
    """``repeats`` seconds per call, each the mean of ``batch`` calls of ``calls`` in turn (the
    turn going on from one sample to the next, so that an op slow enough to take one call a
    sample still reads a different copy each time), of samples that faulted in no fresh memory
    pages, taking up to ``_MAX_SAMPLES`` samples (all of
    them where none was clean). The allocator can give back the memory of a large output it
    frees, so that a later call maps its pages afresh, which a step, allocating the same sizes
    every step, does not: timed on copies spanning 32 MiB, a matmul writing a 4 MiB output took
    0.20–0.28 ms a call in four timings out of six and 1.2–1.4 ms in the two whose calls faulted
    2,000 to 3,000 pages."""
    clean, faulted = [], []
    for sample in range(_MAX_SAMPLES):
        before = _page_faults()
        started = time.perf_counter()
        for i in range(sample * batch, (sample + 1) * batch):
            calls[i % len(calls)]()
        seconds = (time.perf_counter() - started) / batch
        (faulted if _page_faults() > before else clean).append(seconds)
        if len(clean) == repeats:
            break
    return clean or faulted


def _warm_up(calls: list) -> None:
    """Call each of ``calls`` once, untimed, then on through them in turn until a call faults in
    no fresh memory pages (at most ``_MAX_WARMUP_CALLS`` more). The first read of each copy of
    an op's arguments after it is made is slower than the later ones, which a step, reading the
    same weights every step, does not see: here a thin matmul through one of 16 copies of a 4
    MiB weight took 0.70 to 0.89 ms a call in the first pass through them, then 0.50 to 0.56 ms.
    And the first calls of an op with large outputs map new pages for them until the allocator
    settles (glibc moves its thresholds as memory is freed): a matmul with a 4 MiB output took
    1.5 ms in each of its first eight or so calls after its arguments were copied, 1,024 page
    faults each, then 0.22 ms."""
    for call in calls:
        call()
    for i in range(_MAX_WARMUP_CALLS):
        before = _page_faults()
        calls[i % len(calls)]()
        if _page_faults() == before:
            return


def _page_faults() -> int:
    """The process's minor page faults so far (fresh pages mapped)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _like(whole: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of ``shape`` laid out in memory as ``whole`` is (a transposed operand stays
    transposed)."""
    order = sorted(range(whole.ndim), key=lambda d: -whole.stride()[d]) if whole.ndim else []
    t = torch.empty_permuted(shape, order, dtype=whole.dtype)
    return t.uniform_() if whole.dtype.is_floating_point else t.zero_()
