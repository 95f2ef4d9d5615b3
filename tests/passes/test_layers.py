"""Repeated layers sharing variables, cheapest-order reshards, and the flow form of moves."""

import dataclasses

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.redistribute import transition

import autopar
from autopar import Mesh
from autopar.core.mesh import Link
from autopar.core.placement import R, Shard
from autopar.planner import plan_captured
from tests.conftest import FLOP_EQ_BYTE


def _llama(layers: int):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, dim=64, num_heads=4, num_kv_heads=2, hidden=128, num_layers=layers, max_seq=32)
    return Llama(cfg), (torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32)))


def test_the_program_does_not_grow_with_repeated_layers():
    mesh = Mesh((4,), ("dp",))
    plans = {}
    for n in (2, 4):
        model, inputs = _llama(n)
        plans[n] = autopar.plan(model, mesh, inputs, hardware=FLOP_EQ_BYTE, share_layers=True)
    assert plans[2].solver.num_variables == plans[4].solver.num_variables
    per_layer = (plans[4].solver.shared_nodes - plans[2].solver.shared_nodes) // 2
    assert plans[2].solver.shared_nodes == per_layer > 100  # every node of the second layer, backward included
    assert plans[4].placements["blocks.3.w1.weight"] == plans[4].placements["blocks.0.w1.weight"]


def test_shared_layers_find_the_plan_of_unshared_ones_when_layers_agree():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, dim=64, num_heads=4, num_layers=3))
    captured = capture(model, (torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))))
    mesh = Mesh((4,), ("tp",))
    shared = plan_captured(captured, mesh, hardware="h100", share_layers=True)
    alone = plan_captured(captured, mesh, hardware="h100", share_layers=False)
    assert shared.solver.shared_nodes > 0 and alone.solver.shared_nodes == 0
    assert shared.solver.num_variables < alone.solver.num_variables / 2
    assert shared.predicted_step_s == pytest.approx(alone.predicted_step_s, rel=1e-6)
    assert shared.solver.objective_s == pytest.approx(shared.predicted_step_s, rel=1e-6)  # copies priced in full


def test_small_programs_keep_one_choice_per_layer_by_default():
    plan = autopar.plan(
        MLP(256, 256, num_layers=6),
        Mesh((4,), ("tp",)),
        (torch.randn(32, 256), torch.randn(32, 256)),
        hardware=FLOP_EQ_BYTE,
    )
    assert plan.solver.shared_nodes == 0


def test_one_step_moves_as_flow_give_the_same_optimum_as_all_pairs():
    captured = capture(*_two_layer_mlp())
    mesh = Mesh((2, 2), ("dp", "tp"))
    flow = plan_captured(captured, mesh, hardware="h100")
    import autopar.planner as planner

    solve = planner.solve
    try:
        planner.solve = lambda problem, options: solve(dataclasses.replace(problem, one_step_moves=None), options)
        pairs = plan_captured(captured, mesh, hardware="h100")
    finally:
        planner.solve = solve
    assert flow.solver.num_variables < pairs.solver.num_variables
    assert flow.solver.objective_s == pytest.approx(pairs.solver.objective_s, rel=1e-6)
    assert flow.predicted_step_s == pytest.approx(pairs.predicted_step_s, rel=1e-6)


def _two_layer_mlp():
    torch.manual_seed(0)
    return MLP(256, 1024), (torch.randn(64, 256), torch.randn(64, 256))


