"""Gradient buckets: the gradients of many parameters reduced by one collective each.

As torch DDP does, the per-rank program does not reduce each parameter's gradient with a
collective of its own. A gradient whose move into its parameter's placements is a single
all-reduce (``P`` → ``R`` on one mesh axis) or a single reduce-scatter (``P`` → ``S(d)``) joins a
bucket of gradients of the same collective kind, mesh axis and dtype, in parameter order, up to
``bucket_bytes`` per bucket (a gradient larger than that has a bucket to itself). Each bucket is
one collective on the gradients flattened and concatenated; for a reduce-scatter each gradient
is laid out as ``n`` rows, row ``r`` being rank ``r``'s shard, so that every rank's shards of the
whole bucket come out contiguous. Other gradient moves (several steps, as ``(P, P)`` → ``(R, R)``
on a 2-D mesh, or an all-gather) run one by one.

Parameters are gathered in buckets too, as FSDP gathers a unit's parameters at once: the
parameters an op of one layer (segment) reads whole where they are split along one mesh axis,
one all-gather per layer, phase, mesh axis and dtype (up to ``bucket_bytes``), made when the
layer first reads one of them (:func:`~autopar.passes.rewrite.parameter_gathers`).

One function, :func:`gradient_buckets`, makes the buckets for the rewriter and for the plan, so
the plan lists exactly the bucket collectives the per-rank graph runs. The solver cannot know
which gradients will share a bucket while it chooses layouts: it prices a bucketed move at its
bandwidth term, and counts the buckets of each kind, mesh axis and dtype as the sum of the
moves' shares of a bucket, ``min(1, bytes / bucket_bytes)``, and at least one as soon as a
gradient joins, each bucket paying one α (:class:`BucketShare`, :mod:`autopar.passes.solver`).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autopar.cost_model.hardware import Link
from autopar.mesh import Mesh
from autopar.passes.redistribute import Step, step_s

BUCKET_BYTES = 25 * 2**20
"""Default bucket capacity per rank, torch DDP's ``bucket_cap_mb=25``: large enough that a
bucket's latency is small next to its bandwidth term on NCCL and gloo alike, small enough that
a bucket does not hold much more memory than its gradients already take."""

BUCKETED_KINDS = ("all_reduce", "reduce_scatter")


@dataclass(frozen=True, slots=True)
class Bucket:
    """Gradients reduced by one collective."""

    step: Step
    """The bucket's collective: its kind, mesh axis and bytes per rank (the sum of its
    gradients')."""
    members: tuple[int, ...]
    """Positions of its gradients among the moves given to :func:`gradient_buckets`."""


def bucketed_step(steps: Sequence[Step]) -> Step | None:
    """The collective by which a gradient joins a bucket, if its move (the steps of
    :func:`~autopar.passes.redistribute.transition`) is one all-reduce or reduce-scatter;
    ``None`` for any other move."""
    if len(steps) == 1 and steps[0].kind in BUCKETED_KINDS:
        return steps[0]
    return None


def gradient_buckets(moves: Sequence[tuple], bucket_bytes: int) -> list[Bucket]:
    """Pack moves, each its :func:`bucketed_step` and the tensor's dtype (and optionally a label:
    only moves of one label share a bucket), given in order, into buckets of one collective
    kind, mesh axis, dtype and label. A bucket takes the next move of its kind while it stays
    within ``bucket_bytes``; otherwise that move starts a new bucket. Buckets come in the order
    of their first move."""
    buckets: list[list[int]] = []
    filling: dict[tuple, int] = {}  # (kind, axis, dtype, label) -> the index of its bucket being filled
    size: list[int] = []
    for i, (step, dtype, *label) in enumerate(moves):
        key = (step.kind, step.axis, dtype, *label)
        b = filling.get(key)
        if b is None or size[b] + step.bytes > bucket_bytes:
            b = filling[key] = len(buckets)
            buckets.append([])
            size.append(0)
        buckets[b].append(i)
        size[b] += step.bytes
    return [Bucket(Step(moves[m[0]][0].kind, moves[m[0]][0].axis, bytes=total), tuple(m))
            for m, total in zip(buckets, size)]


@dataclass(frozen=True, slots=True)
class BucketShare:
    """What one bucketed gradient move takes of its buckets, for the solver."""

    group: tuple[str, int, torch.dtype]
    """Collective kind, mesh axis and dtype: gradients of one group share buckets."""
    fraction: float
    """``min(1, bytes / bucket_bytes)``: a gradient of a bucket's size or more fills one."""
    latency_s: float
    """α of the group's collective, which each bucket pays once."""


def latency_s(step: Step, mesh: Mesh, links: tuple[Link, ...]) -> float:
    """The α of a collective step: its modelled time less its bandwidth term (0 on an axis of
    one rank, where no time is modelled)."""
    return step_s(dataclasses.replace(step, bytes=0), mesh, links)
