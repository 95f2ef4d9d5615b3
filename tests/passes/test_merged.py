"""Meshes of three axes planned through the mesh with two adjacent axes merged."""

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.passes.analysis.capture import capture
from autopar.passes.solve.merged import lifted, merged_mesh

import autopar
from autopar.config import PlanConfig
from autopar.core.placement import R, Shard
from autopar.planner import _Problem


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, dim=64, num_heads=4, num_layers=2))
    return model, (torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32)))


def test_a_plan_of_the_merged_mesh_is_a_plan_of_the_mesh():
    captured = capture(*_gpt())
    mesh = autopar.Mesh((2, 2, 2), ("a", "b", "c"))
    whole = _Problem.build(captured, mesh, PlanConfig(hardware="cpu"))
    for axis, name in ((0, "Mesh(a*b=4 x c=2)"), (1, "Mesh(a=2 x b*c=4)")):
        flat = merged_mesh(mesh, axis)
        assert str(flat) == name
        merged = _Problem.build(captured, flat, PlanConfig(hardware="cpu"))
        choice = {n.name: 0 for n in merged.space.nodes}
        param = next(n for n in merged.space.nodes if n.kind == "param")
        choice[param.name] = next(k for k, s in enumerate(param.strategies) if s.outputs[0] == (Shard(0), R))
        found = lifted(merged.space, choice, whole.space, axis)
        assert set(found) == {n.name for n in whole.space.nodes}
        placed = whole.space.index()[param.name].strategies[found[param.name]].outputs[0]
        assert placed == ((Shard(0), Shard(0), R) if axis == 0 else (Shard(0), R, R))


def test_a_three_axis_mesh_too_large_to_search_gets_the_plan_of_a_merged_mesh():
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2, 2), ("a", "b", "c"))
    plan = autopar.plan(model, mesh, inputs, hardware="cpu")
    assert plan.solver.status == "LAYOUT" and plan.solver.num_variables == 0
    assert "merged" in plan.stage_s and "the mesh's own program is too large to search" in str(plan)
    flat = {axis: autopar.plan(model, merged_mesh(mesh, axis), inputs, hardware="cpu") for axis in (0, 1)}
    if plan.solver.layout.startswith("plan of"):
        assert plan.solver.layout in {f"plan of {p.mesh}" for p in flat.values()}
    # the plan runs on the three axes as planned
    assert all(len(p) == 3 for p in plan.placements.values())


def test_a_three_axis_mesh_too_large_to_search_plans_under_a_budget_through_a_merged_mesh():
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2, 2), ("a", "b", "c"))
    whole = autopar.plan(model, mesh, inputs, hardware="cpu")
    budget = int(0.7 * whole.peak_memory_bytes)
    plan = autopar.plan(model, mesh, inputs, hardware="cpu", memory_budget=budget, solver_time_limit_s=10)
    assert plan.solver.status == "LAYOUT" and "merged" in plan.stage_s  # a merged mesh's plan, or a layout
    assert plan.peak_memory_bytes <= budget and 0 < plan.memory.liveness_peak_bytes <= budget
    assert plan.peak_memory_bytes < whole.peak_memory_bytes
    with pytest.raises(autopar.InfeasiblePlanError, match="no plan of a mesh with two of the axes"):
        autopar.plan(model, mesh, inputs, hardware="cpu", memory_budget=budget // 20, solver_time_limit_s=10)
