"""Gradient buckets: the gradients of many parameters reduced by one collective each.

As torch DDP does, the per-rank program does not reduce each parameter's gradient with a
collective of its own. A gradient whose move into its parameter's placements is a single
all-reduce (``P`` → ``R`` on one mesh axis), a single reduce-scatter (``P`` → ``S(d)``) or
all-reduces over several mesh axes (``(P, P)`` → ``(R, R)``, data parallelism over a 2-D mesh)
joins a bucket of gradients of the same collectives (kinds and mesh axes) and dtype, in
parameter order, up to ``bucket_bytes`` per bucket (a gradient larger than that has a bucket to
itself). Each bucket is one collective per mesh axis on the gradients flattened and
concatenated; for a reduce-scatter each gradient is laid out as ``n`` rows, row ``r`` being rank
``r``'s shard, so that every rank's shards of the whole bucket come out contiguous. Other
gradient moves (a reduce-scatter with another step, an all-gather) run one by one.

Parameters are gathered in buckets too, as FSDP gathers a unit's parameters at once: the
parameters an op of one layer (segment) reads whole where they are split along one mesh axis,
one all-gather per layer, phase, mesh axis and dtype (up to ``bucket_bytes``), made when the
layer first reads one of them (:func:`parameter_gathers`).

Planning makes the buckets (:func:`gradient_buckets`, :func:`parameter_gathers`) and the plan
lists what each moves (``ShardingPlan.buckets``); the rewriter runs them as listed. The solver cannot know
which gradients will share a bucket while it chooses layouts: it prices a bucketed move at its
bandwidth term and its local ops (:func:`piece_s`), and counts the buckets of each kind, mesh
axis and dtype as the sum of the moves' shares of a bucket, ``min(1, bytes / bucket_bytes)``,
and at least one as soon as a gradient joins, each bucket paying one α and its fixed local ops
(:class:`BucketShare`, :func:`bucket_fixed_s`, :mod:`autopar.passes.solve.solver`).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.passes.analysis.capture import Captured, captured_backward, module_paths
from autopar.passes.propagation.redistribute import bandwidth_s, one_axis_step, step_s, transition
from autopar.passes.rules import tensor_args

from autopar.core.graph import segment_of
from autopar.core.kinds import CollectiveKind, CollectivePhase
from autopar.core.mesh import Link, Mesh
from autopar.core.move import Step
from autopar.core.placement import Placements
from autopar.core.strategy import Strategy, ValueRef, getitem_aliases

BUCKET_BYTES = 25 * 2**20
"""Default bucket capacity per rank, torch DDP's ``bucket_cap_mb=25``: large enough that a
bucket's latency is small next to its bandwidth term on NCCL and gloo alike, small enough that
a bucket does not hold much more memory than its gradients already take."""

BUCKETED_KINDS: tuple[CollectiveKind, ...] = ("all_reduce", "reduce_scatter")
"""The collectives by which a gradient may join a bucket."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """Gradients reduced by one collective."""

    step: Step
    """The bucket's collective: its kind, mesh axis and bytes per rank (the sum of its
    gradients')."""
    members: tuple[int, ...]
    """Positions of its gradients among the moves given to :func:`gradient_buckets`."""
    then: tuple[Step, ...] = ()
    """The all-reduces over further mesh axes that follow ``step`` on the same buffer."""

    @property
    def steps(self) -> tuple[Step, ...]:
        return (self.step, *self.then)


def bucketed_steps(steps: Sequence[Step]) -> tuple[Step, ...] | None:
    """The collectives by which a gradient joins a bucket, if its move (the steps of
    :func:`~autopar.passes.propagation.redistribute.transition`) is one all-reduce or reduce-scatter, or
    all-reduces over distinct mesh axes; ``None`` for any other move."""
    if len(steps) == 1 and steps[0].kind in BUCKETED_KINDS:
        return tuple(steps)
    if len(steps) > 1 and all(s.kind == "all_reduce" for s in steps) and len({s.axis for s in steps}) == len(steps):
        return tuple(steps)
    return None


def collectives_of(chain: Sequence[Step]) -> tuple:
    """What makes moves share a bucket: the kinds and mesh axes of their collectives."""
    return tuple((s.kind, s.axis) for s in chain)


