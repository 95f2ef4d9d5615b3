"""Pipeline stages: the option that asks for them and the plan's record of them.

With stages, one mesh axis holds consecutive parts of the model instead of copies of it: the
rank at position ``s`` along the pipeline axis runs the layers of stage ``s``, for each
micro-batch (a slice of the batch along dim 0) in the order of a schedule, and sends the values
a later stage reads (activations) forward and the gradients an earlier stage needs back. Inside
a stage the other mesh axes split tensors as a plan without stages does.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from autopar.core.mesh import Mesh
from autopar.core.placement import Placements, Replicate

Schedule = Literal["gpipe", "1f1b", "interleaved"]
"""``"gpipe"``: every micro-batch's forward, then every backward (GPipe); ``"1f1b"``: each stage
starts a micro-batch's backward as soon as it can and then alternates one forward and one
backward (PipeDream's one-forward-one-backward), holding the activations of at most as many
micro-batches as there are stages after it, where GPipe holds all of them; ``"interleaved"``:
1F1B over several stages per rank, not consecutive (Megatron-LM's interleaved schedule: with
``v`` stages per rank on ``p`` ranks, rank ``r`` holds stages ``r``, ``r + p``, ...), whose bubble is
``v`` times smaller for ``v`` times the sends (:func:`order`)."""
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Pipeline stages over one mesh axis, as ``autopar.compile(..., pipeline=Pipeline(...))``
    asks for them: ``axis`` names the mesh axis whose positions become the stages (one stage per
    position), ``microbatches`` how many slices of the batch (along dim 0 of every input) run
    through the stages one after another, and ``schedule`` in which order (:data:`Schedule`).
    Which layers each stage holds is planned: the cuts fall between the model's layers (of a
    stack, or its top-level modules) so that the stages' compute is as even as it can be. Under
    the interleaved schedule each rank holds ``stages_per_rank`` stages (2 or more), and the
    micro-batches are a multiple of the axis's positions.

    ``axis``, ``microbatches`` or ``schedule`` left ``None`` are chosen by planning, as
    ``pipeline="auto"`` chooses them (:mod:`autopar.stage_search`), among plans with stages."""

    axis: str | None = None
    microbatches: int | None = None
    schedule: Schedule | None = "1f1b"
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.axis is not None and not isinstance(self.axis, str):
            raise TypeError(f"Pipeline(axis=...) names a mesh axis, got {self.axis!r}")
        count = self.microbatches
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
            raise ValueError(
                f"Pipeline(microbatches={count!r}): give the number of slices of the batch, a positive int "
                "(at least the number of stages keeps every stage busy), or None to have it chosen"
            )
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(
                f"Pipeline(schedule={self.schedule!r}) is not one of {', '.join(map(repr, SCHEDULES))} or None"
            )
        per_rank = self.stages_per_rank
        if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
            raise ValueError(f"Pipeline(stages_per_rank={per_rank!r}): give a positive int")
        if self.schedule is None and per_rank > 1:
            raise ValueError(
                f"Pipeline(stages_per_rank={per_rank}) with the schedule left to planning: give "
                "schedule='interleaved' with it, or leave both to planning"
            )
        if self.schedule is not None and (self.schedule == "interleaved") != (per_rank > 1):
            raise ValueError(
                f"Pipeline(schedule={self.schedule!r}, stages_per_rank={per_rank}): the interleaved schedule runs 2 or "
                "more stages per rank, the others one. Fix: schedule='interleaved' with stages_per_rank=2 or more, "
                "or stages_per_rank=1"
            )

    @property
    def complete(self) -> bool:
        """Whether every part is given (else planning chooses the parts left ``None``)."""
        return None not in (self.axis, self.microbatches, self.schedule)

    def allows(self, other: "Pipeline") -> bool:
        """Whether ``other`` (complete) has every part this one gives."""
        given = [(self.axis, other.axis), (self.microbatches, other.microbatches)]
        if self.schedule is not None:
            given += [(self.schedule, other.schedule), (self.stages_per_rank, other.stages_per_rank)]
        return all(mine is None or mine == theirs for mine, theirs in given)

    def check(self, mesh: Mesh) -> None:
        """Refuse an axis ``mesh`` has not, or one of one position (no stages to make)."""
        if self.axis is None:
            return
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"Pipeline(axis={self.axis!r}) is not an axis of {mesh}. Fix: name one of {mesh.axis_names}"
            )
        if mesh.shape[mesh.axis_names.index(self.axis)] < 2:
            raise ValueError(f"Pipeline(axis={self.axis!r}) has one position in {mesh}: give an axis of 2 or more")
        positions = mesh.shape[mesh.axis_names.index(self.axis)]
        if self.schedule == "interleaved" and self.microbatches is not None and self.microbatches % positions:
            raise ValueError(
                f"the interleaved schedule runs micro-batches in rounds of one per position of '{self.axis}' "
                f"({positions}); Pipeline(microbatches={self.microbatches}) is not a multiple of it. Fix: "
                f"microbatches={positions * max(1, round(self.microbatches / positions))}"
            )


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


