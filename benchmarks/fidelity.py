"""Does the cost model predict this machine? Predicted against measured step time and memory.

For each rank count (1, 2 and 4 local ranks) and each example model: calibrates this machine
(``autopar calibrate``, into ``benchmarks/results/``) just before measuring the model, since this
host's speed drifts within minutes; then on those ranks plans the model with the calibrated
profile, under autopar's own plan and hand-written layouts (pins; on one rank they are all one
plan, without collectives, which tells how well the cost model prices the ops alone), and
measures:

- the step time the plan models: forward and backward of the per-rank program (the mean, a
  training run's time per step, of ``ROUNDS`` rounds of at least ``--steps`` steps, and of as
  many as take ``--round-s`` seconds (the MLP's steps of a few ms swing by 2x from one step to
  the next, so 20 of them gave medians up to 1.9x apart from one run to the next), the plans
  of a model taking turns round by round; the median and quartiles are printed beside it; an
  AdamW step runs between steps, untimed, once every rank has run its backward
  (:func:`autopar.step_scales.training_step`, as the calibration trains its calibration model);
- the steps of the calibration model that ``autopar calibrate`` fits the profile's step and
  collective scales to (:func:`autopar.step_scales.scale_configurations`), taking turns with the
  model's plans in the same rounds, and the scales fitted to them: the plans' step times
  predicted with these scales (``alongside``) leave out how far the host's speed drifted
  between the calibration and the measurement, so that what remains is the cost model's error;
- the per-rank peak memory of a whole training step with AdamW (its state already built), by
  ``torch.distributed._tools.mem_tracker.MemTracker``, against the plan's predicted peak.

On 2 and 4 ranks the GPT also runs in pipeline stages over the ranks (``pp-gpipe``,
``pp-1f1b`` and, where the model has layers enough, ``pp-interleaved`` with two stages per rank;
4 micro-batches), each a call that runs the whole schedule: its predicted step is the stages'
(:attr:`~autopar.core.pipeline.Stages.step_s`), which the scales fitted alongside stretch as a
whole. Their memory is not measured: MemTracker refuses a step that calls a module (a stage's
program) more than once.

Prints one row per model, plan and rank count with the error of the prediction under the
profile's scales and under the scales fitted alongside, and per model whether the predicted
order of the plans matches the measured one, and which pairs of plans the measurements order
either way in every round (the others are too close to tell apart on this host). Writes
``benchmarks/results/fidelity.json``.

    python -m benchmarks.fidelity [--ranks 1,2,4] [--models mlp,gpt,bert,llama] [--steps 4] [--round-s 0.2]
"""

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import calibrated_profile, step_peak_bytes, take_turns, write_results

RESULTS = Path(__file__).parent / "results" / "fidelity.json"
WARMUP = 3
ROUNDS = 5
MODELS = ("mlp", "gpt", "bert", "llama")


PIPELINED = {"pp-gpipe": ("gpipe", 1), "pp-1f1b": ("1f1b", 1), "pp-interleaved": ("interleaved", 2)}
"""The pipelined plans measured, by schedule and stages per rank."""
MICROBATCHES = 4


def _pipeline(layout: str):
    import autopar

    if layout not in PIPELINED:
        return None
    schedule, per_rank = PIPELINED[layout]
    return autopar.Pipeline(axis="ranks", microbatches=MICROBATCHES, schedule=schedule, stages_per_rank=per_rank)


def _pins(layout: str, model_name: str, model, input_names, world: int) -> dict | None:
    batch = {k: "S(0)" for k in input_names}
    if layout in PIPELINED:
        return None
    params = [k for k, _ in model.named_parameters()]
    divisible = {k for k, p in model.named_parameters() if p.shape[0] % world == 0}
    if layout == "auto":
        return batch
    if layout == "ddp":
        return {**batch, **{k: "R" for k in params}}
    if layout == "fsdp":
        return {**batch, **{k: "S(0)" if k in divisible else "R" for k in params}}  # FSDP would pad the rest
    split = {
        "mlp": {"layers.0.weight": "S(0)", "layers.0.bias": "S(0)", "layers.1.weight": "S(1)"},
        "gpt": {
            f"blocks.{i}.{k}": v
            for i in range(2)
            for k, v in (
                ("attn.qkv.weight", "S(0)"),
                ("attn.proj.weight", "S(1)"),
                ("fc1.weight", "S(0)"),
                ("fc1.bias", "S(0)"),
                ("fc2.weight", "S(1)"),
            )
        },
    }
    return split[model_name]


