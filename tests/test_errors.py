"""Bad input gets an error naming the cause and the fix."""

import re

import pytest
import torch
from autopar.examples.mlp import MLP
from torch import nn

import autopar
from autopar import Mesh
from autopar.core.placement import R, S
from tests.conftest import FLOP_EQ_BYTE


def _inputs(batch=8, dim=16):
    return torch.randn(batch, dim), torch.randn(batch, dim)


def test_mesh_size_must_match_world_size(fake_world):
    fake_world(8)
    with pytest.raises(
        ValueError, match=r"Mesh\(dp=4\) has 4 devices but the process group has 8 ranks.*autopar run -n 4"
    ):
        autopar.compile(MLP(16, 32), Mesh((4,), ("dp",)), _inputs())


def test_compile_without_a_process_group_says_how_to_launch():
    with pytest.raises(ValueError, match=r"autopar run -n 4 script.py"):
        autopar.compile(MLP(16, 32), Mesh((4,), ("dp",)), _inputs())


def test_pinned_dim_that_the_axis_does_not_divide_names_tensor_dim_and_axis():
    with pytest.raises(
        autopar.InfeasiblePlanError,
        match=r"(?s)pin x=\(S\(0\)\).*shape \(6, 16\).*dim 0 \(size 6\) "
        r"is not divisible by mesh axis 'dp' \(size 4\).*Fix",
    ):
        autopar.plan(MLP(16, 32), Mesh((4,), ("dp",)), _inputs(batch=6), pins={"x": "S(0)"})


def test_dims_the_mesh_does_not_divide_are_planned_around():
    plan = autopar.plan(MLP(16, 32), Mesh((4,), ("dp",)), _inputs(batch=6), hardware=FLOP_EQ_BYTE)
    batch_ops = [n for n in plan.nodes if n.op in ("aten.addmm.default", "aten.relu.default")]
    assert len(batch_ops) == 3
    for node in batch_ops:  # 6 rows cannot be split 4 ways: no [6, *] output is split on dim 0
        assert node.outputs[0] != (S(0),)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum().item() > 0:  # a Python branch on a tensor's value
            return self.fc(x).sum()
        return self.fc(-x).sum()


def test_uncapturable_model_says_why_and_what_to_change():
    with pytest.raises(autopar.CaptureError, match=r"(?s)could not trace DataDependent.*torch.cond"):
        autopar.plan(DataDependent(), Mesh((2,)), (torch.randn(2, 4),))


def test_unknown_pin_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"pins name \['nope'\].*known names: .*layers.0.weight"):
        autopar.plan(MLP(16, 32), Mesh((2,)), _inputs(), pins={"nope": "R"})


def test_unknown_hardware_lists_profiles():
    with pytest.raises(
        ValueError, match=r"hardware='tpu' is not a known profile; use one of \['a100', 'cpu', 'h100', 'h200'\]"
    ):
        autopar.plan(MLP(16, 32), Mesh((2,)), _inputs(), hardware="tpu")


def test_solver_gap_outside_zero_to_one_is_refused_with_an_example():
    with pytest.raises(ValueError, match=r"solver_gap=1.5 is not a fraction in \[0, 1\).*e.g. 0.01 for 1%"):
        autopar.plan(MLP(16, 32), Mesh((2,)), _inputs(), solver_gap=1.5)


def test_non_tensor_inputs_are_refused_before_tracing():
    with pytest.raises(TypeError, match=r"positions \[1\] are not"):
        autopar.plan(MLP(16, 32), Mesh((2,)), (torch.randn(8, 16), 3))


def test_an_input_that_requires_a_gradient_is_refused(fake_world):
    fake_world(2)
    pmodel = autopar.compile(MLP(16, 32), Mesh((2,)), hardware=FLOP_EQ_BYTE)  # planned at its first call
    x, y = _inputs()
    with pytest.raises(autopar.InputError, match=r"argument 0 of the compiled model requires a gradient.*x.detach\(\)"):
        pmodel(x.requires_grad_(), y)


def test_plan_for_another_model_is_refused(fake_world):
    fake_world(2)
    plan = autopar.plan(MLP(16, 32), Mesh((2,)), _inputs(), hardware=FLOP_EQ_BYTE)
    with pytest.raises(autopar.StalePlanError, match=r"plan was made for another graph.*plan this model again"):
        autopar.compile(MLP(16, 64), Mesh((2,)), _inputs(), plan=plan)


class _Scan(nn.Module):
    def __init__(self, dim: int, softmax_dim: int = -1):
        super().__init__()
        self.dim, self.softmax_dim = dim, softmax_dim
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        return ((self.fc(x).cumsum(self.dim).softmax(self.softmax_dim) - y) ** 2).mean()


@pytest.mark.parametrize(
    "planned, compiled, difference",
    [
        (_Scan(1), _Scan(0), r"cumsum.default\(\[addmm, 1\].*now `cumsum.*\(\[addmm, 0\]"),
        (
            _Scan(1, softmax_dim=-1),
            _Scan(1, softmax_dim=0),
            r"_softmax.default\(\[cumsum, -1, False\].*now `.*_softmax.default\(\[cumsum, 0, False\]",
        ),
    ],
)
def test_a_plan_for_other_op_arguments_is_refused_naming_the_node(fake_world, planned, compiled, difference):
    fake_world(2)
    plan = autopar.plan(planned, Mesh((2,)), _inputs(), hardware=FLOP_EQ_BYTE)
    with pytest.raises(
        autopar.StalePlanError, match=r"(?s)plan was made for another graph.*node \d+ differs.*" + difference
    ):
        autopar.compile(compiled, Mesh((2,)), _inputs(), plan=plan)


