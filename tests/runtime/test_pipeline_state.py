"""A pipelined module under a plain training loop's tools, against one device: checkpoints
through ``torch.distributed.checkpoint`` between plans with and without stages, whole state
dicts, a smaller last batch, eval mode, and a model built on the meta device.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import autopar
from autopar.core.pipeline import Pipeline
from tests.cases import NEEDS_TRANSFORMERS, SYNTHETIC, _rank_inputs
from tests.harness import run_ranks

MEGATRON = {"attn.qkv.weight": "S(0)", "attn.proj.weight": "S(1)", "fc1.weight": "S(0)", "fc2.weight": "S(1)"}

LAYOUTS = {  # mesh shape, axis names, pipeline, pins
    "pp2xdp2": ((2, 2), ("pp", "dp"), Pipeline(axis="pp", microbatches=2), {"idx": "S(0)", "targets": "S(0)"}),
    "pp4": ((4,), ("pp",), Pipeline(axis="pp", microbatches=2), None),
    "pp2xdp2-one-micro-batch": (
        (2, 2),
        ("pp", "dp"),
        Pipeline(axis="pp", microbatches=1),
        {"idx": "S(0)", "targets": "S(0)"},
    ),
    "dp2xtp2": (
        (2, 2),
        ("dp", "tp"),
        "off",
        {
            "idx": ("S(0)", "R"),
            "targets": ("S(0)", "R"),
            **{f"blocks.{i}.{k}": ("R", p) for i in range(4) for k, p in MEGATRON.items()},
        },
    ),
}


def _gpt(tie: bool):
    from autopar.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, dim=16, num_heads=4, num_layers=4, tie_embeddings=tie))
    return model, [(torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))) for _ in range(3)]


def _compile(layout: str, tie: bool = False):
    model, batches = _gpt(tie)
    reference = copy.deepcopy(model)
    shape, names, pipeline, pins = LAYOUTS[layout]
    pmodel = autopar.compile(
        model, autopar.Mesh(shape, names), batches[0], hardware=SYNTHETIC, pins=pins, pipeline=pipeline
    )
    return pmodel, reference, batches


def _train(model, batches, optimizer, rank_inputs=False) -> list[float]:
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(*(_rank_inputs(model, batch) if rank_inputs else batch))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _max_difference(pmodel, reference) -> float:
    whole = pmodel.full_state_dict()
    assert set(whole) == set(reference.state_dict()), "the whole state dict has every stage's keys"
    return max(float((whole[k] - v).abs().max()) for k, v in reference.state_dict().items())


# checkpoints --------------------------------------------------------------------------------

SAVED_AFTER = 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""Each parameter's optimizer hyperparameters under its own key: stages hold different groups."""


def save_checkpoint(path: str, layout: str) -> dict:
    """Train the first steps of the tied GPT and save model and optimizer with DCP."""
    pmodel, _, batches = _compile(layout, tie=True)
    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=1e-2)
    _train(pmodel, batches[:SAVED_AFTER], optimizer, rank_inputs=True)
    model_state, optimizer_state = get_state_dict(pmodel, optimizer, options=FLAT)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    nested = get_state_dict(pmodel, optimizer)[1]  # each stage's parameter groups under one key
    dcp.save({"optimizer": nested}, checkpoint_id=f"{path}-nested")
    return {"keys": sorted(model_state)}


def resume_checkpoint(path: str, layout: str) -> dict:
    """Compile the model, moved away from its initial values, under another layout; load the
    checkpoint, train the last step; compare with the whole run on one device."""
    pmodel, reference, batches = _compile(layout, tie=True)
    with torch.no_grad():
        for _, p in pmodel.named_parameters():
            p.add_(1.0)
    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=1e-2)
    nested = get_state_dict(pmodel, optimizer)[1]
    dcp.load({"optimizer": nested}, checkpoint_id=f"{path}-nested")
    try:
        set_state_dict(pmodel, optimizer, model_state_dict={}, optim_state_dict=nested)
        refused = "no error"
    except autopar.AutoparError as exc:
        refused = str(exc)
    model_state, optimizer_state = get_state_dict(pmodel, optimizer, options=FLAT)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(pmodel, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=FLAT)
    losses = _train(pmodel, batches[SAVED_AFTER:], optimizer, rank_inputs=True)
    ref_losses = _train(reference, batches, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    return {
        "losses": losses,
        "ref_losses": ref_losses[SAVED_AFTER:],
        "param_max": _max_difference(pmodel, reference),
        "refused": refused,
        "staged": pmodel.plan.stages is not None,
    }


@pytest.mark.slow
def test_a_pipelined_checkpoint_resumes_under_other_stages_and_without_them(tmp_path):
    """Saved in two stages (a weight tied across them), resumed in four and on a 2-D mesh
    without stages; and the 2-D mesh's checkpoint resumed in two stages."""
    saved = run_ranks(4, save_checkpoint, str(tmp_path / "staged"), "pp2xdp2")
    assert {k for r in saved for k in r["keys"]} > set(saved[0]["keys"]), "each stage saves its own entries"
    for layout in ("pp4", "dp2xtp2"):
        runs = run_ranks(4, resume_checkpoint, str(tmp_path / "staged"), layout)
        for r in runs:
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), layout
            assert r["param_max"] < 1e-5, layout
        if layout == "pp4":  # its stages 2 and 3 hold parameters the nested groups kept do not name
            assert any("flatten_optimizer_state_dict=True" in r["refused"] for r in runs), runs[0]["refused"]
    run_ranks(4, save_checkpoint, str(tmp_path / "flat"), "dp2xtp2")
    for r in run_ranks(4, resume_checkpoint, str(tmp_path / "flat"), "pp2xdp2"):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5


