"""Gradient and parameter buckets: how gradients are packed, how the solver prices them, that a
layer's parameters are gathered together, and that the per-rank graph runs one collective per
bucket, exactly as the plan lists them."""

import collections
import copy
import dataclasses

import pytest
import torch
from autopar.cost_model.estimate import CostModel
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture
from autopar.passes.lower.rewrite import rewrite
from autopar.passes.propagation.buckets import BucketShare, gradient_buckets
from autopar.passes.propagation.rank_ops import graph_collectives
from autopar.passes.propagation.redistribute import step_s
from autopar.runtime.launch import device_mesh

import autopar
from autopar import planner
from autopar.core.explain import format_bytes
from autopar.core.move import Step
from autopar.core.placement import P, R, S
from autopar.core.plan import PlannedMove
from autopar.planner import plan_captured
from tests.conftest import FLOP_EQ_BYTE
from tests.harness import run_ranks

# compute dear: every op runs on its rank's part of the batch, whatever the layouts cost to move
COMPUTE_DEAR = autopar.SyntheticProfile(s_per_flop=1e-9, s_per_byte=1e-12, latency_s=1e-8)


def test_gradients_are_packed_by_kind_axis_and_dtype_up_to_the_bucket_size():
    moves = [  # each gradient's collectives (one here) and dtype
        ((Step("all_reduce", 0, bytes=60),), torch.float32),
        ((Step("reduce_scatter", 0, 0, bytes=50),), torch.float32),
        ((Step("all_reduce", 0, bytes=40),), torch.float32),
        ((Step("all_reduce", 1, bytes=10),), torch.float32),  # another mesh axis
        ((Step("all_reduce", 0, bytes=10),), torch.bfloat16),  # another dtype
        ((Step("all_reduce", 0, bytes=10),), torch.float32),  # 60 + 40 + 10 > 100: a new bucket
        ((Step("reduce_scatter", 0, 1, bytes=50),), torch.float32),  # any scattered dim shares the bucket
        ((Step("all_reduce", 0, bytes=250),), torch.float32),  # larger than a bucket: alone
        ((Step("all_reduce", 0, bytes=5),), torch.float32),
    ]
    buckets = gradient_buckets(moves, 100)
    assert [b.members for b in buckets] == [(0, 2), (1, 6), (3,), (4,), (5,), (7,), (8,)]
    assert [(b.step.kind, b.step.axis, b.step.bytes) for b in buckets] == [
        ("all_reduce", 0, 100),
        ("reduce_scatter", 0, 100),
        ("all_reduce", 1, 10),
        ("all_reduce", 0, 10),
        ("all_reduce", 0, 10),
        ("all_reduce", 0, 250),
        ("all_reduce", 0, 5),
    ]


def test_bucketed_gradient_move_costs_its_bandwidth_and_a_share_of_a_bucket():
    model = MLP(32, 32, num_layers=1)
    captured = capture(model, (torch.randn(8, 32), torch.randn(8, 32)))
    costs = CostModel(captured, autopar.Mesh((4,), ("dp",)), FLOP_EQ_BYTE, bucket_bytes=4 * 4096)
    grads = {
        k.name: v
        for k, v in zip(captured.outputs, captured.graph.graph.output_node().args[0])
        if k is not None and k.kind == "grad"
    }
    ref = (grads["layers.0.weight"].name, 0)  # 32 x 32 fp32: a quarter of a bucket
    alpha, beta = FLOP_EQ_BYTE.latency_s, FLOP_EQ_BYTE.s_per_byte
    seconds, share = costs.gradient_s(ref, (P,), (R,))
    assert seconds == pytest.approx(2 * 3 / 4 * 4096 * beta)  # the ring all-reduce's bandwidth term
    assert share == BucketShare(((("all_reduce", 0),), torch.float32), 0.25, pytest.approx(alpha))
    assert costs.gradient_s(ref, (P,), (S(1),))[1].group == ((("reduce_scatter", 0),), torch.float32)
    assert costs.gradient_s(ref, (S(0),), (R,)) == (costs.transition_s(ref, (S(0),), (R,)), None)  # no bucket


