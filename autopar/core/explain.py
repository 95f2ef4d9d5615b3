"""Human-readable views of a plan: the summary table and the annotated graph."""

from collections import Counter

from autopar.core.graph import segment_of
from autopar.core.kinds import Activation
from autopar.core.placement import Placements, format_placements
from autopar.core.plan import ShardingPlan, format_layouts

# Ops worth a row in the table: the ones that carry the FLOPs.
_HEAVY = ("mm", "addmm", "bmm", "embedding", "scaled_dot_product", "convolution", "layer_norm")


def format_bytes(nbytes: float) -> str:
    """``1.5 MiB``-style sizes (powers of 2) for tables and messages."""
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if abs(nbytes) < 1024 or unit == "GiB":
            break
    return f"{nbytes:.1f} {unit}"


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"


def _layout(placements: Placements | None) -> str:
    """One tensor's placements as the tables print them (``None``: an output that is not a tensor)."""
    return "None" if placements is None else format_placements(placements)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return out


def plan_table(plan: ShardingPlan) -> str:
    """The plan as text: the predicted step and memory, how the solve went, then parameters,
    inputs, heavy ops, activations by layer and collectives."""
    lines = [f"ShardingPlan for {plan.mesh} on '{plan.hardware}'  (graph {plan.graph_hash})", _step_line(plan)]
    lines += [_solver_line(plan), *_stage_table(plan), ""]
    lines += ["Parameters" + (f"  (pinned: {', '.join(plan.pinned)})" if plan.pinned else "")]
    return "\n".join(lines + _state_tables(plan) + _op_tables(plan) + _collective_table(plan))


def _stage_table(plan: ShardingPlan) -> list[str]:
    """With pipeline stages: the schedule, per stage its units, time and position on the
    pipeline axis, and per position its memory."""
    stages = plan.stages
    if stages is None:
        return []
    interleaved = f" of {stages.stages_per_rank} stages per rank" if stages.stages_per_rank > 1 else ""
    head = (
        f"pipeline stages over '{stages.axis}' of {stages.mesh}: {stages.microbatches} micro-batches, "
        f"{stages.schedule}{interleaved}, predicted bubble {stages.bubble:.0%}, step {_time(stages.step_s)}; "
        f"the rest of this table is one micro-batch on {plan.mesh}"
    )
    rows = [
        [
            str(s),
            str(stages.position_of(s)),
            segments[0] if len(segments) == 1 else f"{segments[0]} .. {segments[-1]} ({len(segments)})",
            _time(stages.compute_s[s]),
            _time(stages.send_s[s]),
            _time(stages.sync_s[s]),
            _time(stages.accumulate_s[s]),
            format_bytes(stages.peak_bytes[s]) if s < stages.positions else "",
        ]
        for s, segments in enumerate(stages.segments)
    ]
    headers = [
        "stage",
        "position",
        "layers",
        "compute per micro-batch",
        "sends per micro-batch",
        "gradient sync",
        "gradient sums",
        "peak memory of the position",
    ]
    return ["", head, *_table(headers, rows)]


def _step_line(plan: ShardingPlan) -> str:
    """The predicted step time by part, and the peak memory by part."""
    mem = plan.memory
    return (
        f"predicted step {_time(plan.predicted_step_s)} (compute {_time(plan.compute_s)}, "
        + (f"recompute {_time(plan.recompute_s)}, " if plan.recompute_s else "")
        + f"communication {_time(plan.communication_s)}"
        + (f", offload {_time(plan.offload_s)}" if plan.offload_s else "")
        + (f", step overhead {_time(plan.overhead_s)}" if plan.overhead_s else "")
        + f"); peak memory per device {format_bytes(plan.peak_memory_bytes)}"
        + (
            f" by the per-rank program's liveness; the solver's {format_bytes(mem.solver_bytes)}"
            if mem.liveness_peak_bytes
            else ""
        )
        + " ("
        + ("at the step's fullest moment; over the step: " if mem.moment_bytes else "")
        + f"params {format_bytes(mem.params_bytes)}, grads {format_bytes(mem.grads_bytes)}, "
        f"optimizer {format_bytes(mem.optimizer_bytes)}, "
        f"activations kept {format_bytes(mem.activations_bytes)}, "
        f"recomputed at once {format_bytes(mem.recomputed_bytes)}, "
        f"largest temporary {format_bytes(mem.transient_bytes)}"
        + (f", gradient bucket {format_bytes(mem.bucket_bytes)}" if mem.bucket_bytes else "")
        + ")"
        + (f"; in host memory {format_bytes(mem.host_bytes)}" if mem.host_bytes else "")
        + (
            f" of the {format_bytes(mem.host_capacity_bytes)} it may fill"
            if mem.host_bytes and mem.host_capacity_bytes
            else ""
        )
        + (f", budget {format_bytes(plan.memory_budget_bytes)}" if plan.memory_budget_bytes else "")
    )


