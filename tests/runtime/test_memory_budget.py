"""A plan made under a memory budget fits it on a real run: on 4 gloo ranks, the per-rank peak
that torch's MemTracker measures over a whole AdamW step is within the budget and within 2% of
the plan's prediction (issue 5 asks for 15%), and training matches one device.

A plan for a device with a host link (offload) runs too. On this CPU host the host copies are in
the same memory as the rest, so MemTracker measures the device peak and the host bytes together:
it must come within 15% of the predicted peak plus the plan's host bytes, and training must match
one device with the optimizer state of some parameters stepped on the host."""

import copy
import threading

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig

import autopar
from autopar.core.mesh import Link
from tests.cases import SYNTHETIC, make_optimizer
from tests.harness import run_ranks

MESH = autopar.Mesh((4,), ("dp",))
REPLICATED = 0.5  # the budget, as a fraction of what data parallelism (replicated parameters) needs
WITH_HOST = autopar.SyntheticProfile(
    s_per_flop=1e-12, s_per_byte=1e-12, latency_s=1e-6, host_link=Link(1e-6, 1e-11), host_s_per_byte_memory=1e-11
)
OFFLOADING = 0.45  # the budget, as a fraction of the unbudgeted plan's peak, that splitting alone cannot meet


def _model(num_layers: int = 2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, dim=32, num_heads=4, num_layers=num_layers))
    batches = [(torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 32))) for _ in range(3)]
    return model, batches


def _reference(model, batches, optimizer=lambda params: make_optimizer("adamw", params)) -> tuple[list[float], dict]:
    """Losses and final state of a copy of ``model`` trained on one device with ``optimizer``."""
    reference = copy.deepcopy(model)
    ref_opt = optimizer(reference.parameters())
    ref_losses = []
    for batch in batches:
        ref_opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss))
    return ref_losses, reference.state_dict()


def _freed_elsewhere(tracker, into: list[int]):
    """Make ``tracker`` append to ``into`` the bytes of each storage freed on a thread other
    than the main one (gloo's, when it held a collective's buffer last)."""
    count = tracker._delete_callback

    def callback(winfo, w_st):
        if threading.current_thread() is not threading.main_thread():
            into.append(winfo.mem_consumed)
        count(winfo, w_st)

    tracker._delete_callback = callback


def _train(pmodel, opt, batches) -> tuple[list[float], int, int]:
    """Losses, the largest per-rank MemTracker peak of a whole step, and the bytes that steps
    freed off the main thread."""
    from torch.distributed._tools.mem_tracker import MemTracker

    losses, peak, elsewhere = [], 0, []
    for step, batch in enumerate(batches):
        tracker = MemTracker()
        _freed_elsewhere(tracker, elsewhere)
        tracker.track_external(pmodel, opt)
        with tracker:  # the last step has the optimizer state of the steps before it
            opt.zero_grad()
            loss = pmodel(*batch)
            loss.backward()
            opt.step()
        losses.append(float(loss))
        peak = max(peak, int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
    return losses, peak, sum(elsewhere)


def _matches(pmodel, losses, ref_losses, ref_params) -> dict:
    params = pmodel.full_state_dict()
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_ok": all(torch.allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-5) for k in ref_params),
    }


def replicated_and_budget(model, batch) -> tuple[int, int]:
    """The peak of data parallelism (every parameter replicated) and the budget, ``REPLICATED`` of it."""
    data_parallel = {**{k: "S(0)" for k in ("idx", "targets")}, **{k: "R" for k, _ in model.named_parameters()}}
    replicated = autopar.plan(model, MESH, batch, hardware=SYNTHETIC, pins=data_parallel).peak_memory_bytes
    return replicated, int(replicated * REPLICATED)


def train_under_budget() -> dict:
    model, batches = _model()
    ref_losses, ref_params = _reference(model, batches)
    replicated, budget = replicated_and_budget(model, batches[0])
    pmodel = autopar.compile(model, MESH, batches[0], hardware=SYNTHETIC, memory_budget=budget)
    losses, peak, elsewhere = _train(pmodel, make_optimizer("adamw", pmodel.parameters()), batches)
    return {
        "replicated": replicated,
        "budget": budget,
        "predicted": pmodel.plan.peak_memory_bytes,
        "measured": peak,
        "freed_elsewhere": elsewhere,
        "recomputed": sum(n.activation == "recompute" and n.activation_bytes > 0 for n in pmodel.plan.nodes),
        **_matches(pmodel, losses, ref_losses, ref_params),
    }


