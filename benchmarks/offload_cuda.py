"""Recomputation and offload on a CUDA device: does the plan's program run as planned?

A GPT in fp32 on one GPU, planned with the profile of the GPU that runs (``h100`` or ``h200``)
without a budget and under budgets that only recomputation and copies to host memory can meet,
each plan compiled by Inductor (Triton kernels) and trained for a few AdamW steps beside the
same model trained eagerly. Per budget the table gives the predicted and measured step time
(median of the timed steps), the predicted peak and the peak of a whole step as the CUDA caching
allocator saw it (``torch.cuda.max_memory_allocated``), of which "outside" was allocated before
the model was built (the batches, cuBLAS's workspaces; the reference run's results are kept on
the host), what the plan offloads and how many layers it prefetches, the largest loss and
parameter differences from the eager run, and, from a profiler trace of one step, the time of
the copies to and from the host, the streams they ran on, and how much of it ran while a
compute kernel was running.

Writes ``benchmarks/results/offload_cuda.json``.

    python -m benchmarks.offload_cuda [--fractions 0.5,0.35] [--steps 8] [--layers 8]
"""

import argparse
import copy
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import cuda_profile, write_results

RESULTS = Path(__file__).parent / "results" / "offload_cuda.json"
GIB = 2**30
LR = 1e-4


def _model(layers: int):
    from autopar.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, block_size=1024, dim=1024, num_heads=16, num_layers=layers)
    batches = [
        (torch.randint(0, cfg.vocab_size, (8, 1024)), torch.randint(0, cfg.vocab_size, (8, 1024))) for _ in range(2)
    ]
    return GPT(cfg), batches


def _step(model, opt, batch) -> float:
    opt.zero_grad()
    loss = model(*batch)
    loss.backward()
    opt.step()
    return float(loss)