def _plan_and_rank_graph(make_world, mesh, pins, bucket_bytes, hardware=COMPUTE_DEAR):
    make_world(mesh.size)
    model = MLP(32, 32, num_layers=6)
    captured = capture(model, (torch.randn(256, 32), torch.randn(256, 32)))  # activations outweigh weights
    plan = plan_captured(captured, mesh, hardware=hardware, pins=pins, bucket_bytes=bucket_bytes)
    groups = [device_mesh(mesh, "cpu").get_group(axis).group_name for axis in range(mesh.ndim)]
    graph = rewrite(captured, plan, coordinate=(0,) * mesh.ndim, group_names=groups)
    ran = collections.Counter(
        (kind, mesh.axis_names[axis], nbytes) for kind, axis, nbytes in graph_collectives(graph, groups)
    )
    return plan, ran, graph


def _data_pins(model, layout):
    return {"x": layout[0], "target": layout[0], **{name: layout[1] for name, _ in model.named_parameters()}}


def test_the_rank_graph_runs_the_buckets_the_plan_lists(fake_world):
    """Lowering reads the buckets from the plan rather than working them out again: a plan whose
    list puts every gradient in a bucket of its own runs one all-reduce per gradient, and one
    listing a gradient whose move no bucket makes is refused."""
    mesh = autopar.Mesh((4,), ("dp",))
    weight, bias = 32 * 32 * 4, 32 * 4
    pins = _data_pins(MLP(32, 32, num_layers=6), ("S(0)", "R"))
    plan, ran, _ = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=2 * (weight + bias))
    assert [len(b.members) for b in plan.buckets if b.of == "gradients"] == [4, 4, 4]
    alone = tuple(
        dataclasses.replace(b, members=(name,), placements=(placements,))
        for b in plan.buckets
        for name, placements in zip(b.members, b.placements)
    )
    model = MLP(32, 32, num_layers=6)
    captured = capture(model, (torch.randn(256, 32), torch.randn(256, 32)))
    groups = [device_mesh(mesh, "cpu").get_group(0).group_name]
    graph = rewrite(captured, dataclasses.replace(plan, buckets=alone), coordinate=(0,), group_names=groups)
    kinds = collections.Counter((kind, nbytes) for kind, _, nbytes in graph_collectives(graph, groups))
    assert kinds == {("all_reduce", weight): 6, ("all_reduce", bias): 6, ("all_reduce", 4): 1}
    wrong = dataclasses.replace(plan.buckets[0], of="parameters", phase="forward")
    with pytest.raises(autopar.RewriteError, match="not one all-gather. Fix: plan again"):
        rewrite(captured, dataclasses.replace(plan, buckets=(wrong,)), coordinate=(0,), group_names=groups)
    unknown = dataclasses.replace(plan.buckets[0], members=("layers.9.weight",))
    with pytest.raises(autopar.RewriteError, match="'layers.9.weight', which the model has not"):
        rewrite(captured, dataclasses.replace(plan, buckets=(unknown,)), coordinate=(0,), group_names=groups)


def test_data_parallel_rank_graph_runs_one_all_reduce_per_bucket(fake_world):
    mesh = autopar.Mesh((4,), ("dp",))
    weight, bias = 32 * 32 * 4, 32 * 4
    pins = _data_pins(MLP(32, 32, num_layers=6), ("S(0)", "R"))
    plan, ran, graph = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=2 * (weight + bias))
    bucket = ("all_reduce", "dp", 2 * (weight + bias))  # two layers' weights and biases
    assert ran == {bucket: 3, ("all_reduce", "dp", 4): 1}  # and the loss
    nodes = list(graph.graph.nodes)
    launched = [
        n
        for n in nodes
        if n.target == torch.ops._c10d_functional.all_reduce.default and n.meta["val"].numel() * 4 == bucket[2]
    ]
    waited = [next(u for u in n.users if u.target == torch.ops._c10d_functional.wait_tensor.default) for n in launched]
    between = [
        sum(m.target == torch.ops.aten.mm.default for m in nodes[nodes.index(a) : nodes.index(w)])
        for a, w in zip(launched, waited)
    ]
    assert (
        between[0] >= 2 and between[1] >= 2 and between[2] == 0
    )  # each runs beside the backward until the next is launched
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
    assert plan.solver.objective_s == pytest.approx(plan.predicted_step_s)  # the solver counted 3 buckets' latency
    buckets = [c for c in plan.collectives if c.tensor.startswith("bucket")]
    assert [c.tensor for c in buckets] == ["bucket of 4 gradients"] * 3
    assert all(c.phase == "backward" and (c.src, c.dst) == (((P,),), ((R,),)) for c in buckets)


