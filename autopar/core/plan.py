"""The sharding plan: what the solver chose, what it costs, and how to read it.

The plan holds placements as :data:`~autopar.core.placement.Placements` (``Shard``,
``Replicate``, ``Partial`` per mesh axis), which lowering and the views read as they are; only
its JSON writes them as text (``S(0)``, ``R``, ``P``), read back once by
:meth:`ShardingPlan.from_json`.
"""

import json
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Literal, Mapping

from autopar.core.kinds import Activation, CollectiveKind, CollectivePhase, Phase, SolverStatus
from autopar.core.mesh import Link, Mesh
from autopar.core.move import Step
from autopar.core.pipeline import Stages
from autopar.core.placement import (
    Placements,
    format_placement,
    format_placements,
    parse_placement,
    parse_placements_text,
)

FORMAT_VERSION = 14


def format_layouts(layouts: tuple[Placements, ...]) -> str:
    """The placements of one or more tensors as text, ``(S(0), R)`` or ``(S(0)) | (S(1))``: how
    the plan's JSON and its views write a collective's ``src`` and ``dst``."""
    return " | ".join(format_placements(p) for p in layouts)


def _parse_layouts(text: str) -> tuple[Placements, ...]:
    """Inverse of :func:`format_layouts`."""
    return tuple(parse_placements_text(p) for p in text.split(" | "))