def gradient_chain(
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    partial: bool,
    mesh: Mesh,
    links: tuple[Link, ...],
    bucket_bytes: int,
) -> tuple[Step, ...] | None:
    """The collectives by which a gradient moving from ``src`` to ``dst`` joins a bucket of
    ``bucket_bytes``: those of its cheapest move (:func:`bucketed_steps`), or, where the
    cheapest priced alone is another (an all-reduce and a slice), the one reduce-scatter that
    splits the partial sum on one mesh axis, if its bandwidth and its share of a full bucket's
    fixed cost are cheaper than that move; ``None`` where no move joins one."""
    steps = transition(src, dst, shape, itemsize, partial, mesh, links)
    chain = bucketed_steps(steps)
    if chain is not None:
        return chain
    differ = [axis for axis in range(mesh.ndim) if src[axis] != dst[axis]]
    if len(differ) == 1:
        step = one_axis_step(src, dst, differ[0], shape, itemsize, mesh)
        if step is not None and step.kind == "reduce_scatter":
            shared = piece_s((step,), mesh, links) + min(1.0, step.bytes / bucket_bytes) * bucket_fixed_s(
                (step,), mesh, links
            )
            if shared < sum(step_s(s, mesh, links) for s in steps):
                return (step,)
    return None


def gradient_buckets(moves: Sequence[tuple], bucket_bytes: int) -> list[Bucket]:
    """Pack moves, each its collectives (:func:`bucketed_steps`) and the tensor's dtype (and
    optionally a label: only moves of one label share a bucket), given in order, into buckets of
    the same collective kinds and mesh axes, dtype and label. A bucket takes the next move of
    its kind while it stays within ``bucket_bytes``; otherwise that move starts a new bucket.
    Buckets come in the order of their first move."""
    buckets: list[list[int]] = []
    filling: dict[tuple, int] = {}  # (collectives, dtype, label) -> the index of its bucket being filled
    size: list[int] = []
    for i, (chain, dtype, *label) in enumerate(moves):
        key = (collectives_of(chain), dtype, *label)
        b = filling.get(key)
        if b is None or size[b] + chain[0].bytes > bucket_bytes:
            b = filling[key] = len(buckets)
            buckets.append([])
            size.append(0)
        buckets[b].append(i)
        size[b] += chain[0].bytes
    return [bucket_of([moves[i][0] for i in members], members) for members in buckets]


def bucket_of(chains: Sequence[Sequence[Step]], members: Sequence[int]) -> Bucket:
    """The bucket of the moves at positions ``members``, whose collectives are ``chains`` (the
    same kinds on the same mesh axes): each collective on all their bytes at once."""
    total = sum(chain[0].bytes for chain in chains)
    first, *then = (Step(s.kind, s.axis, bytes=total) for s in chains[0])
    return Bucket(first, tuple(members), tuple(then))


@dataclass(frozen=True, slots=True)
class BucketShare:
    """What one bucketed gradient move takes of its buckets, for the solver."""

    group: tuple
    """``((kind, mesh axis) of each collective, dtype)``: gradients of one group share buckets."""
    fraction: float
    """``min(1, bytes / bucket_bytes)``: a gradient of a bucket's size or more fills one."""
    latency_s: float
    """What each bucket of the group pays once (:func:`bucket_fixed_s`)."""


_BUCKET_OPS: dict[CollectiveKind, tuple[int, int]] = {
    "all_reduce": (2, 2),
    "reduce_scatter": (3, 4),
    "all_gather": (3, 4),
}
"""Local ops of a bucket's collective in the per-rank program (:meth:`autopar.passes.propagation.rank_ops.Rank.bucket`),
per bucket and per tensor in it: an all-reduce flattens each tensor, concatenates them, splits
the result and views each piece back; a reduce-scatter also stacks each gradient's pieces
into rows; an all-gather also views the result as rows and moves each piece's rows into its
dim."""


def bucket_fixed_s(steps: Sequence[Step], mesh: Mesh, links: tuple[Link, ...]) -> float:
    """What a bucket's collectives ``steps`` (one per mesh axis, on one buffer) cost once,
    whatever it holds: α of each and the fixed local ops that pack and unpack the buffer (0 on
    axes of one rank, where no time is modelled)."""
    real = [s for s in steps if mesh.shape[s.axis] > 1]
    if not real:
        return 0.0
    return (
        sum(links[s.axis].alpha_beta(s.kind)[0] for s in real)
        + _BUCKET_OPS[steps[0].kind][0] * links[real[0].axis].local_op_s
    )


