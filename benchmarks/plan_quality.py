"""The solver's plan against hand-written layouts, under the same cost model.

For full-size versions of the example models (built on the meta device) and meshes of 8, 2x4, 8x8
and 16x16 H100s, plans the model with autopar (under the device's memory) and with the layouts
an expert writes by hand, expressed as pins on the parameters and the batch (autopar then
plans the activations around them):

- ``ddp``: the batch split over every mesh axis, parameters replicated.
- ``fsdp``: the batch split over every axis, every parameter split on dim 0 over every axis
  (ZeRO-3).
- ``megatron``: column/row tensor parallelism on the last axis (inside a host), the batch split
  over the others.
- ``fsdp+tp``: Megatron on the last axis, and parameters split over the other axes on their
  other dim, with the batch (2-D meshes only).
- ``experts`` (the MoE only): the experts split over the last axis (expert parallelism, tokens
  dispatched by all-to-all), the batch over every axis, the other parameters replicated.

Megatron layouts apply to the transformers and the MLP; the ConvNet gets DDP and FSDP.

``llama70b`` (the LLaMA-3-70B shape) is planned on meshes of three axes, pipeline x data x tensor
(``--meshes 8x8x8``), against torchtitan's hand-written 3-D layout: FSDP on the data axis and
Megatron on the tensor axis inside stages over the pipeline axis, interleaved 1F1B with two stages
per rank and two micro-batches per position, every block recomputed (its full activation
checkpointing). autopar plans stages over the same axis under the
device's memory, choosing the micro-batches (1, 2 or 4 per position) and the schedule (1F1B, or
interleaved over two stages per rank), and the placements, recomputation and cuts.

Prints the predicted step time and per-device peak memory of each plan, whether it fits in the
device's memory, and the ratio of the best hand-written plan that fits to autopar's; writes
``benchmarks/results/plan_quality.json``, keeping the rows of model and mesh pairs that this run did
not plan.

    python -m benchmarks.plan_quality [--models gpt,bert,llama,mlp,moe,convnet] [--meshes 8,2x4,8x8,16x16]
    python -m benchmarks.plan_quality --models llama70b --meshes 8x8x8
"""

import argparse
import inspect
import json
import math
import re
import time
from pathlib import Path

import torch

from benchmarks import float32_matmuls_as_on_gpus, write_results

RESULTS = Path(__file__).parent / "results" / "plan_quality.json"

# Megatron's split of each example's parameters: "col" splits the output features (dim 0 of a
# Linear weight, and its bias), "row" the input features (dim 1).
MEGATRON = {
    "gpt": {
        r"attn\.qkv\.(weight|bias)": "col",
        r"attn\.proj\.weight": "row",
        r"fc1\.(weight|bias)": "col",
        r"fc2\.weight": "row",
    },
    "bert": {
        r"(query|key|value)\.(weight|bias)": "col",
        r"\.out\.weight": "row",
        r"fc1\.(weight|bias)": "col",
        r"fc2\.weight": "row",
    },
    "llama": {
        r"attn\.(wq|wk|wv)\.weight": "col",
        r"attn\.wo\.weight": "row",
        r"\.(w1|w3)\.weight": "col",
        r"\.w2\.weight": "row",
    },
    "mlp": {r"layers\.[0-9]*[02468]\.(weight|bias)": "col", r"layers\.[0-9]*[13579]\.weight": "row"},
}
MEGATRON["llama70b"] = MEGATRON["llama"]
STAGED = ("llama70b",)
"""Models planned on meshes of three axes with pipeline stages."""


