"""Gradient buckets: how gradients are packed, and that the per-rank graph runs one collective
per bucket, exactly as the plan lists them."""

import collections

import torch

import autopar
from autopar.examples.mlp import MLP
from autopar.passes.buckets import gradient_buckets
from autopar.passes.capture import capture
from autopar.passes.redistribute import Step
from autopar.passes.rewrite import graph_collectives, rewrite
from autopar.planner import plan_captured
from autopar.runtime.launch import device_mesh

# compute dear: every op runs on its rank's part of the batch, whatever the layouts cost to move
COMPUTE_DEAR = autopar.SyntheticProfile(s_per_flop=1e-9, s_per_byte=1e-12, latency_s=1e-8)


def test_gradients_are_packed_by_kind_axis_and_dtype_up_to_the_bucket_size():
    moves = [
        (Step("all_reduce", 0, bytes=60), torch.float32),
        (Step("reduce_scatter", 0, 0, bytes=50), torch.float32),
        (Step("all_reduce", 0, bytes=40), torch.float32),
        (Step("all_reduce", 1, bytes=10), torch.float32),  # another mesh axis
        (Step("all_reduce", 0, bytes=10), torch.bfloat16),  # another dtype
        (Step("all_reduce", 0, bytes=10), torch.float32),  # 60 + 40 + 10 > 100: a new bucket
        (Step("reduce_scatter", 0, 1, bytes=50), torch.float32),  # any scattered dim shares the bucket
        (Step("all_reduce", 0, bytes=250), torch.float32),  # larger than a bucket: alone
        (Step("all_reduce", 0, bytes=5), torch.float32),
    ]
    buckets = gradient_buckets(moves, 100)
    assert [b.members for b in buckets] == [(0, 2), (1, 6), (3,), (4,), (5,), (7,), (8,)]
    assert [(b.step.kind, b.step.axis, b.step.bytes) for b in buckets] == [
        ("all_reduce", 0, 100), ("reduce_scatter", 0, 100), ("all_reduce", 1, 10), ("all_reduce", 0, 10),
        ("all_reduce", 0, 10), ("all_reduce", 0, 250), ("all_reduce", 0, 5)]


def _plan_and_rank_graph(make_world, mesh, pins, bucket_bytes):
    make_world(mesh.size)
    model = MLP(32, 32, num_layers=6)
    captured = capture(model, (torch.randn(256, 32), torch.randn(256, 32)))  # activations outweigh weights
    plan = plan_captured(captured, mesh, hardware=COMPUTE_DEAR, pins=pins, bucket_bytes=bucket_bytes)
    groups = [device_mesh(mesh, "cpu").get_group(axis).group_name for axis in range(mesh.ndim)]
    graph = rewrite(captured, plan, coordinate=(0,) * mesh.ndim, group_names=groups)
    ran = collections.Counter((kind, mesh.axis_names[axis], nbytes) for kind, axis, nbytes in graph_collectives(graph, groups))
    return plan, ran


def _data_pins(model, layout):
    return {"x": layout[0], "target": layout[0], **{name: layout[1] for name, _ in model.named_parameters()}}


def test_data_parallel_rank_graph_runs_one_all_reduce_per_bucket(fake_world):
    mesh = autopar.Mesh((4,), ("dp",))
    weight, bias = 32 * 32 * 4, 32 * 4
    pins = _data_pins(MLP(32, 32, num_layers=6), ("S(0)", "R"))
    plan, ran = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=2 * (weight + bias))
    bucket = ("all_reduce", "dp", 2 * (weight + bias))  # two layers' weights and biases
    assert ran == {bucket: 3, ("all_reduce", "dp", 4): 1}  # and the loss
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
    buckets = [c for c in plan.collectives if c.tensor.startswith("bucket")]
    assert [c.tensor for c in buckets] == ["bucket of 4 gradients"] * 3
    assert all(c.phase == "backward" and (c.src, c.dst) == ("(P)", "(R)") for c in buckets)


def test_fully_sharded_rank_graph_reduce_scatters_buckets(fake_world):
    mesh = autopar.Mesh((4,), ("dp",))
    three_layers = 3 * (32 * 32 * 4 + 32 * 4)
    pins = _data_pins(MLP(32, 32, num_layers=6), ("S(0)", "S(0)"))
    plan, ran = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=three_layers)
    assert {k: n for k, n in ran.items() if k[0] == "reduce_scatter"} == {("reduce_scatter", "dp", three_layers): 2}
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
    assert [c.tensor for c in plan.collectives if c.kind == "reduce_scatter"] == ["bucket of 6 gradients"] * 2


def test_gradient_moves_of_several_steps_are_not_bucketed(fake_world):
    mesh = autopar.Mesh((2, 2), ("a", "b"))
    pins = _data_pins(MLP(32, 32, num_layers=6), (("S(0)", "S(0)"), ("R", "R")))
    plan, ran = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=2**20)
    weights = [c for c in plan.collectives if c.phase == "backward" and c.bytes == 32 * 32 * 4]
    assert sorted(c.axis for c in weights) == ["a"] * 6 + ["b"] * 6  # (P, P) -> (R, R): an all-reduce per axis each
    assert not any(c.tensor.startswith("bucket") for c in weights)
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
