"""Torch's own training tools on a compiled module whose plan splits parameters: global-norm
clipping, ``torch.distributed.checkpoint`` across meshes, whole state dicts, parameter counts.

Each run is compared with the same loop on one device.
"""

import contextlib
import copy
import math
import pickle
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

import autopar
from tests.cases import NEEDS_TRANSFORMERS, STEP_SEED, SYNTHETIC, _rank_inputs, make_model, make_optimizer, pins_for
from tests.harness import run_ranks

NORM_TYPES = (2.0, math.inf, 1.0)
"""The norm each step clips by, one step each."""
MAX_NORM = 0.05
"""Below every model's gradient norm here, so that every step clips."""


def _value(norm: torch.Tensor) -> float:
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _clipped_steps(model, batches, optimizer, inputs=lambda b: b) -> tuple[list[float], list[float]]:
    """Losses and returned norms of steps that clip gradients, by each of :data:`NORM_TYPES`."""
    losses, norms = [], []
    for step, (batch, norm_type) in enumerate(zip(batches, NORM_TYPES)):
        torch.manual_seed(STEP_SEED + step)
        optimizer.zero_grad()
        loss = model(*inputs(batch))
        loss.backward()
        norms.append(_value(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)))
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, norms


def _compile(model_name: str, mesh_shape, axis_names, preset: str):
    model, batches = make_model(model_name)
    reference = copy.deepcopy(model)
    mesh = autopar.Mesh(tuple(mesh_shape), tuple(axis_names))
    pmodel = autopar.compile(model, mesh, batches[0], hardware=SYNTHETIC, pins=pins_for(preset, model_name, axis_names))
    return pmodel, reference, batches


def _params_max_difference(pmodel, reference) -> float:
    whole = pmodel.full_state_dict()
    return max(float((whole[k] - v).abs().max()) for k, v in reference.state_dict().items())


def clipped_training(model_name: str, mesh_shape, axis_names, preset: str) -> dict:
    pmodel, reference, batches = _compile(model_name, mesh_shape, axis_names, preset)
    ref_losses, ref_norms = _clipped_steps(reference, batches, make_optimizer("adamw", reference.parameters()))
    losses, norms = _clipped_steps(
        pmodel, batches, make_optimizer("adamw", pmodel.parameters()), lambda b: _rank_inputs(pmodel, b)
    )
    split = [n for n, p in pmodel.module.named_parameters() if any(isinstance(q, Shard) for q in p.placements)]
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "split": split,
        "param_max": _params_max_difference(pmodel, reference),
    }


CLIPPED = [
    pytest.param("gpt", (2, 2), ("dp", "tp"), "2d", id="gpt-2x2-2d"),
    pytest.param("mlp", (4,), ("tp",), "megatron", id="mlp-4-megatron"),
    pytest.param("hf-llama", (2, 2), ("dp", "tp"), "fsdp", id="hf-llama-2x2-fsdp", marks=NEEDS_TRANSFORMERS),
]


@pytest.mark.slow
@pytest.mark.parametrize("model_name, mesh_shape, axis_names, preset", CLIPPED)
def test_global_norm_clipping_matches_one_device(model_name, mesh_shape, axis_names, preset):
    for r in run_ranks(4, clipped_training, model_name, mesh_shape, axis_names, preset):
        assert r["split"], "the plan splits no parameter: the test would not test clipping of pieces"
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert min(r["ref_norms"]) > MAX_NORM  # every step clipped
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["param_max"] < 1e-5


# checkpoints --------------------------------------------------------------------------------

STEPS_BEFORE_SAVE = 2