def test_a_float32_plan_is_refused_for_a_bfloat16_model(fake_world):
    fake_world(2)
    plan = autopar.plan(MLP(16, 32), Mesh((2,)), _inputs(), hardware=FLOP_EQ_BYTE)
    x, y = _inputs()
    with pytest.raises(
        autopar.StalePlanError, match=r"(?s)node \d+ differs, planned as `.*float32.*`, now `.*bfloat16"
    ):
        autopar.compile(MLP(16, 32).to(torch.bfloat16), Mesh((2,)), (x.bfloat16(), y.bfloat16()), plan=plan)


def test_a_plan_with_other_input_placements_than_the_pins_is_refused(fake_world):
    fake_world(2)
    plan = autopar.plan(MLP(16, 32), Mesh((2,)), _inputs(), hardware=FLOP_EQ_BYTE, pins={"x": "S(0)"})
    with pytest.raises(
        autopar.StalePlanError, match=r"plan places 'x' as \(S\(0\)\) but pins ask for \(R\).*Fix: plan again"
    ):
        autopar.compile(MLP(16, 32), Mesh((2,)), _inputs(), plan=plan, pins={"x": "R"})


def test_plan_for_another_mesh_is_refused(fake_world):
    fake_world(2)
    plan = autopar.plan(MLP(16, 32), Mesh((2,), ("dp",)), _inputs(), hardware=FLOP_EQ_BYTE)
    with pytest.raises(
        autopar.StalePlanError, match=r"made for Mesh\(dp=2\) but the model is compiled for Mesh\(tp=2\)"
    ):
        autopar.compile(MLP(16, 32), Mesh((2,), ("tp",)), _inputs(), plan=plan)


def test_unsupported_ops_are_listed_when_fallback_is_off():
    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cummax(self.fc(x), 0).values.sum()

    with pytest.raises(
        autopar.UnsupportedOpError,
        match=r"(?s)no sharding rule:\n  cummax.*aten.cummax.default on \(8, 4\).*fallback=True",
    ):
        autopar.plan(Cumulative(), Mesh((2,)), (torch.randn(8, 4),), fallback=False)
    plan = autopar.plan(Cumulative(), Mesh((2,)), (torch.randn(8, 4),))  # falls back to replicated
    assert next(n for n in plan.nodes if n.op == "aten.cummax.default").outputs == ((R,), (R,))


def test_in_place_updates_of_parameters_and_inputs_are_refused_with_their_names():
    class Rescaling(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                self.fc.weight.mul_(0.5)
            x.mul_(2)
            return self.fc(x).sum()

    with pytest.raises(
        autopar.CaptureError,
        match=r"(?s)updates parameter fc.weight, input x in place; autopar writes "
        r"back in-place updates of buffers only.*Fix: .*self.register_buffer.*x.mul_\(2\)",
    ):
        autopar.plan(Rescaling(), Mesh((2,)), (torch.randn(8, 4),))


def test_infeasible_memory_budget_says_what_is_over_and_what_would_fit():
    with pytest.raises(
        autopar.InfeasiblePlanError,
        match=r"(?s)no plan on Mesh\(dp=4\) fits memory_budget=1000 B per device: the least memory any plan "
        r"needs is .*over \(parameters .*activations .*\).*Fix: raise memory_budget to at least .*"
        r"mesh about .*x larger",
    ):
        autopar.plan(MLP(16, 32), Mesh((4,), ("dp",)), _inputs(), memory_budget="1KB")


def test_an_infeasible_budget_is_refused_alike_under_any_time_limit():
    """When the timed search finds no plan, whether any fits is decided by the program's
    relaxation, so a limit too short for any search still gives the infeasible verdict, not a
    timeout."""
    for limit in (0.01, 120.0):
        with pytest.raises(autopar.InfeasiblePlanError) as caught:
            autopar.plan(MLP(16, 32), Mesh((4,), ("dp",)), _inputs(), memory_budget="1KB", solver_time_limit_s=limit)
        assert type(caught.value) is autopar.InfeasiblePlanError, caught.value
        assert re.match(
            r"no plan on Mesh\(dp=4\) fits memory_budget=1000 B per device: "
            r"(any plan needs at least|the least memory any plan needs is) .*\nFix: raise memory_budget to at least ",
            str(caught.value),
        ), caught.value


def test_a_split_pinned_input_without_example_inputs_is_refused_on_the_first_call(fake_world):
    fake_world(2)
    pmodel = autopar.compile(MLP(16, 32), Mesh((2,), ("dp",)), pins={"x": "S(0)"})
    with pytest.raises(autopar.InputError, match=r"input 'x' is pinned to a split.*Fix: pass example_inputs="):
        pmodel(*_inputs(batch=4))


def test_pins_are_compared_with_a_plan_as_planning_reads_them(fake_world):
    fake_world(2)
    mesh = Mesh((2, 1), ("dp", "tp"))
    pins = {"x": ("S(0)", "S(0)")}  # a split over the one-rank axis is planned as replicated there
    plan = autopar.plan(MLP(16, 32), mesh, _inputs(), hardware=FLOP_EQ_BYTE, pins=pins)
    assert plan.inputs["x"] == (S(0), R)
    autopar.compile(MLP(16, 32), mesh, _inputs(), plan=plan, pins=pins)
