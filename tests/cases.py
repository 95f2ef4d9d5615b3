"""Training runs compared with one device; executed on every rank by the harness."""

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
from autopar.examples.bert import Bert, BertConfig, masked_batch
from autopar.examples.convnet import ConvNet
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.mlp import MLP
from autopar.examples.moe import MoEConfig, MoEGPT

import autopar

NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="Hugging Face transformers is not installed (pip install -e '.[test]')",
)

# compute dear, communication cheap: the solver splits work across ranks
SYNTHETIC = autopar.SyntheticProfile(s_per_flop=1e-9, s_per_byte=1e-12, latency_s=1e-8)
# a byte sent costs ten FLOPs: the solver keeps a split batch split through every layer
BYTES_DEAR = autopar.SyntheticProfile(s_per_flop=1e-10, s_per_byte=1e-9, latency_s=1e-8)


def make_model(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP(16, 32, num_layers=3)
        batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(3)]
    elif name == "gpt":
        cfg = GPTConfig(vocab_size=64, block_size=8, dim=16, num_heads=4, num_layers=1)
        model = GPT(cfg)
        batches = [(torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))) for _ in range(3)]
    elif name == "llama":
        cfg = LlamaConfig(vocab_size=64, dim=16, num_heads=4, num_kv_heads=2, hidden=32, num_layers=1, max_seq=8)
        model = Llama(cfg)
        batches = [(torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))) for _ in range(3)]
    elif name == "bert":
        cfg = BertConfig(vocab_size=64, max_seq=8, dim=16, num_heads=4, hidden=32, num_layers=1)
        model = Bert(cfg)
        gen = torch.Generator().manual_seed(0)
        batches = [masked_batch(cfg, 4, 8, gen) for _ in range(3)]
    elif name == "moe":
        cfg = MoEConfig(
            vocab_size=64,
            block_size=8,
            dim=16,
            num_heads=4,
            num_layers=1,
            num_experts=4,
            expert_hidden=32,
            group_size=8,
        )
        model = MoEGPT(cfg)
        batches = [(torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))) for _ in range(3)]
    elif name in ("hf-gpt2", "hf-gpt2-dropout", "hf-llama"):  # Hugging Face transformers, built from a configuration
        from autopar.examples import hf

        sizes = {"vocab_size": 64, "seq": 8, "dim": 16, "num_heads": 4, "num_layers": 1}
        if name == "hf-llama":
            model = hf.llama(**sizes, hidden=32)
        else:
            model = hf.gpt2(**sizes, dropout=0.1 if name == "hf-gpt2-dropout" else 0.0)
        batches = [(torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))) for _ in range(3)]
    elif name.startswith("zoo-"):  # an architecture of the Hugging Face zoo, smaller still
        from autopar.examples.hf import zoo

        model, first = zoo(batch=4, seq=8, dim=16, num_layers=1)[name.removeprefix("zoo-")]()
        batches = [first] + [tuple(_like(t) for t in first) for _ in range(2)]
    elif name == "convnet":
        # 8x8 images: at 16x16 this seed gives one filter weight a first gradient of 6e-8, so near
        # AdamW's eps (1e-8) that its rounding moves the update visibly (fp32 and fp64 runs differ by 1e-4)
        model = ConvNet()
        batches = [(torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))) for _ in range(3)]
    else:
        raise ValueError(name)
    return model, batches


def _like(t: torch.Tensor) -> torch.Tensor:
    """Another batch like ``t``: token ids below its largest, or normal floats."""
    if t.is_floating_point():
        return torch.randn_like(t)
    return torch.randint(0, int(t.max()) + 1, t.shape, dtype=t.dtype)


def pins_for(preset: str | None, model_name: str, axis_names) -> dict | None:
    """Hand-written layouts as pins: ``dp`` (batch split over every mesh axis, weights
    replicated), ``fsdp`` (batch and every parameter split on dim 0 over every axis), ``megatron``
    (column/row tensor parallel, on the last
    axis), ``2d`` (data parallel on the first axis, Megatron on the second), ``experts`` (the
    MoE example's expert weights split on the expert dim over every axis, the rest planned) and
    ``vocab`` (the token embedding and output head split along the vocabulary on the last axis,
    so the cross-entropy is vocabulary parallel; the rest planned)."""
    if preset is None:
        return None
    model, _ = make_model(model_name)
    names = [n for n, _ in model.named_parameters()]
    ndim = len(axis_names)
    batch = {
        "mlp": ("x", "target"),
        "bert": ("idx", "segments", "labels"),
        "convnet": ("images", "labels"),
        "hf-gpt2": ("input_ids", "labels"),
        "hf-llama": ("input_ids", "labels"),
    }.get(model_name, ("idx", "targets"))
    if preset == "experts":
        return {n: ("S(0)",) * ndim for n in names if n.endswith((".moe.w1", ".moe.w2"))}
    if preset == "vocab":
        vocab = (
            "tok.weight",
            "head.weight",
            "model.transformer.wte.weight",
            "model.model.embed_tokens.weight",
            "model.lm_head.weight",
        )
        return {n: ("R",) * (ndim - 1) + ("S(0)",) for n in names if n in vocab}
    assert model_name in ("mlp", "gpt") or preset in ("dp", "fsdp"), f"no tensor-parallel pins for {model_name}"
    if preset == "dp":
        return {**{k: ("S(0)",) * ndim for k in batch}, **{n: ("R",) * ndim for n in names}}
    if preset == "fsdp":
        return {**{k: ("S(0)",) * ndim for k in batch}, **{n: ("S(0)",) * ndim for n in names}}
    if model_name == "mlp":
        split = {
            "layers.0.weight": "S(0)",
            "layers.0.bias": "S(0)",
            "layers.1.weight": "S(1)",
            "layers.2.weight": "S(0)",
            "layers.2.bias": "S(0)",
        }
    else:
        split = {
            "blocks.0.attn.qkv.weight": "S(0)",
            "blocks.0.attn.proj.weight": "S(1)",
            "blocks.0.fc1.weight": "S(0)",
            "blocks.0.fc1.bias": "S(0)",
            "blocks.0.fc2.weight": "S(1)",
        }
    if preset == "megatron":
        return {n: ("R",) * (ndim - 1) + (p,) for n, p in split.items()}
    if preset == "2d":
        assert ndim == 2
        return {**{k: ("S(0)", "R") for k in batch}, **{n: ("R", p) for n, p in split.items()}}
    raise ValueError(preset)


