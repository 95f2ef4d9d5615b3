"""Hardware profiles: saved and loaded, and used by collectives' α-β per kind."""

import pytest

import autopar
from autopar.cost_model.hardware import CPU, HardwareProfile, Link, load_profile, resolve_profile, save_profile
from autopar.mesh import Mesh
from autopar.passes.redistribute import Step, step_s


def _measured() -> HardwareProfile:
    link = Link(1e-4, 1e-9, (("all_reduce", 2e-4, 2e-9), ("all_gather", 5e-5, 1e-9)))
    return HardwareProfile(name="measured", flops_per_s=2e10, memory_bytes_per_s=5e9, efficiency=1.0,
                           memory_bytes=2**33, devices_per_host=4, intra_host=link, inter_host=link,
                           op_overhead_s=1e-5)


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
    slow = HardwareProfile(**{**{f: getattr(CPU, f) for f in CPU.__dataclass_fields__}, "op_overhead_s": 1e-3})
    charged = autopar.plan(MLP(16, 32), Mesh((2,), ("dp",)), inputs, hardware=slow)
    assert charged.compute_s == pytest.approx(plain.compute_s + 1e-3 * len(plain.nodes), rel=1e-6)


def test_the_step_overhead_per_step_and_parameter_is_part_of_the_predicted_step():
    import dataclasses

    import torch

    from autopar.examples.mlp import MLP

    model, inputs = MLP(16, 32), (torch.randn(8, 16), torch.randn(8, 16))
    plain = autopar.plan(model, Mesh((2,), ("dp",)), inputs, hardware=CPU)
    host = dataclasses.replace(CPU, step_overhead_s=1e-3, param_overhead_s=1e-4, contention=2.0)
    charged = autopar.plan(model, Mesh((2,), ("dp",)), inputs, hardware=host)
    expected = (1e-3 + 1e-4 * len(list(model.parameters()))) * 2.0
    assert plain.overhead_s == 0 and charged.overhead_s == pytest.approx(expected)
    assert charged.predicted_step_s == pytest.approx(charged.compute_s + charged.communication_s + expected)
    from autopar.explain import plan_table

    assert "step overhead" in plan_table(charged) and "step overhead" not in plan_table(plain)


def test_the_step_scale_lengthens_every_price_and_keeps_the_plan():
    import dataclasses

    import torch

    from autopar.examples.mlp import MLP

    model, inputs = MLP(16, 32), (torch.randn(8, 16), torch.randn(8, 16))
    host = dataclasses.replace(CPU, step_overhead_s=1e-3, param_overhead_s=1e-4)
    plain = autopar.plan(model, Mesh((4,), ("dp",)), inputs, hardware=host, pins={"x": "S(0)"})
    scaled = autopar.plan(model, Mesh((4,), ("dp",)), inputs, hardware=dataclasses.replace(host, step_scale=1.5),
                          pins={"x": "S(0)"})
    assert plain.collectives and scaled.placements == plain.placements
    for part in ("compute_s", "communication_s", "overhead_s", "predicted_step_s"):
        assert getattr(scaled, part) == pytest.approx(1.5 * getattr(plain, part)), part
    assert [c.time_s for c in scaled.collectives] == pytest.approx([1.5 * c.time_s for c in plain.collectives])


def test_the_collective_scale_lengthens_collectives_only():
    import dataclasses

    import torch

    from autopar.cost_model.estimate import CostModel
    from autopar.examples.mlp import MLP
    from autopar.passes.capture import capture
    from autopar.passes.propagate import propagate
    from autopar.placement import P, R, S

    mesh = Mesh((4,), ("dp",))
    captured = capture(MLP(16, 32), (torch.randn(8, 16), torch.randn(8, 16)))
    space = propagate(captured, mesh)
    host = dataclasses.replace(CPU, step_overhead_s=1e-3, param_overhead_s=1e-4, step_scale=1.5)
    plain, slow = CostModel(captured, mesh, host), CostModel(captured, mesh, dataclasses.replace(host, collective_scale=3.0))
    assert slow.compute_costs(space) == plain.compute_costs(space)
    assert slow.step_overhead_s(10) == plain.step_overhead_s(10)
    ref = (next(n.name for n in space.nodes if n.kind == "op"), 0)
    for src, dst in (((P,), (R,)), ((S(0),), (R,)), ((P,), (S(0),))):
        base = plain.transition_s(ref, src, dst)
        assert base > 0 and slow.transition_s(ref, src, dst) == pytest.approx(3.0 * base)