def pins_inside(pins: Mapping[str, Placements], mesh: Mesh, axis: str) -> dict[str, Placements] | None:
    """Pins on ``mesh`` as pins on the mesh inside stages over ``axis``: each placement but the
    axis's, which must replicate; ``None`` when a pin splits over the axis (it asks that axis to
    split, not to hold stages)."""
    at = mesh.axis_names.index(axis)
    if any(not placements[at].is_replicate() for placements in pins.values()):
        return None
    return {name: tuple(q for i, q in enumerate(p) if i != at) or (Replicate(),) for name, p in pins.items()}


def planning_chooses(pipeline: "Pipeline | str | None") -> bool:
    """Whether planning chooses the stages or some of their parts: ``"auto"``, or a
    :class:`Pipeline` that leaves parts ``None``."""
    return pipeline == "auto" or isinstance(pipeline, Pipeline) and not pipeline.complete


def given_parts(pipeline: "Pipeline | str") -> "Pipeline | None":
    """The parts of the stages a pipeline that :func:`planning_chooses` fixes: none for ``"auto"``."""
    return None if pipeline == "auto" else pipeline


def pins_name_whole_mesh(pipeline: "Pipeline | str | None") -> bool:
    """Whether pins name placements on the whole mesh though the plan may have stages: with
    ``"auto"`` or a Pipeline leaving its axis to planning (:func:`pins_inside` then projects them)."""
    return pipeline == "auto" or isinstance(pipeline, Pipeline) and pipeline.axis is None


def pinned_mesh(pipeline: "Pipeline | str | None", mesh: Mesh) -> Mesh:
    """The mesh pins name placements on: the mesh inside the stages of a Pipeline that gives its
    axis, else ``mesh`` (with ``"auto"`` or the axis left to planning, pins that replicate over
    the axis planning picks keep their other placements inside the stages, :func:`pins_inside`)."""
    return inner_mesh(mesh, pipeline.axis) if isinstance(pipeline, Pipeline) and pipeline.axis else mesh


@dataclass(frozen=True, slots=True)
class Send:
    """A point-to-point send of a step: from the ranks at one position of the pipeline axis to
    those at another (each to the rank at its own place inside the stages)."""

    src: int
    dst: int
    bytes: int
    """Per rank."""
    tied: bool = False
    """The gradient of a weight tied across stages, sent once per step; else a value one stage
    sends another, once per micro-batch."""


