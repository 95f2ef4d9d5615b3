"""``autopar calibrate``: measure this machine into a hardware profile.

Started on N local ranks through torchrun (as training is), every rank measures at the same
time, so the figures include the ranks' contention for cores and memory:

- matmul throughput (``torch.mm`` of square fp32 matrices, the fastest size),
- memory bandwidth (``torch.add`` over 64 MiB operands: 3 tensors' bytes per call),
- the fixed time of running one op (an aten add of one-element tensors),
- the fraction of that roofline that ops of training-graph shapes reach (skinny and square
  matmuls, small and large elementwise ops; the median), the profile's efficiency,
- α and β of each collective over the N ranks (the functional collectives the per-rank graph
  uses), from a least-squares fit of ``t = α + k·B·β`` over message sizes (on the relative
  error, so that small messages weigh as much as large ones), with ``k`` the ring factor of
  :func:`autopar.passes.propagation.redistribute.step_s`. Each collective is timed as a step runs it:
  after the ops that make its input, on every rank. A chain of ``_CHAIN`` pairs of a few
  matmuls and the collective, every rank starting at one barrier, less the same chain's
  matmuls without the collectives. A collective that follows compute takes longer than one
  that follows another collective, since ranks sharing cores finish their ops at different
  times and sleep in the collective until the last arrives: on 4 ranks sharing 2 cores, an
  all-gather of 32 KiB took 2.8 ms in a chain of collectives and 4.0 to 5.7 ms after 0.5 to
  4 ms of matmuls; on 2 ranks, 0.55 ms and 0.7 to 1.5 ms.

The profile also says that it describes the host that will run the plan, so that plans made
with it time each op on this host (:mod:`autopar.cost_model.op_timing`) instead of using the
roofline. More figures serve those timings:

- the node overhead: rank 0 alone runs the joint training graph of a calibration block (layer
  norm, two linears with a tanh GELU, a softmax and a sum; no model of the zoo) and compares
  it with the sum of its ops timed one by one, five times over; the median difference per node
  is what a program adds,
- the contention: how many more matmuls rank 0 runs in 0.1 s alone (the other ranks asleep)
  than while every rank runs them (ranks sharing cores),
- the step overhead: rank 0 alone runs stacks of 1 to 16 linear layers through autopar's
  autograd step and compares each with its forward and backward programs run directly; a line
  through them gives a fixed time per step and a time per parameter,
- the step and collective scales (:mod:`autopar.step_scales`): how much longer the calibration
  model's training steps, planned with the figures above, run their ops than those figures
  price them (the node and step overheads aside), and their collectives than theirs.

Rank 0 writes the profile as JSON; ``hardware="that.json"`` plans with it.

    autopar calibrate [-n 4] [--out cpu-profile.json]
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

from autopar.core.move import COLLECTIVE_KINDS
from autopar.cost_model.hardware import Fitted, HardwareProfile, Link, save_profile
from autopar.runtime.allocator import keep_freed_memory
from autopar.step_scales import CalibrationModel, step_scales

_SIZES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB per rank, toward a gradient bucket (25 MiB)
_CHAIN = 5


def _median_s(fn, repeats: int = 10, warmup: int = 2, *, together: bool = True) -> float:
    """Median seconds of ``fn``; ``together``, every rank starts each call at a barrier (all
    ranks measure at once), else the calling rank times it on its own."""
    return statistics.median(_times_s(fn, repeats, warmup, together=together))


def _times_s(fn, repeats: int, warmup: int = 0, *, together: bool = True) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, as
    :func:`_median_s` times them."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + repeats):
        if together:
            dist.barrier()
        started = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


_WORK = 256, 3
"""The matmuls before each collective timed: 3 of two 256 × 256 fp32 matrices (0.2 ms each on
one of this machine's cores, a rank's thread)."""


def _after_work_s(fn, repeats: int = 6) -> float:
    """Seconds per call of collective ``fn`` where every rank runs the ``_WORK`` matmuls before
    each call: the median of ``repeats`` chains of ``_CHAIN`` pairs that every rank starts at
    one barrier, less the median of as many chains of the matmuls alone (timed in turn with
    them, so that both see the same load)."""
    size, count = _WORK
    a, b = torch.randn(size, size), torch.randn(size, size)

    def work():
        for _ in range(count):
            torch.mm(a, b)

    def paired():
        for _ in range(_CHAIN):
            work()
            fn()

    def alone():
        for _ in range(_CHAIN):
            work()

    _times_s(paired, 0, 1)
    _times_s(alone, 0, 1)
    with_work, without = [], []
    for _ in range(repeats):
        with_work += _times_s(paired, 1)
        without += _times_s(alone, 1)
    return max(statistics.median(with_work) - statistics.median(without), 1e-6 * _CHAIN) / _CHAIN


def _collective(kind: str, nbytes: int, world: int):
    from torch.distributed import _functional_collectives as funcol

    group = torch.distributed.group.WORLD
    numel = max(world, nbytes // 4 // world * world)
    x = torch.randn(numel)
    if kind == "all_reduce":
        return lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)), numel * 4
    if kind == "all_gather":
        part = x[: numel // world].clone()
        return lambda: funcol.wait_tensor(funcol.all_gather_single(part, 0, group)), numel * 4
    if kind == "reduce_scatter":
        return lambda: funcol.wait_tensor(funcol.reduce_scatter_single(x, "sum", 0, group)), numel * 4
    return lambda: funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group)), numel * 4


def _ping(nbytes: int, world: int):
    """A round trip of ``nbytes`` between the ranks of each pair (0 and 1, 2 and 3, ...; a last
    odd rank waits): the even rank sends and waits for the message back, as a pipeline stage
    waits for what the next one sends back. Half of it is one send on the critical path."""
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = rank ^ 1
    message = torch.randn(max(1, nbytes // 4))

    def round_trip():
        if peer >= world:
            return
        if rank % 2 == 0:
            dist.send(message, peer)
            dist.recv(message, peer)
        else:
            dist.recv(message, peer)
            dist.send(message, peer)

    return round_trip, message.numel() * 4


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``t = α + x·β`` through ``(x, t)`` points, both clamped at zero, by least squares on the
    relative error: every message size counts alike, so the small messages that dominate
    training graphs set α instead of being swamped by the largest ones."""
    weights = [1 / t**2 for _, t in points]
    w = sum(weights)
    wx = sum(k * x for k, (x, _) in zip(weights, points))
    wt = sum(k * t for k, (_, t) in zip(weights, points))
    wxx = sum(k * x * x for k, (x, _) in zip(weights, points))
    wxt = sum(k * x * t for k, (x, t) in zip(weights, points))
    det = w * wxx - wx * wx
    beta = (w * wxt - wx * wt) / det if det > 0 else 0.0
    if beta <= 0:
        return wt / w, 0.0
    alpha = (wt - beta * wx) / w
    if alpha < 0:
        return 0.0, wxt / wxx
    return alpha, beta


