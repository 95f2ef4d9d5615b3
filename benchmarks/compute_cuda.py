"""The roofline against one GPU: is a plan's compute priced at the speed of its number format?

A GPT is planned for one GPU with the profile of the GPU that runs (``h100`` or ``h200``),
compiled by Inductor (Triton kernels) and trained for a few AdamW steps, once per format of its
matrix products: float32 with TF32 off, float32 with TF32 on
(``torch.set_float32_matmul_precision("high")``) and the model in bfloat16. Per format the table
gives the predicted compute of the step (the roofline of every op at the profile's rate for its
format, times the profile's efficiency) and the measured forward and backward (median of the
timed steps, CUDA-synchronised), and their ratio. Beside it, the rate a large matmul and the
attention of the model's shape reach in each format against the profile's peak for it.

Writes ``benchmarks/results/compute_cuda.json``.

    python -m benchmarks.compute_cuda [--layers 4] [--steps 8]
"""

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks import cuda_profile, write_results

RESULTS = Path(__file__).parent / "results" / "compute_cuda.json"
FORMATS = ("float32", "tf32", "bfloat16")


def _set_format(fmt: str) -> torch.dtype:
    """Set torch's TF32 flags for ``fmt`` and return the model's dtype."""
    tf32 = fmt == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return torch.bfloat16 if fmt == "bfloat16" else torch.float32


def _timed_s(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def kernel_rates(fmt: str, heads: int, seq: int, head_dim: int, batch: int) -> dict:
    """FLOP/s of an 8192-cube matmul and of the model's attention (forward and backward) in ``fmt``."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    dtype = _set_format(fmt)
    a, b = torch.randn(8192, 8192, device="cuda", dtype=dtype), torch.randn(8192, 8192, device="cuda", dtype=dtype)
    matmul = 2 * 8192**3 / _timed_s(lambda: a @ b)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    return {"matmul_flops_per_s": matmul, "attention_flops_per_s": flops / _timed_s(attention)}


def measure(fmt: str, layers: int, steps: int, hardware: str) -> dict:
    from autopar.examples.gpt import GPT, GPTConfig

    import autopar

    dtype = _set_format(fmt)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, block_size=1024, dim=1024, num_heads=16, num_layers=layers)
    model = GPT(cfg).to(device="cuda", dtype=dtype)
    batch = (
        torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda"),
        torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda"),
    )
    started = time.perf_counter()
    pmodel = autopar.compile(copy.deepcopy(model), autopar.Mesh((1,), ("x",)), batch, hardware=hardware)
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-4)
    forward_backward, whole = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        begun = time.perf_counter()
        opt.zero_grad()
        pmodel(*batch).backward()
        torch.cuda.synchronize()
        middle = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if i == 0:
            compiled_s = time.perf_counter() - started
        elif i >= 2:
            forward_backward.append(middle - begun)
            whole.append(time.perf_counter() - begun)
    plan = pmodel.plan
    return {
        "format": fmt,
        "predicted_s": plan.predicted_step_s,
        "compute_s": plan.compute_s,
        "measured_s": statistics.median(forward_backward),
        "step_s": statistics.median(whole),
        "plan_and_compile_s": compiled_s,
        "kernels": kernel_rates(fmt, cfg.num_heads, 1024, cfg.dim // cfg.num_heads, 8),
    }


def print_table(rows: list[dict], hardware: str, peaks: dict) -> None:
    print(f"\nGPT on one GPU, Inductor, planned with the {hardware!r} profile (fwd+bwd ms; TFLOP/s)")
    header = (
        f"{'format':>8} {'pred. ms':>8} {'meas. ms':>8} {'meas./pred.':>11} {'step ms':>8} "
        f"{'peak':>6} {'matmul':>7} {'attention':>9}"
    )
    print(f"{header}\n{'-' * len(header)}")
    for r in rows:
        k = r["kernels"]
        print(
            f"{r['format']:>8} {r['predicted_s'] * 1e3:>8.2f} {r['measured_s'] * 1e3:>8.2f} "
            f"{r['measured_s'] / r['predicted_s']:>11.2f} {r['step_s'] * 1e3:>8.2f} {peaks[r['format']] / 1e12:>6.0f} "
            f"{k['matmul_flops_per_s'] / 1e12:>7.0f} {k['attention_flops_per_s'] / 1e12:>9.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.compute_cuda needs a CUDA device")
    import torch.distributed as dist
    from autopar.cost_model.hardware import resolve_profile

    hardware = cuda_profile()
    peaks = dict(resolve_profile(hardware).matrix_flops_per_s)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = []
    try:
        for fmt in args.formats.split(","):
            rows.append(measure(fmt, args.layers, args.steps, hardware))
            print(f"  {fmt} done in {rows[-1]['plan_and_compile_s']:.0f} s of planning and compiling", flush=True)
    finally:
        dist.destroy_process_group()
    print_table(rows, hardware, peaks)
    write_results(
        RESULTS, device=torch.cuda.get_device_name(), hardware=hardware, layers=args.layers, steps=args.steps, rows=rows
    )


if __name__ == "__main__":
    main()