def run_cases(cases: list[dict]) -> list[dict]:
    """Run several :func:`compare_with_one_device` cases in one set of ranks."""
    results = []
    for case in cases:
        case = dict(case)
        case["pins"] = pins_for(case.pop("preset", None), case["model_name"], case["axis_names"])
        results.append(compare_with_one_device(**case))
    return results


def case_name(case: dict) -> str:
    mesh = "x".join(map(str, case["mesh_shape"]))
    recompute = f"-recompute-{case['recompute']}" if "recompute" in case else ""
    return f"{case['model_name']}-{mesh}-{case['optimizer_name']}-{case.get('preset', 'auto')}{recompute}"


CASES_PER_RUN = 7
"""Cases one set of ranks runs (about 10 s each on this project's 2-core machine)."""


def run_groups(groups) -> dict[str, list[dict]]:
    """Every case's per-rank results, keyed by :func:`case_name`, for ``(world size, cases)``
    groups: ``CASES_PER_RUN`` cases to a set of ranks, so that each set ends well within the
    harness's time limit on a busy machine."""
    from tests.harness import run_ranks

    out = {}
    for world, cases in groups:
        for start in range(0, len(cases), CASES_PER_RUN):
            chunk = cases[start : start + CASES_PER_RUN]
            per_rank = run_ranks(world, run_cases, chunk)
            for i, case in enumerate(chunk):
                out[case_name(case)] = [rank_results[i] for rank_results in per_rank]
    return out


def assert_matches_one_device(runs: list[dict]) -> None:
    """Losses within 1e-5 relative, gradients and parameters within rtol 1e-4 / atol 1e-5, on
    every rank."""
    for r in runs:
        assert r["loss_rel"] <= 1e-5, f"rank {r['rank']}: loss differs by {r['loss_rel']:.2e}"
        assert r["grad_ok"], f"rank {r['rank']}: gradients differ by up to {r['grad_max']:.2e}"
        assert r["param_ok"], f"rank {r['rank']}: parameters differ by up to {r['param_max']:.2e}"


def assert_runs_the_planned_collectives(runs: list[dict]) -> None:
    """Each rank's program ran exactly the collectives its plan lists, and no other."""
    import collections

    for r in runs:
        plan = autopar.ShardingPlan.from_json(r["plan"])
        planned = collections.Counter((c.kind, c.axis, c.bytes) for c in plan.collectives)
        ran = collections.Counter(tuple(x) for x in r["ran"])
        assert ran == planned