def _run(model, opt, batches, steps: int) -> tuple[list[float], float, int, int]:
    """Losses of ``steps`` steps, the median time of those after the first two (the first plans
    and compiles), and of the last step (which has the optimizer state of the steps before it)
    the peak allocated bytes up to the end of the forward and over the whole step."""
    losses, times = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        torch.cuda.synchronize()
        if i < steps - 1:
            started = time.perf_counter()
            losses.append(_step(model, opt, batch))
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - started)
            continue
        torch.cuda.reset_peak_memory_stats()
        opt.zero_grad()
        loss = model(*batch)
        torch.cuda.synchronize()
        forward_peak = torch.cuda.max_memory_allocated()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, statistics.median(times), forward_peak, torch.cuda.max_memory_allocated()


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def copy_overlap(trace: dict) -> dict:
    """From a chrome trace of the profiler: per direction of host copy and stream it ran on, the
    copies' number and total time, and the time during which a kernel ran on another stream."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    result: dict[str, dict] = {}
    for direction in ("DtoH", "HtoD"):
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and direction in e["name"]]
        for stream in sorted({e["args"].get("stream") for e in copies}):
            busy = _merged([(k["ts"], k["ts"] + k["dur"]) for k in kernels if k["args"].get("stream") != stream])
            mine = [e for e in copies if e["args"].get("stream") == stream]
            overlapped = sum(
                max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start)) for e in mine for start, end in busy
            )
            result[f"{direction} stream {stream}"] = {
                "copies": len(mine),
                "ms": sum(e["dur"] for e in mine) / 1e3,
                "overlapped_ms": overlapped / 1e3,
            }
    return result


def _profile(model, opt, batch) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, opt, batch)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return copy_overlap(json.loads(Path(path).read_text()))


def measure(
    layers: int, fractions: list[float], steps: int, time_limit_s: float, backend: str, hardware: str
) -> list[dict]:
    import autopar

    mesh = autopar.Mesh((1,), ("x",))
    cpu_model, cpu_batches = _model(layers)
    batches = [tuple(t.cuda() for t in b) for b in cpu_batches]

    reference = copy.deepcopy(cpu_model).cuda()
    ref_losses, ref_s, ref_forward, ref_peak = _run(
        reference, torch.optim.AdamW(reference.parameters(), lr=LR), batches, steps
    )
    ref_params = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    del reference
    torch.cuda.empty_cache()
    print(f"eager reference: {ref_s * 1e3:.1f} ms per step, peak {ref_peak / GIB:.2f} GiB", flush=True)

    unbudgeted = autopar.plan(
        copy.deepcopy(cpu_model).cuda(), mesh, batches[0], hardware=hardware, solver_time_limit_s=time_limit_s
    ).peak_memory_bytes
    rows = [{"eager": True, "measured_s": ref_s, "forward_peak_bytes": ref_forward, "measured_peak_bytes": ref_peak}]
    for fraction in [None, *fractions]:
        budget = None if fraction is None else int(unbudgeted * fraction)
        gc.collect()  # the models planning traced are in reference cycles
        torch.cuda.synchronize()
        outside = torch.cuda.memory_allocated()  # the batches, cuBLAS's workspaces
        model = copy.deepcopy(cpu_model).cuda()
        try:
            pmodel = autopar.compile(
                model,
                mesh,
                batches[0],
                hardware=hardware,
                memory_budget=budget,
                solver_time_limit_s=time_limit_s,
                backend=backend,
            )
        except autopar.InfeasiblePlanError as exc:
            rows.append(
                {"fraction": fraction, "budget_bytes": budget, "feasible": False, "reason": str(exc).splitlines()[0]}
            )
            print(f"  budget {fraction}: no plan ({rows[-1]['reason']})", flush=True)
            continue
        opt = pmodel.optimizer(torch.optim.AdamW, lr=LR)
        losses, step_s, forward_peak, peak = _run(pmodel, opt, batches, steps)
        params = {k: v.cpu() for k, v in pmodel.full_state_dict().items()}
        overlap = _profile(pmodel, opt, batches[0])
        plan = pmodel.plan
        row = {
            "fraction": fraction,
            "budget_bytes": budget,
            "feasible": True,
            "solve_s": plan.solver.solve_s,
            "predicted_s": plan.predicted_step_s,
            "measured_s": step_s,
            "predicted_peak_bytes": plan.peak_memory_bytes,
            "forward_peak_bytes": forward_peak,
            "measured_peak_bytes": peak,
            "outside_bytes": outside,
            "offloaded_bytes": sum(n.activation_bytes for n in plan.nodes if n.activation == "offload"),
            "recomputed_bytes": sum(n.activation_bytes for n in plan.nodes if n.activation == "recompute"),
            "prefetched": len(plan.prefetched),
            "host_params": len(plan.host_params),
            "host_optimizer": len(plan.host_optimizer),
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_max_diff": max(float((params[k].float() - ref_params[k].float()).abs().max()) for k in ref_params),
            "copies": overlap,
        }
        rows.append(row)
        print(f"  budget {fraction or 'none'} done", flush=True)
        del pmodel, opt, model, params
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], backend: str, hardware: str) -> None:
    header = (
        f"{'budget':>6} {'pred. ms':>8} {'meas. ms':>8} {'pred. GiB':>9} {'fwd GiB':>7} {'meas. GiB':>9} "
        f"{'outside':>7} "
        f"{'offl. GiB':>9} {'recomp. GiB':>11} {'ahead':>5} {'loss rel':>8} {'param diff':>10}  host copies"
    )
    print(f"\nGPT on one GPU (fp32, {backend}), planned for the {hardware} profile\n{header}\n{'-' * len(header)}")
    for r in rows:
        if r.get("eager"):
            print(
                f"{'eager':>6} {'':>8} {r['measured_s'] * 1e3:>8.1f} {'':>9} {r['forward_peak_bytes'] / GIB:>7.2f} "
                f"{r['measured_peak_bytes'] / GIB:>9.2f}"
            )
            continue
        budget = "none" if r["fraction"] is None else f"{r['fraction']:.0%}"
        if not r["feasible"]:
            print(f"{budget:>6}  no plan: {r['reason']}")
            continue
        copies = "; ".join(
            f"{k}: {c['copies']} in {c['ms']:.1f} ms, {c['overlapped_ms'] / c['ms']:.0%} beside kernels"
            for k, c in r["copies"].items()
            if c["ms"] > 0.01
        )
        print(
            f"{budget:>6} {r['predicted_s'] * 1e3:>8.1f} {r['measured_s'] * 1e3:>8.1f} "
            f"{r['predicted_peak_bytes'] / GIB:>9.2f} {r['forward_peak_bytes'] / GIB:>7.2f} "
            f"{r['measured_peak_bytes'] / GIB:>9.2f} "
            f"{r['outside_bytes'] / GIB:>7.2f} {r['offloaded_bytes'] / GIB:>9.2f} {r['recomputed_bytes'] / GIB:>11.2f} "
            f"{r['prefetched']:>5} "
            f"{r['loss_rel']:>8.1e} {r['param_max_diff']:>10.1e}  {copies or '-'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.5,0.35", help="budgets as fractions of the unbudgeted plan's peak")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--time-limit", type=float, default=120.0, help="the solver's time limit per plan, seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.offload_cuda needs a CUDA device")
    import torch.distributed as dist

    hardware = cuda_profile()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    try:
        rows = measure(
            args.layers,
            [float(f) for f in args.fractions.split(",")],
            args.steps,
            args.time_limit,
            args.backend,
            hardware,
        )
    finally:
        dist.destroy_process_group()
    print_table(rows, args.backend, hardware)
    write_results(
        RESULTS,
        device=torch.cuda.get_device_name(),
        hardware=hardware,
        backend=args.backend,
        layers=args.layers,
        steps=args.steps,
        rows=rows,
    )


if __name__ == "__main__":
    main()