def measure(world: int) -> tuple[HardwareProfile, dict]:
    """Measure on every rank of the running process group; returns the profile and raw figures.
    Freed memory is kept for reuse first, as autopar's runtime keeps it on the CPU
    (:func:`autopar.runtime.allocator.keep_freed_memory`)."""
    keep_freed_memory()
    torch.manual_seed(0)
    matmul = {}
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        matmul[n] = 2 * n**3 / _median_s(lambda: torch.mm(a, b))
    big = [torch.randn(16 * 2**20) for _ in range(3)]
    bandwidth = 3 * big[0].numel() * 4 / _median_s(lambda: torch.add(big[0], big[1], out=big[2]))
    one = [torch.ones(1), torch.ones(1)]
    overhead = _median_s(lambda: [torch.ops.aten.add.Tensor(one[0], one[1]) for _ in range(100)]) / 100
    peak_flops = max(matmul.values())
    efficiency = _efficiency(peak_flops, bandwidth, overhead)
    collectives, raw = [], {}
    for kind in COLLECTIVE_KINDS:
        points = []
        for size in _SIZES:
            fn, nbytes = _collective(kind, size, world)
            rounds = 2 if kind == "all_reduce" else 1
            points.append((rounds * (world - 1) / world * nbytes, _after_work_s(fn)))
        alpha, beta = _fit(points)
        collectives.append((kind, alpha, beta))
        raw[kind] = points
    default = next(c for c in collectives if c[0] == "all_reduce")
    send = None
    if world > 1:
        raw["send"] = [(nbytes, _median_s(fn) / 2) for fn, nbytes in (_ping(size, world) for size in _SIZES)]
        send = _fit(raw["send"])
    link = Link(default[1], default[2], tuple(collectives), send=send)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
    contention = _contention()
    node_overhead, program = _node_overhead()
    step_overhead, param_overhead, steps = _step_overhead()
    alone = HardwareProfile(
        name=f"calibrated-{os.uname().nodename}-{world}-ranks",
        flops_per_s=peak_flops,
        memory_bytes_per_s=bandwidth,
        efficiency=efficiency,
        memory_bytes=memory,
        devices_per_host=world,
        intra_host=link,
        inter_host=link,
        fitted=Fitted(
            op_overhead_s=overhead,
            timed_ops=True,
            node_overhead_s=node_overhead,
            step_overhead_s=step_overhead,
            param_overhead_s=param_overhead,
            contention=contention,
        ),
    )
    step_scale, collective_scale, step_points = step_scales(alone, world)
    fitted = dataclasses.replace(alone.fitted, step_scale=step_scale, collective_scale=collective_scale)
    profile = dataclasses.replace(alone, fitted=fitted)
    return profile, {
        "ranks": world,
        "matmul_flops_per_s": matmul,
        "copy_bytes_per_s": bandwidth,
        "op_overhead_s": overhead,
        "efficiency": efficiency,
        "collective_points_bytes_s": raw,
        "contention": contention,
        "node_overhead_s": node_overhead,
        "calibration_program": program,
        "step_overhead_points": steps,
        "step_scale_points": step_points,
    }