def _train(model, batches, optimizer, inputs=lambda b: b) -> list[float]:
    losses = []
    for step, batch in batches:
        torch.manual_seed(STEP_SEED + step)
        optimizer.zero_grad()
        loss = model(*inputs(batch))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def save_checkpoint(path: str, model_name: str, mesh_shape, axis_names, preset: str) -> list[float]:
    """Train the first steps on this mesh and save the model and optimizer with DCP."""
    pmodel, _, batches = _compile(model_name, mesh_shape, axis_names, preset)
    optimizer = make_optimizer("adamw", pmodel.parameters())
    losses = _train(pmodel, list(enumerate(batches))[:STEPS_BEFORE_SAVE], optimizer, lambda b: _rank_inputs(pmodel, b))
    model_state, optimizer_state = get_state_dict(pmodel, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    return losses


def resume_checkpoint(path: str, model_name: str, mesh_shape, axis_names, preset: str) -> dict:
    """Compile a model initialised otherwise for this mesh, load the checkpoint, train the
    remaining steps; compare with the whole run on one device."""
    pmodel, reference, batches = _compile(model_name, mesh_shape, axis_names, preset)
    with torch.no_grad():
        for p in pmodel.parameters():
            p.add_(1.0)
    optimizer = make_optimizer("adamw", pmodel.parameters())
    model_state, optimizer_state = get_state_dict(pmodel, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(pmodel, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    losses = _train(pmodel, list(enumerate(batches))[STEPS_BEFORE_SAVE:], optimizer, lambda b: _rank_inputs(pmodel, b))
    ref_losses = _train(reference, list(enumerate(batches)), make_optimizer("adamw", reference.parameters()))
    return {
        "losses": losses,
        "ref_losses": ref_losses[STEPS_BEFORE_SAVE:],
        "param_max": _params_max_difference(pmodel, reference),
    }


CHECKPOINTS = [  # saved on 2x2 under one plan; resumed on 4 ranks under another, and on 2 ranks
    pytest.param(
        "gpt",
        ((2, 2), ("dp", "tp"), "2d"),
        [(4, (4,), ("dp",), "fsdp"), (2, (2,), ("tp",), "megatron")],
        id="gpt-2x2-2d",
    ),
    pytest.param(
        "hf-llama",
        ((2, 2), ("dp", "tp"), "fsdp"),
        [(4, (4,), ("dp",), "dp"), (2, (2,), ("dp",), "fsdp")],
        id="hf-llama-2x2-fsdp",
        marks=NEEDS_TRANSFORMERS,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("model_name, saved_on, resumed_on", CHECKPOINTS)
def test_a_checkpoint_resumes_on_other_meshes_as_if_uninterrupted(tmp_path, model_name, saved_on, resumed_on):
    path = str(tmp_path / "checkpoint")
    run_ranks(4, save_checkpoint, path, model_name, *saved_on)
    for world, *mesh in resumed_on:
        for r in run_ranks(world, resume_checkpoint, path, model_name, *mesh):
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), mesh
            assert r["param_max"] < 1e-5, mesh


# state dicts, counts, pickling --------------------------------------------------------------


def whole_state_and_counts() -> dict:
    pmodel, reference, batches = _compile("gpt", (2,), ("tp",), "megatron")
    counts = pmodel.parameter_counts()
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5)
    loaded = pmodel.load_state_dict(reference.state_dict())  # the model's own key names, whole tensors
    out = {
        "loaded_max": _params_max_difference(pmodel, reference),
        "missing": list(loaded.missing_keys),
        "unexpected": list(loaded.unexpected_keys),
        "numel": sum(p.numel() for p in pmodel.parameters()),
        "ref_numel": sum(p.numel() for p in reference.parameters()),
        "counts": tuple(counts),
        "all_dtensors": all(isinstance(p, DTensor) for p in pmodel.parameters()),
        "mesh_names": {p.device_mesh.mesh_dim_names for p in pmodel.parameters()},
        "plan_pickles": pickle.loads(pickle.dumps(pmodel.plan)) == pmodel.plan,
    }
    try:
        copy.deepcopy(pmodel)
        out["deepcopy"] = "no error"
    except TypeError as exc:
        out["deepcopy"] = str(exc)
    try:
        pmodel.load_state_dict({k: v[:1] for k, v in reference.state_dict().items()})
        out["wrong_shape"] = "no error"
    except ValueError as exc:
        out["wrong_shape"] = str(exc)
    return out


@pytest.mark.slow
def test_parameters_are_dtensors_that_count_and_load_whole_values():
    for r in run_ranks(2, whole_state_and_counts):
        assert r["all_dtensors"] and r["mesh_names"] == {("tp",)}
        assert r["numel"] == r["ref_numel"] == r["counts"][0] > r["counts"][1]
        assert r["loaded_max"] == 0.0 and not r["missing"] and not r["unexpected"]
        assert r["plan_pickles"]
        assert "cannot be pickled" in r["deepcopy"] and "torch.save(pmodel.plan)" in r["deepcopy"]
        assert "_foreach_lerp_(ema" in r["deepcopy"]
        assert "has shape (1," in r["wrong_shape"] and "Fix:" in r["wrong_shape"]


def conversions_in_a_step() -> dict:
    """How often a training step converts between DTensors and local tensors, and the
    gradients it leaves: the program runs on the pieces, so a step needs no conversion per
    parameter (``to_local`` and its backward cost more than a small model's step)."""
    model, batches = make_model("mlp")
    pmodel = autopar.compile(
        model, autopar.Mesh((2,), ("tp",)), batches[0], hardware=SYNTHETIC, pins=pins_for("megatron", "mlp", ("tp",))
    )
    pmodel(*batches[0]).backward()
    pmodel.zero_grad()
    calls = {"to_local": 0, "from_local": 0}

    def counted(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return call

    with (
        mock.patch.object(DTensor, "to_local", counted("to_local", DTensor.to_local)),
        mock.patch.object(DTensor, "from_local", counted("from_local", DTensor.from_local)),
    ):
        pmodel(*batches[1]).backward()
    return {
        "calls": calls,
        "grads_laid_out": all(
            isinstance(p.grad, DTensor) and p.grad.placements == p.placements and p.grad.shape == p.shape
            for p in pmodel.parameters()
        ),
    }


def test_a_step_runs_on_the_pieces_without_converting_each_parameter():
    for r in run_ranks(2, conversions_in_a_step):
        assert r["calls"] == {"to_local": 0, "from_local": 0}
        assert r["grads_laid_out"]


def optimizer_before_the_plan() -> dict:
    """An optimizer built before the first call, which makes the plan and splits the
    parameters, steps the split parameters."""
    model, batches = make_model("mlp")
    reference = copy.deepcopy(model)
    pmodel = autopar.compile(
        model, autopar.Mesh((2,), ("tp",)), hardware=SYNTHETIC, pins=pins_for("megatron", "mlp", ("tp",))
    )
    try:
        pmodel.optimizer(torch.optim.SGD, lr=0.1)
        early = "no error"
    except RuntimeError as exc:
        early = str(exc)
    optimizer = make_optimizer("sgd", pmodel.parameters())
    pmodel(*batches[0])  # plans: the optimizer holds the split parameters from here, before it steps
    repointed = all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
    losses = _train(pmodel, list(enumerate(batches)), optimizer)
    ref_losses = _train(reference, list(enumerate(batches)), make_optimizer("sgd", reference.parameters()))
    return {
        "early": early,
        "repointed": repointed,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_max": _params_max_difference(pmodel, reference),
    }


@pytest.mark.slow
def test_an_optimizer_built_before_the_plan_steps_the_split_parameters():
    for r in run_ranks(2, optimizer_before_the_plan):
        assert "example_inputs" in r["early"] and "after the first call" in r["early"]
        assert r["repointed"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5


# batch sizes and inputs ---------------------------------------------------------------------


def _gpt_on_batches_of_eight(count: int, preset: str = "2d"):
    """The GPT example compiled for 2x2 (by default data parallel on dp, Megatron on tp) with
    batches of 8, ``count`` batches, and a copy of the model for one device."""
    model, _ = make_model("gpt")
    reference = copy.deepcopy(model)
    batches = [(torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))) for _ in range(count)]
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    pins = pins_for(preset, "gpt", ("dp", "tp"))
    return autopar.compile(model, mesh, batches[0], hardware=SYNTHETIC, pins=pins), reference, batches


def other_batch_sizes() -> dict:
    """A plan made for batches of 8 trains on 8, 4 (a smaller last batch) and 8 again; batches
    of 6 do not divide the split and are refused, as are inputs of the wrong kind."""
    pmodel, reference, batches = _gpt_on_batches_of_eight(3)
    cut = [tuple(x[:n] for x in b) for n, b in zip([8, 4, 8], batches)]
    optimizer = make_optimizer("adamw", pmodel.parameters())
    losses = _train(pmodel, list(enumerate(cut)), optimizer, lambda b: _rank_inputs(pmodel, b))
    ref_losses = _train(reference, list(enumerate(cut)), make_optimizer("adamw", reference.parameters()))
    out = {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_max": _params_max_difference(pmodel, reference),
        "programs": len(pmodel._lowered),
    }
    idx, targets = batches[0]
    wrong = {
        "six": lambda: pmodel(idx[:3], targets[:3]),  # pinned S(0) on dp: each rank passes its part
        "dtype": lambda: pmodel(*_rank_inputs(pmodel, (idx.int(), targets))),
        "list": lambda: pmodel(idx[:2].tolist(), targets[:2]),
        # rank 0 passes a smaller part than the others: its whole would differ from theirs
        "unequal": lambda: pmodel(*(x[: 1 if dist.get_rank() == 0 else 2] for x in (idx, targets))),
    }
    for name, call in wrong.items():
        try:
            call()
            out[name] = "no error"
        except autopar.AutoparError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.slow
def test_a_smaller_last_batch_runs_the_same_plan_and_sizes_it_cannot_split_are_refused():
    for r in run_ranks(4, other_batch_sizes):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5
        assert r["programs"] == 2  # one per size, the first size's reused
        assert "dim 0 (size 6) is not divisible by mesh axis 'dp' (size 2)" in r["six"], r["six"]
        assert "drop_last=True" in r["six"]
        assert "input 'idx' is a 2-d torch.int32 tensor" in r["dtype"] and "torch.int64" in r["dtype"]
        assert "argument 0 is a list" in r["list"]
        assert "parts of per-rank inputs of different sizes" in r["unequal"] and "drop_last=True" in r["unequal"]


# accumulation and loss scaling --------------------------------------------------------------


def accumulated_steps(preset: str) -> dict:
    """Each step sums the gradients of three micro-batches (the halves of a batch and its first
    half again, a loss divided by 3 each), on one device and on the mesh: the first step reduces
    each micro-batch's gradients, the others run the first two under ``no_sync()``. An optimizer
    step with only micro-batches under it run is refused, and runs once ``pmodel.zero_grad()``
    has dropped them."""
    pmodel, reference, batches = _gpt_on_batches_of_eight(3, preset)

    def train(m, opt, inputs):
        losses = []
        for step, batch in enumerate(batches):
            opt.zero_grad()
            with m.no_sync() if step > 0 and m is pmodel else contextlib.nullcontext():
                for part in (slice(0, 4), slice(4, 8)):
                    loss = m(*inputs(tuple(x[part] for x in batch))) / 3
                    loss.backward()
                    losses.append(float(loss.detach()))
            loss = m(*inputs(tuple(x[:4] for x in batch))) / 3
            loss.backward()
            losses.append(float(loss.detach()))
            opt.step()
        return losses

    optimizer = make_optimizer("adamw", pmodel.parameters())
    losses = train(pmodel, optimizer, lambda b: _rank_inputs(pmodel, b))
    ref_losses = train(reference, make_optimizer("adamw", reference.parameters()), lambda b: b)
    out = {"losses": losses, "ref_losses": ref_losses, "param_max": _params_max_difference(pmodel, reference)}
    out["collectives"] = {
        gradients: len(pmodel._variants[pmodel._key, gradients].collectives)
        for gradients in ("unreduced", "accumulated")
    }
    out["collectives"]["reduced"] = len(pmodel.collectives)
    out["gradient collectives"] = sum(c.gradient for c in pmodel.plan.collectives)
    with pmodel.no_sync():
        pmodel(*_rank_inputs(pmodel, tuple(x[:4] for x in batches[0]))).backward()
    out["held bytes"] = sum(g.numel() * g.element_size() for g in pmodel._unsynced.grads)
    out["accumulated bytes"] = pmodel.plan.accumulated_bytes
    try:
        optimizer.step()
        out["unsynced step"] = "no error"
    except RuntimeError as exc:
        out["unsynced step"] = str(exc)
    pmodel.zero_grad()
    optimizer.step()  # the round dropped: nothing left unsynchronised
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["2d", "fsdp"])
def test_gradients_accumulated_over_micro_batches_match_one_device(preset):
    """With and without ``no_sync()``; under it the backward runs no gradient collectives (those
    the plan marks ``gradient``), and the micro-batch after runs as many as a step without
    accumulation. The sums held between them are the bytes the plan gives."""
    for r in run_ranks(4, accumulated_steps, preset):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5
        counts = r["collectives"]
        assert counts["unreduced"] < counts["reduced"] == counts["accumulated"], counts
        assert counts["reduced"] - counts["unreduced"] == r["gradient collectives"]  # priced once per step
        assert r["held bytes"] == r["accumulated bytes"]  # the sums the plan says the device holds
        assert "never synchronised" in r["unsynced step"]


def accumulated_on_cuda() -> dict:
    """On one CUDA rank, programs compiled by Inductor: two micro-batches a step, the first under
    ``no_sync()``, against one device."""
    device = torch.device("cuda", torch.cuda.current_device())
    model, batches = make_model("gpt")
    model = model.to(device)
    batches = [tuple(x.to(device) for x in b) for b in batches]
    reference = copy.deepcopy(model)
    pmodel = autopar.compile(model, autopar.Mesh((1,), ("dp",)), batches[0], hardware=SYNTHETIC, backend="inductor")
    runs = []
    for m in (pmodel, reference):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for batch, other in zip(batches, batches[1:] + batches[:1]):
            opt.zero_grad()
            with m.no_sync() if m is pmodel else contextlib.nullcontext():
                (m(*batch) / 2).backward()
            loss = m(*other) / 2
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        runs.append(losses)
    return {"losses": runs[0], "ref_losses": runs[1], "param_max": _params_max_difference(pmodel, reference)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Inductor programs of accumulation on CUDA")
def test_micro_batches_under_no_sync_compiled_by_inductor_on_cuda_match_one_device():
    (r,) = run_ranks(1, accumulated_on_cuda, backend="nccl")
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4) and r["param_max"] < 1e-4, r


def overflow_on_one_rank() -> dict:
    """``torch.amp.GradScaler`` over split parameters: an infinite gradient in one rank's piece
    skips the step on every rank and lowers the scale everywhere."""
    pmodel, _, batches = _compile("gpt", (2, 2), ("dp", "tp"), "2d")
    optimizer = make_optimizer("sgd", pmodel.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = pmodel.full_state_dict()
    scaler.scale(pmodel(*_rank_inputs(pmodel, batches[0]))).backward()
    if dist.get_rank() == 1:
        grad = next(p.grad for p in pmodel.parameters() if any(isinstance(q, Shard) for q in p.placements))
        grad.to_local().view(-1)[0] = math.inf
    scaler.step(optimizer)
    scaler.update()
    after = pmodel.full_state_dict()
    return {"moved": max(float((after[k] - v).abs().max()) for k, v in before.items()), "scale": scaler.get_scale()}


@pytest.mark.slow
def test_an_overflow_in_one_ranks_piece_skips_the_step_on_every_rank():
    for r in run_ranks(4, overflow_on_one_rank):
        assert r["moved"] == 0.0 and r["scale"] == 512.0


def modes_and_misuse() -> dict:
    """Eval mode of a model without dropout runs the plan lowered for eval; torch.autocast
    around the call and dtype changes after compiling are refused."""
    pmodel, reference, batches = _compile("mlp", (2,), ("tp",), "megatron")
    pmodel.eval()
    reference.eval()
    with torch.no_grad():
        out = {"eval": float(pmodel(*batches[1])), "ref_eval": float(reference(*batches[1]))}
    pmodel.train()
    for name, call in {
        "autocast": lambda: _under_autocast(pmodel, batches[0]),
        "to": lambda: pmodel.to(torch.bfloat16),
    }.items():
        try:
            call()
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def _under_autocast(pmodel, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return pmodel(*batch)


@pytest.mark.slow
def test_eval_mode_runs_and_autocast_around_the_call_or_dtype_changes_are_refused():
    for r in run_ranks(2, modes_and_misuse):
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5)
        assert "under torch.autocast" in r["autocast"] and "inside the model's forward" in r["autocast"]
        assert "cannot change" in r["to"] and "before autopar.compile" in r["to"]


def dropout_model_in_eval_mode() -> dict:
    """A model with dropout runs other ops in eval mode: those are planned around the
    parameters where they are, and train mode then runs its own program again."""
    pmodel, reference, batches = _compile("hf-gpt2-dropout", (2, 2), ("dp", "tp"), None)
    pmodel.eval()
    reference.eval()
    with torch.no_grad():
        out = {"eval": float(pmodel(*batches[1])), "ref_eval": float(reference(*batches[1]))}
    pmodel.train()
    reference.train()
    torch.manual_seed(STEP_SEED)
    out["train"] = float(pmodel(*batches[0]).detach())
    torch.manual_seed(STEP_SEED)
    out["ref_train"] = float(reference(*batches[0]).detach())
    return out


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_a_model_with_dropout_evaluates_as_on_one_device():
    for r in run_ranks(4, dropout_model_in_eval_mode):
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5)
        assert r["train"] == pytest.approx(r["ref_train"], rel=1e-5) and r["train"] != pytest.approx(r["eval"])


# models built on the meta device ------------------------------------------------------------


def meta_model() -> dict:
    """An MLP built under ``torch.device("meta")`` compiles on 4 ranks, each materialising only
    its pieces, with the values one device draws from the same seed, and trains as one device."""
    from autopar.examples.mlp import MLP

    torch.manual_seed(0)
    reference = MLP(16, 64, num_layers=3)
    with torch.device("meta"):
        model = MLP(16, 64, num_layers=3)
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(3)]
    torch.manual_seed(0)
    pmodel = autopar.compile(
        model,
        autopar.Mesh((2, 2), ("dp", "tp")),
        batches[0],
        hardware=SYNTHETIC,
        pins={"layers.0.weight": ("S(0)", "S(0)"), "layers.1.weight": ("R", "S(1)")},
    )
    initial = _params_max_difference(pmodel, reference)
    local = {n: tuple(p.to_local().shape) for n, p in pmodel.module.named_parameters()}
    losses = _train(pmodel, list(enumerate(batches)), make_optimizer("adamw", pmodel.parameters()))
    ref_losses = _train(reference, list(enumerate(batches)), make_optimizer("adamw", reference.parameters()))
    return {
        "initial": initial,
        "local": local,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_max": _params_max_difference(pmodel, reference),
        "real": all(not p.to_local().is_meta for p in pmodel.parameters()),
    }


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_materialises_its_pieces_and_trains():
    for r in run_ranks(4, meta_model):
        assert r["real"] and r["initial"] == 0.0
        assert r["local"]["layers.0.weight"] == (16, 16) and r["local"]["layers.1.weight"] == (64, 32)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5) and r["param_max"] < 1e-5