# state dicts, batch sizes, modes ------------------------------------------------------------


def sizes_modes_and_whole_state() -> dict:
    """Batches of 8, 4 (a smaller last batch) and 8 in two stages; eval mode; sizes the plan
    cannot cut refused; the whole state dict gathered and loaded."""
    pmodel, reference, batches = _compile("pp2xdp2")
    cut = [tuple(x[:n] for x in b) for n, b in zip([8, 4, 8], batches)]
    losses = _train(pmodel, cut, pmodel.optimizer(torch.optim.AdamW, lr=1e-2))
    ref_losses = _train(reference, cut, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    out = {"losses": losses, "ref_losses": ref_losses}
    pmodel.eval(), reference.eval()
    with torch.no_grad():
        out["eval"], out["ref_eval"] = float(pmodel(*cut[1])), float(reference(*cut[1]))
    out["lowered"] = len(pmodel._runners)
    pmodel.train(), reference.train()
    for name, size in {"six": 6, "five": 5}.items():
        try:
            pmodel(*(x[:size] for x in batches[0]))
            out[name] = "no error"
        except autopar.AutoparError as exc:
            out[name] = str(exc)
    out["param_max"] = _max_difference(pmodel, reference)
    out["rank0_only"] = sorted(pmodel.full_state_dict(rank0_only=True))
    out["named"] = sorted(name.removeprefix("module.") for name, _ in pmodel.named_parameters())
    out["state_keys"] = sorted(pmodel.state_dict())
    out["all"] = sorted(name for name, _ in reference.named_parameters())
    out["ref_keys"] = sorted(reference.state_dict())
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5)
    loaded = pmodel.load_state_dict(reference.state_dict())  # every stage's entries, whole
    out["loaded_max"] = _max_difference(pmodel, reference)
    out["missing"], out["unexpected"] = list(loaded.missing_keys), list(loaded.unexpected_keys)
    out["count"] = pmodel.parameter_counts().whole
    out["ref_count"] = sum(p.numel() for p in reference.parameters())
    out["rank"] = dist.get_rank()
    return out


@pytest.mark.slow
def test_pipelined_state_dicts_other_batch_sizes_and_eval_match_one_device():
    runs = run_ranks(4, sizes_modes_and_whole_state)
    for r in runs:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5
        assert r["lowered"] == 3, "the stages lowered for 8, for 4 and for eval mode"
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5)
        assert "by mesh axis 'dp'" in r["six"] and "drop_last=True" in r["six"], r["six"]
        assert "cannot be cut into 2 micro-batches" in r["five"], r["five"]
        assert r["loaded_max"] == 0.0 and not r["missing"] and not r["unexpected"]
        assert r["count"] == r["ref_count"]
        assert r["state_keys"] == sorted(f"module.{name}" for name in r["named"]), "the state dict is the stage's"
        assert set(r["named"]) < set(r["all"])
    assert set().union(*(r["named"] for r in runs)) == set(runs[0]["all"]), "every parameter is on some stage"
    assert runs[0]["rank0_only"] == runs[0]["ref_keys"] and not any(r["rank0_only"] for r in runs[1:])


