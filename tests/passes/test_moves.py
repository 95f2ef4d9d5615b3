"""The plan records each move's steps, and lowering runs those steps as recorded."""

import dataclasses
import re

import pytest
import torch
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture
from autopar.passes.lower.rewrite import rewrite
from autopar.passes.propagation.rank_ops import graph_collectives
from autopar.runtime.launch import device_mesh

import autopar
from autopar.core.move import Step
from autopar.core.placement import P, S
from autopar.core.plan import ShardingPlan
from autopar.planner import plan_captured

SYNTHETIC = autopar.SyntheticProfile(s_per_flop=1e-9, s_per_byte=1e-12, latency_s=1e-8)


def _megatron_mlp(fake_world):
    fake_world(4)
    model = MLP(32, 32, num_layers=2)
    captured = capture(model, (torch.randn(64, 32), torch.randn(64, 32)))
    mesh = autopar.Mesh((4,), ("tp",))
    pins = {
        "x": "R",
        "target": "R",
        "layers.0.weight": "S(0)",
        "layers.0.bias": "S(0)",
        "layers.1.weight": "S(1)",
        "layers.1.bias": "R",
    }
    plan = plan_captured(captured, mesh, hardware=SYNTHETIC, pins=pins)
    return captured, plan, [device_mesh(mesh, "cpu").get_group(0).group_name]


def test_lowering_runs_the_steps_the_plan_records(fake_world):
    """A plan whose record of a reduce-scatter says an all-reduce then a slice (the same values)
    gets a program that runs exactly that; a plan without a move the program needs is refused,
    naming the move."""
    captured, plan, groups = _megatron_mlp(fake_world)
    assert ShardingPlan.from_json(plan.to_json()).moves == plan.moves
    scatter = next(m for m in plan.moves if m.src == (P,) and m.dst == (S(1),))
    assert [s.kind for s in scatter.steps] == ["reduce_scatter"]
    bytes_ = scatter.steps[0].bytes

    def ran(plan) -> list:
        graph = rewrite(captured, plan, coordinate=(0,), group_names=groups)
        return sorted((kind, nbytes) for kind, _, nbytes in graph_collectives(graph, groups))

    as_planned = ran(plan)
    assert ("reduce_scatter", bytes_) in as_planned
    other = dataclasses.replace(
        scatter, steps=(Step("all_reduce", 0, bytes=bytes_), Step("slice", 0, dim=1, bytes=bytes_ // 4))
    )
    edited = dataclasses.replace(plan, moves=tuple(other if m is scatter else m for m in plan.moves))
    as_edited = as_planned.copy()
    as_edited[as_edited.index(("reduce_scatter", bytes_))] = ("all_reduce", bytes_)
    assert ran(edited) == sorted(as_edited)

    missing = dataclasses.replace(plan, moves=tuple(m for m in plan.moves if m is not scatter))
    named = re.escape(f"moves {scatter.tensor} from (P) to (S(1)), a move the plan")
    with pytest.raises(autopar.RewriteError, match=named):
        rewrite(captured, missing, coordinate=(0,), group_names=groups)
