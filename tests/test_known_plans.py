"""Plans whose optimum is known by hand under the synthetic α-β profile."""

import torch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.mlp import MLP

import autopar
from autopar import Mesh
from autopar.core.placement import P, R, S
from tests.conftest import FLOP_EQ_BYTE


def _collectives(plan, phase=None):
    return [(c.kind, c.axis, c.bytes) for c in plan.collectives if phase is None or c.phase == phase]


def test_wide_mlp_gets_megatron_column_then_row_split():
    # hidden 4096 >> batch 8: moving the [8, 256] activation beats moving 2 x 4 MB of gradients
    batch, dim, hidden = 8, 256, 4096
    plan = autopar.plan(
        MLP(dim, hidden), Mesh((4,), ("tp",)), (torch.randn(batch, dim), torch.randn(batch, dim)), hardware=FLOP_EQ_BYTE
    )
    assert plan.placements["layers.0.weight"] == (S(0),)  # split by output features (column)
    assert plan.placements["layers.0.bias"] == (S(0),)
    assert plan.placements["layers.1.weight"] == (S(1),)  # split by input features (row)
    assert _collectives(plan, "forward") == [("all_reduce", "tp", batch * dim * 4)]
    assert _collectives(plan) == _collectives(plan, "forward")  # nothing else, not even in backward


def test_batch_heavy_mlp_gets_pure_data_parallel():
    # batch 4096 >> hidden 64: moving 17 KB of gradients beats moving the 512 KB activations
    batch, dim, hidden = 4096, 32, 64
    model = MLP(dim, hidden)
    plan = autopar.plan(
        model, Mesh((4,), ("dp",)), (torch.randn(batch, dim), torch.randn(batch, dim)), hardware=FLOP_EQ_BYTE
    )
    assert all(p == (R,) for p in plan.placements.values())  # weights replicated
    assert plan.inputs == {"x": (R,), "target": (R,)}  # every rank is given the whole batch
    first = plan.node("addmm")
    assert first.inputs[1] == (S(0),) and first.outputs == ((S(0),),)  # and computes on its rows
    assert _collectives(plan, "forward") == []
    assert _collectives(plan, "output") == [("all_reduce", "dp", 4)]  # the scalar loss, returned whole
    grads = ("all_reduce", "dp", sum(p.numel() * 4 for p in model.parameters()))
    assert _collectives(plan, "backward") == [grads]  # one all-reduce of a bucket of every gradient, nothing else


def test_pins_fix_parameters_and_the_solver_plans_the_rest():
    batch, dim, hidden = 4096, 32, 64
    pins = {"layers.0.weight": "S(0)"}
    plan = autopar.plan(
        MLP(dim, hidden),
        Mesh((4,), ("dp",)),
        (torch.randn(batch, dim), torch.randn(batch, dim)),
        hardware=FLOP_EQ_BYTE,
        pins=pins,
    )
    assert plan.placements["layers.0.weight"] == (S(0),)
    assert plan.pinned == ("layers.0.weight",)


def test_a_split_pinned_over_an_axis_of_one_rank_is_the_whole_tensor_and_moves_nothing():
    batch, dim, hidden = 64, 32, 64
    inputs = (torch.randn(batch, dim), torch.randn(batch, dim))
    plan = autopar.plan(
        MLP(dim, hidden),
        Mesh((1,), ("dp",)),
        inputs,
        hardware=FLOP_EQ_BYTE,
        pins={"x": "S(0)", "target": "S(0)", "layers.0.weight": "S(0)"},
    )
    assert plan.inputs == {"x": (R,), "target": (R,)}
    assert plan.placements["layers.0.weight"] == (R,)
    assert plan.collectives == ()
    plan = autopar.plan(
        MLP(dim, hidden),
        Mesh((1, 4), ("a", "b")),
        inputs,
        hardware=FLOP_EQ_BYTE,
        pins={"x": ("S(0)", "S(0)"), "target": ("S(0)", "S(0)")},
    )
    assert plan.inputs == {"x": (R, S(0)), "target": (R, S(0))}
    assert plan.collectives and all(c.axis == "b" for c in plan.collectives)


def test_memory_budget_below_replicated_state_flips_data_parallel_to_sharded_parameters():
    # batch-heavy MLP fed by a per-rank data loader: data parallel, unless its replicated
    # parameters, gradients and Adam state do not fit
    batch, dim, hidden = 4096, 64, 256
    inputs = (torch.randn(batch, dim), torch.randn(batch, dim))
    loader = {"x": "S(0)", "target": "S(0)"}
    mesh = Mesh((4,), ("dp",))
    free = autopar.plan(MLP(dim, hidden), mesh, inputs, hardware=FLOP_EQ_BYTE, pins=loader)
    assert all(p == (R,) for p in free.placements.values())
    state = free.memory.params_bytes + free.memory.grads_bytes + free.memory.optimizer_bytes
    budget = free.peak_memory_bytes - state // 3
    tight = autopar.plan(MLP(dim, hidden), mesh, inputs, hardware=FLOP_EQ_BYTE, pins=loader, memory_budget=budget)
    assert tight.peak_memory_bytes <= budget < free.peak_memory_bytes
    assert tight.placements["layers.0.weight"] != (R,) and tight.placements["layers.1.weight"] != (R,)
    assert tight.memory_budget_bytes == budget
    assert tight.predicted_step_s >= free.predicted_step_s  # memory is bought with time


def test_budgets_parse_sizes():
    from autopar.config import parse_memory

    assert parse_memory("40GB") == 40 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory(1000) == 1000
    import pytest

    with pytest.raises(ValueError, match="is not a size"):
        parse_memory("lots")


def test_large_vocabulary_gets_vocabulary_parallel_embedding_and_cross_entropy():
    # vocabulary 32k >> width 512 on 8 H100s: moving [2048, 32k] logits or the 64 MB table costs more
    # than all-reducing a max and a sum per token
    vocab, tokens = 32768, 8 * 256
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, block_size=256, dim=512, num_heads=8, num_layers=1))
        ids = torch.randint(0, vocab, (8, 256))
    plan = autopar.plan(model, Mesh((8,), ("tp",)), (ids, ids), hardware="h100")
    assert plan.placements["tok.weight"] == (S(0),)  # the tied table split along the vocabulary
    lookup = plan.node("embedding")
    assert lookup.inputs[0] == (S(0),) and lookup.outputs == ((P,),)  # each rank looks up the rows it holds
    assert plan.node("_log_softmax").inputs == ((S(1),),)  # logits split along the vocabulary
    assert plan.node("gather").outputs == ((P,),)  # the target's log-probability, from the rank that holds it
    per_token = [(c.kind, c.phase, c.bytes) for c in plan.collectives if c.consumer.startswith("_log_softmax")]
    assert per_token == [("all_reduce", "forward", tokens * 4)] * 2 + [("all_reduce", "backward", tokens * 4)]
    assert max(c.bytes for c in plan.collectives) < tokens * vocab * 4 // 8  # no logits moved, not even a rank's piece
