"""Parallel training of the examples on 2, 4 and 8 gloo ranks against the same training on one device.

Losses at every step must match within 1e-5 relative, gradients after the first step and
parameters after 3 optimizer steps within rtol 1e-4 / atol 1e-5 (fp32), buffers (batch norm's
running statistics) likewise, and the per-rank graphs must run exactly the collectives their
plans list. Models from Hugging Face transformers run in :mod:`tests.runtime.test_graph_diff_hf`.
"""

import collections

import pytest

import autopar
from autopar.core.placement import P, R, S
from tests.cases import (
    BYTES_DEAR,
    assert_matches_one_device,
    assert_runs_the_planned_collectives,
    case_name,
    make_model,
    run_groups,
)

FOUR = [
    dict(model_name="mlp", mesh_shape=(4,), axis_names=("tp",), optimizer_name="adamw"),
    dict(model_name="mlp", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="sgd"),
    dict(model_name="gpt", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw"),
    dict(model_name="gpt", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw"),
    dict(model_name="gpt", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="sgd"),
    dict(model_name="gpt", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw", recompute="layers"),
    dict(
        model_name="gpt",
        mesh_shape=(4,),
        axis_names=("tp",),
        optimizer_name="adamw",
        preset="megatron",
        recompute="layers",
    ),
    dict(model_name="mlp", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw", preset="dp"),
    dict(model_name="mlp", mesh_shape=(4,), axis_names=("tp",), optimizer_name="adamw", preset="megatron"),
    dict(model_name="mlp", mesh_shape=(4,), axis_names=("dp",), optimizer_name="sgd", preset="fsdp"),
    dict(model_name="gpt", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw", preset="dp"),
    dict(model_name="gpt", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw", preset="fsdp"),
    dict(model_name="gpt", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw", preset="2d"),
    dict(model_name="gpt", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw", preset="dp"),
    dict(model_name="llama", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw", preset="fsdp"),
    dict(model_name="llama", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw"),
    dict(model_name="llama", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw", preset="fsdp"),
    dict(model_name="bert", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw"),
    dict(model_name="bert", mesh_shape=(4,), axis_names=("dp",), optimizer_name="sgd", preset="dp"),
    dict(model_name="moe", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw"),
    dict(model_name="moe", mesh_shape=(2, 2), axis_names=("dp", "ep"), optimizer_name="adamw"),
    dict(model_name="moe", mesh_shape=(4,), axis_names=("ep",), optimizer_name="adamw", preset="experts"),
    # data parallel with synchronised batch norm; and the solver's own plan (filter splits) on 2x2
    dict(
        model_name="convnet",
        mesh_shape=(4,),
        axis_names=("dp",),
        optimizer_name="adamw",
        preset="dp",
        hardware=BYTES_DEAR,
    ),
    dict(model_name="convnet", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw"),
    # embedding and head split along the vocabulary: vocabulary-parallel lookups and cross-entropy
    dict(
        model_name="gpt",
        mesh_shape=(4,),
        axis_names=("tp",),
        optimizer_name="adamw",
        preset="vocab",
        hardware=BYTES_DEAR,
    ),
    dict(
        model_name="llama",
        mesh_shape=(2, 2),
        axis_names=("dp", "tp"),
        optimizer_name="adamw",
        preset="vocab",
        hardware=BYTES_DEAR,
    ),
]
EIGHT = [  # a 3-D mesh: 8 ranks on this 2-core host, so one small model
    dict(model_name="mlp", mesh_shape=(2, 2, 2), axis_names=("a", "b", "c"), optimizer_name="adamw"),
]
TWO = [
    dict(model_name="mlp", mesh_shape=(2,), axis_names=("dp",), optimizer_name="sgd"),
    dict(model_name="gpt", mesh_shape=(2,), axis_names=("tp",), optimizer_name="adamw"),
    dict(model_name="gpt", mesh_shape=(2,), axis_names=("tp",), optimizer_name="sgd", preset="megatron"),
]

EXAMPLES = FOUR + TWO + EIGHT


@pytest.fixture(scope="module")
def results():
    return run_groups(((4, FOUR), (2, TWO), (8, EIGHT)))


@pytest.mark.slow
@pytest.mark.parametrize("case", EXAMPLES, ids=case_name)
def test_parallel_training_matches_one_device(results, case):
    assert_matches_one_device(results[case_name(case)])


@pytest.mark.slow
@pytest.mark.parametrize("case", EXAMPLES, ids=case_name)
def test_per_rank_graph_runs_exactly_the_planned_collectives(results, case):
    assert_runs_the_planned_collectives(results[case_name(case)])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["convnet-4-adamw-dp", "convnet-2x2-adamw-auto"])
def test_batch_norm_running_statistics_match_one_device(results, name):
    stats = {f"blocks.{i}.bn.{s}" for i in range(2) for s in ("running_mean", "running_var", "num_batches_tracked")}
    for r in results[name]:
        assert set(r["buffers_ok"]) == stats
        assert all(r["buffers_ok"].values()), f"rank {r['rank']}: {r['buffers_ok']}"


@pytest.mark.slow
def test_data_parallel_batch_norm_all_reduces_its_statistics(results):
    """With the batch split over the ranks, each batch norm all-reduces its per-channel sums
    (mean and variance) in the forward: every rank normalises with the whole batch's
    statistics, and the run executed these all-reduces (the collectives test)."""
    for r in results["convnet-4-adamw-dp"]:
        plan = autopar.ShardingPlan.from_json(r["plan"])
        assert plan.inputs["images"] == (S(0),)
        module_of = {n.name: n.module for n in plan.nodes}
        synced = collections.Counter(
            module_of.get(c.tensor) for c in plan.collectives if c.kind == "all_reduce" and c.phase == "forward"
        )
        assert synced["blocks.0.bn"] == synced["blocks.1.bn"] == 2


@pytest.mark.slow
def test_pins_are_kept_in_the_plan(results):
    plan = autopar.ShardingPlan.from_json(results["gpt-2x2-adamw-2d"][0]["plan"])
    assert plan.placements["blocks.0.fc1.weight"] == (R, S(0))
    assert plan.placements["blocks.0.fc2.weight"] == (R, S(1))
    assert plan.inputs["idx"] == (S(0), R)
    fsdp = autopar.ShardingPlan.from_json(results["gpt-4-adamw-fsdp"][0]["plan"])
    assert all(p == (S(0),) for p in fsdp.placements.values())
    fsdp_2d = autopar.ShardingPlan.from_json(results["llama-2x2-adamw-fsdp"][0]["plan"])
    params = [n for n in fsdp_2d.pinned if n in fsdp_2d.placements]
    assert len(params) > 10 and all(fsdp_2d.placements[n] == (S(0), S(0)) for n in params)  # one dim cut by both axes
    ddp_2d = autopar.ShardingPlan.from_json(results["gpt-2x2-adamw-dp"][0]["plan"])
    assert ddp_2d.inputs["idx"] == (S(0), S(0))
    reduced = [(c.kind, c.axis) for c in ddp_2d.collectives if c.consumer == "gradients"]
    assert set(reduced) == {("all_reduce", "dp"), ("all_reduce", "tp")}  # buckets reduced over both axes, as it ran


@pytest.mark.slow
def test_expert_split_sends_tokens_to_their_experts_and_back_with_all_to_all(results):
    cfg = make_model("moe")[0].cfg
    groups = 4 * 8 // cfg.group_size  # the case's batch: 4 sequences of 8 tokens
    dispatched = cfg.num_experts * groups * cfg.capacity * cfg.dim * 4 // 4  # [E, G, C, D] fp32, a quarter per rank
    for r in results["moe-4-adamw-experts"]:
        plan = autopar.ShardingPlan.from_json(r["plan"])
        assert plan.placements["blocks.0.moe.w1"] == plan.placements["blocks.0.moe.w2"] == (S(0),)
        moves = collections.Counter(
            c.phase for c in plan.collectives if c.kind == "all_to_all" and c.bytes == dispatched
        )
        assert moves == {"forward": 2, "backward": 2}  # dispatch and combine, and their gradients
        assert collections.Counter(tuple(x) for x in r["ran"])["all_to_all", "ep", dispatched] == 4


@pytest.mark.slow
def test_recomputed_layers_repeat_their_forward_collectives(results):
    plan = autopar.ShardingPlan.from_json(results["gpt-4-adamw-megatron-recompute-layers"][0]["plan"])
    forward, again = collections.Counter(), collections.Counter()  # bytes by collective kind and mesh axis
    for c in plan.collectives:
        if c.phase in ("forward", "recompute"):
            (forward if c.phase == "forward" else again)[c.kind, c.axis] += c.bytes
    # each kind made again is one the forward makes, on no more bytes (a layer's recomputation
    # gathers the parameters it reads, a bucket that can be a part of the forward's)
    assert again and all(nbytes <= forward[key] for key, nbytes in again.items())
    assert any(n.activation == "recompute" for n in plan.nodes)


@pytest.mark.slow
def test_vocabulary_parallel_lookups_and_cross_entropy_match_one_device(results):
    """The LLaMA case splits its embedding and head along the vocabulary on ``tp``: the lookup,
    the log-softmax, the target's gather and scatter and the table's gradient all run on the
    rank's piece of the vocabulary (and the parallel-training test checks the run)."""
    plan = autopar.ShardingPlan.from_json(results["llama-2x2-adamw-vocab"][0]["plan"])
    lookup = plan.node("embedding")
    assert lookup.inputs[0] == (R, S(0)) and lookup.outputs == ((S(0), P),)
    for name in ("_log_softmax", "scatter", "_log_softmax_backward_data"):
        assert plan.node(name).outputs == ((S(0), S(1)),), plan.node(name)
    assert plan.node("gather").outputs == ((S(0), P),)
    # the table's gradient is the rank's piece of the vocabulary; over dp it is reduced at the op or in
    # its bucket, priced alike, so the solver may return either
    (table,) = plan.node("embedding_dense_backward").outputs
    assert table[1] == S(0) and table[0] in (R, P), table
    own = collections.Counter((c.kind, c.phase) for c in plan.collectives if c.consumer.startswith("_log_softmax"))
    assert own == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 1}