def _shared(solver) -> str:
    """Which layers took another layer's choices: those of classes of identical layers, and those
    alike to no other that share the ops they have in common with one."""
    parts = []
    if solver.layer_classes:
        parts.append(
            f"{solver.shared_layers} repeated layers in {solver.layer_classes} "
            f"class{'es' if solver.layer_classes != 1 else ''} share their first layer's"
        )
    if solver.aligned_layers:
        parts.append(
            f"{solver.aligned_layers} {'more ' if parts else ''}"
            + (
                "layers alike to no other share the ops they have"
                if solver.aligned_layers != 1
                else "layer alike to no other shares the ops it has"
            )
            + " in common with their stack's"
        )
    return ", ".join(parts)


def _solver_line(plan: ShardingPlan) -> str:
    return (
        (
            f"solver: LAYOUT, the {plan.solver.layout}{'' if plan.solver.layout.startswith('plan of') else ' layout'} "
            "(the mesh's own program is too large to search)"
            if plan.solver.status == "LAYOUT" and plan.solver.num_variables == 0
            else f"solver: LAYOUT, the {plan.solver.layout} layout (the search found no faster plan within its time "
            f"limit), {plan.solver.num_variables} variables"
            if plan.solver.status == "LAYOUT"
            else f"solver: {plan.solver.status}, objective {_time(plan.solver.objective_s)}, bound "
            f"{_time(plan.solver.bound_s)}, {plan.solver.num_variables} variables"
        )
        + (f" ({_shared(plan.solver)}, {plan.solver.shared_nodes} nodes)" if plan.solver.shared_nodes else "")
        + f", solved in {plan.solver.solve_s:.2f} s; "
        f"planning took {sum(plan.stage_s.values()):.2f} s ("
        + ", ".join(f"{k} {v:.2f}" for k, v in plan.stage_s.items())
        + ")"
    )


def _state_tables(plan: ShardingPlan) -> list[str]:
    """Parameters (with what lives in host memory) and inputs."""
    lines: list[str] = []
    if plan.host_optimizer:
        lines += _table(
            ["name", "placements", "in host memory"],
            [
                [
                    k,
                    format_placements(v),
                    "parameter, gradient, optimizer state"
                    if k in plan.host_params
                    else "optimizer state"
                    if k in plan.host_optimizer
                    else "-",
                ]
                for k, v in plan.placements.items()
            ],
        )
    else:
        lines += _table(["name", "placements"], [[k, format_placements(v)] for k, v in plan.placements.items()])
    lines += ["", "Inputs"]
    lines += _table(["name", "placements"], [[k, format_placements(v)] for k, v in plan.inputs.items()])
    return lines


def _op_tables(plan: ShardingPlan) -> list[str]:
    """The heavy ops, and activations by layer."""
    lines: list[str] = []
    heavy = [n for n in plan.nodes if any(h in n.op for h in _HEAVY)]
    lines += ["", "Heavy ops"]
    lines += _table(
        ["module", "op", "node", "phase", "inputs", "output", "format", "compute"],
        [
            [
                n.module or "-",
                n.op.removeprefix("aten.").removesuffix(".default"),
                n.name,
                n.phase,
                " ".join(format_placements(p) for p in n.inputs),
                _layout(n.outputs[0]),
                n.fmt or "-",
                _time(n.compute_s),
            ]
            for n in heavy
        ],
    )
    lines += [
        "",
        "Activations by layer (kept from the forward, recomputed in the backward, or offloaded to host memory)",
    ]
    lines += _table(
        [
            "layer",
            "kept",
            "recomputed",
            "offloaded",
            "ops recomputed",
            "recompute time",
            "ops offloaded",
            "copy time",
            "copied back",
        ],
        activation_rows(plan),
    )
    return lines