def test_fully_sharded_rank_graph_reduce_scatters_buckets(fake_world):
    mesh = autopar.Mesh((4,), ("dp",))
    three_layers = 3 * (32 * 32 * 4 + 32 * 4)
    pins = _data_pins(MLP(32, 32, num_layers=6), ("S(0)", "S(0)"))
    plan, ran, _ = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=three_layers)
    assert {k: n for k, n in ran.items() if k[0] == "reduce_scatter"} == {("reduce_scatter", "dp", three_layers): 2}
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
    assert [c.tensor for c in plan.collectives if c.kind == "reduce_scatter"] == ["bucket of 6 gradients"] * 2


def test_gradients_join_reduce_scatter_buckets_where_an_all_reduce_and_a_slice_look_cheaper_alone(fake_world):
    # gloo's reduce-scatter can have a larger α than its all-reduce, as on the 2-core host: alone,
    # a 4 KiB gradient's all-reduce and slice cost 100 us, its reduce-scatter 200 us; in a
    # bucket of three, 67 us
    link = autopar.Link(1e-4, 1e-9, (("reduce_scatter", 2e-4, 1e-9),))
    dear = autopar.HardwareProfile(
        name="rs-dear",
        flops_per_s=1e9,
        memory_bytes_per_s=1e10,
        efficiency=1.0,
        memory_bytes=2**34,
        devices_per_host=8,
        intra_host=link,
        inter_host=link,
    )
    mesh = autopar.Mesh((4,), ("dp",))
    three_layers = 3 * (32 * 32 * 4 + 32 * 4)
    pins = _data_pins(MLP(32, 32, num_layers=6), ("S(0)", "S(0)"))
    plan, ran, _ = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=three_layers, hardware=dear)
    assert {k: n for k, n in ran.items() if k[0] != "all_gather"} == {
        ("reduce_scatter", "dp", three_layers): 2,
        ("all_reduce", "dp", 4): 1,
    }  # and the loss
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran


def test_a_layers_parameters_are_gathered_by_one_all_gather_per_phase(fake_world):
    """FSDP layout of a GPT: the parameters each layer reads whole are gathered together, once
    in the forward and once in the backward, as the plan lists them; the same bytes move as
    when each is gathered alone."""
    fake_world(4)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, dim=32, num_heads=4, num_layers=2))
    captured = capture(model, (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))))
    mesh = autopar.Mesh((4,), ("dp",))
    pins = {"idx": "S(0)", "targets": "S(0)", **{name: "S(0)" for name, _ in model.named_parameters()}}
    groups = [device_mesh(mesh, "cpu").get_group(0).group_name]
    plan = plan_captured(captured, mesh, hardware=COMPUTE_DEAR, pins=pins, bucket_bytes=2**20)

    def gathered(plan, as_listed: bool = True) -> list[int]:
        graph = rewrite(captured, plan, coordinate=(0,), group_names=groups)
        ran = graph_collectives(graph, groups)
        if as_listed:
            assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == collections.Counter(
                (kind, mesh.axis_names[axis], nbytes) for kind, axis, nbytes in ran
            )
        return [nbytes for kind, _, nbytes in ran if kind == "all_gather"]

    buckets = [c for c in plan.collectives if c.tensor.endswith("parameters")]
    assert {c.consumer for c in buckets} >= {"parameters of blocks.0", "parameters of blocks.1"}
    assert {c.phase for c in buckets} >= {"forward", "backward"}
    assert len(set((c.phase, c.consumer) for c in buckets)) == len(buckets)  # one per layer and phase
    # the same plan with each parameter gathered alone: its gather a move of its own
    placeholder = {k.name: n.name for n, k in zip(captured.placeholders, captured.inputs)}
    one_by_one = tuple(
        PlannedMove(placeholder[name], plan.placements[name], dst, chain)
        for b in plan.buckets
        if b.of == "parameters"
        for name, dst, chain in zip(b.members, b.placements, b.steps)
    )
    unbucketed = dataclasses.replace(
        plan, buckets=tuple(b for b in plan.buckets if b.of == "gradients"), moves=plan.moves + one_by_one
    )
    together, alone = gathered(plan), gathered(unbucketed, as_listed=False)
    assert len(together) <= len(alone) - len(buckets) and sum(together) == sum(alone)


