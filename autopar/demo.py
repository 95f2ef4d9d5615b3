"""``autopar demo``: plan a small model (a GPT by default) for a 2×2 mesh, train it on 4 local
ranks and compare the run with single-device training.

Run as ``autopar demo``; it starts the ranks through torchrun and runs this module on each.
"""

import argparse
import copy
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar.examples import EXAMPLES, check_example, make_example
from autopar.runtime.launch import torchrun


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=sorted(EXAMPLES), help="built-in example (default gpt)")
    p.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2 or 4 (default 2x2)")
    p.add_argument("--axes", default=None, help="axis names, comma-separated (default dp,tp or dp)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--hardware", default="cpu", help="cost-model profile to plan for (default cpu)")
    p.add_argument("--backend", default=None, choices=["eager", "inductor"], help="per-rank graph execution")
    return p


def mesh_from(shape: str, axes: str | None) -> autopar.Mesh:
    sizes = tuple(int(s) for s in shape.lower().split("x"))
    names = (
        tuple(axes.split(","))
        if axes
        else (("dp", "tp") if len(sizes) == 2 else tuple(f"axis{i}" for i in range(len(sizes))))
    )
    return autopar.Mesh(sizes, names)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    mesh = mesh_from(args.mesh, args.axes)
    if "RANK" not in os.environ:
        try:
            check_example(args.model)
        except ModuleNotFoundError as exc:
            raise SystemExit(f"autopar demo: {exc}") from None
        print(f"autopar demo: launching {mesh.size} local ranks with torchrun", flush=True)
        return torchrun(mesh.size, ["-m", "autopar.demo", *argv])
    return _run(args, mesh)


def _batches(example, steps: int):
    """``steps`` batches shaped like the example's inputs: token ids below the example's
    largest id, or normal floats."""
    gen = torch.Generator().manual_seed(1)

    def like(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen)
        return torch.randint(0, int(t.max()) + 1, t.shape, generator=gen)

    return [tuple(like(t) for t in example) for _ in range(steps)]


def _train(model, batches):
    # Adam divides each update by the gradient's magnitude plus eps. With the default eps=1e-8 a
    # gradient that is zero up to rounding (a saturated GELU unit) moves its weight by up to lr
    # either way, whatever order the ranks sum in; eps=1e-6 keeps the comparison meaningful.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _run(args, mesh: autopar.Mesh) -> int:
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    model, example = make_example(args.model)
    reference = copy.deepcopy(model)
    batches = _batches(example, args.steps)
    started = time.perf_counter()
    pmodel = autopar.compile(model, mesh, batches[0], hardware=args.hardware, backend=args.backend)
    rank = dist.get_rank()
    if rank == 0:
        print(f"planned and compiled in {time.perf_counter() - started:.1f} s\n", flush=True)
        print(pmodel.plan, "\n", flush=True)
    started = time.perf_counter()
    losses = _train(pmodel, batches)
    elapsed = time.perf_counter() - started
    params = pmodel.full_state_dict(rank0_only=True)
    status = 0
    if rank == 0:
        ref_losses = _train(reference, batches)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        ref_params = reference.state_dict()
        diffs = {k: float((params[k] - ref_params[k]).abs().max()) for k in ref_params}
        worst = max(diffs, key=diffs.get)
        print(f"trained {args.steps} AdamW steps on {mesh.size} ranks in {elapsed:.1f} s")
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"  step {i}: loss {a:.6f} on {mesh}, {b:.6f} on one device")
        print(
            f"largest relative loss difference {loss_diff:.2e}; largest parameter difference "
            f"{diffs[worst]:.2e} ({worst})"
        )
        ok = loss_diff <= 1e-5 and all(
            torch.allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-5) for k in ref_params
        )
        print(
            "MATCH: the parallel run reproduces single-device training"
            if ok
            else "MISMATCH: results differ from one device"
        )
        status = 0 if ok else 1
    box = [status]
    dist.broadcast_object_list(box, src=0)
    dist.destroy_process_group()
    return box[0]


if __name__ == "__main__":
    sys.exit(main())