def make_optimizer(name: str, params):
    """``sgd``, ``adamw``, or ``adamw-eps1e-6`` for models with a parameter whose gradient is zero
    up to rounding (GPT-2's key bias: softmax ignores a shift shared by every key). AdamW moves
    such a parameter by about lr·|g|/eps, rounding noise that depends on the order ranks sum in:
    1e-5 with eps=1e-8 and a gradient of 1e-11, past the comparison's tolerance; eps=1e-6 makes
    it a hundred times smaller."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6 if name == "adamw-eps1e-6" else 1e-8)


STEP_SEED = 1000
"""Each training step ``k`` starts from ``torch.manual_seed(STEP_SEED + k)``, on one device and
on every rank, so that models with dropout draw the same masks."""


def _train(model, batches, optimizer_name):
    opt = make_optimizer(optimizer_name, model.parameters())
    losses, grads = [], None
    for step, batch in enumerate(batches):
        torch.manual_seed(STEP_SEED + step)
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach().clone())
    return losses, grads


def compare_with_one_device(
    model_name: str,
    mesh_shape,
    axis_names,
    optimizer_name: str = "adamw",
    pins=None,
    hardware=SYNTHETIC,
    backend="eager",
    recompute="auto",
) -> dict:
    """Train 3 steps on one device and on the mesh; return the largest differences, whether
    each buffer (batch norm's running statistics) matches, the plan and the collectives the
    per-rank graph ran."""
    model, batches = make_model(model_name)
    reference = copy.deepcopy(model)
    ref_losses, ref_grads = _train(reference, batches, optimizer_name)

    mesh = autopar.Mesh(tuple(mesh_shape), tuple(axis_names))
    pmodel = autopar.compile(
        model, mesh, batches[0], hardware=hardware, pins=pins, backend=backend, recompute=recompute
    )
    opt = make_optimizer(optimizer_name, pmodel.parameters())
    losses, first_grads = [], None
    for step, batch in enumerate(batches):
        torch.manual_seed(STEP_SEED + step)
        opt.zero_grad()
        loss = pmodel(*_rank_inputs(pmodel, batch))
        loss.backward()
        if first_grads is None:
            first_grads = _gather_grads(pmodel)
        opt.step()
        losses.append(loss.detach().clone())
    params = pmodel.full_state_dict()
    ref_params = reference.state_dict()
    buffers = dict(reference.named_buffers())
    return {
        "loss_rel": max(float((a - b).abs() / b.abs().clamp_min(1e-12)) for a, b in zip(losses, ref_losses)),
        "grad_ok": all(torch.allclose(first_grads[k], ref_grads[k], rtol=1e-4, atol=1e-5) for k in ref_grads),
        "grad_max": max(float((first_grads[k] - ref_grads[k]).abs().max()) for k in ref_grads),
        "param_ok": all(torch.allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-5) for k in ref_params),
        "param_max": max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params),
        "buffers_ok": {
            k: torch.allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-5) for k in ref_params if k in buffers
        },
        "plan": pmodel.plan.to_json(),
        "ran": list(pmodel.collectives),
        "rank": dist.get_rank(),
    }


def _rank_inputs(pmodel, batch):
    """Each rank's own part of inputs whose placement is pinned to a split, as a per-rank data
    loader would give it; the whole batch otherwise."""
    return [
        pmodel.rank_part(name, x) if pmodel.passes_own_part(name) else x for name, x in zip(pmodel.plan.inputs, batch)
    ]


def _gather_grads(pmodel) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() for name, p in pmodel.module.named_parameters()}


def decorated_and_lazy() -> dict:
    """The decorator on a class and on a factory; inputs taken from the first call."""
    mesh = autopar.Mesh((2,), ("dp",))
    torch.manual_seed(0)
    reference = MLP(16, 32)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    ref_loss = reference(x, y)

    @autopar.compile(mesh=mesh, hardware=SYNTHETIC)
    class Net(MLP):
        pass

    @autopar.compile(mesh=mesh, hardware=SYNTHETIC)
    def build():
        torch.manual_seed(0)
        return MLP(16, 32)

    torch.manual_seed(0)
    from_class = Net(16, 32)
    from_factory = build()
    before_call = isinstance(from_class, autopar.runtime.module.ParallelModule)
    losses = [float(m(x, y)) for m in (from_class, from_factory)]
    return {
        "is_parallel": before_call,
        "losses": losses,
        "ref": float(ref_loss),
        "planned": from_factory.plan.mesh == mesh,
    }


def saved_plan_and_inductor() -> dict:
    """Plan once, save it as JSON, compile from the saved plan with Inductor, train."""
    result = compare_with_one_device("mlp", (2,), ("tp",), "adamw", backend="inductor")
    model, batches = make_model("mlp")
    plan = autopar.ShardingPlan.from_json(result["plan"])
    again = autopar.compile(model, plan.mesh, batches[0], plan=plan)
    result["same_plan"] = again.plan == plan
    return result


def planning_error_on_every_rank() -> str:
    """Rank 0 plans; an error there must reach every rank, not leave them waiting."""
    model = MLP(16, 32)
    try:
        autopar.compile(
            model, autopar.Mesh((2,), ("dp",)), (torch.randn(5, 16), torch.randn(5, 16)), pins={"x": "S(0)"}
        )
    except autopar.InfeasiblePlanError as exc:
        return str(exc)
    return "no error"


class _TwoOutputs(MLP):
    def forward(self, x, target):
        hidden = x
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden)
            if i < len(self.layers) - 1:
                hidden = torch.relu(hidden)
        return {"loss": torch.nn.functional.mse_loss(hidden, target), "out": hidden}


def dict_outputs() -> dict:
    """A model returning a dict of the loss and its activations; backward through the loss."""
    torch.manual_seed(0)
    model = _TwoOutputs(16, 32)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    ref = reference(x, y)
    ref["loss"].backward()
    pmodel = autopar.compile(model, autopar.Mesh((2,), ("tp",)), (x, y), hardware=SYNTHETIC)
    got = pmodel(x, y)
    got["loss"].backward()
    grads = _gather_grads(pmodel)
    return {
        "keys": sorted(got),
        "out_ok": torch.allclose(got["out"], ref["out"], rtol=1e-4, atol=1e-5),
        "grad_ok": all(torch.allclose(grads[k], p.grad, rtol=1e-4, atol=1e-5) for k, p in reference.named_parameters()),
    }