def test_the_solver_prices_a_layers_parameters_gathered_together():
    """FSDP layout of a GPT where latency dominates: the solver's objective is the plan's step
    time, each layer's bucket of gathered parameters paying one latency (priced alone, each
    parameter's gather paid its own and the objective came out 48% above the plan's time)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, dim=32, num_heads=4, num_layers=2))
    captured = capture(model, (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))))
    pins = {"idx": "S(0)", "targets": "S(0)", **{name: "S(0)" for name, _ in model.named_parameters()}}
    latency_dear = autopar.SyntheticProfile(s_per_flop=1e-12, latency_s=1e-4, s_per_byte=1e-10)
    plan = plan_captured(captured, autopar.Mesh((4,), ("dp",)), hardware=latency_dear, pins=pins, bucket_bytes=2**20)
    gathered = [c for c in plan.collectives if c.tensor.endswith("parameters")]
    assert {(c.phase, c.consumer) for c in gathered} >= {
        ("forward", "parameters of blocks.0"),
        ("backward", "parameters of blocks.0"),
    }
    assert plan.solver.objective_s == pytest.approx(plan.predicted_step_s, rel=1e-6)


def test_the_solver_prices_a_transposed_weight_gathered_again_in_the_backward(monkeypatch):
    """A weight split over the ranks, transposed, and the transpose gathered for the forward's
    matmul; the backward reads the transpose of that transpose, which reads it whole. Views of
    weights are made again in the backward, so the transpose is gathered again there: the
    solver prices both gathers, as the plan lists them (it priced the forward's only, and chose
    this layout for the GPT example's FSDP pins under this machine's profile, at a step 13%
    over its objective). The ops are held to that layout, which the solver would not choose
    here."""
    model = MLP(32, 32, num_layers=2)
    captured = capture(model, (torch.randn(64, 32), torch.randn(64, 32)))
    pins = {"x": "S(0)", "target": "S(0)", **{name: "S(0)" for name, _ in model.named_parameters()}}
    propagate = planner.propagate

    def transposes_gathered(*args, **kwargs):
        space = propagate(*args, **kwargs)
        by_name = space.index()

        def held(n):
            if n.kind != "op" or n.target != "aten.t.default":
                return n
            operand = by_name[n.args[0][0]]
            if operand.kind == "param":
                need = (S(0),)
            elif operand.target == "aten.t.default" and by_name[operand.args[0][0]].kind == "param":
                need = (R,)
            else:
                return n
            return dataclasses.replace(n, strategies=tuple(s for s in n.strategies if s.inputs[0] == need))

        return dataclasses.replace(space, nodes=tuple(held(n) for n in space.nodes))

    monkeypatch.setattr(planner, "propagate", transposes_gathered)
    plan = plan_captured(captured, autopar.Mesh((2,), ("dp",)), hardware=FLOP_EQ_BYTE, pins=pins)
    second = next(n.name for n in plan.nodes if n.module == "layers.1" and n.op == "aten.t.default")
    gathered = [(c.kind, c.phase) for c in plan.collectives if c.tensor == second]
    assert gathered == [("all_gather", "forward"), ("all_gather", "recompute")]
    assert plan.solver.objective_s == pytest.approx(plan.predicted_step_s, rel=1e-6)


def test_gradients_reduced_over_both_axes_of_a_2d_mesh_share_buckets(fake_world):
    mesh = autopar.Mesh((2, 2), ("a", "b"))
    weight, bias = 32 * 32 * 4, 32 * 4
    pins = _data_pins(MLP(32, 32, num_layers=6), (("S(0)", "S(0)"), ("R", "R")))
    plan, ran, _ = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=3 * (weight + bias))
    buckets = [c for c in plan.collectives if c.tensor.startswith("bucket")]
    # (P, P) -> (R, R): each bucket of three layers is all-reduced over a, then over b
    assert [(c.kind, c.axis, c.bytes) for c in buckets] == [
        ("all_reduce", axis, 3 * (weight + bias)) for _ in range(2) for axis in "ab"
    ]
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
    assert plan.solver.objective_s == pytest.approx(plan.predicted_step_s)  # the solver counted 2 buckets' latencies


def test_gradient_moves_of_other_several_steps_are_not_bucketed_and_run_as_soon_as_the_gradient_is_made(fake_world):
    mesh = autopar.Mesh((2, 2), ("a", "b"))
    pins = _data_pins(MLP(32, 32, num_layers=6), (("S(0)", "S(0)"), ("S(0)", "R")))
    plan, ran, graph = _plan_and_rank_graph(fake_world, mesh, pins, bucket_bytes=2**20)
    weights = [
        (c.kind, c.axis, c.bytes) for c in plan.collectives if c.phase == "backward" and c.tensor.startswith("t_")
    ]
    # (P, P) -> (S(0), R): a reduce-scatter over a, then an all-reduce of the shard over b, each
    assert sorted(weights) == [("all_reduce", "b", 32 * 16 * 4)] * 6 + [("reduce_scatter", "a", 32 * 32 * 4)] * 6
    assert not any(c.consumer == "gradients" for c in plan.collectives)
    assert {c.gradient for c in plan.collectives if c.phase == "backward" and c.tensor.startswith("t_")} == {True}
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives) == ran
    nodes = list(graph.graph.nodes)
    reduced = [
        i
        for i, n in enumerate(nodes)
        if n.target == torch.ops._c10d_functional.reduce_scatter_tensor.default
        and n.args[0].meta["val"].shape == (32, 32)
    ]
    matmuls = [i for i, n in enumerate(nodes) if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    # the last layer's weight gradient is reduced before the backward of the five layers before it
    assert sum(i > reduced[0] for i in matmuls) >= 5


def reduce_scattered_gradients() -> dict:
    """One step of an MLP whose weights are split alternately by rows and columns, against one
    device; run on every rank."""
    torch.manual_seed(0)
    model = MLP(32, 32, num_layers=4)
    batch = (torch.randn(64, 32), torch.randn(64, 32))
    reference = copy.deepcopy(model)
    reference(*batch).backward()
    pins = {
        "x": "S(0)",
        "target": "S(0)",
        **{f"layers.{i}.weight": f"S({i % 2})" for i in range(4)},
        **{f"layers.{i}.bias": "S(0)" for i in range(4)},
    }
    pmodel = autopar.compile(model, autopar.Mesh((4,), ("dp",)), batch, hardware=COMPUTE_DEAR, pins=pins)
    pmodel(*(pmodel.rank_part(name, x) for name, x in zip(("x", "target"), batch))).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {
        "matches": {
            name: torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-6) for name, p in reference.named_parameters()
        },
        "buckets": [(c.kind, c.dst) for c in pmodel.plan.collectives if c.tensor.endswith("gradients")],
        "gathered": {c.src for c in pmodel.plan.collectives if c.tensor.endswith("parameters")},
    }


@pytest.mark.slow
def test_reduce_scattered_bucket_gives_each_rank_its_shards():
    # one reduce-scatter for gradients scattered on dim 0 and on dim 1: every rank's shards of
    # the bucket must come out contiguous and in place; a layer's weight and bias, split on dim
    # 1 and dim 0, gathered by one all-gather, each whole
    for result in run_ranks(4, reduce_scattered_gradients):
        assert result["buckets"] == [("reduce_scatter", ((S(0),), (S(1),)))]
        assert ((S(1),), (S(0),)) in result["gathered"]
        assert all(result["matches"].values()), result["matches"]


# compute dear, as COMPUTE_DEAR; a program node costs 10 us and a copy 0.2 ns per byte
PACKING = autopar.HardwareProfile(
    name="packing",
    flops_per_s=1e8,
    memory_bytes_per_s=1e10,
    efficiency=1.0,
    memory_bytes=2**34,
    devices_per_host=8,
    intra_host=autopar.Link(1e-5, 1e-9),
    inter_host=autopar.Link(1e-5, 1e-9),
    fitted=autopar.Fitted(node_overhead_s=1e-5),
)


def test_plan_prices_the_local_ops_that_pack_and_unpack_each_bucket(fake_world):
    mesh = autopar.Mesh((4,), ("dp",))
    fake_world(mesh.size)
    model = MLP(32, 32, num_layers=6)
    captured = capture(model, (torch.randn(256, 32), torch.randn(256, 32)))
    weight, bias = 32 * 32 * 4, 32 * 4
    plan = plan_captured(
        captured, mesh, hardware=PACKING, pins=_data_pins(model, ("S(0)", "R")), bucket_bytes=2 * (weight + bias)
    )
    nbytes = 2 * (weight + bias)
    flatten_cat_split_view = 2 * 4 + 2  # per bucket of 4 gradients
    expected = 1e-5 + 2 * 3 / 4 * nbytes * 1e-9 + flatten_cat_split_view * 1e-5 + nbytes * 2 / 1e10
    buckets = [c for c in plan.collectives if c.tensor.startswith("bucket")]
    assert [c.time_s for c in buckets] == pytest.approx([expected] * 3)
    assert plan.solver.objective_s == pytest.approx(plan.predicted_step_s)  # the solver priced the same ops

    groups = [device_mesh(mesh, "cpu").get_group(axis).group_name for axis in range(mesh.ndim)]
    graph = rewrite(captured, plan, coordinate=(0,), group_names=groups)
    packing = (torch.ops.aten.view.default, torch.ops.aten.cat.default, torch.ops.aten.split_with_sizes.default)

    def count(gm):
        return sum(n.op == "call_function" and n.target in packing for n in gm.graph.nodes)

    assert count(graph) - count(captured.graph) == 3 * flatten_cat_split_view


def test_gathers_and_scatters_along_other_dims_price_their_chunks_and_copy():
    mesh = autopar.Mesh((4,), ("x",))
    link = autopar.Link(1e-5, 1e-9, local_op_s=2e-6, local_s_per_byte=1e-10)
    base = {"all_gather": 1e-5 + 0.75 * 1000 * 1e-9, "all_to_all": 1e-5 + 0.75 * 1000 * 1e-9}
    assert step_s(Step("all_gather", 0, 0, bytes=1000), mesh, (link,)) == pytest.approx(base["all_gather"])
    assert step_s(Step("all_gather", 0, 1, bytes=1000), mesh, (link,)) == pytest.approx(
        base["all_gather"] + 2 * 2e-6 + 1000 * 1e-10
    )
    assert step_s(Step("all_to_all", 0, 0, 1, bytes=1000), mesh, (link,)) == pytest.approx(
        base["all_to_all"] + 4 * 2e-6 + 2000 * 1e-10
    )


@pytest.mark.parametrize(("shares", "expected"), [((0.25, 0.5), 0.75), ((0.75, 1.0), 1.0), ((), 0.0)])
def test_the_solver_holds_a_bucket_in_flight_as_the_bucketed_gradients_up_to_one_full_bucket(shares, expected):
    from autopar.passes.solve.memory_program import in_flight_bucket
    from autopar.passes.solve.mip import MEMORY_SCALE
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("HIGHS")
    joined = [solver.IntVar(1, 1, "") for _ in shares]  # every gradient joins a bucket
    held = in_flight_bucket(solver, [(share * var, share) for share, var in zip(shares, joined)] or [(0, 0.0)], 2**20)
    solver.Minimize(held)
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    assert held.solution_value() == pytest.approx(expected * 2**20 * MEMORY_SCALE)


def test_the_packed_copy_of_the_largest_gradient_bucket_is_part_of_the_plans_memory(fake_world):
    mesh = autopar.Mesh((4,), ("dp",))
    weight, bias = 32 * 32 * 4, 32 * 4
    fake_world(mesh.size)
    model = MLP(32, 32, num_layers=6)
    captured = capture(model, (torch.randn(256, 32), torch.randn(256, 32)))
    plan = plan_captured(
        captured,
        mesh,
        hardware=COMPUTE_DEAR,
        pins=_data_pins(model, ("S(0)", "R")),
        bucket_bytes=2 * (weight + bias),
        memory_budget=2**30,
    )
    mem = plan.memory
    assert (
        2 * weight <= mem.bucket_bytes <= 2 * (weight + bias)
    )  # two layers' weights and their biases, or most of them
    assert f"gradient bucket {format_bytes(mem.bucket_bytes)}" in str(plan)


@pytest.mark.slow
def test_a_convnet_at_70_percent_of_its_peak_on_8_h100s_plans_with_its_bucket_in_flight_counted():
    from autopar.examples.convnet import ConvNet, ConvNetConfig

    with torch.device("meta"):  # the plan-quality benchmark's full-size ConvNet
        model = ConvNet(ConvNetConfig(channels=(128, 256, 512, 1024), num_classes=1000))
        batch = (torch.empty(256, 3, 128, 128), torch.zeros(256, dtype=torch.long))
    captured = capture(model, batch)
    mesh = autopar.Mesh((8,), ("ranks",))
    budget = int(plan_captured(captured, mesh, hardware="h100").peak_memory_bytes * 0.7)  # the least is 67%
    plan = plan_captured(captured, mesh, hardware="h100", memory_budget=budget)  # was 25 MiB over, then no plan
    assert plan.memory.bucket_bytes > 0 and plan.peak_memory_bytes <= budget
