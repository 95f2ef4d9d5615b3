"""Step time against memory budget on H100s: what the solver gives up to fit, in what order.

For the full-size example models of ``benchmarks.plan_quality`` (built on the meta device) on a
mesh of 8 H100s (the ``h100`` profile: PCIe Gen5 to the host at 50 GB/s, the host stepping
optimizer state at 77 GB/s per GPU), plans the model without a budget, then under budgets from
80% down to 20% of that plan's predicted peak. For each budget the table gives the predicted step
time (and its ratio to the unbudgeted plan's), the peak per device, and how the plan fits: bytes
per device recomputed in the backward, activations offloaded to host memory, parameters,
gradients and optimizer state kept in host memory (and how many parameters are stepped on the
host, how many live there), how many layers have their offloaded activations copied back ahead
(prefetched) out of those that offload, and parameters split across the devices. Planning only: no device
runs.

Writes ``benchmarks/results/budget.json``, keeping the rows of models that this run did not plan.

    python -m benchmarks.budget [--models gpt,bert,mlp,moe,convnet,llama] [--devices 8]
"""

import argparse
import json
import time
from pathlib import Path

from benchmarks import float32_matmuls_as_on_gpus, write_results
from benchmarks.plan_quality import full_size

RESULTS = Path(__file__).parent / "results" / "budget.json"
FRACTIONS = (None, 0.8, 0.6, 0.4, 0.3, 0.2)
GIB = 2**30


def sweep(name: str, devices: int, time_limit_s: float) -> list[dict]:
    from autopar.passes.analysis.capture import capture

    import autopar
    from autopar.core.errors import InfeasiblePlanError
    from autopar.core.graph import segment_of
    from autopar.planner import plan_captured

    model, batch = full_size(name, devices)
    captured = capture(model, batch)
    mesh = autopar.Mesh((devices,), ("ranks",))
    rows, free = [], None
    for fraction in FRACTIONS:
        budget = None if fraction is None else int(free.peak_memory_bytes * fraction)
        row = {"model": name, "devices": devices, "fraction": fraction, "budget_bytes": budget}
        started = time.perf_counter()
        try:
            plan = plan_captured(
                captured, mesh, hardware="h100", memory_budget=budget, solver_time_limit_s=time_limit_s
            )
        except InfeasiblePlanError as exc:
            rows.append({**row, "feasible": False, "reason": str(exc).splitlines()[0]})
            print(f"  {name} {fraction}: no plan fits", flush=True)
            continue
        free = free or plan
        offloaded = sum(n.activation_bytes for n in plan.nodes if n.activation == "offload")
        rows.append(
            {
                **row,
                "feasible": True,
                "plan_s": time.perf_counter() - started,
                "status": plan.solver.status,
                "predicted_s": plan.predicted_step_s,
                "slowdown": plan.predicted_step_s / free.predicted_step_s,
                "peak_bytes": plan.peak_memory_bytes,
                "offload_s": plan.offload_s,
                "recompute_s": plan.recompute_s,
                "recomputed_bytes": sum(n.activation_bytes for n in plan.nodes if n.activation == "recompute"),
                "offloaded_bytes": offloaded,
                "host_state_bytes": plan.memory.host_bytes - offloaded,
                "host_optimizer": len(plan.host_optimizer),
                "host_params": len(plan.host_params),
                "prefetched": len(plan.prefetched),
                "offloading_layers": len({segment_of(n.module) for n in plan.nodes if n.activation == "offload"}),
                "split_params": sum(any(not p.is_replicate() for p in v) for v in plan.placements.values()),
                "params": len(plan.placements),
            }
        )
        print(f"  {name} {fraction}: planned in {rows[-1]['plan_s']:.0f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,bert,mlp,moe,convnet,llama")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=120.0, help="the solver's time limit per plan, seconds")
    args = parser.parse_args()
    models = args.models.split(",")
    precision = float32_matmuls_as_on_gpus()
    rows = [r for name in models for r in sweep(name, args.devices, args.time_limit)]
    header = (
        f"{'model':8} {'budget':>6} {'GiB':>6} {'step ms':>8} {'x free':>6} {'peak GiB':>8} {'recomp. GiB':>11} "
        f"{'offl. GiB':>9} {'ahead':>9} {'state on host GiB':>17} {'stepped / in host':>17} "
        f"{'split params':>12} {'plan s':>6}"
    )
    print(
        f"\npredicted step time and per-device memory against the memory budget, {args.devices} H100s\n"
        f"{header}\n{'-' * len(header)}"
    )
    for r in rows:
        budget = "none" if r["fraction"] is None else f"{r['fraction']:.0%}"
        gib = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / GIB:.1f}"
        if not r["feasible"]:
            print(f"{r['model']:8} {budget:>6} {gib:>6}  no plan fits")
            continue
        print(
            f"{r['model']:8} {budget:>6} {gib:>6} {r['predicted_s'] * 1e3:>8.1f} {r['slowdown']:>6.2f} "
            f"{r['peak_bytes'] / GIB:>8.1f} {r['recomputed_bytes'] / GIB:>11.2f} {r['offloaded_bytes'] / GIB:>9.2f} "
            f"{r['prefetched']:>3} / {r['offloading_layers']:<3} "
            f"{r['host_state_bytes'] / GIB:>17.2f} {r['host_optimizer']:>8} / {r['host_params']:<6} "
            f"{r['split_params']:>5} of {r['params']:<4} {r['plan_s']:>6.0f}"
        )
    kept = [r for r in json.loads(RESULTS.read_text())["rows"] if r["model"] not in models] if RESULTS.exists() else []
    write_results(RESULTS, devices=args.devices, hardware="h100", float32_matmul_precision=precision, rows=kept + rows)


if __name__ == "__main__":
    main()