def _collective_table(plan: ShardingPlan) -> list[str]:
    lines: list[str] = []
    lines += ["", "Collectives"]
    lines += _table(
        ["kind", "axis", "phase", "bytes", "time", "tensor", "for", "from -> to"],
        [
            [
                c.kind,
                c.axis,
                c.phase,
                format_bytes(c.bytes),
                _time(c.time_s),
                c.tensor,
                c.consumer,
                f"{format_layouts(c.src)} -> {format_layouts(c.dst)}",
            ]
            for c in plan.collectives
        ],
    )
    counts = Counter((c.phase, c.kind) for c in plan.collectives)
    if counts:
        lines.append("total: " + ", ".join(f"{n} {kind} ({phase})" for (phase, kind), n in sorted(counts.items())))
    return lines


def activation_rows(plan: ShardingPlan) -> list[list[str]]:
    """Per layer (segment): bytes kept, recomputed and offloaded per device, how many ops are
    recomputed and what recomputing them costs (their compute and the collectives made again),
    how many are offloaded, how long their copies to the host and back take, and when they are
    copied back: ahead (prefetched during the backward of the layer after) or at the first read."""
    rows: dict[str, list] = {}
    segment = {n.name: segment_of(n.module) for n in plan.nodes}
    column: dict[Activation, int] = {"keep": 0, "recompute": 1, "offload": 2}
    for n in plan.nodes:
        if n.activation:
            row = rows.setdefault(segment[n.name], [0, 0, 0, 0, 0.0, 0, 0.0])
            row[column[n.activation]] += n.activation_bytes
            if n.activation == "recompute":
                row[3] += 1
                row[4] += n.compute_s
            elif n.activation == "offload":
                row[5] += 1
                row[6] += n.copy_s
    for c in plan.collectives:
        if c.phase == "recompute":
            rows.setdefault(segment.get(c.consumer, ""), [0, 0, 0, 0, 0.0, 0, 0.0])[4] += c.time_s
    return [
        [
            name or "(root)",
            format_bytes(kept),
            format_bytes(again),
            format_bytes(away),
            str(count),
            _time(time_s),
            str(copies),
            _time(copy_s),
            "-" if not copies else "ahead" if name in plan.prefetched else "at first read",
        ]
        for name, (kept, again, away, count, time_s, copies, copy_s) in rows.items()
    ]


def annotated_graph(plan: ShardingPlan) -> str:
    """One line per op of the joint graph with its placements, collectives where they happen."""
    moves: dict[str, list[str]] = {}
    for c in plan.collectives:
        moves.setdefault(c.consumer, []).append(
            f"    <- {c.kind}[{c.axis}] {c.tensor} {format_layouts(c.src)} -> {format_layouts(c.dst)} "
            f"({format_bytes(c.bytes)})"
        )
    lines = []
    starts = {segments[0]: s for s, segments in enumerate(plan.stages.segments)} if plan.stages else {}
    for n in plan.nodes:
        begun = next((u for u in starts if n.phase == "forward" and (n.module + ".").startswith(u + ".")), None)
        if begun is not None:
            lines.append(f"# pipeline stage {starts.pop(begun)} ({begun} ..)")
        lines.extend(moves.get(n.name, []))
        ins, outs = ", ".join(format_placements(p) for p in n.inputs), ", ".join(_layout(o) for o in n.outputs)
        where = f"  # {n.module}" if n.module else ""
        if n.activation:
            where += f"  [{n.activation} {format_bytes(n.activation_bytes)}]"
        lines.append(f"{n.phase[:3]}  {n.name} = {n.op}({ins}) -> {outs}{where}")
    for consumer in moves:
        if consumer not in {n.name for n in plan.nodes}:
            lines.append(f"{consumer}:")
            lines.extend(moves[consumer])
    return "\n".join(lines)