@pytest.mark.parametrize("slow_axis", [0, 1])
def test_reshards_gather_over_the_slow_axis_while_the_tensor_is_small(slow_axis):
    mesh = Mesh((2, 2), ("a", "b"))
    slow, fast = Link(1e-6, 1e-9), Link(1e-6, 1e-12)
    links = (slow, fast) if slow_axis == 0 else (fast, slow)
    steps = transition((Shard(0), Shard(1)), (R, R), (64, 64), 4, True, mesh, links)
    assert [s.kind for s in steps] == ["all_gather", "all_gather"]
    assert steps[0].axis == slow_axis
    assert [s.bytes for s in steps] == [64 * 64 * 4 // 2, 64 * 64 * 4]


def test_a_model_on_the_meta_device_plans_like_the_real_one():
    torch.manual_seed(0)
    real, inputs = _two_layer_mlp()
    with torch.device("meta"):
        meta = MLP(256, 1024)
        meta_inputs = tuple(torch.empty_like(x) for x in inputs)
    mesh = Mesh((4,), ("tp",))
    assert autopar.plan(meta, mesh, meta_inputs, hardware=FLOP_EQ_BYTE) == autopar.plan(
        real, mesh, inputs, hardware=FLOP_EQ_BYTE
    )
    assert next(meta.parameters()).is_meta  # the user's model is left as it was


def test_a_dim_cut_by_two_axes_is_gathered_inner_cut_first():
    mesh = Mesh((2, 2), ("a", "b"))
    links = (Link(1e-6, 1e-9), Link(1e-6, 1e-9))
    both, inner = (Shard(0), Shard(0)), (R, Shard(0))
    to_whole = transition(both, (R, R), (8, 8), 4, True, mesh, links)
    assert [(s.kind, s.axis) for s in to_whole] == [("all_gather", 1), ("all_gather", 0)]
    # a cut on the first axis goes outside the second axis' cut, so the second must be undone first
    deeper = transition(inner, both, (8, 8), 4, True, mesh, links)
    assert [(s.kind, s.axis) for s in deeper] == [("all_gather", 1), ("slice", 0), ("slice", 1)]


@pytest.mark.parametrize("input_grad", [False, True])
def test_layers_that_differ_at_the_ends_keep_their_own_choice_and_the_rest_share(input_grad):
    from autopar.examples.stack import BlockStack, StackConfig

    mesh = Mesh((2,), ("dp",))
    plans = {}
    for n in (4, 6):
        torch.manual_seed(0)
        model = BlockStack(StackConfig(dim=32, hidden=64, num_heads=4, num_layers=n))
        x = torch.randn(8, 16, 32, requires_grad=input_grad)
        plans[n] = autopar.plan(model, mesh, (x,), hardware="h100", share_layers=True)
    # the last block feeds the output; the first differs too when it computes no input gradient
    own = 1 if input_grad else 2
    per_layer = (plans[6].solver.shared_nodes - plans[4].solver.shared_nodes) // 2
    for n, p in plans.items():
        assert p.solver.layer_classes == 1 and p.solver.shared_layers == n - own - 1
        assert p.solver.aligned_layers == own and p.solver.status == "OPTIMAL"
        # and the layers alike to no other share the ops they have in common with the class's first
        assert p.solver.shared_nodes >= (n - 1) * per_layer - per_layer // 4
    assert plans[4].solver.num_variables == plans[6].solver.num_variables
    assert f"repeated layers in 1 class share their first layer's, {own} more layer" in str(plans[6])


def test_a_stack_of_layers_alike_to_no_other_aligns_them_with_its_first():
    """Two blocks, the first computing no input gradient and the second feeding the output: no
    two layers are alike, and the second takes the first's choices for the ops they share."""
    from autopar.examples.stack import BlockStack, StackConfig

    torch.manual_seed(0)
    model = BlockStack(StackConfig(dim=32, hidden=64, num_heads=4, num_layers=2))
    captured = capture(model, (torch.randn(8, 16, 32),))
    mesh = Mesh((2,), ("dp",))
    shared = plan_captured(captured, mesh, hardware="h100", share_layers=True)
    alone = plan_captured(captured, mesh, hardware="h100", share_layers=False)
    assert shared.solver.layer_classes == 0 and shared.solver.aligned_layers == 1
    assert "(1 layer alike to no other shares the ops it has in common with their stack's" in str(shared)
    assert shared.solver.shared_nodes > 150 and shared.solver.num_variables < alone.solver.num_variables * 0.7
    assert shared.placements["layers.1.wq.weight"] == shared.placements["layers.0.wq.weight"]
    assert shared.predicted_step_s == pytest.approx(alone.predicted_step_s, rel=1e-2)


def test_shared_classes_find_the_plan_of_unshared_layers():
    from autopar.examples.stack import BlockStack, StackConfig

    torch.manual_seed(0)
    model = BlockStack(StackConfig(dim=32, hidden=64, num_heads=4, num_layers=4))
    captured = capture(model, (torch.randn(8, 16, 32),))
    mesh = Mesh((2,), ("tp",))
    shared = plan_captured(captured, mesh, hardware="h100", share_layers=True)
    alone = plan_captured(captured, mesh, hardware="h100", share_layers=False)
    assert shared.solver.shared_layers == 1 and alone.solver.shared_layers == 0
    assert shared.predicted_step_s == pytest.approx(alone.predicted_step_s, rel=1e-3)
    assert shared.solver.objective_s == pytest.approx(shared.predicted_step_s, rel=1e-6)


def test_layers_a_layout_splits_by_column_and_by_row_in_turn_share_in_two_classes():
    """Identical linear layers that Megatron splits by output and by input features in turn: one
    class could not alternate (the shared plan was 1.2x slower than unshared); grouped as the
    standard layouts treat them, the even and the odd layers share apart and the plan is the
    unshared one."""
    with torch.device("meta"):
        model = MLP(256, 1024, num_layers=8)
    x = torch.empty(64, 256, device="meta")
    captured = capture(model, (x, x))
    mesh = Mesh((4,), ("tp",))
    shared = plan_captured(captured, mesh, hardware="h100", share_layers=True)
    alone = plan_captured(captured, mesh, hardware="h100", share_layers=False)
    assert shared.solver.layer_classes == 2 and shared.solver.shared_layers == 4
    assert shared.solver.status == "OPTIMAL"
    assert shared.predicted_step_s == pytest.approx(alone.predicted_step_s, rel=1e-6)
    splits = [shared.placements[f"layers.{i}.weight"][0] for i in range(1, 7)]
    assert splits[0] != splits[1] and splits[::2] == [splits[0]] * 3 and splits[1::2] == [splits[1]] * 3
