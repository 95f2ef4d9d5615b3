"""How long planning takes, stage by stage: the example models on 1-D and 2-D meshes, a
LLaMA-3-8B-shaped model for 64 H100s (8x8) from 2 to 64 layers, without a memory budget and
under the device's memory (planned with ``solver_gap=0.01``: proven within 1% of the fastest plan
that fits), and the block stack meta-pytorch/autoparallel benchmarks its planner on
(:mod:`autopar.examples.stack`: 8, 32 and 80 LLaMA-dimension blocks, batch 16 x sequence 1024, its
input needing a gradient and not) for 8x8 H100s.

The 8B-shaped model (hidden 4096, 32 query / 8 key-value heads, MLP 14336, vocabulary 128256,
global batch 64 x sequence 8192) is built under ``torch.device("meta")`` with meta inputs, as
users do for models that fit on no single device. Each configuration plans in its own process
under a wall-clock limit, so a solve that does not finish is recorded as such instead of
stopping the benchmark. Prints tables and writes ``benchmarks/results/planning.json``.

    python -m benchmarks.planning [--limit-s 120] [--hardware h100] [--layers 2,8,32,64]
                                  [--budget 80GB] [--budget-layers 32] [--budget-gap 0.01]
                                  [--stack-layers 8,32,80] [--only stack]
"""

import argparse
import multiprocessing as mp
import time
from pathlib import Path

from benchmarks import FLOAT32_MATMULS, float32_matmuls_as_on_gpus, write_results

MODELS = ("mlp", "gpt", "bert", "llama")
MESHES = ((8,), (2, 2), (2, 4))
SCALE_MESH = (8, 8)
RESULTS = Path(__file__).parent / "results" / "planning.json"


def llama3_8b_shaped(num_layers: int):
    """The LLaMA-3-8B-shaped model and a global batch, on the meta device."""
    import torch

    from autopar.examples.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=128256, dim=4096, num_heads=32, num_kv_heads=8, hidden=14336,
                      num_layers=num_layers, max_seq=8192, rope_theta=500000.0)
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (64, cfg.max_seq))
    return model, (tokens, tokens)


AUTOPARALLEL_STACK_S = 136.0
"""meta-pytorch/autoparallel's planning time for the 32-block stack on 8x8, proven optimal, measured
on a machine like this one (2 cores, CPU torch 2.13, an H100 cost model)."""


def block_stack(num_layers: int, input_grad: bool):
    """autoparallel's benchmark stack and its input, on the meta device."""
    import torch

    from autopar.examples.stack import BlockStack, StackConfig

    with torch.device("meta"):
        model = BlockStack(StackConfig(num_layers=num_layers))
        x = torch.randn(16, 1024, 4096, requires_grad=input_grad)
    return model, (x,)


def _build(name: str, layers: int):
    from autopar.examples import make_example

    if name == "llama3-8b":
        return llama3_8b_shaped(layers)
    if name.startswith("stack"):
        return block_stack(layers, input_grad=name == "stack+grad")
    return make_example(name)


def _plan_one(model_spec: tuple[str, int], shape: tuple[int, ...], hardware: str, limit_s: float, budget: str | None,
              gap: float, queue) -> None:
    import autopar

    float32_matmuls_as_on_gpus()
    name, layers = model_spec
    started = time.perf_counter()
    model, inputs = _build(name, layers)
    names = ("dp", "tp")[: len(shape)] if len(shape) == 2 else ("dp",)
    try:
        plan = autopar.plan(model, autopar.Mesh(shape, names), inputs, hardware=hardware, solver_time_limit_s=limit_s,
                            memory_budget=budget, solver_gap=gap)
    except autopar.AutoparError as exc:
        queue.put({"status": "NO PLAN", "error": str(exc).splitlines()[0], "wall_s": time.perf_counter() - started})
        return
    queue.put({
        "wall_s": time.perf_counter() - started,
        "stage_s": dict(plan.stage_s),
        "status": plan.solver.status,
        "gap": (plan.solver.objective_s - plan.solver.bound_s) / plan.solver.objective_s if plan.solver.objective_s else 0.0,
        "variables": plan.solver.num_variables,
        "shared_nodes": plan.solver.shared_nodes,
        "layer_classes": plan.solver.layer_classes,
        "shared_layers": plan.solver.shared_layers,
        "nodes": len(plan.nodes),
        "predicted_step_s": plan.predicted_step_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "collectives": len(plan.collectives),
    })


def run(model_spec: tuple[str, int], shape: tuple[int, ...], hardware: str, limit_s: float, budget: str | None = None,
        gap: float = 1e-3) -> dict:
    from autopar.planner import LIVENESS_TRIES

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_plan_one, args=(model_spec, shape, hardware, limit_s, budget, gap, queue))
    started = time.perf_counter()
    proc.start()
    proc.join(limit_s * (1.5 if budget is None else LIVENESS_TRIES + 1) + 120)  # under a budget, a solve per liveness try
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": "NOT FINISHED", "wall_s": time.perf_counter() - started}
    if queue.empty():
        return {"status": f"FAILED (exit {proc.exitcode})", "wall_s": time.perf_counter() - started}
    return queue.get()