def _layouts(model_name: str, world: int) -> tuple[str, ...]:
    """The plans measured: autopar's and the hand-written ones (on one rank, they are one plan)."""
    if world == 1:
        return ("auto",)
    if model_name == "gpt":  # 6 units to cut into stages: token and position embeddings, 2 blocks, norm, head
        return ("auto", "ddp", "fsdp", "megatron", "pp-gpipe", "pp-1f1b") + (("pp-interleaved",) if world == 2 else ())
    return ("auto", "ddp", "fsdp", "megatron") if model_name == "mlp" else ("auto", "ddp", "fsdp")


def _steps_per_round(warm_s: list[float], steps: int, round_s: float) -> int:
    """At least ``steps``, and enough steps of the warm-up's median time to take ``round_s``:
    the largest count of any rank, so that every rank runs the same collectives."""
    import torch.distributed as dist

    count = torch.tensor([max(steps, math.ceil(round_s / statistics.median(warm_s)))])
    dist.all_reduce(count, dist.ReduceOp.MAX)
    return int(count)


def worker(profile: str, models: list[str], steps: int, round_s: float, out: str) -> None:
    import torch.distributed as dist
    from autopar.cost_model.hardware import load_profile
    from autopar.examples import make_example

    import autopar
    from autopar.step_scales import fit_scales, fixed_s, scale_configurations, scale_points, training_step

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = autopar.Mesh((world,), ("ranks",))
    calibrated = load_profile(profile)
    unscaled = dataclasses.replace(
        calibrated, fitted=dataclasses.replace(calibrated.fitted, step_scale=1.0, collective_scale=1.0)
    )
    rows, alongside = [], {}
    for name in models:
        runs = []
        for layout in _layouts(name, world):
            torch.manual_seed(0)
            model, batch = make_example(name)
            input_names = list(inspect.signature(model.forward).parameters)[: len(batch)]
            pins = _pins(layout, name, model, input_names, world)
            pipeline = _pipeline(layout)
            pmodel = autopar.compile(model, mesh, batch, hardware=profile, pins=pins, pipeline=pipeline)
            if pipeline is not None:
                pmodel(*batch)  # built on its first call
                local, opt = list(batch), pmodel.optimizer(torch.optim.AdamW, lr=1e-4)
            else:
                local = [pmodel.rank_part(k, x) if pmodel.passes_own_part(k) else x for k, x in zip(input_names, batch)]
                opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
            step = functools.partial(training_step, pmodel, local, opt)
            warm = [step() for _ in range(WARMUP)]
            runs.append((layout, pmodel, opt, local, step, _steps_per_round(warm, steps, round_s)))
        configurations = scale_configurations(unscaled, world)
        calls = [step for *_, step, _ in runs] + [step for _, _, step in configurations]
        counts = [count for *_, count in runs] + [
            _steps_per_round([step() for _ in range(WARMUP)], steps, round_s) for _, _, step in configurations
        ]
        measured = take_turns(calls, counts, ROUNDS)
        points = scale_points(
            configurations,
            {
                label: [t for r in rounds for t in r]
                for (label, _, _), rounds in zip(configurations, measured[len(runs) :])
            },
        )
        step_scale, collective_scale = fit_scales(list(points.values()))
        alongside[name] = {"step_scale": step_scale, "collective_scale": collective_scale, "points": points}
        for (layout, pmodel, opt, local, _, _), rounds in zip(runs, measured):
            times = [t for r in rounds for t in r]
            quartiles = statistics.quantiles(times, n=4)
            plan = pmodel.plan
            parts = {
                "compute": plan.compute_s + plan.recompute_s - plan.node_overhead_s,
                "communication": plan.communication_s,
                "overhead": fixed_s(plan),
            }
            if plan.stages is not None:  # the stages' time, stretched as a whole
                parts = {"compute": plan.stages.step_s, "communication": 0.0, "overhead": plan.overhead_s}
            rows.append(
                {
                    "model": name,
                    "ranks": world,
                    "layout": layout,
                    "predicted_s": plan.predicted_step_s,
                    "predicted_parts_s": parts,
                    "collectives": len(plan.collectives),
                    "measured_s": statistics.mean(times),
                    "measured_median_s": statistics.median(times),
                    "measured_steps": len(times),
                    "measured_quartiles_s": [quartiles[0], quartiles[2]],
                    "measured_round_s": [statistics.mean(r) for r in rounds],
                    "predicted_peak_bytes": plan.peak_memory_bytes
                    if plan.stages is None
                    else plan.stages.peak_bytes[rank],  # on a mesh of one axis rank r is position r
                    # MemTracker refuses a step that calls a module more than once: the stages' programs
                    "measured_peak_bytes": None if plan.stages is not None else step_peak_bytes(pmodel, opt, local),
                }
            )
        if rank == 0:
            print(f"  {name} on {_ranks(world)} done", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "alongside": alongside}))
    dist.destroy_process_group()


