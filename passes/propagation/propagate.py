"""Sharding propagation: list each node's strategies on the whole mesh.

Rules give rows for one mesh axis (:mod:`autopar.passes.rules`); a strategy on an N-D mesh picks
one row per axis. A dim may be split by several axes (the first axis cuts it, the next cuts each
piece) when the op does the same thing on each of them. Layouts are dropped when the mesh axes
do not divide the dim they split, so uneven shapes are planned around.
"""

import itertools
import logging
import math

import torch
from autopar.passes.analysis.capture import Captured, InputKind, captured_backward
from autopar.passes.propagation.redistribute import valid_layouts
from autopar.passes.propagation.transit import drop_transit_splits
from autopar.passes.rules import carries, rule_for, tensor_args
from torch import fx

from autopar.core.errors import InfeasiblePlanError, UnsupportedOpError
from autopar.core.kinds import Phase
from autopar.core.mesh import Mesh
from autopar.core.placement import Partial, Placements, R, Shard, format_placements
from autopar.core.strategy import NodeSpace, Strategy, StrategySpace, ValueRef, getitem_aliases

log = logging.getLogger(__name__)


def propagate(
    captured: Captured, mesh: Mesh, *, pins: dict[str, Placements] | None = None, fallback: bool = True
) -> StrategySpace:
    """Enumerate the strategies of every node of ``captured``'s joint graph on ``mesh``.

    ``pins`` fixes the placements of parameters, buffers or inputs by name. Ops with no rule run
    replicated when ``fallback`` is true (with one warning listing them) and raise
    :class:`UnsupportedOpError` otherwise.
    """
    pins = dict(pins or {})
    graph = captured.graph.graph
    backward = captured_backward(captured)
    aliases = getitem_aliases(graph)
    updates = _state_updates(captured)
    nodes: list[NodeSpace] = []
    unsupported: list[fx.Node] = []
    carrying: set[str] = set()
    placeholder_kinds = dict(zip(captured.placeholders, captured.inputs))
    seen: dict[tuple, tuple[Strategy, ...]] = {}  # per op signature, its strategies (repeated layers repeat them)
    for node in graph.nodes:
        phase: Phase = "backward" if node in backward else "forward"
        if node.op == "placeholder":
            kind = placeholder_kinds[node]
            nodes.append(_placeholder_space(node, kind, mesh, pins.pop(kind.name, None), updates, aliases, phase))
        elif node.op == "get_attr" and isinstance(node.meta.get("val"), torch.Tensor):
            whole = (R,) * mesh.ndim  # a constant of the graph (a tensor literal of the model's code)
            nodes.append(NodeSpace(node.name, "constant", str(node.target), (), (Strategy((whole,), ()),), phase))
        elif node.op == "call_function" and node.name not in aliases:
            key = _op_signature(node)
            if rule_for(node.target) is None:
                unsupported.append(node)
            elif carries(node.target):
                carrying.add(node.name)
            if key not in seen:
                seen[key] = _op_strategies(node, mesh)
            nodes.append(
                NodeSpace(
                    node.name,
                    "op",
                    str(node.target),
                    tuple(_ref(a, aliases) for a in tensor_args(node)),
                    seen[key],
                    phase,
                )
            )
    nodes.append(_output_space(captured, mesh, aliases))
    if pins:
        known = sorted(k.name for k in captured.inputs if k.kind != "tangent")
        raise ValueError(
            f"pins name {sorted(pins)}, which are not parameters, buffers or inputs of the model; known names: {known}"
        )
    if unsupported:
        lines = [f"  {n.name}: {n.target} on {_shapes(n)}" for n in unsupported]
        if not fallback:
            raise UnsupportedOpError(
                f"{len(unsupported)} node(s) use operators with no sharding rule:\n"
                + "\n".join(lines)
                + "\nFix: pass fallback=True to run them replicated, or add a rule in autopar/passes/rules/"
            )
        log.warning("no sharding rule for %d node(s); they run replicated:\n%s", len(unsupported), "\n".join(lines))
    return StrategySpace(tuple(drop_transit_splits(nodes, carrying)), aliases)


def placement_problem(value: torch.Tensor, placements: Placements, mesh: Mesh) -> str | None:
    """Why ``placements`` cannot lay out ``value`` on ``mesh``, or ``None`` if they can.

    A dim split by several mesh axes is cut by the first axis, each piece by the next, and so on,
    so the product of their sizes must divide it.
    """
    splits: dict[int, list[int]] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Partial) and not value.is_floating_point():
            return f"a {value.dtype} tensor cannot hold partial sums"
        if isinstance(p, Shard):
            if p.dim >= value.ndim:
                return f"dim {p.dim} does not exist in a {value.ndim}-d tensor"
            splits.setdefault(p.dim, []).append(axis)
    for dim, axes in splits.items():
        if value.shape[dim] % math.prod(mesh.shape[a] for a in axes):
            names = " x ".join(f"'{mesh.axis_names[a]}' (size {mesh.shape[a]})" for a in axes)
            return f"dim {dim} (size {value.shape[dim]}) is not divisible by mesh axis {names}"
    return None


def _co_split_rows_agree(combo, placements: list[Placements]) -> bool:
    """A dim split by several mesh axes is split the same way by the op on each of them: the
    axes then act as one axis of their combined size, for which the rule's row holds."""
    for layout in placements:
        seen: dict[int, int] = {}
        for axis, p in enumerate(layout):
            if isinstance(p, Shard):
                if p.dim in seen and combo[seen[p.dim]] != combo[axis]:
                    return False
                seen[p.dim] = axis
    return True


def _ref(arg: fx.Node, aliases: dict[str, ValueRef]) -> ValueRef:
    return aliases.get(arg.name, (arg.name, 0))


