"""A model whose forward runs under ``torch.autocast`` trains on the mesh as on one device.

Capture keeps autocast's casts, so the graph's matmuls are bfloat16 ops (priced at bfloat16's
rate on GPU profiles) and every rank runs them so; the parameters stay float32.
"""

import copy

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.passes.analysis.capture import capture

import autopar
from tests.conftest import FLOP_EQ_BYTE
from tests.harness import run_ranks


class Autocast(torch.nn.Module):
    """``model``'s forward under CPU autocast to bfloat16."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(idx, targets)


def _model_and_batches():
    torch.manual_seed(0)
    batches = [(torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))) for _ in range(3)]
    return Autocast(GPT(GPTConfig())), batches


def _train(model, batches, grads_of) -> tuple[list[float], dict]:
    """Losses of SGD steps over ``batches``, and the first step's gradients by ``grads_of``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        grads = grads or grads_of()
        opt.step()
        losses.append(float(loss))
    return losses, grads


def train_under_autocast(axis: str) -> dict:
    model, batches = _model_and_batches()
    reference = copy.deepcopy(model)
    ref_losses, ref_grads = _train(
        reference, batches, lambda: {k: p.grad.clone() for k, p in reference.named_parameters()}
    )
    pmodel = autopar.compile(model, autopar.Mesh((2,), (axis,)), batches[0], hardware=FLOP_EQ_BYTE)
    losses, grads = _train(
        pmodel, batches, lambda: {k: p.grad.full_tensor() for k, p in pmodel.module.named_parameters()}
    )
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_rel": max(float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items()),
        "param_dtypes": {str(p.dtype) for p in pmodel.parameters()},
    }


def test_autocast_is_captured_as_bfloat16_matmuls():
    model, batches = _model_and_batches()
    graph = capture(model, batches[0]).graph.graph
    matmuls = [
        n.meta["val"].dtype
        for n in graph.nodes
        if n.op == "call_function"
        and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    ]
    assert matmuls and set(matmuls) == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_a_model_under_autocast_trains_on_two_ranks_as_on_one_device(axis):
    results = run_ranks(2, train_under_autocast, axis)
    for r in results:
        assert r["param_dtypes"] == {"torch.float32"}
        # bfloat16 matmuls summed in another order on the ranks: gradients and losses agree to
        # bfloat16's rounding (a gradient reduced wrongly is off by tens of percent)
        assert r["loss_rel"] < 1e-4 and r["grad_rel"] < 2e-2, r


class _OneDeviceUnderPolicy(torch.nn.Module):
    """One device under the same policy: the model run on bfloat16 copies of its parameters."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        casts = {n: p.to(torch.bfloat16) for n, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, casts, args)


def train_under_policy() -> dict:
    from tests.cases import _rank_inputs, pins_for

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, dim=32, num_heads=4, num_layers=2))
    batches = [(torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))) for _ in range(3)]
    reference = _OneDeviceUnderPolicy(copy.deepcopy(model))
    ref_losses, ref_grads = _train(
        reference, batches, lambda: {k.removeprefix("model."): p.grad.clone() for k, p in reference.named_parameters()}
    )
    policy = autopar.MixedPrecision(param_dtype=torch.bfloat16)
    pmodel = autopar.compile(
        model,
        autopar.Mesh((2, 2), ("dp", "tp")),
        batches[0],
        hardware=FLOP_EQ_BYTE,
        pins=pins_for("2d", "gpt", ("dp", "tp")),
        mixed_precision=policy,
    )
    local_batches = [tuple(_rank_inputs(pmodel, b)) for b in batches]
    losses, grads = _train(
        pmodel, local_batches, lambda: {k: p.grad.full_tensor() for k, p in pmodel.module.named_parameters()}
    )
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_rel": max(float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items()),
        "grad_rels": {k: float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items()},
        "param_dtypes": {str(p.dtype) for p in pmodel.parameters()},
        "grad_dtypes": {str(g.dtype) for g in grads.values()},
        "matmul_formats": {n.fmt for n in pmodel.plan.nodes if n.fmt},
    }


@pytest.mark.slow
def test_the_mixed_precision_policy_trains_on_a_split_plan_as_one_device_under_it():
    for r in run_ranks(4, train_under_policy):
        assert r["param_dtypes"] == r["grad_dtypes"] == {"torch.float32"}
        assert r["matmul_formats"] == {"bfloat16"}
        # bfloat16 products summed in another order, and in pieces, on the ranks: every gradient
        # within a few of bfloat16's steps (0.8% each; 1-2% measured), where a gradient missing
        # a rank's part of the reduction is off by half
        assert r["loss_rel"] < 1e-3 and r["grad_rel"] < 5e-2, r


def test_a_policy_of_a_dtype_that_is_no_floating_point_one_is_refused():
    with pytest.raises(ValueError, match="floating-point"):
        autopar.MixedPrecision(param_dtype=torch.int8)