def piece_s(piece: Sequence[Step], mesh: Mesh, links: tuple[Link, ...]) -> float:
    """What one tensor adds to the bucket it joins, ``piece`` being its own move (one
    collective per mesh axis): its bandwidth terms, its local ops and their copies (its bytes
    into the flat buffer; for a reduce-scatter also into rows; for an all-gather its own piece
    in, and the gathered tensor out when it is gathered along a dim other than 0)."""
    real = [s for s in piece if mesh.shape[s.axis] > 1]
    if not real:
        return 0.0
    first, link = piece[0], links[real[0].axis]
    if first.kind == "all_gather":
        copied = first.bytes // mesh.shape[first.axis] + (first.bytes if first.dim else 0)
    else:
        copied = first.bytes * (2 if first.kind == "reduce_scatter" else 1)
    return (
        sum(bandwidth_s(s, mesh, links) for s in real)
        + _BUCKET_OPS[first.kind][1] * link.local_op_s
        + copied * link.local_s_per_byte
    )


def bucket_s(steps: Sequence[Step], pieces: Sequence[Sequence[Step]], mesh: Mesh, links: tuple[Link, ...]) -> float:
    """Modelled time of a bucket's collectives ``steps`` on tensors whose own moves are
    ``pieces``, with the local ops that pack and unpack them."""
    return bucket_fixed_s(steps, mesh, links) + sum(piece_s(p, mesh, links) for p in pieces)


@dataclass(frozen=True, slots=True)
class ParameterGather:
    """Parameters gathered by one all-gather, the first time a layer reads one of them in a
    phase."""

    bucket: Bucket
    keys: tuple[tuple[bool, ValueRef, Placements], ...]
    """Each parameter's move: ``(in backward, parameter, placements it is gathered into)``."""
    steps: tuple[Step, ...]
    phase: CollectivePhase
    """``"forward"``, ``"backward"`` or ``"recompute"``: the phase of the op first reading one."""
    segment: str


def parameter_gathers(
    captured: Captured,
    strategies: dict[str, Strategy],
    recomputed: set[str] | frozenset[str],
    host_params: set[str],
    mesh: Mesh,
    links: tuple[Link, ...],
    bucket_bytes: int,
    groups: "Mapping[str, int] | None" = None,
) -> list[ParameterGather]:
    """The parameters' all-gathers that run in buckets, for the plan to list: every
    move of a parameter (not one in host memory, ``host_params`` by placeholder name) that is one
    all-gather, grouped by the phase and segment (layer) of the op that first reads it, by mesh
    axis and dtype, up to ``bucket_bytes`` (:func:`gradient_buckets`),
    in the order the ops first read them; parameters of different ``groups`` (by qualified
    name: pipeline stages) never share one. A bucket of one parameter is left to its own move."""
    group_of = {n.name: (groups or {}).get(k.name, 0) for n, k in zip(captured.placeholders, captured.inputs)}
    graph = captured.graph.graph
    aliases = getitem_aliases(graph)
    backward = captured_backward(captured)
    params = {n.name: n for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "param"}
    paths = module_paths(captured)
    seen: set = set()
    moves: list[tuple] = []  # (key, step, dtype, (phase, segment))
    for n in graph.nodes:
        if n.op != "call_function" or n.name in aliases:
            continue
        runs: tuple[tuple[CollectivePhase, bool], ...] = (
            (("backward", True),)
            if n in backward
            else (("forward", False), ("recompute", True))
            if n.name in recomputed
            else (("forward", False),)
        )
        for phase, in_backward in runs:
            for a, dst in zip(tensor_args(n), strategies[n.name].inputs):
                ref = aliases.get(a.name, (a.name, 0))
                key = (in_backward, ref, dst)
                if ref[0] not in params or ref[0] in host_params or key in seen:
                    continue
                seen.add(key)
                val = params[ref[0]].meta["val"]
                src = strategies[ref[0]].outputs[0]
                steps = (
                    transition(src, dst, tuple(val.shape), val.element_size(), val.dtype.is_floating_point, mesh, links)
                    if src != dst
                    else []
                )
                if len(steps) == 1 and steps[0].kind == "all_gather":
                    label = (phase, segment_of(paths.get(n.name, "")), group_of[ref[0]])
                    moves.append((key, steps[0], val.dtype, label))
    found = []
    for bucket in gradient_buckets([((step,), *rest) for _, step, *rest in moves], bucket_bytes):
        if len(bucket.members) > 1:
            members = [moves[i] for i in bucket.members]
            found.append(
                ParameterGather(bucket, tuple(m[0] for m in members), tuple(m[1] for m in members), *members[0][3][:2])
            )
    return found
