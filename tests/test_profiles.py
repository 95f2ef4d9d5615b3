"""Hardware profiles: saved and loaded, and used by collectives' α-β per kind."""

import dataclasses

import pytest
import torch
from autopar.cost_model.hardware import (
    CPU,
    Fitted,
    HardwareProfile,
    Link,
    load_profile,
    resolve_profile,
    save_profile,
)
from autopar.passes.propagation.redistribute import step_s

import autopar
from autopar.core.mesh import Mesh
from autopar.core.move import Step


def _measured() -> HardwareProfile:
    link = Link(1e-4, 1e-9, (("all_reduce", 2e-4, 2e-9), ("all_gather", 5e-5, 1e-9)))
    return HardwareProfile(
        name="measured",
        flops_per_s=2e10,
        memory_bytes_per_s=5e9,
        efficiency=1.0,
        memory_bytes=2**33,
        devices_per_host=4,
        intra_host=link,
        inter_host=link,
        fitted=Fitted(op_overhead_s=1e-5),
    )


def test_a_saved_profile_loads_back_and_is_accepted_by_name(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_measured(), path, note="test")
    assert load_profile(path) == _measured()
    assert resolve_profile(str(path)) == _measured() == resolve_profile(path)


def test_a_missing_profile_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match=r"no such profile file.*autopar calibrate --out"):
        resolve_profile(str(tmp_path / "nope.json"))


def test_collectives_use_their_own_alpha_and_beta():
    mesh = Mesh((4,), ("x",))
    links = (_measured().intra_host,)
    assert step_s(Step("all_reduce", 0, bytes=1000), mesh, links) == pytest.approx(2e-4 + 2 * 0.75 * 1000 * 2e-9)
    assert step_s(Step("all_gather", 0, 0, bytes=1000), mesh, links) == pytest.approx(5e-5 + 0.75 * 1000 * 1e-9)
    assert step_s(Step("all_to_all", 0, 0, 1, bytes=1000), mesh, links) == pytest.approx(1e-4 + 0.75 * 1000 * 1e-9)


def test_each_op_costs_the_profiles_overhead():
    import torch
    from autopar.examples.mlp import MLP

    inputs = (torch.randn(8, 16), torch.randn(8, 16))
    plain = autopar.plan(MLP(16, 32), Mesh((2,), ("dp",)), inputs, hardware=CPU)
    slow = dataclasses.replace(CPU, fitted=Fitted(op_overhead_s=1e-3))
    charged = autopar.plan(MLP(16, 32), Mesh((2,), ("dp",)), inputs, hardware=slow)
    assert charged.compute_s == pytest.approx(plain.compute_s + 1e-3 * len(plain.nodes), rel=1e-6)


def test_the_step_overhead_per_step_and_parameter_is_part_of_the_predicted_step():
    import dataclasses

    import torch
    from autopar.examples.mlp import MLP

    model, inputs = MLP(16, 32), (torch.randn(8, 16), torch.randn(8, 16))
    plain = autopar.plan(model, Mesh((2,), ("dp",)), inputs, hardware=CPU)
    host = dataclasses.replace(CPU, fitted=Fitted(step_overhead_s=1e-3, param_overhead_s=1e-4, contention=2.0))
    charged = autopar.plan(model, Mesh((2,), ("dp",)), inputs, hardware=host)
    expected = (1e-3 + 1e-4 * len(list(model.parameters()))) * 2.0
    assert plain.overhead_s == 0 and charged.overhead_s == pytest.approx(expected)
    assert charged.predicted_step_s == pytest.approx(charged.compute_s + charged.communication_s + expected)
    from autopar.core.explain import plan_table

    assert "step overhead" in plan_table(charged) and "step overhead" not in plan_table(plain)


