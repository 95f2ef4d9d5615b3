"""How long planning takes, stage by stage: the example models on 1-D and 2-D meshes, a
LLaMA-3-8B-shaped model for 64 H100s (8x8) from 2 to 64 layers, without a memory budget and
under the device's memory (planned with ``solver_gap=0.01``: proven within 1% of the fastest plan
that fits), and the block stack meta-pytorch/autoparallel benchmarks its planner on
(:mod:`autopar.examples.stack`: 8, 32 and 80 LLaMA-dimension blocks, batch 16 x sequence 1024, its
input needing a gradient and not) for 8x8 H100s; and, on 4 local gloo ranks (2x2), how long a
compiled example takes to lower its plan to a batch of half the size on the first call with it,
against the time ``autopar.compile`` took to plan it. ``--only 3d`` plans the 8B shape at 8 layers
on 2x4x8 and the LLaMA-3-70B shape (80 layers, batch 1,024 x 8,192) on 16x8x8 under ``--budget``;
``--only stages`` plans the 8B shape at 32 layers on 2, 4 and 8 pipeline positions (1F1B, and
interleaved over two stages per rank), and on 2 under ``--budget``; ``--only budget``
plans the examples on 2x2 under 60% and 40% of their unbudgeted plan's peak.

The 8B-shaped model (hidden 4096, 32 query / 8 key-value heads, MLP 14336, vocabulary 128256,
global batch 64 x sequence 8192) is built under ``torch.device("meta")`` with meta inputs, as
users do for models that fit on no single device. Each configuration plans in its own process
under a wall-clock limit, so a solve that does not finish is recorded as such instead of
stopping the benchmark. Prints tables and writes ``benchmarks/results/planning.json``.

    python -m benchmarks.planning [--limit-s 120] [--hardware h100] [--layers 2,8,32,64]
                                  [--budget 80GB] [--budget-layers 32] [--budget-gap 0.01]
                                  [--stack-layers 8,32,80]
                                  [--only {stack,relower,3d,stages,budget}]
"""

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

from benchmarks import FLOAT32_MATMULS, float32_matmuls_as_on_gpus, write_results

MODELS = ("mlp", "gpt", "bert", "llama")
MESHES = ((8,), (2, 2), (2, 4))
SCALE_MESH = (8, 8)
RESULTS = Path(__file__).parent / "results" / "planning.json"


def llama3_8b_shaped(num_layers: int, batch: int = 64, dim: int = 4096, heads: int = 32, hidden: int = 14336):
    """The LLaMA-3-8B-shaped model (or, with other dims, another of its family) and a global
    batch, on the meta device."""
    import torch
    from autopar.examples.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128256,
        dim=dim,
        num_heads=heads,
        num_kv_heads=8,
        hidden=hidden,
        num_layers=num_layers,
        max_seq=8192,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq))
    return model, (tokens, tokens)


def llama3_70b_shaped(num_layers: int, batch: int = 1024):
    """The LLaMA-3-70B shape (hidden 8192, 64 query / 8 key-value heads, MLP 28672) with a global
    batch of ``batch`` x 8,192 tokens, on the meta device."""
    return llama3_8b_shaped(num_layers, batch=batch, dim=8192, heads=64, hidden=28672)


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
    if name == "llama3-70b":
        return llama3_70b_shaped(layers)
    if name.startswith("stack"):
        return block_stack(layers, input_grad=name == "stack+grad")
    return make_example(name)


