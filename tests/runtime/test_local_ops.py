"""Ops whose local form differs from the whole one, run on 2 gloo ranks against one device."""

import pytest
import torch
from torch import nn

import autopar
from tests.cases import SYNTHETIC
from tests.harness import run_ranks


class _Squeezed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = (x @ self.w).unsqueeze(1)  # (2, 1, 6): split in two, a rank's batch dim has size 1
        q = h.squeeze()  # must stay (1, 6) on a rank, not (6,)
        return ((q[:, :3] - y[:, :3]) ** 2).sum()


def squeeze_with_the_batch_split() -> tuple[float, float]:
    torch.manual_seed(0)
    model, x, y = _Squeezed(), torch.randn(2, 6), torch.randn(2, 6)
    expected = float(model(x, y))
    pmodel = autopar.compile(
        model, autopar.Mesh((2,), ("dp",)), (x, y), hardware=SYNTHETIC, pins={"x": "S(0)", "y": "S(0)", "w": "R"}
    )
    return float(pmodel(pmodel.rank_part("x", x), pmodel.rank_part("y", y))), expected


@pytest.mark.slow
def test_squeeze_of_every_size_one_dim_keeps_a_split_dim_of_one():
    for got, expected in run_ranks(2, squeeze_with_the_batch_split):
        assert got == pytest.approx(expected, rel=1e-6)