def train_with_offload() -> dict:
    model, batches = _model()
    ref_losses, ref_params = _reference(model, batches)
    unbudgeted = autopar.plan(model, MESH, batches[0], hardware=WITH_HOST).peak_memory_bytes
    budget = int(unbudgeted * OFFLOADING)
    pmodel = autopar.compile(model, MESH, batches[0], hardware=WITH_HOST, memory_budget=budget)
    losses, peak, _ = _train(pmodel, pmodel.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), batches)
    plan = pmodel.plan
    return {
        "budget": budget,
        "predicted": plan.peak_memory_bytes,
        "host": plan.memory.host_bytes,
        "measured": peak,
        "offloaded": sum(n.activation == "offload" for n in plan.nodes),
        "host_optimizer": len(plan.host_optimizer),
        "host_params": len(plan.host_params),
        **_matches(pmodel, losses, ref_losses, ref_params),
    }


def meta_model_under_a_cap() -> dict:
    """An MLP built on the meta device whose whole parameters exceed a per-rank cap: compiled with
    the cap as its budget for plain SGD (``optimizer_slots=0``), each rank materialises only its
    pieces and trains under the cap, as one device does from the same seed. An AdamW step then
    warns that the plan's memory counts no optimizer state."""
    import logging

    from autopar.examples.mlp import MLP

    torch.manual_seed(0)
    reference = MLP(64, 512, num_layers=4)
    with torch.device("meta"):
        model = MLP(64, 512, num_layers=4)
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    cap = int(whole * 0.75)
    batches = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(3)]
    torch.manual_seed(0)
    pmodel = autopar.compile(
        model, MESH, batches[0], hardware=SYNTHETIC, memory_budget=cap, optimizer_slots=0, recompute="none"
    )
    losses, peak, _ = _train(pmodel, pmodel.optimizer(torch.optim.SGD, lr=0.1), batches)
    ref_losses, ref_params = _reference(reference, batches, lambda params: torch.optim.SGD(params, lr=0.1))
    matches = _matches(pmodel, losses, ref_losses, ref_params)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("autopar").addHandler(handler)
    try:
        adam = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
        pmodel(*batches[0]).backward()
        adam.step()
    finally:
        logging.getLogger("autopar").removeHandler(handler)
    return {
        "whole": whole,
        "cap": cap,
        "measured": peak,
        "predicted": pmodel.plan.peak_memory_bytes,
        "local": sum(p.to_local().numel() * p.element_size() for p in pmodel.parameters()),
        **matches,
        "warnings": warnings,
    }


@pytest.mark.slow
def test_a_meta_device_model_over_the_cap_trains_with_each_rank_under_it():
    for r in run_ranks(4, meta_model_under_a_cap):
        assert r["whole"] > r["cap"] and r["local"] < r["whole"]
        assert r["predicted"] <= r["cap"]
        assert r["measured"] <= r["cap"], f"measured {r['measured']} B over the cap {r['cap']} B"
        assert r["loss_rel"] <= 1e-5 and r["param_ok"]
        assert any(
            "AdamW keeps 2 tensors the size of each parameter" in w and "optimizer_slots=2" in w for w in r["warnings"]
        ), r["warnings"]


def both() -> tuple[dict, dict]:
    return train_under_budget(), train_with_offload()


@pytest.fixture(scope="module")
def both_runs():
    return run_ranks(4, both)


@pytest.fixture(scope="module")
def runs(both_runs):
    return [r for r, _ in both_runs]


@pytest.fixture(scope="module")
def offload_runs(both_runs):
    return [r for _, r in both_runs]


@pytest.mark.slow
def test_a_model_that_does_not_fit_replicated_gets_a_plan_that_fits(runs):
    for r in runs:
        assert r["budget"] < r["replicated"] and r["predicted"] <= r["budget"]
        assert r["recomputed"] > 0


@pytest.mark.slow
def test_measured_peak_is_within_the_budget_and_near_the_prediction(runs):
    for r in runs:
        assert r["measured"] <= r["budget"], f"measured {r['measured']} B over the budget {r['budget']} B"
        assert abs(r["measured"] / r["predicted"] - 1) <= 0.02, (
            f"predicted {r['predicted']} B, measured {r['measured']} B"
        )


@pytest.mark.slow
def test_collective_buffers_are_freed_by_the_program_not_by_gloos_thread(runs):
    """gloo's thread may hold a collective's buffers past the wait; were it to free them, the
    peak would depend on when it gets to (up to 10% above liveness on one rank of four)."""
    assert [r["freed_elsewhere"] for r in runs] == [0] * len(runs)


@pytest.mark.slow
def test_training_under_the_budget_matches_one_device(runs):
    for r in runs:
        assert r["loss_rel"] <= 1e-5 and r["param_ok"]


@pytest.mark.slow
def test_a_plan_that_offloads_fits_and_trains_as_one_device(offload_runs):
    for r in offload_runs:
        assert r["offloaded"] > 0 and r["host_optimizer"] >= r["host_params"] > 0 and r["host"] > 0
        assert r["predicted"] <= r["budget"]
        together = r["predicted"] + r["host"]  # device and host memory are one on this host
        assert abs(r["measured"] / together - 1) <= 0.15, (
            f"predicted {r['predicted']} + {r['host']} B, measured {r['measured']} B"
        )
        assert r["loss_rel"] <= 1e-5 and r["param_ok"]
