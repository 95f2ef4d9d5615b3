"""How long planning takes: the example models on 1-D and 2-D meshes, stage by stage.

Each configuration plans in its own process under a wall-clock limit, so a solve that does not
finish is recorded as such instead of stopping the benchmark. Prints a table and writes
``benchmarks/results/planning.json``.

    python -m benchmarks.planning [--limit-s 120] [--hardware h100]
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path

MODELS = ("mlp", "gpt", "bert", "llama")
MESHES = ((8,), (2, 2), (2, 4))
RESULTS = Path(__file__).parent / "results" / "planning.json"


def _plan_one(model_name: str, shape: tuple[int, ...], hardware: str, limit_s: float, queue) -> None:
    import autopar
    from autopar.examples import make_example

    model, inputs = make_example(model_name)
    names = ("dp", "tp")[: len(shape)] if len(shape) == 2 else ("dp",)
    started = time.perf_counter()
    try:
        plan = autopar.plan(model, autopar.Mesh(shape, names), inputs, hardware=hardware, solver_time_limit_s=limit_s)
    except autopar.AutoparError as exc:
        queue.put({"status": "NO PLAN", "error": str(exc).splitlines()[0], "wall_s": time.perf_counter() - started})
        return
    queue.put({
        "wall_s": time.perf_counter() - started,
        "stage_s": dict(plan.stage_s),
        "status": plan.solver.status,
        "gap": (plan.solver.objective_s - plan.solver.bound_s) / plan.solver.objective_s if plan.solver.objective_s else 0.0,
        "variables": plan.solver.num_variables,
        "nodes": len(plan.nodes),
        "predicted_step_s": plan.predicted_step_s,
        "collectives": len(plan.collectives),
    })


def run(model_name: str, shape: tuple[int, ...], hardware: str, limit_s: float) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_plan_one, args=(model_name, shape, hardware, limit_s, queue))
    started = time.perf_counter()
    proc.start()
    proc.join(limit_s * 1.5 + 30)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": "NOT FINISHED", "wall_s": time.perf_counter() - started}
    if queue.empty():
        return {"status": f"FAILED (exit {proc.exitcode})", "wall_s": time.perf_counter() - started}
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-s", type=float, default=120.0, help="solver time limit per configuration")
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args()
    rows = []
    header = f"{'model':6} {'mesh':5} {'nodes':>5} {'variables':>9} {'status':12} {'gap':>6} {'wall s':>7} {'capture':>7} {'solve':>7}"
    print(header)
    print("-" * len(header))
    for model_name in MODELS:
        for shape in MESHES:
            r = run(model_name, shape, args.hardware, args.limit_s)
            r.update(model=model_name, mesh="x".join(map(str, shape)))
            rows.append(r)
            stages = r.get("stage_s", {})
            print(f"{model_name:6} {r['mesh']:5} {r.get('nodes', ''):>5} {r.get('variables', ''):>9} {r['status']:12} "
                  f"{r['gap'] * 100 if 'gap' in r else float('nan'):>5.2f}% {r['wall_s']:>7.1f} "
                  f"{stages.get('capture', float('nan')):>7.2f} {stages.get('solve', float('nan')):>7.2f}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    import torch

    RESULTS.write_text(json.dumps({
        "hardware_profile": args.hardware, "solver_time_limit_s": args.limit_s,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"), "rows": rows,
    }, indent=1))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
