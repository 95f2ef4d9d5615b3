"""Shared fixtures: a synthetic cost profile and a fake process group for single-process tests."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar

# A FLOP costs what a byte sent costs, so neither redundant compute nor communication is free;
# latency is small so that bytes, not message counts, decide the known plans.
FLOP_EQ_BYTE = autopar.SyntheticProfile(s_per_flop=1e-12, s_per_byte=1e-12, latency_s=1e-8)


@pytest.fixture
def fake_world():
    """A fake process group of ``size`` ranks in this process (no communication happens)."""

    def make(size: int, rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()