def full_size(name: str, devices: int):
    """A full-size example model on the meta device and a global batch of a few sequences per
    device (2 for GPT and the MoE, 4 for BERT, 1 for LLaMA; 4096 rows for the MLP, 32 images of
    128x128 per device for the ConvNet)."""
    from autopar.examples.bert import Bert, BertConfig
    from autopar.examples.convnet import ConvNet, ConvNetConfig
    from autopar.examples.gpt import GPT, GPTConfig
    from autopar.examples.llama import Llama, LlamaConfig
    from autopar.examples.mlp import MLP
    from autopar.examples.moe import MoEConfig, MoEGPT

    with torch.device("meta"):
        if name == "gpt":  # GPT-2 XL-sized, widths rounded to multiples of 256
            cfg = GPTConfig(vocab_size=50432, block_size=1024, dim=2048, num_heads=16, num_layers=24)
            model, batch, seq, vocab = GPT(cfg), 2 * devices, 1024, cfg.vocab_size
        elif name == "bert":  # BERT-large
            cfg = BertConfig(vocab_size=30720, max_seq=512, dim=1024, num_heads=16, hidden=4096, num_layers=24)
            model, batch, seq, vocab = Bert(cfg), 4 * devices, 512, cfg.vocab_size
        elif name == "llama":  # LLaMA-3-8B-shaped
            cfg = LlamaConfig(
                vocab_size=128256,
                dim=4096,
                num_heads=32,
                num_kv_heads=8,
                hidden=14336,
                num_layers=32,
                max_seq=2048,
                rope_theta=500000.0,
            )
            model, batch, seq, vocab = Llama(cfg), devices, 2048, cfg.vocab_size
        elif name == "llama70b":  # sequences of 8,192, one per 4 devices (16 per FSDP rank on 8x8x8)
            from benchmarks.planning import llama3_70b_shaped

            return llama3_70b_shaped(80, batch=devices // 4)
        elif name == "moe":  # 12 GPT blocks of width 1024 whose MLPs are 64 experts, top-2
            cfg = MoEConfig(
                vocab_size=50432,
                block_size=1024,
                dim=1024,
                num_heads=16,
                num_layers=12,
                num_experts=64,
                expert_hidden=4096,
                group_size=1024,
            )
            model, batch, seq, vocab = MoEGPT(cfg), 2 * devices, 1024, cfg.vocab_size
        elif name == "mlp":
            model = MLP(8192, 32768, num_layers=8)
            x = torch.empty(4096, 8192)
            return model, (x, x)
        elif name == "convnet":
            model = ConvNet(ConvNetConfig(channels=(128, 256, 512, 1024), num_classes=1000))
            return model, (torch.empty(32 * devices, 3, 128, 128), torch.zeros(32 * devices, dtype=torch.long))
        else:
            raise ValueError(name)
        tokens = torch.randint(0, vocab, (batch, seq))
        if name == "bert":
            return model, (tokens, torch.zeros_like(tokens), tokens)
        return model, (tokens, tokens)


def hand_written(name: str, model: torch.nn.Module, batch_names, mesh_shape: tuple[int, ...]) -> dict[str, dict]:
    """Pins of each hand-written layout that applies to ``mesh_shape``. A parameter whose dim
    the mesh axes do not divide stays replicated on those axes (FSDP would pad it)."""
    ndim = len(mesh_shape)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    every = ("S(0)",) * ndim
    batch = {k: every for k in batch_names}

    def megatron_split(k: str) -> str | None:
        return next((kind for pattern, kind in MEGATRON[name].items() if re.search(pattern, k)), None)

    layouts = {
        "ddp": {**batch, **{k: ("R",) * ndim for k in shapes}},
        "fsdp": {**batch, **{k: _fit(every, shape, mesh_shape) for k, shape in shapes.items()}},
    }
    if name == "moe":
        experts = _fit(("R",) * (ndim - 1) + ("S(0)",), shapes["blocks.0.moe.w1"], mesh_shape)
        layouts["experts"] = {**layouts["ddp"], **{k: experts for k in shapes if k.endswith((".moe.w1", ".moe.w2"))}}
    if name not in MEGATRON:
        return layouts
    tp_batch = {k: ("S(0)",) * (ndim - 1) + ("R",) for k in batch_names}
    megatron, fsdp_tp = dict(tp_batch), dict(tp_batch)
    for k, shape in shapes.items():
        split = megatron_split(k)
        tp = {"col": "S(0)", "row": "S(1)"}.get(split, "R")
        megatron[k] = _fit(("R",) * (ndim - 1) + (tp,), shape, mesh_shape)
        other = "S(1)" if split == "col" else "S(0)"
        fsdp_tp[k] = _fit((other,) * (ndim - 1) + (tp,), shape, mesh_shape)
    layouts["megatron"] = megatron
    if ndim >= 2:
        layouts["fsdp+tp"] = fsdp_tp
    return layouts


def _fit(layout: tuple[str, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[str, ...]:
    """``layout`` with replicated axes wherever a split dim does not exist or is not divided."""
    fitted, factor = [], {}
    for size, p in zip(mesh_shape, layout):
        dim = int(p[2:-1]) if p.startswith("S(") else None
        if dim is not None and dim < len(shape) and shape[dim] % (factor.get(dim, 1) * size) == 0:
            factor[dim] = factor.get(dim, 1) * size
            fitted.append(p)
        else:
            fitted.append("R")
    return tuple(fitted)


def _timed(make) -> dict:
    """The predicted step, peak and collectives of the plan ``make()`` returns (and its stages),
    with the wall time it took; its error's first line where it makes none."""
    from autopar import AutoparError

    started = time.perf_counter()
    try:
        plan = make()
    except AutoparError as exc:
        return {"status": "NO PLAN", "error": str(exc).splitlines()[0], "wall_s": time.perf_counter() - started}
    row = {
        "status": plan.solver.status,
        "step_s": plan.predicted_step_s,
        "peak_bytes": plan.peak_memory_bytes,
        "collectives": len(plan.collectives),
        "wall_s": time.perf_counter() - started,
    }
    if plan.stages is not None:
        st = plan.stages
        row["stages"] = f"{st.count} stages, {st.microbatches} micro-batches, {st.schedule}, bubble {st.bubble:.0%}"
    return row


def _plan(captured, mesh, **kwargs) -> dict:
    from autopar.planner import plan_captured

    return _timed(lambda: plan_captured(captured, mesh, hardware="h100", **kwargs))


def _plan_staged(model, inputs, mesh, pipeline, **kwargs) -> dict:
    import autopar

    return _timed(lambda: autopar.plan(model, mesh, inputs, hardware="h100", pipeline=pipeline, **kwargs))


def staged_results(name: str, shape: tuple[int, ...], device_bytes: int, limit_s: float) -> dict[str, dict]:
    """autopar's plan in stages over the first axis, and torchtitan's 3-D layout, on a mesh of
    pipeline x data x tensor axes."""
    import autopar
    from autopar.core.pipeline import Pipeline

    model, inputs = full_size(name, math.prod(shape))
    mesh = autopar.Mesh(shape, ("pp", "dp", "tp"))
    batch_names = list(inspect.signature(model.forward).parameters)
    inside = hand_written(name, model, batch_names, shape[1:])["fsdp+tp"]
    titan = Pipeline(axis="pp", microbatches=2 * shape[0], schedule="interleaved", stages_per_rank=2)
    chosen = Pipeline(axis="pp", microbatches=None, schedule=None)
    options = dict(memory_budget=device_bytes, solver_time_limit_s=limit_s)
    return {
        "autopar": _plan_staged(model, inputs, mesh, chosen, **options),
        "torchtitan": _plan_staged(
            model, inputs, mesh, titan, pins=inside, recompute="layers", solver_time_limit_s=limit_s
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,bert,llama,mlp,moe,convnet")
    parser.add_argument("--meshes", default="8,2x4,8x8,16x16")
    parser.add_argument("--limit-s", type=float, default=120.0, help="solver time limit per plan")
    args = parser.parse_args()

    from autopar.cost_model.hardware import resolve_profile
    from autopar.passes.analysis.capture import capture

    import autopar

    device_bytes = resolve_profile("h100").memory_bytes
    precision = float32_matmuls_as_on_gpus()
    rows = []
    header = f"{'model':6} {'mesh':6} {'plan':9} {'step ms':>9} {'peak GiB':>9} {'fits':>4} {'vs autopar':>10}  status"
    print(
        f"H100 profile, {device_bytes / 2**30:.0f} GiB per device; autopar plans under that budget\n"
        f"{header}\n{'-' * len(header)}"
    )
    for name in args.models.split(","):
        for spec in args.meshes.split(","):
            shape = tuple(int(n) for n in spec.split("x"))
            if name in STAGED:
                results = staged_results(name, shape, device_bytes, args.limit_s)
            else:
                model, inputs = full_size(name, math.prod(shape))
                captured = capture(model, inputs)
                batch_names = [k.name for k in captured.inputs if k.kind == "input"]
                mesh = autopar.Mesh(shape, ("dp", "tp")[-len(shape) :])
                options = dict(memory_budget=device_bytes, solver_time_limit_s=args.limit_s)
                results = {"autopar": _plan(captured, mesh, **options)}
                for label, pins in hand_written(name, model, batch_names, shape).items():
                    results[label] = _plan(captured, mesh, pins=pins, solver_time_limit_s=args.limit_s)
            fitting = [
                r["step_s"] for k, r in results.items() if k != "autopar" and r.get("peak_bytes", 1e30) <= device_bytes
            ]
            best_hand = min(fitting, default=None)
            for label, r in results.items():
                fits = r.get("peak_bytes", 1e30) <= device_bytes
                ratio = (
                    r["step_s"] / results["autopar"]["step_s"]
                    if "step_s" in r and "step_s" in results["autopar"]
                    else None
                )
                rows.append({"model": name, "mesh": spec, "plan": label, "fits": fits, "ratio_to_autopar": ratio, **r})
                print(
                    f"{name:6} {spec:6} {label:9} {r.get('step_s', float('nan')) * 1e3:>9.2f} "
                    f"{r.get('peak_bytes', float('nan')) / 2**30:>9.2f} {'yes' if fits else 'no':>4} "
                    f"{'' if ratio is None else f'{ratio:.3f}':>10}  {r['status']} {r['wall_s']:.0f} s "
                    f"{r.get('stages', '')}",
                    flush=True,
                )
            auto = results["autopar"].get("step_s")
            if auto is not None and best_hand is not None:
                verdict = "autopar at least as fast" if auto <= best_hand * (1 + 1e-9) else "HAND-WRITTEN FASTER"
                print(f"{name:6} {spec:6} best hand-written that fits / autopar = {best_hand / auto:.3f}  ({verdict})")
            rows.append(
                {"model": name, "mesh": spec, "summary": True, "best_hand_written_s": best_hand, "autopar_s": auto}
            )
    planned = {(r["model"], r["mesh"]) for r in rows}
    kept = (
        [r for r in json.loads(RESULTS.read_text())["rows"] if (r["model"], r["mesh"]) not in planned]
        if RESULTS.exists()
        else []
    )
    write_results(
        RESULTS,
        hardware_profile="h100",
        float32_matmul_precision=precision,
        device_memory_bytes=device_bytes,
        rows=kept + rows,
    )


if __name__ == "__main__":
    main()
