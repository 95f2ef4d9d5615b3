"""Rank 0's plan handed to the other ranks within a timeout.

Rank 0 plans while the others wait; under a timeout a planning may take longer than the
timeout, so waiting in the plan's broadcast would either fail a long planning or never notice a
rank 0 that froze. Rank 0 instead beats in the process group's store while it plans, and the
others wait as long as it beats.
"""

import contextlib
import itertools
import threading
import time

import torch.distributed as dist

from autopar.core.errors import CollectiveError

_PLANNING_KEY = "autopar/planning/{}".format
"""The store key through which rank 0 shows the other ranks that its ``n``-th planning goes on:
a count it raises every :func:`_beat_s` seconds, and -1 once done."""
_BEAT_S = 1.0


def _beat_s(timeout_s: float) -> float:
    """How often rank 0 beats, and the others look: several times within any timeout."""
    return min(_BEAT_S, timeout_s / 4)


_PLANNINGS = itertools.count(1)
"""Numbers the plannings of this process, in the same order on every rank (every rank builds
its modules and calls them in the same order), so that each has its own store key."""


def next_planning() -> int:
    """The number of the planning about to start (see :data:`_PLANNINGS`)."""
    return next(_PLANNINGS)


@contextlib.contextmanager
def planning_on_rank0(timeout_s: float | None, n: int):
    """On rank 0, while planning: with a timeout, beat in the store (a thread raising
    ``_PLANNING_KEY(n)``), so that the ranks waiting for the plan can tell a long planning from
    a rank 0 that stalled or died."""
    if timeout_s is None:
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(_beat_s(timeout_s)):
            store.add(_PLANNING_KEY(n), 1)

    thread = threading.Thread(target=beat, name="autopar-planning-beat", daemon=True)
    store.add(_PLANNING_KEY(n), 1)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        store.set(_PLANNING_KEY(n), "-1")


def wait_for_rank0_to_plan(timeout_s: float, n: int) -> None:
    """Wait until rank 0 is done with its ``n``-th planning, failing with a
    :class:`~autopar.core.errors.CollectiveError` once it has not beaten for ``timeout_s``
    (it stalled) or the store it hosts is gone (it died)."""
    store = dist.distributed_c10d._get_default_store()
    last, since = None, time.monotonic()
    while True:
        try:
            beats = int(store.add(_PLANNING_KEY(n), 0))
        except RuntimeError as exc:
            raise CollectiveError(
                f"rank {dist.get_rank()}: rank 0 left the job while planning (its store is gone: {exc})"
            ) from exc
        if beats == -1:
            return
        if beats != last:
            last, since = beats, time.monotonic()
        elif time.monotonic() - since > timeout_s:
            raise CollectiveError(
                f"rank {dist.get_rank()}: rank 0 stopped answering while planning: it showed no progress for the "
                f"timeout of {timeout_s:g} s (it stalled, or left the job)"
            )
        time.sleep(_beat_s(timeout_s))
