"""Pipeline stages: the option that asks for them and the plan's record of them.

With stages, one mesh axis holds consecutive parts of the model instead of copies of it: the
rank at position ``s`` along the pipeline axis runs the layers of stage ``s``, for each
micro-batch (a slice of the batch along dim 0) in the order of a schedule, and sends the values
a later stage reads (activations) forward and the gradients an earlier stage needs back. Inside
a stage the other mesh axes split tensors as a plan without stages does.
"""

import math
from dataclasses import dataclass
from typing import Literal

from autopar.core.mesh import Mesh

Schedule = Literal["gpipe", "1f1b"]
"""``"gpipe"``: every micro-batch's forward, then every backward (GPipe); ``"1f1b"``: each stage
starts a micro-batch's backward as soon as it can and then alternates one forward and one
backward (PipeDream's one-forward-one-backward), holding the activations of at most as many
micro-batches as there are stages after it, where GPipe holds all of them."""
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Pipeline stages over one mesh axis, as ``autopar.compile(..., pipeline=Pipeline(...))``
    asks for them: ``axis`` names the mesh axis whose positions become the stages (one stage per
    position), ``microbatches`` how many slices of the batch (along dim 0 of every input) run
    through the stages one after another, and ``schedule`` in which order (:data:`Schedule`).
    Which layers each stage holds is planned: the cuts fall between the model's layers (of a
    stack, or its top-level modules) so that the stages' compute is as even as it can be."""

    axis: str
    microbatches: int
    schedule: Schedule = "1f1b"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str):
            raise TypeError(f"Pipeline(axis=...) names a mesh axis, got {self.axis!r}")
        if not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise ValueError(
                f"Pipeline(microbatches={self.microbatches!r}): give the number of slices of the batch, a positive int "
                "(at least the number of stages keeps every stage busy)"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Pipeline(schedule={self.schedule!r}) is not one of {', '.join(map(repr, SCHEDULES))}")

    def check(self, mesh: Mesh) -> None:
        """Refuse an axis ``mesh`` has not, or one of one position (no stages to make)."""
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"Pipeline(axis={self.axis!r}) is not an axis of {mesh}. Fix: name one of {mesh.axis_names}"
            )
        if mesh.shape[mesh.axis_names.index(self.axis)] < 2:
            raise ValueError(f"Pipeline(axis={self.axis!r}) has one position in {mesh}: give an axis of 2 or more")


def shared_batch(inputs) -> int:
    """The size of dim 0 every input shares (the batch the stages cut into micro-batches), or 0
    where they share none."""
    sizes = {x.shape[0] if getattr(x, "ndim", 0) else 0 for x in inputs}
    return sizes.pop() if len(sizes) == 1 else 0


def first_microbatch(inputs, microbatches: int) -> tuple:
    """The first of ``microbatches`` micro-batches of ``inputs`` (all of them for one)."""
    return tuple(inputs) if microbatches == 1 else tuple(x[: x.shape[0] // microbatches] for x in inputs)


def inner_mesh(mesh: Mesh, axis: str) -> Mesh:
    """The mesh inside each stage: ``mesh`` without the pipeline ``axis`` (an axis of one
    position where that leaves none)."""
    kept = [(n, name) for n, name in zip(mesh.shape, mesh.axis_names) if name != axis]
    if not kept:
        return Mesh((1,), (f"{axis}_stage",))
    return Mesh(tuple(n for n, _ in kept), tuple(name for _, name in kept))


@dataclass(frozen=True, kw_only=True)
class Stages:
    """The pipeline stages of a plan. The plan's placements are on :func:`inner_mesh`, the mesh
    inside each stage, and priced for one micro-batch."""

    axis: str
    """The mesh axis whose positions are the stages."""
    mesh: Mesh
    """The whole mesh, pipeline axis included."""
    microbatches: int
    schedule: Schedule
    segments: tuple[tuple[str, ...], ...]
    """The units each stage holds (:func:`~autopar.passes.analysis.stages.cut_units`: layers of
    stacks, modules outside them), in order."""
    compute_s: tuple[float, ...]
    """Modelled time of one micro-batch's forward and backward on each stage: its ops and the
    collectives they wait for inside the stage."""
    send_s: tuple[float, ...]
    """Modelled time of each stage's sends of one micro-batch (activations on, gradients back),
    α-β on the pipeline axis's link."""
    sync_s: tuple[float, ...]
    """Modelled time of each stage's gradient collectives, once per step after the last
    micro-batch's backward (its gradient buckets), and of its sends of the gradients of weights
    tied across stages to the stages holding copies."""
    peak_bytes: tuple[int, ...]
    """Predicted peak per device of each stage: its parameters, gradients and optimizer state,
    the activations of the micro-batches the schedule holds at once
    (:func:`in_flight`), and the largest transient of the plan."""

    @property
    def count(self) -> int:
        return len(self.segments)

    @property
    def bubble(self) -> float:
        """The share of a step the stages wait in, if every stage took as long: GPipe's and
        1F1B's ``(S - 1) / (M + S - 1)`` for S stages and M micro-batches."""
        return (self.count - 1) / (self.microbatches + self.count - 1)

    @property
    def step_s(self) -> float:
        """Modelled time of a step: each micro-batch's time on the slowest stage, the time the
        other stages take to fill and drain the pipeline, and the slowest stage's gradient
        collectives at the end."""
        per_micro = [c + s for c, s in zip(self.compute_s, self.send_s)]
        return (self.microbatches - 1) * max(per_micro) + math.fsum(per_micro) + max(self.sync_s)

    def to_dict(self) -> dict:
        return {
            "axis": self.axis,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "segments": [list(s) for s in self.segments],
            "compute_s": list(self.compute_s),
            "send_s": list(self.send_s),
            "sync_s": list(self.sync_s),
            "peak_bytes": list(self.peak_bytes),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Stages":
        return cls(
            axis=data["axis"],
            mesh=Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"])),
            microbatches=data["microbatches"],
            schedule=data["schedule"],
            segments=tuple(tuple(s) for s in data["segments"]),
            compute_s=tuple(data["compute_s"]),
            send_s=tuple(data["send_s"]),
            sync_s=tuple(data["sync_s"]),
            peak_bytes=tuple(data["peak_bytes"]),
        )


def in_flight(schedule: Schedule, stage: int, stages: int, microbatches: int) -> int:
    """The most micro-batches whose activations stage ``stage`` holds at once: all of them under
    GPipe, under 1F1B as many as there are stages from it to the last."""
    return microbatches if schedule == "gpipe" else min(stages - stage, microbatches)
