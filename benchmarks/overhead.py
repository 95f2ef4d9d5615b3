"""Run-time overhead: autopar's compiled module against torch's own parallel wrappers.

Side by side in one run, on local gloo ranks started by torchrun, the same model, batch and
optimizer (SGD) trained with:

- ``ddp``: ``DistributedDataParallel`` against autopar pinned to the same layout (batch split,
  parameters replicated);
- ``fsdp``: ``fully_shard`` on every layer and the root against autopar with every parameter
  split on dim 0 over the ranks;
- ``tp``: DTensor ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` against
  autopar pinned to the same column/row split (MLP only: the GPT example's attention reshapes
  by its global head count, which torch's tensor parallelism needs rewritten by hand);
- ``auto``: autopar's own plan, with the batch given to each rank in pieces as above.

Each autopar module also runs a third way, ``local``: the same module and steps, but the
optimizer steps the parameters' local pieces (plain tensors sharing the DTensors' storage, the
gradients' pieces handed to them) instead of the DTensor parameters themselves. The two differ
only in DTensor's dispatch in ``zero_grad`` and the optimizer step: the cost of autopar's
parameters being DTensors.

autopar plans with this machine's profile, calibrated for the rank count just before
(``autopar calibrate``): with the generic ``cpu`` profile (α of 50 µs against the 0.3–6 ms
calibrated for gloo here) it splits the MLP's loss over the ranks in the tensor-parallel
layout, at the price of a reduce-scatter, an all-gather and two small collectives where
DTensor makes one all-reduce.

Every step is zero_grad, forward, backward, optimizer step, after a barrier. torch's module and
autopar's take turns over ``ROUNDS`` rounds of ``--steps`` steps each (after ``WARMUP`` steps
of each), so that a slow spell of the host stretches both alike; the table gives the mean step
time of each (a training run's time per step), the ratio autopar / torch, the lowest and
highest ratio of one round's means, and the collectives of autopar's plan
(pins fix the parameters and the batch, not every op: where the solver finds another layout
faster under the profile, the row compares layouts, not run times of one layout). Writes
``benchmarks/results/overhead.json``.

    python -m benchmarks.overhead [--ranks 2,4] [--steps 4]
"""

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import calibrated_profile, take_turns, write_results

RESULTS = Path(__file__).parent / "results" / "overhead.json"
WARMUP = 3
ROUNDS = 5


def _model(name: str):
    from autopar.examples.gpt import GPT, GPTConfig
    from autopar.examples.mlp import MLP

    torch.manual_seed(0)
    if name == "mlp":
        return MLP(1024, 4096), (torch.randn(256, 1024), torch.randn(256, 1024)), ("x", "target")
    cfg = GPTConfig(vocab_size=1024, block_size=128, dim=256, num_heads=8, num_layers=2)
    tokens = torch.randint(0, cfg.vocab_size, (16, cfg.block_size))
    return GPT(cfg), (tokens, tokens), ("idx", "targets")


def _stepper(model, batch):
    """A function that runs one timed training step of ``model`` on ``batch`` (SGD), after a
    barrier, and returns its seconds."""
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        dist.barrier()
        started = time.perf_counter()
        opt.zero_grad()
        model(*batch).backward()
        opt.step()
        return time.perf_counter() - started

    return step


def _local_stepper(pmodel, batch):
    """As :func:`_stepper` for autopar's module, the optimizer stepping each parameter's local
    piece (a plain tensor on the DTensor's storage) with its gradient's piece."""
    import torch.distributed as dist

    params = list(pmodel.parameters())
    pieces = [p.to_local().detach() for p in params]
    opt = torch.optim.SGD(pieces, lr=1e-3)

    def step() -> float:
        dist.barrier()
        started = time.perf_counter()
        for p in params:
            p.grad = None
        pmodel(*batch).backward()
        for p, piece in zip(params, pieces):
            piece.grad = None if p.grad is None else p.grad.to_local()
        opt.step()
        return time.perf_counter() - started

    return step


def _rounds(steppers: list, steps: int) -> list[list[list[float]]]:
    """Per stepper, the step times of each of ``ROUNDS`` rounds of ``steps`` steps, the steppers
    taking turns round by round, after ``WARMUP`` untimed steps of each."""
    for step in steppers:
        for _ in range(WARMUP):
            step()
    return take_turns(steppers, [steps] * len(steppers), ROUNDS)


def _mean(rounds: list[list[float]]) -> float:
    return statistics.mean(t for r in rounds for t in r)