def _fields(obj) -> dict:
    """The fields of a flat dataclass by name, unconverted (``asdict`` would copy placements
    deeply)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective that the per-rank program runs."""

    kind: CollectiveKind
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``."""
    axis: str
    """Mesh axis name."""
    bytes: int
    """Bytes per rank (the gathered result of an all-gather, the input of a reduce-scatter)."""
    phase: CollectivePhase
    """``forward``, ``backward``, ``recompute`` (run again in the backward for a recomputed
    op), or ``output``: making a result whole for the caller (the loss of a batch-split step),
    which nothing else in the step waits for."""
    time_s: float
    """Modelled time, with the local ops that pack and unpack its tensors."""
    tensor: str
    """The graph value moved, ``node`` or ``node[i]``, or ``bucket of N gradients``."""
    consumer: str
    """The node that needs it (``output`` for the step's results, ``gradients`` for a bucket of
    parameters' gradients)."""
    src: tuple[Placements, ...]
    dst: tuple[Placements, ...]
    """Placements before and after the whole transition: of the one tensor moved, e.g.
    ``((P, R),)`` → ``((R, R),)``; for a bucket, the distinct ones of its tensors, in the order
    they first appear (:func:`format_layouts` writes them joined by ``|``)."""
    gradient: bool = False
    """Whether it moves parameters' gradients into their placements (a bucket of them, or one
    alone): the collectives a micro-batch under ``no_sync()`` does not run."""

    def to_dict(self) -> dict:
        """Its JSON object, placements written as text."""
        return {**_fields(self), "src": format_layouts(self.src), "dst": format_layouts(self.dst)}

    @classmethod
    def from_dict(cls, data: dict) -> "Collective":
        """Inverse of :meth:`to_dict`."""
        return cls(**{**data, "src": _parse_layouts(data["src"]), "dst": _parse_layouts(data["dst"])})


@dataclass(frozen=True, slots=True)
class PlannedBucket:
    """Tensors one bucketed collective moves, as the plan priced it and the per-rank program
    runs it (:mod:`autopar.passes.propagation.buckets`)."""

    of: Literal["gradients", "parameters"]
    """Parameters' gradients reduced together in the backward, or parameters all-gathered
    together for the ops of one layer that read them."""
    phase: CollectivePhase
    segment: str
    """For parameters: the layer whose ops first read them (``""``: the root module)."""
    members: tuple[str, ...]
    """The parameters, by qualified name, in the order the bucket packs them."""
    placements: tuple[Placements, ...]
    """Each one's placements after the move."""
    steps: tuple[tuple[Step, ...], ...]
    """Each one's collectives in the bucket (the same kinds on the same mesh axes for all): the
    one all-gather of a parameter; a gradient's reduce-scatter, or its all-reduces over one or
    more mesh axes."""

    def to_dict(self, mesh: Mesh) -> dict:
        """Its JSON object, placements written as text."""
        return {
            **_fields(self),
            "placements": [format_placements(p) for p in self.placements],
            "steps": [[s.to_dict(mesh) for s in chain] for chain in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict, mesh: Mesh) -> "PlannedBucket":
        """Inverse of :meth:`to_dict`."""
        return cls(
            **{
                **data,
                "members": tuple(data["members"]),
                "placements": tuple(parse_placements_text(p) for p in data["placements"]),
                "steps": tuple(tuple(Step.from_dict(s, mesh) for s in chain) for chain in data["steps"]),
            }
        )


@dataclass(frozen=True, slots=True)
class PlannedMove:
    """A tensor's move between placements, as the plan priced it and the per-rank program runs
    it: its steps, one mesh axis each (:mod:`autopar.passes.propagation.redistribute`). Moves
    made in a bucket are the bucket's (:class:`PlannedBucket`)."""

    tensor: str
    """The graph value moved, ``node`` or ``node[i]``."""
    src: Placements
    dst: Placements
    steps: tuple[Step, ...]

    def to_dict(self, mesh: Mesh) -> dict:
        """Its JSON object, placements written as text."""
        return {
            "tensor": self.tensor,
            "src": format_placements(self.src),
            "dst": format_placements(self.dst),
            "steps": [s.to_dict(mesh) for s in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict, mesh: Mesh) -> "PlannedMove":
        """Inverse of :meth:`to_dict`."""
        return cls(
            data["tensor"],
            parse_placements_text(data["src"]),
            parse_placements_text(data["dst"]),
            tuple(Step.from_dict(s, mesh) for s in data["steps"]),
        )


@dataclass(frozen=True, slots=True)
class NodePlan:
    """The chosen strategy of one node."""

    name: str
    op: str
    module: str
    """Qualified name of the module the op comes from (``""`` for the root or unknown)."""
    phase: Phase
    """``forward`` or ``backward``: the phase of the op in the joint graph."""
    outputs: tuple[Placements | None, ...]
    """Placements of each output (``None`` where the output is not a tensor)."""
    inputs: tuple[Placements, ...]
    """Placements required on each tensor input."""
    compute_s: float
    activation: Activation = ""
    """For a forward op whose outputs the backward needs: ``keep``, ``recompute`` or
    ``offload`` (to host memory until the backward reads them)."""
    activation_bytes: int = 0
    """Per-device bytes of the outputs that choice concerns."""
    copy_s: float = 0.0
    """For an offloaded op: seconds of copying those bytes to host memory and back."""
    fmt: str = ""
    """For a matrix product (matmul, convolution, attention): the format of its multiply-adds,
    whose rate its compute is priced at (``float32``, ``tf32``, ``bfloat16``, ...)."""
    flops: float = 0.0
    """For a matrix product: the FLOPs one rank runs, by :mod:`torch.utils.flop_counter`'s
    formulas on the rank's local shapes (what its compute is priced from)."""

    def to_dict(self) -> dict:
        """Its JSON object, placements written as text."""
        return {
            **_fields(self),
            "outputs": [None if p is None else format_placements(p) for p in self.outputs],
            "inputs": [format_placements(p) for p in self.inputs],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "NodePlan":
        """Inverse of :meth:`to_dict`."""
        return cls(
            **{
                **data,
                "outputs": tuple(None if p is None else parse_placements_text(p) for p in data["outputs"]),
                "inputs": tuple(parse_placements_text(p) for p in data["inputs"]),
            }
        )


@dataclass(frozen=True, slots=True)
class SolverInfo:
    status: SolverStatus
    """``OPTIMAL``, ``FEASIBLE``, ``START`` or ``LAYOUT`` (:data:`autopar.core.kinds.SolverStatus`)."""
    objective_s: float
    bound_s: float
    solve_s: float
    num_variables: int
    num_constraints: int
    shared_nodes: int = 0
    """Nodes of repeated layers that took the choice of the first layer of their class."""
    layer_classes: int = 0
    """Classes of two or more identical layers (:mod:`autopar.passes.solve.layers`)."""
    shared_layers: int = 0
    """Layers that took the choice of the first layer of their class."""
    aligned_layers: int = 0
    """Layers alike to no other whose ops that match a class's first layer took its choices."""
    layout: str = ""
    """With status ``LAYOUT``: the standard layout returned (``data parallel``, ``fully
    sharded``, ``sharded over <axis>``, :mod:`autopar.passes.solve.layouts`), predicted faster than
    any plan the search found in its time limit, or the search found none."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted per-device peak memory, by part."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    """Forward values kept for the backward."""
    transient_bytes: int
    """The largest output of a backward op (with activations chosen, forward ops' outputs are
    held while the backward needs them); of any op without."""
    recomputed_bytes: int = 0
    """Recomputed or reloaded activations alive at once in the backward (one segment's)."""
    host_bytes: int = 0
    """Bytes per device kept in host memory instead: offloaded activations, optimizer state
    stepped on the host, and parameters living there with their gradients (not part of the
    device's peak)."""
    host_capacity_bytes: int = 0
    """Host memory each device may fill (its host's memory over its devices; 0: no limit),
    which ``host_bytes`` stays within."""
    liveness_peak_bytes: int = 0
    """The peak of the per-rank program itself, every tensor alive from the op making it to its
    last reader (:mod:`autopar.passes.analysis.liveness`), measured for plans that recompute (under a
    memory budget, or with ``recompute="layers"``): the program gathers a layer's parameters in
    one bucket, whose packed copy the solver does not count, so it can exceed the solver's figure
    (planning then solves once more, :func:`autopar.budget_check.within_budget`). 0 when not measured:
    without a budget the solver's count is within a few percent of the program's peak, as the
    tests check."""
    bucket_bytes: int = 0
    """The packed copy of the largest gradient bucket, alive while its collective runs beside
    the backward."""
    moment_bytes: int = 0
    """What is alive at the fullest moment of the training step, as the solver counts it
    (:func:`autopar.passes.solve.planning.moment_bytes`): at the start of a segment's backward,
    parameters, optimizer state, the gradients made by then, the activations not yet read for
    the last time, and the values the segment recomputes or reloads, with the most its backward
    holds beyond that while one of its ops runs and the gradient bucket in flight; in the
    forward and at the optimizer step likewise, with their own temporaries (0: not counted by
    moments)."""

    @property
    def solver_bytes(self) -> int:
        """The peak as the solver budgets it: the fullest moment (without moments, every part
        added up)."""
        return self.moment_bytes or (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.recomputed_bytes
            + self.transient_bytes
            + self.bucket_bytes
        )

    @property
    def peak_bytes(self) -> int:
        """The liveness peak when measured, else the solver's."""
        return self.liveness_peak_bytes or self.solver_bytes


@dataclass(frozen=True, slots=True)
class ShardingPlan:
    """A frozen plan: per node the chosen strategy, per parameter and input its placements, the
    collectives they imply, the predicted cost and how the solve went."""

    mesh: Mesh
    hardware: str
    links: tuple[Link, ...]
    """The α-β link of each mesh axis the plan was costed with; the rewriter reshards tensors
    in the order these make cheapest, as the solver assumed."""
    graph_hash: str
    """Fingerprint of the captured graph; a plan is refused for any other graph."""
    placements: Mapping[str, Placements]
    """Parameter (and buffer) qualified name → one placement per mesh axis."""
    inputs: Mapping[str, Placements]
    """Forward argument name → placements."""
    pinned: tuple[str, ...]
    """Names whose placements the user fixed."""
    nodes: tuple[NodePlan, ...]
    collectives: tuple[Collective, ...]
    bucket_bytes: int
    """Capacity of a gradient bucket (:mod:`autopar.passes.propagation.buckets`)."""
    compute_s: float
    communication_s: float
    memory: MemoryEstimate
    memory_budget_bytes: int | None
    """The per-device budget the plan was made under, if any."""
    solver: SolverInfo
    stage_s: Mapping[str, float]
    """Wall time of each planning stage: capture, propagate, cost, solve, plan, and (for plans
    that recompute) the program's liveness."""
    recompute_s: float = 0.0
    """Compute time of the ops the backward runs again (their collectives are in
    ``communication_s``)."""
    node_overhead_s: float = 0.0
    """The part of ``compute_s`` and ``recompute_s`` that the per-rank program's nodes take
    beyond their ops (a profile's ``node_overhead_s`` per timed op), which its step scale does
    not stretch."""
    overhead_s: float = 0.0
    """Time per step of the work around the per-rank program (autograd, one gradient per
    parameter), as the hardware profile measured it."""
    offload_s: float = 0.0
    """Time of offloading: activations copied back to the device where a prefetch does not
    hide it, and copied out where the forward does not, the gradients out, parameters back and host update of
    optimizer state stepped on the host, and parameters in host memory copied in for the
    forward and the backward."""
    host_optimizer: tuple[str, ...] = ()
    """Parameters whose optimizer state lives in host memory, stepped there
    (:meth:`autopar.runtime.module.ParallelModule.optimizer` builds that optimizer)."""
    host_params: tuple[str, ...] = ()
    """Parameters (among ``host_optimizer``) whose pieces live in host memory, copied to the
    device for the forward and again for the backward; their gradients go to the host."""
    optimizer_slots: int = 2
    """Tensors of its parameter's size the optimizer keeps per parameter, as the memory counts
    them (2 for Adam and AdamW, 1 for SGD with momentum, 0 for SGD without)."""
    prefetched: tuple[str, ...] = ()
    """Segments (layers, or top-level modules) whose offloaded activations are copied back
    ahead, while the backward of the segment after them runs; the others' are copied back when
    the backward first reads them."""
    buckets: tuple[PlannedBucket, ...] = ()
    """The bucketed collectives: which gradients are reduced together and which parameters
    gathered together. The per-rank program runs them as listed here."""
    moves: tuple[PlannedMove, ...] = ()
    """Every move of a tensor to other placements the step makes outside a bucket, once per
    tensor, source and destination, with the steps the per-rank program runs."""
    graph_lines: tuple[str, ...] = ()
    """One line per node of the captured graph (:func:`autopar.passes.analysis.capture.graph_lines`): a
    plan refused as stale names the first line that differs."""
    stages: Stages | None = None
    """The pipeline stages, if any: then ``mesh`` is the mesh inside each stage, and the graph,
    placements and costs are those of one micro-batch."""
    accumulation_add_s: float = 0.0
    """Time of adding one micro-batch's gradients, as its backward makes them (before their
    collectives), into the sum of the micro-batches before: what each micro-batch after the
    first adds to a step accumulated under ``no_sync()`` (:meth:`accumulated_step_s`)."""
    accumulated_bytes: int = 0
    """Bytes of those sums, which the device holds beside what the step holds from the first
    micro-batch's backward under ``no_sync()`` to the backward outside it that reduces them."""

    def __post_init__(self) -> None:
        for name in ("placements", "inputs", "stage_s"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def predicted_step_s(self) -> float:
        """Modelled time of one training step (compute, recomputation, communication, offload
        and the step's overhead, no overlap but for activations copied out in the forward);
        with pipeline stages, the micro-batches' time through the stages
        (:attr:`~autopar.core.pipeline.Stages.step_s`) and the step's overhead."""
        if self.stages is not None:
            return self.stages.step_s + self.overhead_s
        return self.compute_s + self.recompute_s + self.communication_s + self.overhead_s + self.offload_s

    def accumulated_step_s(self, microbatches: int) -> float:
        """Modelled time of a step that accumulates the gradients of ``microbatches`` calls of the
        planned size, all but the last under ``no_sync()``: each runs the step but for the
        collectives of the gradients (:attr:`Collective.gradient`), which the last runs once for
        all, and each after the first adds its gradients to the sum (:attr:`accumulation_add_s`)."""
        if self.stages is not None:
            raise ValueError(
                "a plan with pipeline stages already prices its micro-batches in predicted_step_s; "
                "accumulated_step_s is for plans without stages"
            )
        if microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {microbatches}")
        gradients_s = sum(c.time_s for c in self.collectives if c.gradient)
        return (
            microbatches * (self.predicted_step_s - gradients_s)
            + gradients_s
            + (microbatches - 1) * self.accumulation_add_s
        )

    @property
    def peak_memory_bytes(self) -> int:
        """Predicted per-device peak memory (with pipeline stages, the fullest stage's)."""
        return max(self.stages.peak_bytes) if self.stages is not None else self.memory.peak_bytes

    def __reduce__(self):
        """Pickled (``torch.save(plan)``) as its JSON, the format that outlives autopar's versions."""
        return (ShardingPlan.from_json, (self.to_json(indent=None),))

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the plan")

    # JSON ------------------------------------------------------------------------------------

    def to_json(self, indent: int | None = 1) -> str:
        data = {
            "format_version": FORMAT_VERSION,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "hardware": self.hardware,
            "links": [asdict(link) for link in self.links],
            "graph_hash": self.graph_hash,
            "placements": {k: [format_placement(p) for p in v] for k, v in self.placements.items()},
            "inputs": {k: [format_placement(p) for p in v] for k, v in self.inputs.items()},
            "pinned": list(self.pinned),
            "nodes": [n.to_dict() for n in self.nodes],
            "collectives": [c.to_dict() for c in self.collectives],
            "bucket_bytes": self.bucket_bytes,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "memory": asdict(self.memory),
            "memory_budget_bytes": self.memory_budget_bytes,
            "solver": asdict(self.solver),
            "stage_s": dict(self.stage_s),
            "recompute_s": self.recompute_s,
            "node_overhead_s": self.node_overhead_s,
            "overhead_s": self.overhead_s,
            "offload_s": self.offload_s,
            "host_optimizer": list(self.host_optimizer),
            "host_params": list(self.host_params),
            "optimizer_slots": self.optimizer_slots,
            "prefetched": list(self.prefetched),
            "buckets": [b.to_dict(self.mesh) for b in self.buckets],
            "moves": [m.to_dict(self.mesh) for m in self.moves],
            "graph_lines": list(self.graph_lines),
            "stages": None if self.stages is None else self.stages.to_dict(),
            "accumulation_add_s": self.accumulation_add_s,
            "accumulated_bytes": self.accumulated_bytes,
            "predicted_step_s": self.predicted_step_s,
            "peak_memory_bytes": self.peak_memory_bytes,
        }
        return json.dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        data = json.loads(text)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"plan format version {version} is not supported (this autopar reads version {FORMAT_VERSION}); "
                "plan the model again"
            )
        mesh = Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"]))
        return cls(
            mesh=mesh,
            hardware=data["hardware"],
            links=tuple(Link.from_dict(link) for link in data["links"]),
            graph_hash=data["graph_hash"],
            placements={k: tuple(parse_placement(p) for p in v) for k, v in data["placements"].items()},
            inputs={k: tuple(parse_placement(p) for p in v) for k, v in data["inputs"].items()},
            pinned=tuple(data["pinned"]),
            nodes=tuple(NodePlan.from_dict(n) for n in data["nodes"]),
            collectives=tuple(Collective.from_dict(c) for c in data["collectives"]),
            bucket_bytes=data["bucket_bytes"],
            compute_s=data["compute_s"],
            communication_s=data["communication_s"],
            memory=MemoryEstimate(**data["memory"]),
            memory_budget_bytes=data["memory_budget_bytes"],
            solver=SolverInfo(**data["solver"]),
            stage_s=data["stage_s"],
            recompute_s=data["recompute_s"],
            node_overhead_s=data.get("node_overhead_s", 0.0),
            overhead_s=data["overhead_s"],
            offload_s=data["offload_s"],
            host_optimizer=tuple(data["host_optimizer"]),
            host_params=tuple(data["host_params"]),
            optimizer_slots=data.get("optimizer_slots", 2),
            prefetched=tuple(data["prefetched"]),
            buckets=tuple(PlannedBucket.from_dict(b, mesh) for b in data["buckets"]),
            moves=tuple(PlannedMove.from_dict(m, mesh) for m in data["moves"]),
            graph_lines=tuple(data["graph_lines"]),
            stages=None if data.get("stages") is None else Stages.from_dict(data["stages"]),
            accumulation_add_s=data["accumulation_add_s"],
            accumulated_bytes=data["accumulated_bytes"],
        )

    def _decisions(self) -> tuple:
        return (
            self.mesh,
            self.hardware,
            self.links,
            self.graph_hash,
            tuple(self.placements.items()),
            tuple(self.inputs.items()),
            self.pinned,
            self.nodes,
            self.collectives,
            self.bucket_bytes,
            self.host_optimizer,
            self.host_params,
            self.optimizer_slots,
            self.prefetched,
            self.buckets,
            self.moves,
            self.stages,
        )

    def __eq__(self, other) -> bool:
        """Plans are equal when they make the same decisions (solve time aside)."""
        return isinstance(other, ShardingPlan) and self._decisions() == other._decisions()

    def __hash__(self) -> int:
        return hash(self._decisions())

    def __str__(self) -> str:
        from autopar.core.explain import plan_table

        return plan_table(self)
