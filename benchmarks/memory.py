"""Step time against memory budget: what the solver gives up, and in what order, to fit.

On 4 local gloo ranks (torchrun) with this machine's calibrated profile
(``benchmarks/results/cpu-profile-4-ranks.json``, made by ``benchmarks.fidelity`` or
``autopar calibrate -n 4``), every example model is planned without a budget, then under
budgets from 90% down to 40% of that plan's predicted peak, in 10% steps. Each plan that
exists is trained for a few AdamW steps; the table gives per budget:

- the predicted step time and peak memory per rank, and the measured ones: the median
  forward+backward time of the timed steps and the per-rank peak of a whole training step
  (its optimizer state built) by ``torch.distributed._tools.mem_tracker.MemTracker``;
- what the plan does to fit: ops recomputed, parameters split across the ranks;
- whether its losses match one device (relative 1e-5).

Writes ``benchmarks/results/memory.json``, keeping the rows of models that this run did not plan.

    python -m benchmarks.memory [--steps 5] [--models gpt,bert,llama,mlp,moe,convnet]
"""

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import step_peak_bytes, write_results

RESULTS = Path(__file__).parent / "results" / "memory.json"
PROFILE = Path(__file__).parent / "results" / "cpu-profile-4-ranks.json"
FRACTIONS = (None, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
WARMUP = 2


def _losses(model, batch, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _measure(pmodel, batch, steps: int) -> tuple[list[float], float, int]:
    """Losses of ``steps`` AdamW steps, the median forward+backward time of those after the
    warm-up, and the MemTracker peak of one more step."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    losses, times = [], []
    for i in range(steps):
        opt.zero_grad()
        dist.barrier()
        started = time.perf_counter()
        loss = pmodel(*batch)
        loss.backward()
        if i >= WARMUP:
            times.append(time.perf_counter() - started)
        opt.step()
        losses.append(float(loss))
    return losses, statistics.median(times), step_peak_bytes(pmodel, opt, batch)


def worker(models: list[str], steps: int, out: str) -> None:
    import torch.distributed as dist
    from autopar.examples import make_example

    import autopar

    dist.init_process_group("gloo")
    mesh = autopar.Mesh((dist.get_world_size(),), ("ranks",))
    rows = []
    for name in models:
        torch.manual_seed(0)
        _, batch = make_example(name)
        unbounded = None
        for fraction in FRACTIONS:
            torch.manual_seed(0)
            model, _ = make_example(name)
            reference = _losses(copy.deepcopy(model), batch, steps)
            budget = None if fraction is None else int(unbounded * fraction)
            row = {"model": name, "fraction": fraction, "budget_bytes": budget}
            try:
                pmodel = autopar.compile(model, mesh, batch, hardware=str(PROFILE), memory_budget=budget)
            except autopar.InfeasiblePlanError:
                rows.append({**row, "feasible": False})
                continue
            plan = pmodel.plan
            unbounded = unbounded or plan.peak_memory_bytes
            losses, step_s, peak = _measure(pmodel, batch, steps)
            rows.append(
                {
                    **row,
                    "feasible": True,
                    "predicted_s": plan.predicted_step_s,
                    "measured_s": step_s,
                    "predicted_peak_bytes": plan.peak_memory_bytes,
                    "measured_peak_bytes": peak,
                    "recomputed_ops": sum(n.activation == "recompute" and n.activation_bytes > 0 for n in plan.nodes),
                    "split_params": sum(any(not p.is_replicate() for p in v) for v in plan.placements.values()),
                    "params": len(plan.placements),
                    "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, reference)),
                }
            )
            if dist.get_rank() == 0:
                print(f"  {name} budget {fraction or 'none'} done", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="gpt,bert,llama,mlp,moe,convnet")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if args.worker:
        return worker(models, args.steps, args.worker)

    from autopar.runtime.launch import torchrun

    if not PROFILE.exists():
        raise SystemExit(f"{PROFILE} is missing: run `autopar calibrate -n 4 --out {PROFILE}` first")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        if torchrun(
            4, ["-m", "benchmarks.memory", "--steps", str(args.steps), "--models", args.models, "--worker", out]
        ):
            raise SystemExit("the benchmark failed")
        rows = json.loads(Path(out).read_text())
    header = (
        f"{'model':5} {'budget':>6} {'budget MiB':>10} {'pred. ms':>8} {'meas. ms':>8} {'pred. MiB':>9} "
        f"{'meas. MiB':>9} {'error':>6} {'recomputed':>10} {'split params':>12} {'loss rel':>8}"
    )
    print(
        "\nstep time and per-rank peak memory against the memory budget, 4 gloo ranks, AdamW\n"
        f"{header}\n{'-' * len(header)}"
    )
    for r in rows:
        budget = "none" if r["fraction"] is None else f"{r['fraction']:.0%}"
        mib = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**20:.2f}"
        if not r["feasible"]:
            print(f"{r['model']:5} {budget:>6} {mib:>10}  no plan fits")
            continue
        r["memory_error"] = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
        print(
            f"{r['model']:5} {budget:>6} {mib:>10} {r['predicted_s'] * 1e3:>8.2f} {r['measured_s'] * 1e3:>8.2f} "
            f"{r['predicted_peak_bytes'] / 2**20:>9.2f} {r['measured_peak_bytes'] / 2**20:>9.2f} "
            f"{r['memory_error']:>+6.0%} "
            f"{r['recomputed_ops']:>10} {r['split_params']:>5} of {r['params']:<4} {r['loss_rel']:>8.1e}"
        )
    kept = [r for r in json.loads(RESULTS.read_text())["rows"] if r["model"] not in models] if RESULTS.exists() else []
    write_results(RESULTS, steps=args.steps, warmup=WARMUP, rows=kept + rows)


if __name__ == "__main__":
    main()