@dataclass(frozen=True, kw_only=True)
class Stages:
    """The pipeline stages of a plan. The plan's placements are on :func:`inner_mesh`, the mesh
    inside each stage, and priced for one micro-batch. Stage ``s`` runs at position
    ``s % positions`` of the pipeline axis (:meth:`position_of`): one stage per position, or
    under the interleaved schedule ``stages_per_rank`` of them."""

    axis: str
    """The mesh axis whose positions run the stages."""
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
    accumulate_s: tuple[float, ...]
    """Modelled time of each stage's additions, per step, of the micro-batches' gradients after
    the first into their sums (made before the gradients' collectives, which run once)."""
    peak_bytes: tuple[int, ...]
    """Predicted peak per device at each position of the pipeline axis: its stages' parameters,
    gradients and optimizer state, the sums of the micro-batches' gradients and one
    micro-batch's being added to them (with more than one), every micro-batch's pieces of the
    inputs its stages read, the activations of the micro-batches the schedule holds at once
    (:func:`held_activations`), and the largest transient of the plan."""
    stages_per_rank: int = 1
    sends: tuple[Send, ...] = ()
    """Every send the step's schedule makes, per micro-batch or (tied) once, as priced in
    ``send_s`` and ``sync_s``."""

    @property
    def count(self) -> int:
        return len(self.segments)

    @property
    def pipeline(self) -> Pipeline:
        """The :class:`Pipeline` these stages run."""
        return Pipeline(
            axis=self.axis, microbatches=self.microbatches, schedule=self.schedule, stages_per_rank=self.stages_per_rank
        )

    @property
    def positions(self) -> int:
        """The positions of the pipeline axis."""
        return self.count // self.stages_per_rank

    def position_of(self, stage: int) -> int:
        return stage % self.positions

    def on_position(self, position: int) -> range:
        """The stages the ranks at ``position`` run, in order."""
        return range(position, self.count, self.positions)

    @property
    def bubble(self) -> float:
        """The share of a step the stages wait in, if every stage took as long:
        ``(p - 1) / (v·M + p - 1)`` on p positions of v stages each with M micro-batches
        (GPipe's and 1F1B's ``(S - 1) / (M + S - 1)``)."""
        p = self.positions
        return (p - 1) / (self.stages_per_rank * self.microbatches + p - 1)

    @property
    def step_s(self) -> float:
        """Modelled time of a step: every micro-batch through the busiest position's stages, the
        time the other stages take to fill and drain the pipeline (divided among a position's
        stages when it holds several), and the slowest position's gradient collectives at the
        end with its additions of the micro-batches' gradients into their sums. Exact when every
        stage takes as long; without interleaving it is each micro-batch on the slowest stage plus
        one micro-batch through the others."""
        per_stage = [c + s for c, s in zip(self.compute_s, self.send_s)]
        busiest = max(math.fsum(per_stage[s] for s in self.on_position(r)) for r in range(self.positions))
        synced = max(
            math.fsum(self.sync_s[s] + self.accumulate_s[s] for s in self.on_position(r)) for r in range(self.positions)
        )
        return self.microbatches * busiest + (math.fsum(per_stage) - busiest) / self.stages_per_rank + synced

    def to_dict(self) -> dict:
        return {
            "axis": self.axis,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "stages_per_rank": self.stages_per_rank,
            "segments": [list(s) for s in self.segments],
            "compute_s": list(self.compute_s),
            "send_s": list(self.send_s),
            "sync_s": list(self.sync_s),
            "accumulate_s": list(self.accumulate_s),
            "peak_bytes": list(self.peak_bytes),
            "sends": [[x.src, x.dst, x.bytes, x.tied] for x in self.sends],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Stages":
        return cls(
            axis=data["axis"],
            mesh=Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"])),
            microbatches=data["microbatches"],
            schedule=data["schedule"],
            stages_per_rank=data["stages_per_rank"],
            segments=tuple(tuple(s) for s in data["segments"]),
            compute_s=tuple(data["compute_s"]),
            send_s=tuple(data["send_s"]),
            sync_s=tuple(data["sync_s"]),
            accumulate_s=tuple(data["accumulate_s"]),
            peak_bytes=tuple(data["peak_bytes"]),
            sends=tuple(Send(*x) for x in data["sends"]),
        )


Action = tuple[str, int, int]
"""``("F", m, s)`` runs micro-batch ``m``'s forward through stage ``s``; ``("B", m, s)`` its backward."""


def order(kind: Schedule, position: int, positions: int, microbatches: int, stages_per_rank: int = 1) -> list[Action]:
    """The order the ranks at ``position`` of a pipeline axis of ``positions`` run their stages'
    forwards and backwards. Under 1F1B a position starts a micro-batch's backward once the
    forwards of as many micro-batches as there are stages after it are out, then alternates;
    interleaved, it runs forwards in rounds of one micro-batch per position through each of its
    stages in turn, starting backwards after ``2·(p - 1 - position) + (v - 1)·p`` of them
    (Megatron-LM's order), backwards from its last stage to its first."""
    if kind == "gpipe":
        return [("F", m, position) for m in range(microbatches)] + [("B", m, position) for m in range(microbatches)]
    p, v = positions, stages_per_rank
    if v > 1 and microbatches % p:
        raise ValueError(
            f"the interleaved schedule runs micro-batches in rounds of one per position ({p}); {microbatches} "
            "micro-batches is not a multiple of it. Fix: a multiple of the positions"
        )
    total = microbatches * v

    def unit(action: str, k: int) -> Action:
        chunk = (k // p) % v
        chunk = v - 1 - chunk if action == "B" else chunk
        return action, (k // (p * v)) * p + k % p, chunk * p + position

    warmup = min(p - 1 - position if v == 1 else 2 * (p - 1 - position) + (v - 1) * p, total)
    actions = [unit("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [unit("F", warmup + k), unit("B", k)]
    return actions + [unit("B", k) for k in range(total - warmup, total)]


def held_activations(
    kind: Schedule, position: int, positions: int, microbatches: int, kept: Sequence[int], stages_per_rank: int = 1
) -> int:
    """The most bytes of activations the ranks at ``position`` hold at once under the schedule,
    ``kept[s]`` per micro-batch through stage ``s``: each forward keeps its stage's until the
    micro-batch's backward through it."""
    held = most = 0
    for action, _, stage in order(kind, position, positions, microbatches, stages_per_rank):
        held += kept[stage] if action == "F" else -kept[stage]
        most = max(most, held)
    return most