def _state_updates(captured: Captured) -> dict[str, fx.Node]:
    """Parameter name -> its gradient, buffer name -> its new value (a buffer the forward
    updates in place): each must reach the step's end in the placements of its parameter or
    buffer."""
    out = captured.graph.graph.output_node()
    return {
        kind.name: value
        for kind, value in zip(captured.outputs, out.args[0])
        if kind is not None and kind.kind in ("grad", "buffer") and isinstance(value, fx.Node)
    }


def _layouts(value: torch.Tensor, mesh: Mesh) -> list[Placements]:
    """Every replicate/shard layout of ``value`` that fits ``mesh``."""
    return list(valid_layouts(tuple(value.shape), mesh, partial=False))


def whole_on_one_rank(placements: Placements, mesh: Mesh) -> Placements:
    """``placements`` with a split over an axis of one rank read as replicated: that rank's
    piece is the whole tensor, and a split there would have the program gather its one piece
    (a gloo all-gather over one rank took 0.1 to 0.2 ms here, the MLP example's three of them
    15% of its step on one rank)."""
    return tuple(R if size == 1 and isinstance(p, Shard) else p for size, p in zip(mesh.shape, placements))


def _placeholder_space(node, kind: InputKind, mesh, pin, updates, aliases, phase: Phase) -> NodeSpace:
    value = node.meta["val"]
    if kind.kind in ("tangent", "input") and pin is None:
        layouts = [(R,) * mesh.ndim]  # every rank is given the whole tensor; ops slice it for free
    elif pin is not None:
        problem = placement_problem(value, pin, mesh)
        if problem:
            raise InfeasiblePlanError(
                f"pin {kind.name}={format_placements(pin)} cannot lay out its tensor of shape "
                f"{tuple(value.shape)}: {problem}.\nFix: pin a dim that the mesh axis divides, or "
                "change the tensor's size to a multiple of the axis size"
            )
        layouts = [whole_on_one_rank(pin, mesh)]
    else:
        layouts = _layouts(value, mesh)
    update = updates.get(kind.name) if kind.kind in ("param", "buffer") else None
    args = (_ref(update, aliases),) if update is not None else ()
    strategies = tuple(Strategy((p,), (p,) if args else ()) for p in layouts)
    return NodeSpace(node.name, kind.kind, kind.name, args, strategies, phase)


def _op_signature(node: fx.Node) -> tuple:
    """What an op's strategies depend on: its target, its arguments (nodes by the order they
    first appear and their values' shapes, strides and dtypes; constants by value) and its
    outputs' shapes. Ops of repeated layers have the same signature."""
    order: dict[fx.Node, int] = {}

    def encode(a):
        if isinstance(a, fx.Node):
            return ("node", order.setdefault(a, len(order)), _value_signature(a.meta.get("val")))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(encode(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, encode(v)) for k, v in sorted(a.items())))
        return (type(a).__name__, repr(a))

    return node.target, encode(node.args), encode(node.kwargs), _value_signature(node.meta.get("val"))


def _value_signature(val) -> tuple:
    if isinstance(val, torch.Tensor):
        return ("tensor", tuple(val.shape), val.stride() if val.layout == torch.strided else None, val.dtype)
    if isinstance(val, (list, tuple)):
        return (type(val).__name__, tuple(_value_signature(v) for v in val))
    return (type(val).__name__, repr(val))


def _op_strategies(node: fx.Node, mesh: Mesh) -> tuple[Strategy, ...]:
    """Every strategy of op ``node`` on ``mesh``: one rule row per mesh axis, where the layouts
    fit the shapes (replicated where the op has no rule)."""
    args = tensor_args(node)
    rule = rule_for(node.target)
    outs = node.meta.get("val")
    out_vals = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    replicated = (tuple(R if isinstance(o, torch.Tensor) else None for o in out_vals), (R,) * len(args))
    rows = [replicated] if rule is None else rule(node)
    in_vals = [a.meta["val"] for a in args]
    strategies = []
    for combo in itertools.product(
        *(rows if size > 1 else [replicated] for size in mesh.shape)
    ):  # an axis of 1 rank only replicates
        outputs = tuple(
            None if not isinstance(o, torch.Tensor) else tuple(row[0][i] for row in combo)
            for i, o in enumerate(out_vals)
        )
        inputs = tuple(tuple(row[1][k] for row in combo) for k in range(len(args)))
        if not _co_split_rows_agree(combo, [p for p in outputs + inputs if p is not None]):
            continue
        if all(
            placement_problem(v, p, mesh) is None for v, p in zip(out_vals + in_vals, outputs + inputs) if p is not None
        ):
            strategies.append(Strategy(outputs, inputs))
    strategies = tuple(dict.fromkeys(strategies))
    if not strategies:
        raise InfeasiblePlanError(f"node {node.name} ({node.target} on {_shapes(node)}) has no layout that fits {mesh}")
    return strategies


def _output_space(captured: Captured, mesh: Mesh, aliases) -> NodeSpace:
    out = captured.graph.graph.output_node()
    refs = tuple(
        _ref(value, aliases)
        for kind, value in zip(captured.outputs, out.args[0])
        if kind is not None and kind.kind == "output" and isinstance(value, fx.Node)
    )
    whole = Strategy((), tuple((R,) * mesh.ndim for _ in refs))  # outputs come back whole
    return NodeSpace("output", "output", "output", refs, (whole,), "forward")


def _shapes(node: fx.Node) -> str:
    shapes = [tuple(a.meta["val"].shape) for a in tensor_args(node)]
    return ", ".join(str(s) for s in shapes) or "no tensor inputs"