def _predicted_pairs(rows: list[dict], key: str = "predicted_s", margin: float = 0.05) -> list[tuple[dict, dict]]:
    """The ``(faster, slower)`` plans of every two whose predicted times (``key``) differ by
    more than ``margin`` (plans predicted alike, such as autopar choosing the DDP layout, are
    not ordered)."""
    return [(a, b) for a in rows for b in rows if a[key] < b[key] * (1 - margin)]


def _faster_every_round(a: dict, b: dict) -> bool:
    """Whether ``a``'s steps took less time than ``b``'s on average in every round (the plans
    take turns round by round, so each round compares them over the same minutes)."""
    return all(x < y for x, y in zip(a["measured_round_s"], b["measured_round_s"], strict=True))


def _order(rows: list[dict], key: str = "predicted_s") -> dict:
    """How the predicted order of a model's plans compares with the measured one: ``matches``,
    whether every pair of plans predicted apart is measured (by mean step time) in the same
    order; ``contradicted``, the pairs whose order the measurements reverse in every round;
    ``unresolved``, the pairs predicted apart that neither plan measured faster in every round
    (the measurements do not order them, so no prediction can match or contradict them)."""
    pairs = _predicted_pairs(rows, key)
    return {
        "matches": all(a["measured_s"] < b["measured_s"] for a, b in pairs),
        "contradicted": [[a["layout"], b["layout"]] for a, b in pairs if _faster_every_round(b, a)],
        "unresolved": [
            [a["layout"], b["layout"]]
            for a, b in pairs
            if not _faster_every_round(a, b) and not _faster_every_round(b, a)
        ],
    }


def _ranks(world: int) -> str:
    return f"{world} rank{'s' * (world != 1)}"