def _plan_one(
    model_spec: tuple[str, int],
    shape: tuple[int, ...],
    hardware: str,
    limit_s: float,
    budget: str | float | None,
    gap: float,
    queue,
    staged: tuple[str, int] | None = None,
) -> None:
    import autopar

    float32_matmuls_as_on_gpus()
    name, layers = model_spec
    started = time.perf_counter()
    model, inputs = _build(name, layers)
    names = ("pp", "dp", "tp")[-len(shape) :] if len(shape) > 1 else ("dp",)
    if isinstance(budget, float):  # a fraction of the unbudgeted plan's peak, planned first and not timed
        free = autopar.plan(model, autopar.Mesh(shape, names), inputs, hardware=hardware, solver_time_limit_s=limit_s)
        budget = int(budget * free.peak_memory_bytes)
        started = time.perf_counter()
    try:
        plan = autopar.plan(
            model,
            autopar.Mesh(shape, names),
            inputs,
            hardware=hardware,
            solver_time_limit_s=limit_s,
            memory_budget=budget,
            solver_gap=gap,
            pipeline=None
            if staged is None
            else autopar.Pipeline(axis="pp", microbatches=2 * shape[0], schedule=staged[0], stages_per_rank=staged[1]),
        )
    except autopar.AutoparError as exc:
        queue.put(
            {
                "status": "NO PLAN",
                "error": str(exc).splitlines()[0],
                "wall_s": time.perf_counter() - started,
                "budget_bytes": budget,
            }
        )
        return
    queue.put(
        {
            "wall_s": time.perf_counter() - started,
            "budget_bytes": budget,
            "stage_s": dict(plan.stage_s),
            "status": plan.solver.status,
            "gap": (plan.solver.objective_s - plan.solver.bound_s) / plan.solver.objective_s
            if plan.solver.objective_s
            else 0.0,
            "variables": plan.solver.num_variables,
            "shared_nodes": plan.solver.shared_nodes,
            "layer_classes": plan.solver.layer_classes,
            "shared_layers": plan.solver.shared_layers,
            "nodes": len(plan.nodes),
            "predicted_step_s": plan.predicted_step_s,
            "peak_memory_bytes": plan.peak_memory_bytes,
            "layout": plan.solver.layout,
            "collectives": len(plan.collectives),
            "stages": None if plan.stages is None else plan.stages.to_dict(),
        }
    )


def run(
    model_spec: tuple[str, int],
    shape: tuple[int, ...],
    hardware: str,
    limit_s: float,
    budget: str | float | None = None,
    gap: float = 1e-3,
    searches: int = 1,
    staged: tuple[str, int] | None = None,
) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_plan_one, args=(model_spec, shape, hardware, limit_s, budget, gap, queue, staged))
    started = time.perf_counter()
    proc.start()
    # each search: a solve (under a budget: its correction and the least memory); then checks of the programs
    proc.join(searches * limit_s * (1.5 if budget is None else 3) + 120 * searches)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": "NOT FINISHED", "wall_s": time.perf_counter() - started}
    if queue.empty():
        return {"status": f"FAILED (exit {proc.exitcode})", "wall_s": time.perf_counter() - started}
    return queue.get()


_HEADER = (
    f"{'model':10} {'layers':>6} {'mesh':5} {'nodes':>5} {'shared':>6} {'variables':>9} {'status':12} "
    f"{'gap':>6} {'wall s':>7} {'capture':>7} {'propagate':>9} {'solve':>7} {'memory':>7}"
)


def _row(r: dict) -> str:
    stages = r.get("stage_s", {})
    return (
        f"{r['model']:10} {r['layers'] or '':>6} {r['mesh']:5} {r.get('nodes', ''):>5} {r.get('shared_nodes', ''):>6} "
        f"{r.get('variables', ''):>9} {r['status']:12} {r['gap'] * 100 if 'gap' in r else float('nan'):>5.2f}% "
        f"{r['wall_s']:>7.1f} {stages.get('capture', float('nan')):>7.2f} "
        f"{stages.get('propagate', float('nan')):>9.2f} {stages.get('solve', float('nan')):>7.2f} "
        f"{stages.get('memory', float('nan')):>7.2f}"
    )


def _table(
    title: str,
    configs,
    hardware: str,
    limit_s: float,
    budget: str | float | None = None,
    gap: float = 1e-3,
    searches: int = 1,
    staged: tuple[str, int] | None = None,
) -> list[dict]:
    print(f"\n{title}\n{_HEADER}\n{'-' * len(_HEADER)}", flush=True)
    rows = []
    for spec, shape in configs:
        r = run(spec, shape, hardware, limit_s, budget, gap, searches, staged)
        r.update(model=spec[0], layers=spec[1], mesh="x".join(map(str, shape)))
        rows.append(r)
        print(_row(r), flush=True)
    return rows


RELOWER_MESH = (2, 2)


