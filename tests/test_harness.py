"""The multi-rank test harness reports a rank that dies in native code at once, not at its timeout."""

import os
import time

import pytest

from tests.harness import run_ranks


def _rank_one_dies() -> int:
    if os.environ["RANK"] == "1":
        os._exit(3)  # as a segfault would: no traceback, nothing put on the queue
    return 0


def test_a_rank_that_dies_without_a_traceback_fails_the_run_at_once():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 died with exit code 3"):
        run_ranks(2, _rank_one_dies, timeout_s=120)
    assert time.monotonic() - started < 60