def dropout_in_eval_mode() -> dict:
    """Hugging Face's GPT-2 with dropout (its embedding tied to its output head across the
    stages) evaluates in eval mode, whose ops the stages plan again, as on one device; train
    mode then runs its own stages again."""
    from autopar.examples import hf

    torch.manual_seed(0)
    model = hf.gpt2(vocab_size=64, seq=8, dim=16, num_heads=4, num_layers=2, dropout=0.1)
    reference = copy.deepcopy(model)
    batch = (torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8)))
    mesh = autopar.Mesh((2, 2), ("pp", "dp"))
    pmodel = autopar.compile(model, mesh, batch, hardware=SYNTHETIC, pipeline=Pipeline(axis="pp", microbatches=2))
    planned = len(pmodel.plan.nodes)
    pmodel.eval(), reference.eval()
    with torch.no_grad():
        out = {"eval": float(pmodel(*batch)), "ref_eval": float(reference(*batch))}
    out["eval nodes"], out["planned nodes"] = len(pmodel._runner.plan.nodes), planned
    pmodel.train()
    out["train"] = float(pmodel(*batch).detach())
    out["lowered"] = len(pmodel._runners)
    return out


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_a_pipelined_model_with_dropout_evaluates_as_on_one_device():
    for r in run_ranks(4, dropout_in_eval_mode):
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5)
        assert r["eval nodes"] < r["planned nodes"], "eval mode's plan has no dropout"
        assert r["lowered"] == 2 and r["train"] != pytest.approx(r["eval"])


# accumulation -------------------------------------------------------------------------------


def accumulated(layout: str) -> dict:
    """Each step sums the gradients of a batch's halves, the first under ``no_sync()``, each
    loss halved, in two stages (an embedding tied across them) and on one device. Refused: a
    step with only calls under it, losses scaled otherwise, a call under it without backward,
    and a call after the round whose loss got no backward."""
    pmodel, reference, batches = _compile(layout, tie=True)

    written = []

    def train(m, opt):
        losses = []
        for batch in batches:
            opt.zero_grad()
            with m.no_sync() if m is pmodel else contextlib.nullcontext():
                loss = m(*(x[:4] for x in batch)) / 2
                loss.backward()
                losses.append(float(loss.detach()))
            if m is pmodel:  # the sums are held apart, before any collective
                written.append(any(p.grad is not None for p in pmodel.stage_parameters()))
            loss = m(*(x[4:] for x in batch)) / 2
            loss.backward()
            losses.append(float(loss.detach()))
            opt.step()
        return losses

    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=1e-2)
    out = {
        "losses": train(pmodel, optimizer),
        "ref_losses": train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2)),
    }
    out["param_max"] = _max_difference(pmodel, reference)
    out["written under no_sync"] = written
    half = tuple(x[:4] for x in batches[0])
    misuse = {
        "unsynced step": lambda: (_under_no_sync(pmodel, half, 2), optimizer.step()),
        "scaled otherwise": lambda: (_under_no_sync(pmodel, half, 2), (pmodel(*half) / 4).backward()),
        "no backward": lambda: (_under_no_sync(pmodel, half, None), (pmodel(*half) / 2).backward()),
        "last without backward": lambda: (_under_no_sync(pmodel, half, 2), pmodel(*half), pmodel(*half)),
    }
    for name, call in misuse.items():
        pmodel.zero_grad()
        try:
            call()
            out[name] = "no error"
        except (RuntimeError, autopar.AutoparError) as exc:
            out[name] = str(exc)
    return out


def _under_no_sync(pmodel, batch, divisor):
    with pmodel.no_sync():
        loss = pmodel(*batch)
        if divisor is not None:
            (loss / divisor).backward()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2xdp2", "pp2xdp2-one-micro-batch"])
def test_pipelined_gradients_accumulated_under_no_sync_match_one_device(layout):
    for r in run_ranks(4, accumulated, layout):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5
        assert r["written under no_sync"] == [False] * 3
        assert "never synchronised" in r["unsynced step"], r["unsynced step"]
        assert "scale every call's loss by the same factor" in r["scaled otherwise"], r["scaled otherwise"]
        assert "ran 0 backwards" in r["no backward"], r["no backward"]
        assert "never reached .grad" in r["last without backward"], r["last without backward"]


# the meta device ------------------------------------------------------------------------------


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def meta_model() -> dict:
    """A stack built on the meta device, in two stages: each rank materialises its stage's
    pieces, with the values one device draws from the same seed, and trains as one device."""
    torch.manual_seed(0)
    reference = _Stack()
    with torch.device("meta"):
        model = _Stack()
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(3)]
    torch.manual_seed(0)
    mesh = autopar.Mesh((2, 2), ("pp", "dp"))
    pmodel = autopar.compile(model, mesh, batches[0], hardware=SYNTHETIC, pipeline=Pipeline(axis="pp", microbatches=2))
    initial = _max_difference(pmodel, reference)
    losses = _train(pmodel, batches, pmodel.optimizer(torch.optim.AdamW, lr=1e-2))
    ref_losses = _train(reference, batches, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    return {
        "initial": initial,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_max": _max_difference(pmodel, reference),
        "real": all(not p.to_local().is_meta for _, p in pmodel.named_parameters()),
    }


@pytest.mark.slow
def test_a_meta_device_model_materialises_its_stage_and_trains():
    for r in run_ranks(4, meta_model):
        assert r["real"] and r["initial"] == 0.0
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5