_HEADER = (f"{'model':10} {'layers':>6} {'mesh':5} {'nodes':>5} {'shared':>6} {'variables':>9} {'status':12} "
           f"{'gap':>6} {'wall s':>7} {'capture':>7} {'propagate':>9} {'solve':>7} {'memory':>7}")


def _row(r: dict) -> str:
    stages = r.get("stage_s", {})
    return (f"{r['model']:10} {r['layers'] or '':>6} {r['mesh']:5} {r.get('nodes', ''):>5} {r.get('shared_nodes', ''):>6} "
            f"{r.get('variables', ''):>9} {r['status']:12} {r['gap'] * 100 if 'gap' in r else float('nan'):>5.2f}% "
            f"{r['wall_s']:>7.1f} {stages.get('capture', float('nan')):>7.2f} "
            f"{stages.get('propagate', float('nan')):>9.2f} {stages.get('solve', float('nan')):>7.2f} "
            f"{stages.get('memory', float('nan')):>7.2f}")


def _table(title: str, configs, hardware: str, limit_s: float, budget: str | None = None, gap: float = 1e-3) -> list[dict]:
    print(f"\n{title}\n{_HEADER}\n{'-' * len(_HEADER)}", flush=True)
    rows = []
    for spec, shape in configs:
        r = run(spec, shape, hardware, limit_s, budget, gap)
        r.update(model=spec[0], layers=spec[1], mesh="x".join(map(str, shape)))
        rows.append(r)
        print(_row(r), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-s", type=float, default=120.0, help="solver time limit per configuration")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--layers", default="2,8,32,64", help="layer counts of the 8B-shaped model")
    parser.add_argument("--budget", default="80GB", help="the device memory the budgeted 8B plans must fit")
    parser.add_argument("--budget-layers", default="32", help="layer counts of the 8B-shaped model planned under --budget")
    parser.add_argument("--budget-gap", type=float, default=0.01, help="solver_gap of the budgeted plans")
    parser.add_argument("--stack-layers", default="8,32,80", help="block counts of autoparallel's stack")
    parser.add_argument("--only", choices=("stack",), help="plan only autoparallel's stack (results to planning-stack.json)")
    args = parser.parse_args()
    stack = _table(f"autoparallel's block stack on {'x'.join(map(str, SCALE_MESH))} {args.hardware} (meta device); "
                   f"autoparallel: {AUTOPARALLEL_STACK_S:.0f} s at 32 blocks, proven optimal",
                   [((name, int(n)), SCALE_MESH) for name in ("stack", "stack+grad") for n in args.stack_layers.split(",")],
                   args.hardware, args.limit_s)
    if args.only == "stack":
        write_results(RESULTS.with_name("planning-stack.json"), hardware_profile=args.hardware,
                      float32_matmul_precision=FLOAT32_MATMULS, solver_time_limit_s=args.limit_s, stack=stack,
                      autoparallel_stack_s=AUTOPARALLEL_STACK_S)
        return
    zoo = _table("Example models (autopar.examples, as `autopar plan` builds them)",
                 [((name, 0), shape) for name in MODELS for shape in MESHES], args.hardware, args.limit_s)
    scale = _table(f"LLaMA-3-8B-shaped on {'x'.join(map(str, SCALE_MESH))} {args.hardware} (meta device), by layer count",
                   [(("llama3-8b", int(n)), SCALE_MESH) for n in args.layers.split(",")], args.hardware, args.limit_s)
    budgeted = _table(f"The same under memory_budget={args.budget!r} per device, solver_gap={args.budget_gap}",
                      [(("llama3-8b", int(n)), SCALE_MESH) for n in args.budget_layers.split(",")], args.hardware,
                      args.limit_s, args.budget, args.budget_gap)
    for r in scale + budgeted:
        if "peak_memory_bytes" in r:
            print(f"{r['layers']:>3} layers: predicted step {r['predicted_step_s']:.3f} s, peak {r['peak_memory_bytes'] / 1e9:.1f} GB per device")
    write_results(RESULTS, hardware_profile=args.hardware, float32_matmul_precision=FLOAT32_MATMULS,
                  solver_time_limit_s=args.limit_s, examples=zoo,
                  llama3_8b_shaped=scale, llama3_8b_shaped_budget=budgeted, budget=args.budget, budget_gap=args.budget_gap,
                  stack=stack, autoparallel_stack_s=AUTOPARALLEL_STACK_S)


if __name__ == "__main__":
    main()
