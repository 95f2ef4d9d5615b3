"""autopar.compile as users call it: decorator, lazy inputs, saved plans, Inductor, bad input."""

import pytest

from tests.cases import (
    decorated_and_lazy,
    dict_outputs,
    planning_error_on_every_rank,
    saved_plan_and_inductor,
)
from tests.harness import run_ranks


@pytest.mark.slow
def test_decorator_on_class_and_factory_plans_on_first_call():
    for r in run_ranks(2, decorated_and_lazy):
        assert r["is_parallel"] and r["planned"]
        assert r["losses"] == pytest.approx([r["ref"], r["ref"]], rel=1e-5)


@pytest.mark.slow
def test_inductor_compiled_ranks_match_one_device_and_saved_plans_reload():
    for r in run_ranks(2, saved_plan_and_inductor):
        assert r["loss_rel"] <= 1e-5 and r["grad_ok"] and r["param_ok"]
        assert r["same_plan"]


@pytest.mark.slow
def test_a_planning_error_reaches_every_rank_instead_of_hanging():
    for message in run_ranks(2, planning_error_on_every_rank, timeout_s=120):
        assert "dim 0 (size 5) is not divisible by mesh axis 'dp' (size 2)" in message


@pytest.mark.slow
def test_models_returning_a_dict_get_it_back_whole():
    for r in run_ranks(2, dict_outputs):
        assert r["keys"] == ["loss", "out"]
        assert r["out_ok"] and r["grad_ok"]
