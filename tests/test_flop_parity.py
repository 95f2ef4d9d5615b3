"""The work a plan prices is the work its per-rank programs run: for every graph-diff model and
plan, the FLOPs of each rank's program (torch.utils.flop_counter's formulas on the program's
local shapes) equal the FLOPs the plan priced, within 1%."""

import itertools

import pytest
import torch
from autopar.cost_model.compute import math_format, node_work
from autopar.passes.analysis.capture import capture
from autopar.passes.lower.rewrite import rewrite
from torch import nn

import autopar
from autopar import Mesh
from autopar.planner import plan_captured
from tests.cases import SYNTHETIC, make_model, pins_for
from tests.runtime.test_graph_diff import FOUR, TWO


def executed_flops(gm: torch.fx.GraphModule) -> float:
    """FLOPs of a per-rank program: the flop counter's formulas (and autopar's for the CPU
    attention kernels, which the counter lacks) on the program's local values."""
    return sum(node_work(node)[0] for node in gm.graph.nodes if math_format(node) is not None)


def priced_flops(plan: autopar.ShardingPlan) -> float:
    recomputed = {n.name for n in plan.nodes if n.activation == "recompute"}
    return sum(n.flops * (2 if n.name in recomputed else 1) for n in plan.nodes)


def _check(captured, plan):
    names = [f"axis{k}" for k in range(plan.mesh.ndim)]
    for coordinate in itertools.product(*(range(n) for n in plan.mesh.shape)):
        program = rewrite(captured, plan, coordinate=coordinate, group_names=names)
        executed, priced = executed_flops(program), priced_flops(plan)
        assert executed > 0
        assert executed == pytest.approx(priced, rel=0.01), f"rank {coordinate}"


_CASES = [c for c in FOUR + TWO if not c["model_name"].startswith("hf-")]


@pytest.mark.parametrize(
    "case",
    _CASES,
    ids=lambda c: "-".join(
        str(v) for v in (c["model_name"], *c["mesh_shape"], c.get("preset", ""), c.get("recompute", ""))
    ),
)
def test_priced_flops_are_the_flops_each_rank_runs(case):
    model, batches = make_model(case["model_name"])
    mesh = Mesh(case["mesh_shape"], case["axis_names"])
    captured = capture(model, batches[0])
    plan = plan_captured(
        captured,
        mesh,
        hardware=case.get("hardware", SYNTHETIC),
        pins=pins_for(case.get("preset"), case["model_name"], case["axis_names"]),
        recompute=case.get("recompute", "auto"),
    )
    _check(captured, plan)


class _Uneven(nn.Module):
    """An MLP whose widths no 4-way axis divides, so no tensor parallel layout exists."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(1024, 16382), nn.Linear(16382, 1022)

    def forward(self, x, y):
        return ((self.down(torch.relu(self.up(x))) - y) ** 2).mean()


def test_redundant_work_on_whole_operands_is_priced_in_full():
    with torch.device("meta"):
        model = _Uneven()
        inputs = (torch.randn(8190, 1024), torch.randn(8190, 1022))
    captured = capture(model, inputs)
    plan = plan_captured(captured, Mesh((4,), ("tp",)), hardware="h100")
    _check(captured, plan)
