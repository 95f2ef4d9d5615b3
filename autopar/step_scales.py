"""The step and collective scales of a calibrated profile: how much longer a training step on
this host runs than its ops and collectives timed alone.

Every rank trains a calibration model of four residual blocks (no model of the zoo) in
data-parallel, fully sharded and tensor-parallel layouts, planned with the profile's other
figures, and its measured forward and backward times (an AdamW step between steps, as in
training: :func:`training_step`) are fitted as ``overheads + step scale × (ops + collective
scale × collectives)`` of the predicted ones (:func:`fit_scales`; each the mean of its steps,
the time a training run takes per step). A step runs its ops and collectives longer than they
take measured alone, and its collectives longer still: ops run colder between other ops than in
a loop of one, ranks drift apart between collectives, the first to reach one waits for the
last, and a rank waiting in one sleeps and must be woken. The overheads (the step's around the
per-rank program, each node's beyond its op) are measured as a program runs them, and are not
stretched. ``autopar calibrate``
(:mod:`autopar.calibrate`) fits them last; the fidelity benchmark fits them again alongside the
plans it measures.
"""

import functools
import itertools
import statistics
import time

import torch

from autopar.cost_model.hardware import HardwareProfile


class CalibrationModel(torch.nn.Module):
    """Residual blocks (a layer norm, two linears with a tanh GELU), each run ``repeats`` times,
    then a softmax and a sum: a small training graph unlike the example models."""

    def __init__(self, dim: int = 64, layers: int = 1, repeats: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(layers))
        self.repeats = repeats

    def forward(self, x):
        for block in self.blocks:
            for _ in range(self.repeats):
                x = x + block(x)
        return torch.softmax(x, -1).square().sum()


class _Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x)), approximate="tanh"))


_STEP_LAYERS = 4
_STEP_LAYOUTS = {
    "data parallel": lambda name: "S(0)" if name == "x" else "R",
    "fully sharded": lambda name: "S(0)",
    "tensor parallel": lambda name: (
        "S(0)" if name.endswith(("up.weight", "up.bias")) else "S(1)" if name.endswith("down.weight") else "R"
    ),
}


_STEP_BATCHES = (256, 2048)
_STEP_ROUNDS, _STEPS_PER_ROUND = 4, 15


def step_scales(profile: HardwareProfile, world: int) -> tuple[float, float, dict]:
    """How many times longer the forward and backward of a training step run than ``profile``
    predicts, as ``(step_scale, collective_scale, points)``: the calibration model's
    configurations (:func:`scale_configurations`), each the mean of 60 steps on rank 0 (a run's
    time per step: on ranks sharing cores, a plan's steps can fall into a fast and a slow mode,
    and a median then lands in either), and the two scales fitted to them
    (:func:`fit_scales`; broadcast to every rank). The six configurations take turns over
    ``_STEP_ROUNDS`` rounds of ``_STEPS_PER_ROUND`` steps, so that a slow spell of the host
    stretches them alike instead of one of them."""
    import torch.distributed as dist

    configurations = scale_configurations(profile, world)
    times = {label: [] for label, _, _ in configurations}
    for _ in range(_STEP_ROUNDS):
        for label, _, step in configurations:
            times[label] += [step() for _ in range(_STEPS_PER_ROUND)]
    points = scale_points(configurations, times)
    scales = torch.tensor(fit_scales(list(points.values())), dtype=torch.float64)
    dist.broadcast(scales, 0)
    return float(scales[0]), float(scales[1]), points