def _torch_variant(kind: str, model, mesh_1d):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "fsdp":
        for block in getattr(model, "blocks", getattr(model, "layers", [])):
            fully_shard(block, mesh=mesh_1d)
        return fully_shard(model, mesh=mesh_1d)
    return parallelize_module(model, mesh_1d, {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})


def _autopar_pins(kind: str, model, input_names) -> dict | None:
    batch = {k: "S(0)" for k in input_names}
    if kind == "ddp":
        return {**batch, **{k: "R" for k, _ in model.named_parameters()}}
    if kind == "fsdp":
        return {**batch, **{k: "S(0)" for k, _ in model.named_parameters()}}
    if kind == "tp":
        return {"layers.0.weight": "S(0)", "layers.0.bias": "S(0)", "layers.1.weight": "S(1)"}
    return batch


def worker(models: list[str], steps: int, profile: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh_1d = init_device_mesh("cpu", (world,))
    mesh = autopar.Mesh((world,), ("ranks",))
    rows = []
    for name in models:
        kinds = ("ddp", "fsdp", "tp", "auto") if name == "mlp" else ("ddp", "fsdp", "auto")
        for kind in kinds:
            row = {"model": name, "ranks": world, "layout": kind}
            model, batch, input_names = _model(name)
            pins = _autopar_pins(kind, model, input_names)
            local = [x.chunk(world)[rank] if k in pins and pins[k] == "S(0)" else x for k, x in zip(input_names, batch)]
            pmodel = autopar.compile(model, mesh, batch, hardware=profile, pins=pins)
            kinds = collections.Counter(c.kind for c in pmodel.plan.collectives if c.bytes > 64)
            row["autopar_collectives"] = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
            steppers = [_stepper(pmodel, local), _local_stepper(pmodel, local)]
            if kind != "auto":
                model, batch, _ = _model(name)
                shard = [x.chunk(world)[rank] for x in batch] if kind != "tp" else batch
                steppers.append(_stepper(_torch_variant(kind, model, mesh_1d), shard))
            rounds = _rounds(steppers, steps)
            row["autopar_s"] = _mean(rounds[0])
            row["local_s"] = _mean(rounds[1])
            if kind != "auto":
                row["torch_s"] = _mean(rounds[2])
                row["round_ratios"] = [statistics.mean(a) / statistics.mean(t) for a, t in zip(rounds[0], rounds[2])]
            rows.append(row)
            if rank == 0:
                print(f"  {name} {kind} on {world} ranks done", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per module and round")
    parser.add_argument("--worker", nargs=2, metavar=("PROFILE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.models.split(","), args.steps, *args.worker)

    from autopar.runtime.launch import torchrun

    rows = []
    for world in (int(n) for n in args.ranks.split(",")):
        profile = calibrated_profile(world)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            if torchrun(
                world,
                [
                    "-m",
                    "benchmarks.overhead",
                    "--models",
                    args.models,
                    "--steps",
                    str(args.steps),
                    "--worker",
                    str(profile),
                    out,
                ],
            ):
                raise SystemExit(f"the benchmark failed on {world} ranks")
            rows += json.loads(Path(out).read_text())
    header = (
        f"{'model':5} {'ranks':>5} {'layout':6} {'torch ms':>9} {'autopar ms':>10} {'autopar/torch':>13} "
        f"{'by round':>11} {'local ms':>8} {'autopar/local':>13}  "
        f"autopar's collectives over 64 bytes"
    )
    print(
        f"\nmean step time of {ROUNDS} rounds of {args.steps} steps, autopar's module (its optimizer stepping the "
        "DTensors, or their local pieces) and torch's taking turns, "
        f"after {WARMUP} warm-up steps each, gloo on this machine\n{header}\n{'-' * len(header)}"
    )
    for r in rows:
        torch_ms = r.get("torch_s", float("nan")) * 1e3
        ratio = f"{r['autopar_s'] / r['torch_s']:.2f}" if "torch_s" in r else "-"
        spread = f"{min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f}" if "torch_s" in r else "-"
        print(
            f"{r['model']:5} {r['ranks']:>5} {r['layout']:6} {torch_ms:>9.2f} {r['autopar_s'] * 1e3:>10.2f} "
            f"{ratio:>13} {spread:>11} {r['local_s'] * 1e3:>8.2f} {r['autopar_s'] / r['local_s']:>13.2f}  "
            f"{r['autopar_collectives']}"
        )
    write_results(RESULTS, steps=args.steps, rounds=ROUNDS, warmup=WARMUP, rows=rows)


if __name__ == "__main__":
    main()