def _contention() -> float:
    """How many more matmuls rank 0 runs in 0.1 s alone (the other ranks asleep) than while
    every rank runs them (the median of 3 of each)."""
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def calls_in(seconds: float = 0.1) -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(a, b)
            count += 1
        return count

    alone, together = [], []
    for _ in range(3):
        dist.barrier()
        if dist.get_rank() == 0:
            alone.append(calls_in())
        else:
            time.sleep(0.2)
        dist.barrier()
        together.append(calls_in())
    ratio = torch.tensor([statistics.median(alone) / statistics.median(together) if alone else 0.0])
    dist.broadcast(ratio, 0)
    return max(1.0, float(ratio))


_NODE_ROUNDS = 5


def _node_overhead() -> tuple[float, dict]:
    """Seconds per node that running the calibration block's joint graph takes beyond its ops
    timed one by one (rank 0 alone; broadcast to every rank): the median over ``_NODE_ROUNDS``
    rounds, each timing the program and then every op afresh, since the difference of the two
    is small beside either."""
    import torch.distributed as dist

    from autopar.core.mesh import Mesh
    from autopar.core.placement import R
    from autopar.core.strategy import Strategy
    from autopar.cost_model.op_timing import OpTimer
    from autopar.passes.analysis.capture import capture
    from autopar.passes.rules import tensor_args

    figures = torch.zeros(2 * _NODE_ROUNDS + 1, dtype=torch.float64)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model, x = CalibrationModel(), torch.randn(256, 64)
        captured = capture(model, (x,))
        state = dict(model.named_parameters())
        args = [
            state[k.name] if k.kind == "param" else x if k.kind == "input" else torch.ones(()) for k in captured.inputs
        ]
        graph = captured.graph
        graph.graph.set_codegen(torch.fx.graph.CodeGen())  # flat positional inputs
        graph.recompile()
        ops = [n for n in graph.graph.nodes if n.op == "call_function" and n.target.__name__ != "getitem"]

        def replicated(node) -> Strategy:
            outs = node.meta["val"]
            outputs = tuple(None if o is None else (R,) for o in (outs if isinstance(outs, (list, tuple)) else [outs]))
            return Strategy(outputs, ((R,),) * len(tensor_args(node)))

        strategies = [replicated(n) for n in ops]
        rounds = []
        for _ in range(_NODE_ROUNDS):
            with torch.no_grad():
                program = _median_s(lambda: graph(*args), 20, 3, together=False)
            timer = OpTimer(Mesh((1,), ("one",)), fresh=True)
            timed = [timer.node_s(node, strategy) for node, strategy in zip(ops, strategies)]
            rounds += [program, sum(t for t in timed if t is not None)]
        figures = torch.tensor([*rounds, len(ops)], dtype=torch.float64)
    dist.broadcast(figures, 0)
    *rounds, count = (float(f) for f in figures)
    programs, ops_s = rounds[0::2], rounds[1::2]
    per_node = statistics.median((program - timed) / count for program, timed in zip(programs, ops_s))
    return max(0.0, per_node), {"program_s": programs, "ops_timed_s": ops_s, "nodes": int(count)}