def scale_configurations(profile: HardwareProfile, world: int) -> list[tuple[str, object, object]]:
    """The configurations that the step and collective scales are fitted to, as ``(label,
    plan, step)``: a calibration model (four residual blocks, unlike the example models)
    planned with ``profile`` in data-parallel, fully sharded and tensor-parallel layouts over
    every rank, on a small and a large batch (so that collectives take from about a tenth to
    most of a step), each with its training step (:func:`training_step` with AdamW; every rank
    calls it, and it returns the seconds of the forward and backward), warmed up. On one rank
    the layouts are one plan, and only the first is planned."""
    import autopar

    mesh = autopar.Mesh((world,), ("ranks",))
    layouts = list(_STEP_LAYOUTS.items())[: len(_STEP_LAYOUTS) if world > 1 else 1]
    configurations = []
    for (layout, pin), rows in itertools.product(layouts, _STEP_BATCHES):
        torch.manual_seed(0)
        model, x = CalibrationModel(128, _STEP_LAYERS, 1), torch.randn(rows, 128)
        pins = {name: pin(name) for name in ["x", *(k for k, _ in model.named_parameters())]}
        pmodel = autopar.compile(model, mesh, (x,), hardware=profile, pins=pins)
        local = pmodel.rank_part("x", x) if pmodel.passes_own_part("x") else x
        step = functools.partial(training_step, pmodel, (local,), torch.optim.AdamW(pmodel.parameters(), lr=1e-4))
        for _ in range(3):
            step()
        configurations.append((f"{layout}, batch {rows}", pmodel.plan, step))
    return configurations


def scale_points(configurations: list, times: dict[str, list[float]]) -> dict[str, tuple[float, float, float, float]]:
    """Per configuration of :func:`scale_configurations`, ``(predicted seconds of ops,
    predicted seconds of collectives, predicted seconds of overheads, measured seconds)``: the
    overheads the step overhead and every program node's (:func:`fixed_s`), the ops the rest
    but for collectives, the measured the mean of its ``times``: the points :func:`fit_scales`
    takes."""
    points = {}
    for label, plan, _ in configurations:
        fixed = fixed_s(plan)
        points[label] = (
            plan.predicted_step_s - plan.communication_s - fixed,
            plan.communication_s,
            fixed,
            statistics.mean(times[label]),
        )
    return points


def fixed_s(plan) -> float:
    """The part of ``plan``'s predicted step that the step scale does not stretch: the step's
    overhead around the per-rank program and every node's beyond its op, measured by
    ``autopar calibrate`` as a program runs them (:mod:`autopar.calibrate`)."""
    return plan.overhead_s + plan.node_overhead_s


def training_step(pmodel, inputs, opt):
    """One training step of ``pmodel`` on ``inputs`` as a training loop runs it, returning the
    seconds of its forward and backward (the part a plan predicts): gradients dropped, every
    rank starting the forward at a barrier, then ``opt`` stepped once every rank has run its
    backward. An optimizer step between steps changes what the next one finds in the cache (on
    one rank the MLP example's forward and backward took 2.42 and 2.44 ms with none, 2.53 and
    2.67 ms with AdamW, in two runs of 200 steps each); the barrier before it keeps ranks done
    first from stepping their optimizers on the cores the others' last collectives wait for,
    which devices of their own do not do (the MLP's data-parallel plan on 4 ranks, whose AdamW
    steps every parameter on every rank, measured 20.6 ms without it against 16.0 ms)."""
    import torch.distributed as dist

    opt.zero_grad()
    dist.barrier()
    started = time.perf_counter()
    pmodel(*inputs).backward()
    elapsed = time.perf_counter() - started
    dist.barrier()
    opt.step()
    return elapsed


def fit_scales(points: list[tuple[float, float, float, float]]) -> tuple[float, float]:
    """``(s, c)`` such that ``fixed + s · (ops + c · collectives)`` predicts each ``(ops,
    collectives, fixed, measured)`` point best in relative error (least squares). ``c`` may
    come out below 1: the collectives are timed after compute, waiting included, so a step can
    stretch its ops more than its collectives. Where the points do not tell the two apart
    (their shares of collectives alike) or the fit gives a scale of 0 or less, ``c`` is 1 and
    ``s`` the median of ``(measured - fixed) / (ops + collectives)``."""
    rows = [
        (ops / measured, collectives / measured, 1 - fixed / measured) for ops, collectives, fixed, measured in points
    ]
    uu, uv, vv = (sum(u * u for u, _, _ in rows), sum(u * v for u, v, _ in rows), sum(v * v for _, v, _ in rows))
    uy, vy = sum(u * y for u, _, y in rows), sum(v * y for _, v, y in rows)
    det = uu * vv - uv * uv
    if det > 1e-6 * uu * vv:
        s, sc = (uy * vv - vy * uv) / det, (vy * uu - uy * uv) / det
        if s > 0 and sc > 0:
            return s, sc / s
    return statistics.median(
        (measured - fixed) / (ops + collectives) for ops, collectives, fixed, measured in points
    ), 1.0