def test_the_step_scale_lengthens_ops_and_collectives_and_keeps_the_plan():
    import dataclasses

    import torch
    from autopar.examples.mlp import MLP

    model, inputs = MLP(16, 32), (torch.randn(8, 16), torch.randn(8, 16))
    fitted = Fitted(step_overhead_s=1e-3, param_overhead_s=1e-4)
    host, stretched = (
        dataclasses.replace(CPU, fitted=fitted),
        dataclasses.replace(CPU, fitted=dataclasses.replace(fitted, step_scale=1.5)),
    )
    plain = autopar.plan(model, Mesh((4,), ("dp",)), inputs, hardware=host, pins={"x": "S(0)"})
    scaled = autopar.plan(model, Mesh((4,), ("dp",)), inputs, hardware=stretched, pins={"x": "S(0)"})
    assert plain.collectives and scaled.placements == plain.placements
    for part in ("compute_s", "communication_s"):
        assert getattr(scaled, part) == pytest.approx(1.5 * getattr(plain, part)), part
    assert plain.overhead_s > 0 and scaled.overhead_s == plain.overhead_s  # measured as a step runs it
    assert scaled.predicted_step_s == pytest.approx(
        1.5 * (plain.predicted_step_s - plain.overhead_s) + plain.overhead_s
    )
    assert [c.time_s for c in scaled.collectives] == pytest.approx([1.5 * c.time_s for c in plain.collectives])


def test_the_collective_scale_lengthens_collectives_only():
    import dataclasses

    import torch
    from autopar.cost_model.estimate import CostModel
    from autopar.examples.mlp import MLP
    from autopar.passes.analysis.capture import capture
    from autopar.passes.propagation.propagate import propagate

    from autopar.core.placement import P, R, S

    mesh = Mesh((4,), ("dp",))
    captured = capture(MLP(16, 32), (torch.randn(8, 16), torch.randn(8, 16)))
    space = propagate(captured, mesh)
    fitted = Fitted(step_overhead_s=1e-3, param_overhead_s=1e-4, step_scale=1.5)
    plain, slow = (
        CostModel(captured, mesh, dataclasses.replace(CPU, fitted=fitted)),
        CostModel(captured, mesh, dataclasses.replace(CPU, fitted=dataclasses.replace(fitted, collective_scale=3.0))),
    )
    assert slow.compute_costs(space) == plain.compute_costs(space)
    assert slow.step_overhead_s(10) == plain.step_overhead_s(10)
    ref = (next(n.name for n in space.nodes if n.kind == "op"), 0)
    for src, dst in (((P,), (R,)), ((S(0),), (R,)), ((P,), (S(0),))):
        base = plain.transition_s(ref, src, dst)
        assert base > 0 and slow.transition_s(ref, src, dst) == pytest.approx(3.0 * base)