def _span(scales: list[tuple[float, ...]], i: int) -> str:
    return f"{min(s[i] for s in scales):.2f} to {max(s[i] for s in scales):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per plan and round, at least")
    parser.add_argument(
        "--round-s", type=float, default=0.2, help="seconds of timed steps per plan and round, at least"
    )
    parser.add_argument("--worker", nargs=2, metavar=("PROFILE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if unknown := set(models) - set(MODELS):
        parser.error(f"--models: no example {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    if args.worker:
        return worker(args.worker[0], models, args.steps, args.round_s, args.worker[1])

    from autopar.cost_model.hardware import load_profile
    from autopar.runtime.launch import torchrun

    rows, profiles, scales, alongside = [], {}, {}, {}
    for world in (int(n) for n in args.ranks.split(",")):
        for name in models:
            path = calibrated_profile(world)
            profile = load_profile(path)
            profiles[f"{name}@{world}"] = dataclasses.asdict(profile)
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rows.json")
                if torchrun(
                    world,
                    [
                        "-m",
                        "benchmarks.fidelity",
                        "--models",
                        name,
                        "--steps",
                        str(args.steps),
                        "--round-s",
                        str(args.round_s),
                        "--worker",
                        str(path),
                        out,
                    ],
                ):
                    raise SystemExit(f"the benchmark failed for {name} on {world} ranks")
                result = json.loads(Path(out).read_text())
            fit = alongside[f"{name}@{world}"] = result["alongside"][name]
            scales.setdefault(world, []).append(
                (profile.fitted.step_scale, profile.fitted.collective_scale, fit["step_scale"], fit["collective_scale"])
            )
            rows += [
                {
                    **r,
                    "step_scale": profile.fitted.step_scale,
                    "collective_scale": profile.fitted.collective_scale,
                    "alongside_step_scale": fit["step_scale"],
                    "alongside_collective_scale": fit["collective_scale"],
                }
                for r in result["rows"]
            ]
    header = (
        f"{'model':5} {'ranks':>5} {'plan':14} {'predicted ms':>12} {'measured ms':>11} {'median ms':>9} "
        f"{'quartiles ms':>13} {'error':>7} "
        f"{'alongside':>9} {'unscaled':>8} {'pred. peak MiB':>14} {'meas. peak MiB':>14} {'error':>7}"
    )
    print()
    for world, s in scales.items():
        print(
            f"{_ranks(world)}: a step runs {_span(s, 0)}x its ops and collectives timed alone, its collectives "
            f"{_span(s, 1)}x that again (the profiles' scales); {_span(s, 2)}x and {_span(s, 3)}x fitted alongside"
        )
    print(
        f"forward+backward step time (mean of {ROUNDS} rounds of at least {args.steps} steps and {args.round_s} s, "
        f"with the median and quartiles) and peak memory of a training step, gloo on this machine; the error of the "
        f"prediction with the profile's scales, and with the scales fitted to the calibration model's steps taken in "
        f"the same rounds as the plans' (alongside)\n{header}\n{'-' * len(header)}"
    )
    for r in rows:
        parts = r["predicted_parts_s"]
        ops = parts["compute"] / r["step_scale"]
        collectives = parts["communication"] / (r["step_scale"] * r["collective_scale"])
        r["alongside_s"] = parts["overhead"] + r["alongside_step_scale"] * (
            ops + r["alongside_collective_scale"] * collectives
        )
        r["time_error"] = r["predicted_s"] / r["measured_s"] - 1
        r["alongside_error"] = r["alongside_s"] / r["measured_s"] - 1
        r["unscaled_error"] = (parts["overhead"] + ops + collectives) / r["measured_s"] - 1
        measured_peak = r["measured_peak_bytes"]
        r["memory_error"] = None if measured_peak is None else r["predicted_peak_bytes"] / measured_peak - 1
        print(
            f"{r['model']:5} {r['ranks']:>5} {r['layout']:14} {r['predicted_s'] * 1e3:>12.2f} "
            f"{r['measured_s'] * 1e3:>11.2f} {r['measured_median_s'] * 1e3:>9.2f} "
            f"{'-'.join(f'{q * 1e3:.1f}' for q in r['measured_quartiles_s']):>13} {r['time_error']:>+7.0%} "
            f"{r['alongside_error']:>+9.0%} "
            f"{r['unscaled_error']:>+8.0%} {r['predicted_peak_bytes'] / 2**20:>14.2f} "
            + ("" if measured_peak is None else f"{measured_peak / 2**20:>14.2f} {r['memory_error']:>+7.0%}")
        )
    orders = {}
    for r in rows:
        orders.setdefault((r["model"], r["ranks"]), []).append(r)
    orders = {key: group for key, group in orders.items() if len(group) > 1}
    print()
    compared = {key: _order(group) for key, group in orders.items()}
    compared_alongside = {key: _order(group, "alongside_s") for key, group in orders.items()}
    for (name, world), group in orders.items():
        order = compared[name, world]
        print(
            f"{name:5} on {world} ranks: predicted order of plans (more than 5% apart) "
            f"{'matches' if order['matches'] else 'DIFFERS FROM'} the measured one "
            f"({', '.join(r['layout'] for r in sorted(group, key=lambda r: r['measured_s']))} measured fastest first)"
            + "".join(
                f"; {a} predicted faster than {b}, measured slower in every round" for a, b in order["contradicted"]
            )
            + "".join(f"; {a} predicted faster than {b}, neither faster in every round" for a, b in order["unresolved"])
            + ("" if compared_alongside[name, world]["matches"] else "; with the scales fitted alongside, it differs")
        )
    print()
    for world in scales:
        group = [r for r in rows if r["ranks"] == world]
        within = {
            key: sum(abs(r[key]) <= 0.3 for r in group) for key in ("time_error", "alongside_error", "unscaled_error")
        }
        print(
            f"{_ranks(world)}: {within['time_error']} of {len(group)} step-time predictions within ±30% "
            f"({within['alongside_error']} with the scales fitted alongside, "
            f"{within['unscaled_error']} without the step and "
            f"collective scales), median error {statistics.median(r['time_error'] for r in group):+.0%}"
        )
    pairs = sum(len(_predicted_pairs(g)) for g in orders.values())
    contradicted = sum(len(c["contradicted"]) for c in compared.values())
    unresolved = sum(len(c["unresolved"]) for c in compared.values())
    print(
        f"plan order: {sum(c['matches'] for c in compared.values())} of {len(orders)} models and rank counts "
        "measured in the predicted order "
        f"({sum(c['matches'] for c in compared_alongside.values())} with the scales fitted alongside); of "
        f"{pairs} pairs of plans predicted more than 5% apart, {pairs - contradicted - unresolved} measured in that "
        f"order in every round, {contradicted} in the reverse order in every round, {unresolved} in neither"
    )
    write_results(
        RESULTS,
        profiles=profiles,
        alongside=alongside,
        steps=args.steps,
        round_s=args.round_s,
        rounds=ROUNDS,
        warmup=WARMUP,
        rows=rows,
        order={f"{k[0]}@{k[1]}": c for k, c in compared.items()},
        order_alongside={f"{k[0]}@{k[1]}": c for k, c in compared_alongside.items()},
    )


if __name__ == "__main__":
    main()