def meta_hugging_face_model() -> dict:
    """A Hugging Face LLaMA built on the meta device: initialised by its own ``_init_weights``,
    module by module (rotary frequencies included); refused without it, naming the fix."""
    from autopar.examples import hf

    sizes = {"vocab_size": 64, "seq": 8, "dim": 16, "num_heads": 4, "num_layers": 1, "hidden": 32}
    torch.manual_seed(0)
    reference = hf.llama(**sizes)
    batch = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        bare = hf.llama(**sizes)
    try:
        autopar.compile(bare, mesh, batch, hardware=SYNTHETIC)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    with torch.device("meta"):
        model = hf.llama(**sizes)
    pmodel = autopar.compile(model, mesh, batch, hardware=SYNTHETIC, init_weights=model.model._init_weights)
    buffers = {n: b.full_tensor() for n, b in pmodel.module.named_buffers()}
    pmodel.load_state_dict(reference.state_dict())
    return {
        "refused": refused,
        "buffers_max": max(float((buffers[n] - b).abs().max()) for n, b in reference.named_buffers()),
        "loss": float(pmodel(*batch).detach()),
        "ref_loss": float(reference(*batch).detach()),
    }


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_a_hugging_face_model_built_on_the_meta_device_initialises_by_its_own_init():
    for r in run_ranks(4, meta_hugging_face_model):
        assert "on the meta device" in r["refused"] and "init_weights=" in r["refused"]
        assert r["buffers_max"] == 0.0
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)


