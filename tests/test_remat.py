"""Recomputation chosen by the solver: what a memory budget makes it recompute, and in what order."""

import pytest
import torch
from autopar.examples.gpt import GPT, GPTConfig
from torch import nn

import autopar
from autopar import Mesh

ONE_DEVICE = Mesh((1,), ("x",))  # nothing to split: only recomputation saves memory
FLOPS_AND_BYTES = autopar.SyntheticProfile(s_per_flop=1e-12, s_per_byte=1e-12, latency_s=1e-6)
MATMULS = {"mm", "addmm", "bmm"}


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, dim=128, num_heads=4, num_layers=2)
    return GPT(cfg), (torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 32)))


def _plan(gpt, **options):
    model, batch = gpt
    return autopar.plan(model, ONE_DEVICE, batch, hardware=FLOPS_AND_BYTES, **options)


def _recomputed_ops(plan) -> set[str]:
    """The ops recomputed that hold memory (views of parameters are always made again)."""
    return {n.op.split(".")[1] for n in plan.nodes if n.activation == "recompute" and n.activation_bytes}


def test_without_a_budget_every_activation_is_kept(gpt):
    plan = _plan(gpt)
    assert not _recomputed_ops(plan) and plan.recompute_s == 0 and plan.memory.recomputed_bytes == 0
    assert plan.memory.activations_bytes > 0 and any(n.activation == "keep" for n in plan.nodes)
    remade = [n for n in plan.nodes if n.activation == "recompute"]  # a weight's transpose, from the weight
    assert remade and all(
        n.op == "aten.t.default" and n.module.endswith(("qkv", "proj", "fc1", "fc2", "head")) for n in remade
    )


def test_tightening_the_budget_recomputes_cheap_ops_before_matmuls(gpt):
    keep_all = _plan(gpt)
    slightly = _plan(gpt, memory_budget=int(keep_all.peak_memory_bytes * 0.95))
    tighter = _plan(gpt, memory_budget=int(keep_all.peak_memory_bytes * 0.88))
    assert _recomputed_ops(slightly) and not _recomputed_ops(slightly) & MATMULS  # a GELU's or a layer norm's output
    assert _recomputed_ops(tighter) & MATMULS
    for plan, fraction in ((slightly, 0.95), (tighter, 0.88)):
        assert plan.peak_memory_bytes <= keep_all.peak_memory_bytes * fraction
        assert plan.memory.recomputed_bytes > 0
    assert keep_all.predicted_step_s < slightly.predicted_step_s < tighter.predicted_step_s
    assert slightly.predicted_step_s < keep_all.predicted_step_s * 1.01  # a pointwise op saves its output almost free


def test_recompute_none_refuses_the_budget_that_recomputation_fits(gpt):
    budget = int(_plan(gpt).peak_memory_bytes * 0.95)
    with pytest.raises(autopar.InfeasiblePlanError, match=r"(?s)fits memory_budget=.*Fix: raise memory_budget"):
        _plan(gpt, memory_budget=budget, recompute="none")


def test_recompute_layers_recomputes_inside_every_block(gpt):
    plan = _plan(gpt, recompute="layers")
    table = str(plan)
    assert "Activations by layer" in table
    for block in ("blocks.0", "blocks.1"):
        inside = [n for n in plan.nodes if n.module.startswith(block + ".") and n.activation]
        assert sum(n.activation == "recompute" for n in inside) > 10
        row = next(line for line in table.splitlines() if line.startswith(block + " "))
        assert "0 B" not in row.split()[3:5]  # recomputed bytes
    assert plan.recompute_s > 0 and plan.memory.recomputed_bytes > 0
    assert plan.memory.activations_bytes < _plan(gpt).memory.activations_bytes / 2


def test_plan_json_keeps_the_activation_choices(gpt):
    plan = _plan(gpt, recompute="layers")
    again = autopar.ShardingPlan.from_json(plan.to_json())
    assert again == plan
    assert again.recompute_s == plan.recompute_s and again.memory == plan.memory


class _Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.GELU()) for _ in range(2))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x - y) ** 2).mean()


def test_ops_that_draw_random_numbers_are_never_recomputed():
    plan = autopar.plan(_Dropped(), ONE_DEVICE, (torch.randn(16, 32), torch.randn(16, 32)), recompute="layers")
    random_ops = [n for n in plan.nodes if "bernoulli" in n.op or "dropout" in n.op or "rand" in n.op]
    assert random_ops and all(n.activation != "recompute" for n in random_ops)
    assert any(n.activation == "recompute" for n in plan.nodes)


def test_unknown_recompute_option_is_refused():
    with pytest.raises(ValueError, match=r"recompute='all' is not one of 'auto', 'none', 'layers'"):
        autopar.plan(_Dropped(), ONE_DEVICE, (torch.randn(16, 32), torch.randn(16, 32)), recompute="all")


def test_ops_reading_a_buffer_the_forward_overwrites_are_never_recomputed():
    """Batch norm reads its running statistics, which are written back after the forward: run
    again in the backward, it would read the new values (autograd refuses the saved tensor)."""
    from autopar.examples.convnet import ConvNet

    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    plan = autopar.plan(ConvNet(), ONE_DEVICE, batch, recompute="layers")
    norms = [n for n in plan.nodes if "batch_norm_legit" in n.op]
    assert norms and all(n.activation != "recompute" for n in norms)
    assert any(n.activation == "recompute" for n in plan.nodes)