def relower_worker(models: list[str], out: str) -> None:
    """On each rank (under torchrun): compile each example for its batch, then time the first
    call with half that batch (capture on fake tensors, the plan checked to fit, lowering, one
    step) less a second call with it (the step alone)."""
    import torch
    import torch.distributed as dist
    from autopar.examples import make_example

    import autopar

    dist.init_process_group("gloo")
    rows = []
    for name in models:
        torch.manual_seed(0)  # every rank passes the same batch
        model, inputs = make_example(name)
        dist.barrier()
        started = time.perf_counter()
        pmodel = autopar.compile(model, autopar.Mesh(RELOWER_MESH, ("dp", "tp")), inputs, hardware="h100")
        compile_s = time.perf_counter() - started
        half = tuple(x[: x.shape[0] // 2] for x in inputs)
        steps = []
        for _ in range(2):
            dist.barrier()
            started = time.perf_counter()
            pmodel(*half).backward()
            steps.append(time.perf_counter() - started)
        rows.append(
            {
                "model": name,
                "batch": inputs[0].shape[0],
                "half": half[0].shape[0],
                "compile_s": compile_s,
                "plan_s": sum(pmodel.plan.stage_s.values()),
                "relower_s": steps[0] - steps[1],
                "step_s": steps[1],
            }
        )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def relower_table(models: list[str]) -> list[dict]:
    from autopar.runtime.launch import torchrun

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        if torchrun(4, ["-m", "benchmarks.planning", "--relower-worker", ",".join(models), out]):
            raise SystemExit("the re-lowering benchmark failed")
        rows = json.loads(Path(out).read_text())
    header = (
        f"{'model':6} {'batch':>5} {'half':>4} {'plan s':>7} {'compile s':>9} {'relower s':>9} {'relower/plan':>12}"
    )
    print(
        f"\nLowering a plan to half the batch on 2x2 gloo ranks (rank 0; plan s: the plan's stages)\n{header}\n"
        f"{'-' * len(header)}"
    )
    for r in rows:
        print(
            f"{r['model']:6} {r['batch']:>5} {r['half']:>4} {r['plan_s']:>7.2f} {r['compile_s']:>9.2f} "
            f"{r['relower_s']:>9.2f} {r['relower_s'] / r['plan_s']:>12.2f}"
        )
    return rows


def three_axes_table(args) -> list[dict]:
    """The 8B shape at 8 layers on 2x4x8 without a budget, and the 70B shape on 16x8x8 (1,024
    H100s) under ``--budget``: meshes of three axes, planned through their merged meshes."""
    rows = _table(
        f"The 8B shape on 2x4x8 {args.hardware}, unbudgeted",
        [(("llama3-8b", 8), (2, 4, 8))],
        args.hardware,
        args.limit_s,
    ) + _table(
        f"The 70B shape (batch 1024 x 8192) on 16x8x8 {args.hardware} under memory_budget={args.budget!r}, "
        f"solver_gap={args.budget_gap}",
        [(("llama3-70b", 80), (16, 8, 8))],
        args.hardware,
        args.limit_s,
        args.budget,
        args.budget_gap,
        searches=3,  # one for each merged mesh and the program lifted from them
    )
    for r in rows:
        if "peak_memory_bytes" in r:
            print(
                f"{r['model']} on {r['mesh']}: the {r['layout'] or 'searched plan'}, predicted step "
                f"{r['predicted_step_s']:.3f} s, peak {r['peak_memory_bytes'] / 2**30:.1f} GiB per device"
            )
    return rows


BUDGET_FRACTIONS = (0.6, 0.4)
BUDGET_MESH = (2, 2)


def budget_table(args) -> list[dict]:
    """The examples on 2x2 under 60% and 40% of their unbudgeted plan's peak, at the default
    solver gap: what the memory choices cost the search (the unbudgeted plan is made first, in
    the same process, and not timed)."""
    rows = []
    for fraction in BUDGET_FRACTIONS:
        for r in _table(
            f"The examples on {'x'.join(map(str, BUDGET_MESH))} {args.hardware} under {fraction:.0%} of their "
            "unbudgeted peak",
            [((name, 0), BUDGET_MESH) for name in MODELS],
            args.hardware,
            args.limit_s,
            fraction,
        ):
            r["fraction"] = fraction
            rows.append(r)
            if r["status"] == "NO PLAN":
                print(f"  {r['model']}: {r['error'][:160]}")
    return rows


def stages_table(args) -> list[dict]:
    """The 8B shape at 32 layers on pp x 8 x 8 H100s, the first axis cut into 2, 4 and 8 pipeline
    stages of twice as many micro-batches, under 1F1B and interleaved with two stages per rank:
    how planning time grows with the stages; and on 2 x 8 x 8 under ``--budget``."""
    rows = []
    for schedule, per_rank in (("1f1b", 1), ("interleaved", 2)):
        rows += _table(
            f"The 8B shape (32 layers) on pp x 8 x 8 {args.hardware}, pp pipeline positions of {per_rank} stage(s) "
            f"each, 2 x pp micro-batches, {schedule}",
            [(("llama3-8b", 32), (count, 8, 8)) for count in (2, 4, 8)],
            args.hardware,
            args.limit_s,
            staged=(schedule, per_rank),
        )
    rows += _table(
        f"The same on 2 x 8 x 8 under memory_budget={args.budget!r} (each position held to it), 1f1b",
        [(("llama3-8b", 32), (2, 8, 8))],
        args.hardware,
        args.limit_s,
        args.budget,
        args.budget_gap,
        staged=("1f1b", 1),
    )
    for r in rows:
        if r.get("stages"):
            st = r["stages"]
            units = ", ".join(str(len(x)) for x in st["segments"])
            print(
                f"{r['mesh']} {st['schedule']}: predicted step {r['predicted_step_s']:.3f} s, stages of {units} "
                f"units, peak {max(st['peak_bytes']) / 2**30:.1f} GiB per device"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-s", type=float, default=120.0, help="solver time limit per configuration")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--layers", default="2,8,32,64", help="layer counts of the 8B-shaped model")
    parser.add_argument("--budget", default="80GB", help="the device memory the budgeted 8B plans must fit")
    parser.add_argument(
        "--budget-layers", default="32", help="layer counts of the 8B-shaped model planned under --budget"
    )
    parser.add_argument("--budget-gap", type=float, default=0.01, help="solver_gap of the budgeted plans")
    parser.add_argument("--stack-layers", default="8,32,80", help="block counts of autoparallel's stack")
    parser.add_argument(
        "--only",
        choices=("stack", "relower", "3d", "stages", "budget"),
        help="plan only autoparallel's stack, only the 8B and 70B shapes on meshes of three axes, only the 8B shape "
        "in pipeline stages, only the examples under budgets, or time only the re-lowering (results to "
        "planning-<only>.json)",
    )
    parser.add_argument("--relower-worker", nargs=2, metavar=("MODELS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relower_worker:
        return relower_worker(args.relower_worker[0].split(","), args.relower_worker[1])
    settings = {  # what every planning table's results record
        "hardware_profile": args.hardware,
        "float32_matmul_precision": FLOAT32_MATMULS,
        "solver_time_limit_s": args.limit_s,
    }
    if args.only == "relower":
        write_results(
            RESULTS.with_name("planning-relower.json"), mesh=list(RELOWER_MESH), relower=relower_table(list(MODELS))
        )
        return
    if args.only == "stages":
        write_results(RESULTS.with_name("planning-stages.json"), **settings, stages=stages_table(args))
        return
    if args.only == "budget":
        write_results(RESULTS.with_name("planning-budget.json"), **settings, budgeted_examples=budget_table(args))
        return
    if args.only == "3d":
        write_results(
            RESULTS.with_name("planning-3d.json"),
            **settings,
            three_axes=three_axes_table(args),
        )
        return
    stack = _table(
        f"autoparallel's block stack on {'x'.join(map(str, SCALE_MESH))} {args.hardware} (meta device); "
        f"autoparallel: {AUTOPARALLEL_STACK_S:.0f} s at 32 blocks, proven optimal",
        [((name, int(n)), SCALE_MESH) for name in ("stack", "stack+grad") for n in args.stack_layers.split(",")],
        args.hardware,
        args.limit_s,
    )
    if args.only == "stack":
        write_results(
            RESULTS.with_name("planning-stack.json"),
            **settings,
            stack=stack,
            autoparallel_stack_s=AUTOPARALLEL_STACK_S,
        )
        return
    zoo = _table(
        "Example models (autopar.examples, as `autopar plan` builds them)",
        [((name, 0), shape) for name in MODELS for shape in MESHES],
        args.hardware,
        args.limit_s,
    )
    scale = _table(
        f"LLaMA-3-8B-shaped on {'x'.join(map(str, SCALE_MESH))} {args.hardware} (meta device), by layer count",
        [(("llama3-8b", int(n)), SCALE_MESH) for n in args.layers.split(",")],
        args.hardware,
        args.limit_s,
    )
    budgeted = _table(
        f"The same under memory_budget={args.budget!r} per device, solver_gap={args.budget_gap}",
        [(("llama3-8b", int(n)), SCALE_MESH) for n in args.budget_layers.split(",")],
        args.hardware,
        args.limit_s,
        args.budget,
        args.budget_gap,
    )
    relower = relower_table(list(MODELS))
    for r in scale + budgeted:
        if "peak_memory_bytes" in r:
            print(
                f"{r['layers']:>3} layers: predicted step {r['predicted_step_s']:.3f} s, "
                f"peak {r['peak_memory_bytes'] / 1e9:.1f} GB per device"
            )
    write_results(
        RESULTS,
        **settings,
        examples=zoo,
        llama3_8b_shaped=scale,
        llama3_8b_shaped_budget=budgeted,
        budget=args.budget,
        budget_gap=args.budget_gap,
        stack=stack,
        autoparallel_stack_s=AUTOPARALLEL_STACK_S,
        relower=relower,
    )


if __name__ == "__main__":
    main()
