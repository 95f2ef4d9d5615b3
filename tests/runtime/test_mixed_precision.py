"""A model whose forward runs under ``torch.autocast`` trains on the mesh as on one device.

Capture keeps autocast's casts, so the graph's matmuls are bfloat16 ops (priced at bfloat16's
rate on GPU profiles) and every rank runs them so; the parameters stay float32.
"""

import copy

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture, gradients_before_cast

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


def _train(model, batches, grads_of, scaler=None) -> tuple[list[float], dict]:
    """Losses of SGD steps over ``batches``, and the first step's gradients by ``grads_of``
    (unscaled, with a ``torch.amp.GradScaler``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        if scaler is None:
            loss.backward()
            grads = grads or grads_of()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grads = grads or grads_of()
            scaler.step(opt)
            scaler.update()
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
    """One device under the same policy: the model run on ``dtype`` copies of its parameters."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args):
        casts = {n: p.to(self.dtype) for n, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, casts, args)


def train_under_policy(reduce_dtype: torch.dtype | None = None, param_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Three SGD steps under the policy, on 2x2 and on one device; float16 with a
    ``torch.amp.GradScaler`` on each, as float16's range needs."""
    from tests.cases import _rank_inputs, pins_for

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, dim=32, num_heads=4, num_layers=2))
    batches = [(torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))) for _ in range(3)]
    reference = _OneDeviceUnderPolicy(copy.deepcopy(model), param_dtype)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) if param_dtype == torch.float16 else None for _ in "ab"]
    ref_losses, ref_grads = _train(
        reference,
        batches,
        lambda: {k.removeprefix("model."): p.grad.clone() for k, p in reference.named_parameters()},
        scalers[0],
    )
    policy = autopar.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
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
        pmodel,
        local_batches,
        lambda: {k: p.grad.full_tensor() for k, p in pmodel.module.named_parameters()},
        scalers[1],
    )
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_rel": max(float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items()),
        "grad_rels": {k: float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items()},
        "param_dtypes": {str(p.dtype) for p in pmodel.parameters()},
        "grad_dtypes": {str(g.dtype) for g in grads.values()},
        "matmul_formats": {n.fmt for n in pmodel.plan.nodes if n.fmt},
        "scales": [s.get_scale() for s in scalers if s is not None],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "reduce_dtype, param_dtype",
    [(None, torch.bfloat16), (torch.float32, torch.bfloat16), (None, torch.float16)],
    ids=["bfloat16", "bfloat16-reduced-in-float32", "float16-with-grad-scaler"],
)
def test_the_mixed_precision_policy_trains_on_a_split_plan_as_one_device_under_it(reduce_dtype, param_dtype):
    for r in run_ranks(4, train_under_policy, reduce_dtype, param_dtype):
        assert r["param_dtypes"] == r["grad_dtypes"] == {"torch.float32"}
        assert r["matmul_formats"] == {str(param_dtype).removeprefix("torch.")}
        assert len(set(r["scales"])) <= 1, r["scales"]  # float16: the scalers skipped the same steps
        # bfloat16 products summed in another order, and in pieces, on the ranks: every gradient
        # within a few of bfloat16's steps (0.8% each; 1-2% measured), where a gradient missing
        # a rank's part of the reduction is off by half
        assert r["loss_rel"] < 1e-3 and r["grad_rel"] < 5e-2, r


def test_a_policy_of_a_dtype_that_is_no_floating_point_one_is_refused():
    with pytest.raises(ValueError, match="floating-point"):
        autopar.MixedPrecision(param_dtype=torch.int8)


def _gradient_reductions(reduce_dtype: torch.dtype | None) -> tuple[set[str], set[str]]:
    """The values a data-parallel MLP's plan reduces across ranks in the backward, and the
    gradients' values before their cast to float32."""
    batch = (torch.randn(16384, 1024), torch.randn(16384, 1024))
    pins = {"x": "S(0)", "target": "S(0)", **{f"layers.{i}.{k}": "R" for i in (0, 1) for k in ("weight", "bias")}}
    policy = autopar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    plan = autopar.plan(MLP(1024, 4096), autopar.Mesh((4,), ("dp",)), batch, pins=pins, mixed_precision=policy)
    reduced = {
        c.tensor for c in plan.collectives if c.phase == "backward" and c.kind in ("all_reduce", "reduce_scatter")
    }
    return reduced, set(gradients_before_cast(capture(MLP(1024, 4096), batch, torch.bfloat16)))


def test_reduce_dtype_float32_reduces_every_gradient_after_its_cast():
    reduced, before_cast = _gradient_reductions(None)
    assert reduced & before_cast  # priced cheaper, the weights' gradients are reduced in bfloat16
    reduced, before_cast = _gradient_reductions(torch.float32)
    assert reduced and not reduced & before_cast, reduced


def test_a_reduce_dtype_other_than_the_parameters_is_refused():
    policy = autopar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gradients are stepped in torch.float32.*Fix: reduce_dtype=torch.float32"):
        autopar.plan(
            MLP(8, 16), autopar.Mesh((2,), ("dp",)), (torch.randn(4, 8), torch.randn(4, 8)), mixed_precision=policy
        )
    with pytest.raises(ValueError, match="reduce_dtype=torch.int8"):
        autopar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.int8)


def train_data_parallel_reducing_in_float32() -> dict:
    torch.manual_seed(0)
    model = MLP(64, 256)
    batches = [(torch.randn(256, 64), torch.randn(256, 64)) for _ in range(3)]
    reference = _OneDeviceUnderPolicy(copy.deepcopy(model))
    ref_losses, ref_grads = _train(
        reference,
        [tuple(t.to(torch.bfloat16) for t in b) for b in batches],  # the policy casts floating-point inputs too
        lambda: {k.removeprefix("model."): p.grad.clone() for k, p in reference.named_parameters()},
    )
    pins = {"x": "S(0)", "target": "S(0)", **{f"layers.{i}.{k}": "R" for i in (0, 1) for k in ("weight", "bias")}}
    policy = autopar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = autopar.Mesh((4,), ("dp",))
    pmodel = autopar.compile(model, mesh, batches[0], pins=pins, mixed_precision=policy)  # plain data parallel
    rank = torch.distributed.get_rank()
    local = [tuple(t.chunk(4)[rank] for t in b) for b in batches]
    losses, grads = _train(
        pmodel, local, lambda: {k: p.grad.full_tensor() for k, p in pmodel.module.named_parameters()}
    )
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_rel": max(float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items()),
        "reduced": sorted(
            c.tensor for c in pmodel.plan.collectives if c.kind == "all_reduce" and c.phase == "backward"
        ),
    }


@pytest.mark.slow
def test_gradients_reduced_in_float32_train_as_one_device_under_the_policy():
    for r in run_ranks(4, train_data_parallel_reducing_in_float32):
        assert r["reduced"], r  # the gradients are reduced, after their cast
        assert r["loss_rel"] < 1e-3 and r["grad_rel"] < 2e-2, r