# a rank that hangs --------------------------------------------------------------------------

TIMEOUT_S = 5.0


def one_rank_hangs() -> str:
    """Rank 1 sleeps past the timeout at the third step; every rank must fail with the timeout's
    error instead of waiting for it."""
    import time

    model, batches = make_model("mlp")
    pmodel = autopar.compile(
        model, autopar.Mesh((2, 2), ("dp", "tp")), batches[0], hardware=SYNTHETIC, timeout=TIMEOUT_S
    )
    try:
        for step in range(5):
            if step == 2 and dist.get_rank() == 1:
                time.sleep(3 * TIMEOUT_S)
            pmodel(*batches[0]).backward()
    except autopar.CollectiveError as exc:
        return str(exc)
    return "no error"


def rank0_plans_long() -> tuple[str, str]:
    """Rank 0 plans for ``3 * TIMEOUT_S``, first showing progress (a long planning, which every
    rank must wait for), then without showing it, as if its process were frozen (the other ranks
    must fail with the timeout's error instead of waiting for the plan)."""
    import contextlib
    import time
    from unittest import mock

    from autopar.runtime import module

    model, batches = make_model("mlp")
    outcomes = []
    for frozen in (False, True):
        with contextlib.ExitStack() as patches:
            if frozen and dist.get_rank() == 0:
                patches.enter_context(
                    mock.patch.object(module, "planning_on_rank0", lambda *a: contextlib.nullcontext())
                )
            try:
                mesh = autopar.Mesh((2, 2), ("dp", "tp"))
                pmodel = autopar.compile(copy.deepcopy(model), mesh, hardware=SYNTHETIC, timeout=TIMEOUT_S)
                planner = pmodel._planner
                pmodel._planner = lambda *a: (time.sleep(3 * TIMEOUT_S), planner(*a))[1]
                pmodel(*batches[0])
                outcomes.append("no error")
            except autopar.CollectiveError as exc:
                outcomes.append(str(exc))
    return tuple(outcomes)


@pytest.mark.slow
def test_a_rank_0_that_stalls_while_planning_fails_every_rank_within_the_timeout():
    """A planning that shows progress may take longer than the timeout; one that stops showing
    it may not."""
    results = run_ranks(4, rank0_plans_long, timeout_s=300)
    assert all(long == "no error" for long, _ in results), results
    for _, message in results[1:]:
        assert "rank 0 stopped answering while planning" in message, message
    message = results[0][1]
    assert "did not join it within the timeout of 5 s" in message or "left the job" in message, message


@pytest.mark.slow
def test_a_rank_that_hangs_fails_every_rank_within_the_timeout():
    for rank, message in enumerate(run_ranks(4, one_rank_hangs, timeout_s=300)):
        assert "did not join it within the timeout of 5 s" in message, message
        if rank != 1:  # the ranks that waited name the one that stalled
            assert "because rank 1 of the mesh did not join it" in message, message
