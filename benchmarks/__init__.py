"""Benchmarks of autopar: each prints tables and writes JSON under ``benchmarks/results/``."""

import json
import os
import platform
import time
from pathlib import Path


def calibrated_profile(world: int) -> Path:
    """Calibrate this machine for ``world`` local ranks (``autopar calibrate``) into
    ``benchmarks/results/cpu-profile-{world}-ranks.json`` and return that path. The host's
    speed drifts within the hour, so a benchmark calibrates just before it measures."""
    import subprocess
    import sys

    path = Path(__file__).parent / "results" / f"cpu-profile-{world}-ranks.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "autopar.cli", "calibrate", "-n", str(world), "--out", str(path)], check=True)
    return path


FLOAT32_MATMULS = "high"


def float32_matmuls_as_on_gpus() -> str:
    """Have the float32 models that the benchmarks plan for GPUs priced as they would train
    there: with TF32 matmuls (``torch.set_float32_matmul_precision("high")``, as PyTorch advises
    on Ampere and later GPUs), so that the profiles price their matmuls and convolutions at the
    TF32 rate and their attention at float32's. Returns the precision, for the results."""
    import torch

    torch.set_float32_matmul_precision(FLOAT32_MATMULS)
    return FLOAT32_MATMULS


def cuda_profile() -> str:
    """The built-in profile of the CUDA device that runs: ``"h200"`` on an H200, else ``"h100"``."""
    import torch

    return "h200" if "H200" in torch.cuda.get_device_name() else "h100"


def take_turns(steps: list, counts: list[int], rounds: int) -> list[list[list[float]]]:
    """Per function of ``steps`` (each runs one timed step and returns its seconds), the
    seconds of its ``counts[i]`` steps in each of ``rounds`` rounds, the functions taking turns
    round by round, so that a slow spell of the host stretches them alike."""
    times: list[list[list[float]]] = [[] for _ in steps]
    for _ in range(rounds):
        for step, count, kept in zip(steps, counts, times, strict=True):
            kept.append([step() for _ in range(count)])
    return times


def write_results(path: Path, **fields) -> None:
    """Write ``fields`` as JSON to ``path`` with the machine and date they were measured on."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    path.write_text(json.dumps({**fields, "machine": machine, "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(f"\nwrote {path}")


def step_peak_bytes(pmodel, opt, batch) -> int:
    """The per-rank peak memory of one whole training step (zero_grad, forward, backward,
    optimizer step) by ``torch.distributed._tools.mem_tracker.MemTracker``, counting the
    module's parameters and the optimizer's state."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(pmodel, opt)
    with tracker:
        opt.zero_grad()
        pmodel(*batch).backward()
        opt.step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
