"""Planning models written by others: each Hugging Face architecture of
:func:`autopar.examples.hf.zoo` (language models, a vision transformer, convolutional image
classifiers, a CLIP-style dual encoder, a state-space model, mixtures of experts; built from small configurations:
2 layers or stages of 2 blocks, hidden 64, batch 8 x sequence 16 or 32x32 images), captured once
and planned for 2x2 and 8x8 H100 meshes.

Per model and mesh it records the ops that fall back to running replicated (no sharding rule),
the program's variables, the solver's status, the planning time (capture included) and whether
the plan splits anything (a parameter or an input). Prints a table and writes
``benchmarks/results/models.json``.

    python -m benchmarks.models [--models gpt2,llama] [--meshes 2x2,8x8] [--limit-s 120]
"""

import argparse
import collections
import logging
import time
from pathlib import Path

from benchmarks import write_results

RESULTS = Path(__file__).parent / "results" / "models.json"


def fallback_ops(captured) -> dict[str, int]:
    """Operator → nodes of the graph that no sharding rule covers."""
    from autopar.passes.rules import rule_for

    counts = collections.Counter(
        str(n.target)
        for n in captured.graph.graph.nodes
        if n.op == "call_function" and "getitem" not in str(n.target) and rule_for(n.target) is None
    )
    return dict(counts)


def plan_model(name: str, shape: tuple[int, ...], limit_s: float) -> dict:
    import torch
    from autopar.examples.hf import zoo
    from autopar.passes.analysis.capture import capture

    import autopar
    from autopar.planner import plan_captured

    torch.manual_seed(0)
    started = time.perf_counter()
    model, inputs = zoo()[name]()
    row = {"model": name, "mesh": "x".join(map(str, shape))}
    try:
        captured = capture(model, inputs)
        row["fallback"] = fallback_ops(captured)
        plan = plan_captured(captured, autopar.Mesh(shape, ("dp", "tp")), hardware="h100", solver_time_limit_s=limit_s)
    except Exception as exc:  # noqa: BLE001  (a failure is a result of this benchmark)
        row.update(
            status=f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            wall_s=time.perf_counter() - started,
        )
        return row
    placements = [*plan.placements.values(), *plan.inputs.values()]
    row.update(
        status=plan.solver.status,
        variables=plan.solver.num_variables,
        wall_s=time.perf_counter() - started,
        nodes=len(plan.nodes),
        splits=any(not p.is_replicate() for ps in placements for p in ps),
        collectives=len(plan.collectives),
        predicted_step_s=plan.predicted_step_s,
        layer_classes=plan.solver.layer_classes,
        shared_layers=plan.solver.shared_layers,
    )
    return row


def main() -> None:
    from autopar.examples.hf import zoo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo()), help="comma-separated names of autopar.examples.hf.zoo")
    parser.add_argument("--meshes", default="2x2,8x8")
    parser.add_argument("--limit-s", type=float, default=120.0, help="solver time limit per plan")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    header = (
        f"{'model':12} {'mesh':5} {'status':8} {'variables':>9} {'plan s':>7} {'splits':6} {'collectives':>11}"
        "  fallback ops"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    rows = []
    for name in args.models.split(","):
        for mesh in args.meshes.split(","):
            r = plan_model(name, tuple(int(n) for n in mesh.split("x")), args.limit_s)
            rows.append(r)
            fallback = ", ".join(f"{op} x{n}" for op, n in r.get("fallback", {}).items()) or "-"
            print(
                f"{r['model']:12} {r['mesh']:5} {r['status'][:8]:8} {r.get('variables', ''):>9} {r['wall_s']:>7.1f} "
                f"{str(r.get('splits', '')):6} {r.get('collectives', ''):>11}  {fallback}"
                + (f"\n  {r['status']}" if r["status"].startswith("FAILED") else ""),
                flush=True,
            )
    used = collections.Counter(
        op for r in rows if r["mesh"] == args.meshes.split(",")[0] for op in r.get("fallback", {})
    )
    print("\nops falling back in two or more models:", [op for op, n in used.items() if n >= 2] or "none")
    write_results(RESULTS, hardware_profile="h100", solver_time_limit_s=args.limit_s, rows=rows)


if __name__ == "__main__":
    main()