_STACKS = (1, 2, 4, 8, 16)


class _LinearStack(torch.nn.Module):
    def __init__(self, num_layers: int, dim: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def _step_overhead() -> tuple[float, float, list]:
    """``(seconds per step, seconds per parameter and step)`` that autopar's autograd step adds
    to running its forward and backward programs (rank 0 alone, stacks of 1 to 16 linear
    layers, a line through them; broadcast to every rank)."""
    import torch.distributed as dist

    figures = torch.zeros(len(_STACKS), 2, dtype=torch.float64)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        figures = torch.tensor([_runtime_overhead(_LinearStack(layers)) for layers in _STACKS], dtype=torch.float64)
    dist.broadcast(figures, 0)
    points = figures.tolist()
    fixed, per_param = _fit([(n, max(s, 1e-7)) for n, s in points])
    return fixed, per_param, points


def _runtime_overhead(model: torch.nn.Module) -> tuple[float, float]:
    """``(parameters, seconds)`` that a training step through the runtime's autograd function
    takes beyond the model's forward and backward programs."""
    from autopar.passes.analysis.capture import capture
    from autopar.passes.lower.partition import partition
    from autopar.runtime.program import Program, Step

    x = torch.randn(256, 64)
    captured = capture(model, (x,))
    parts = partition(
        captured.graph,
        [k.kind == "tangent" for k in captured.inputs],
        [None if k is None else k.kind == "grad" for k in captured.outputs],
    )
    grads = captured.graded
    program = Program(
        parts,
        "eager",
        [k.kind == "param" and k.name in grads for k in captured.inputs if k.kind != "tangent"],
        [None for k in captured.outputs if k is not None and k.kind != "grad"],
    )
    state = dict(model.named_parameters())
    flat = [state[k.name] if k.kind == "param" else x for k in captured.inputs if k.kind != "tangent"]

    def step():
        for p in state.values():
            p.grad = None
        Step.apply(program, *flat)[0].backward()

    with torch.no_grad():
        results = program.forward(*flat)
        saved, tangents = results[program.num_outputs :], [torch.ones_like(r) for r in results[: program.num_outputs]]
        programs = _median_s(lambda: program.forward(*flat), 50, 5, together=False) + _median_s(
            lambda: program.backward([*saved, *tangents]), 50, 5, together=False
        )
    return len(state), max(0.0, _median_s(step, 50, 5, together=False) - programs)


# Ops of the shapes training graphs are made of: skinny and square matmuls, elementwise ops
# small and large. (FLOPs, bytes moved, the op.)
def _suite():
    def mm(m, k, n):
        a, b = torch.randn(m, k), torch.randn(k, n)
        return 2 * m * k * n, 4 * (m * k + k * n + m * n), lambda: torch.ops.aten.mm.default(a, b)

    def pointwise(*shape):
        x, y = torch.randn(*shape), torch.randn(*shape)
        return x.numel(), 12 * x.numel(), lambda: torch.ops.aten.mul.Tensor(x, y)

    return [
        mm(8, 256, 4096),
        mm(64, 512, 512),
        mm(256, 64, 256),
        mm(512, 1024, 512),
        mm(2048, 256, 64),
        pointwise(8, 4096),
        pointwise(64, 32, 64),
        pointwise(256, 1024),
        pointwise(1024, 1024),
    ]


def _efficiency(flops_per_s: float, bytes_per_s: float, overhead_s: float) -> float:
    """The median fraction of the roofline that the suite's ops reach, past the per-op overhead."""
    ratios = []
    for flops, nbytes, op in _suite():
        measured = _median_s(lambda: [op() for _ in range(10)]) / 10 - overhead_s
        ratios.append(max(flops / flops_per_s, nbytes / bytes_per_s) / max(measured, 1e-9))
    return min(statistics.median(ratios), 1.0)


def oversubscribed(ranks: int, cores: int) -> str | None:
    """What to expect of a profile measured with more ranks than ``cores``, or ``None``."""
    if ranks <= cores:
        return None
    return (
        f"{ranks} ranks share {cores} CPU cores: they take turns on them, and a collective waits for ranks that "
        "are not running, so step times depend on what the other ranks run meanwhile. The profile's scales fit "
        "them on average; predictions of other models' steps can be off by more than with a core per rank"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--ranks", type=int, default=4, help="local ranks to measure with (default 4)")
    parser.add_argument(
        "--out", default="cpu-profile.json", help="where to write the profile (default cpu-profile.json)"
    )
    args = parser.parse_args(argv)
    ranks = f"{args.ranks} rank{'s' * (args.ranks != 1)}"
    if "RANK" not in os.environ:
        from autopar.runtime.launch import torchrun

        print(f"autopar calibrate: measuring with {ranks} on this host", flush=True)
        if note := oversubscribed(args.ranks, len(os.sched_getaffinity(0))):
            print(f"autopar calibrate: {note}", flush=True)
        return torchrun(args.ranks, ["-m", "autopar.calibrate", *(argv if argv is not None else sys.argv[1:])])
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        profile, measured = measure(dist.get_world_size())
        if dist.get_rank() == 0:
            save_profile(profile, args.out, **measured)
            fitted = profile.fitted
            print(
                f"matmul {profile.flops_per_s / 1e9:.1f} GFLOP/s, memory {profile.memory_bytes_per_s / 1e9:.1f} GB/s, "
                f"{fitted.op_overhead_s * 1e6:.1f} us per op, ops reach {profile.efficiency:.0%} of that roofline; "
                f"a program node adds {fitted.node_overhead_s * 1e6:.1f} us to its op timed alone, a step "
                f"{fitted.step_overhead_s * 1e6:.0f} us and {fitted.param_overhead_s * 1e6:.1f} us per parameter; "
                f"{ranks} computing together run {fitted.contention:.2f}x slower than one; a "
                f"training step runs its ops {fitted.step_scale:.2f}x longer than these figures price them, "
                f"its collectives {fitted.collective_scale:.2f}x that again"
            )
            sends = [("send", *profile.intra_host.send)] if profile.intra_host.send is not None else []
            for kind, alpha, beta in [*profile.intra_host.per_kind, *sends]:
                print(
                    f"{kind:15} alpha {alpha * 1e6:8.1f} us   beta {1 / beta / 1e9 if beta else float('inf'):8.2f} GB/s"
                )
            print(f"wrote {args.out}; plan with hardware={args.out!r}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