@pytest.fixture
def float32_matmul_precision():
    """Restores torch's float32 matmul precision after a test that sets it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def _graph_of(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return {
        n.target.overloadpacket.__name__: n
        for n in make_fx(fn, tracing_mode="fake")(*args).graph.nodes
        if n.op == "call_function"
    }


def test_a_matrix_product_runs_at_the_rate_of_its_format(float32_matmul_precision):
    from autopar.cost_model.compute import math_format, node_work
    from autopar.cost_model.hardware import H100

    a, b = torch.randn(256, 512), torch.randn(512, 1024)
    fp32 = _graph_of(lambda a, b: torch.relu(a @ b), a, b)
    assert math_format(fp32["mm"]) == "float32" and math_format(fp32["relu"]) is None
    assert math_format(_graph_of(torch.mm, a.bfloat16(), b.bfloat16())["mm"]) == "bfloat16"
    float32_matmul_precision("high")
    assert math_format(_graph_of(torch.mm, a, b)["mm"]) == "tf32"
    conv = _graph_of(torch.nn.functional.conv2d, torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))["convolution"]
    assert math_format(conv) == ("tf32" if torch.backends.cudnn.allow_tf32 else "float32")

    flops, _ = node_work(fp32["mm"])
    assert flops == 2 * 256 * 512 * 1024
    assert H100.compute_s(flops, 0, "float32") == pytest.approx(flops / 67e12 / 0.6)
    assert H100.compute_s(flops, 0, "tf32") == pytest.approx(flops / 495e12 / 0.6)
    assert H100.compute_s(flops, 0, "bfloat16") == H100.compute_s(flops, 0) == pytest.approx(flops / 989e12 / 0.6)


def test_a_float32_model_is_priced_slower_than_in_bfloat16_on_a_gpu(float32_matmul_precision):
    from autopar.examples.mlp import MLP

    from autopar.core.explain import plan_table
    from autopar.core.plan import ShardingPlan

    model, inputs = MLP(1024, 4096), (torch.randn(256, 1024), torch.randn(256, 1024))
    mesh = Mesh((4,), ("dp",))
    fp32 = autopar.plan(model, mesh, inputs, hardware="h100", pins={"x": "S(0)"})
    float32_matmul_precision("high")
    tf32 = autopar.plan(model, mesh, inputs, hardware="h100", pins={"x": "S(0)"})
    bf16 = autopar.plan(
        model.bfloat16(), mesh, tuple(t.bfloat16() for t in inputs), hardware="h100", pins={"x": "S(0)"}
    )
    assert fp32.compute_s > 2 * tf32.compute_s and tf32.compute_s > bf16.compute_s
    for plan, fmt in ((fp32, "float32"), (tf32, "tf32"), (bf16, "bfloat16")):
        assert {n.fmt for n in plan.nodes if n.op in ("aten.mm.default", "aten.addmm.default")} == {fmt}
        assert f"  {fmt}  " in plan_table(plan) and ShardingPlan.from_json(plan.to_json()) == plan


def test_a_profile_file_without_matrix_rates_loads_with_none(tmp_path):
    import json

    path = tmp_path / "old.json"
    save_profile(_measured(), path)
    data = json.loads(path.read_text())
    del data["profile"]["matrix_flops_per_s"]
    path.write_text(json.dumps(data))
    assert load_profile(path) == _measured()
    rated = dataclasses.replace(_measured(), matrix_flops_per_s=(("bfloat16", 4e10),))
    save_profile(rated, path)
    assert load_profile(path) == rated and load_profile(path).compute_s(4e10, 0, "bfloat16") == pytest.approx(
        1e-5 + 1.0
    )


def test_a_profile_file_keeps_the_fitted_factors_apart_and_a_version_1_file_still_loads(tmp_path):
    import json

    path = tmp_path / "p.json"
    fitted = Fitted(op_overhead_s=1e-5, timed_ops=True, contention=1.5, step_scale=1.2, collective_scale=0.8)
    profile = dataclasses.replace(_measured(), fitted=fitted)
    save_profile(profile, path)
    data = json.loads(path.read_text())
    assert (
        data["version"] == 2 and data["profile"]["fitted"]["step_scale"] == 1.2 and "contention" not in data["profile"]
    )
    data["version"] = 1  # as `autopar calibrate` wrote them before: the factors among the figures
    data["profile"].update(data["profile"].pop("fitted"))
    path.write_text(json.dumps(data))
    assert load_profile(path) == profile


def test_a_measured_send_prices_point_to_point_and_survives_the_profile_file(tmp_path):
    """A calibrated link's send (pipeline stages' sends) replaces the collectives' α-β for sends
    only, and is saved, loaded and scaled with the rest of the link."""
    measured = Link(1e-3, 1e-9, (("all_reduce", 1e-3, 1e-9),), send=(1e-4, 2e-9))
    assert measured.send_s(1000) == pytest.approx(1e-4 + 2e-6)
    assert Link(1e-3, 1e-9).send_s(1000) == pytest.approx(1e-3 + 1e-6)
    assert measured.scaled(2.0).send == pytest.approx((2e-4, 4e-9))
    profile = dataclasses.replace(_measured(), intra_host=measured)
    save_profile(profile, tmp_path / "profile.json")
    assert load_profile(tmp_path / "profile.json").intra_host == measured
