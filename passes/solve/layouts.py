"""The standard hand-written layouts, as complete plans of the solver's program: the plan
returned when the search stops at its time limit with none, or only with slower ones.

- **Data parallel**: parameters and buffers replicated (DDP).
- **Fully sharded**: every parameter split along its first dim over every mesh axis that
  divides it (FSDP, ZeRO-3).
- On a mesh of several axes, **sharded over one axis** and replicated over the others (HSDP).
- **Tensor parallel over one axis** (Megatron), data parallel over the others; on a mesh of
  several axes also **fully sharded over the others** (FSDP with tensor parallelism, as
  torchtitan lays out 2-D training).

Parameters and buffers are fixed as the layout says (inputs come whole, as every plan has them
unless pinned); every other node then takes, in graph order, the strategy that costs least
given its operands' layouts (its compute plus moving each operand, by the cost model's
transitions): the batch splits where slicing it makes the ops cheaper. Over the axes a layout
shards parameters for storage (FSDP's and HSDP's), ops read them whole: each is gathered where
it is used, in the forward and again in the backward.

Which matmuls pair up into Megatron's column and row splits is not written anywhere in the
graph, so the tensor-parallel layouts find them in the same pass. A parameter's split over the
tensor-parallel axis is left open until the first op that reads it through layout-only ops
(a transpose, a view, a cast) prices it: the op takes the strategy that costs least over
every split of the parameter that its readers can take. And no operand replicated over that
axis is sliced over it, so the work over the axis splits only where a parameter's split
splits it. A linear layer whose input is whole then splits its weight's output dim (its
output comes split for free), and one whose input comes split splits its input dim (its
output comes as partial sums, which the next op that needs them whole all-reduces): Megatron's
column and row pairs, with its one all-reduce per pair.
"""

import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field

from autopar.core.mesh import Mesh
from autopar.core.placement import Partial, Placements, Replicate, Shard
from autopar.core.strategy import NodeSpace, StrategySpace, ValueRef

_MATMULS = frozenset(f"aten.{op}.default" for op in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm"))
"""The ops whose reading of a parameter split over the tensor-parallel axis splits their work:
every other op reads an open parameter replicated over it (norm scales, embeddings)."""

TransitionCost = Callable[[ValueRef, Placements, Placements], float]


def standard_layouts(
    space: StrategySpace,
    mesh: Mesh,
    node_costs: dict[str, list[float]],
    transition_s: TransitionCost,
    shared: Mapping[str, str] | None = None,
    value_kind: Callable[[ValueRef], Hashable] | None = None,
) -> Iterator[tuple[str, dict[str, int]]]:
    """``(name, strategy index of every node)`` of each standard layout the pins allow.
    ``shared`` maps nodes of repeated layers to their counterparts in the layer they copy
    (:attr:`~autopar.passes.solve.layers.LayerClasses.template`) and ``value_kind`` gives what a
    value's moves cost depends on (:meth:`~autopar.cost_model.estimate.CostModel.value_kind`):
    with both, a node whose operands come as its counterpart's came takes the strategy its
    counterpart took, without pricing its strategies again."""
    axes = tuple(range(mesh.ndim))
    repeats = {"shared": dict(shared or {}), "value_kind": value_kind}
    splits = [("data parallel", ()), ("fully sharded", axes)]
    if mesh.ndim > 1:
        splits += [(f"sharded over {mesh.axis_names[a]}", (a,)) for a in axes]
    for name, split in splits:
        fixed = {
            n.name: _closest(n, split if n.kind == "param" else ())
            for n in space.nodes
            if n.kind in ("param", "buffer", "input")
        }
        choice = _Completion(space, node_costs, transition_s, fixed, gathered=split, **repeats).run()
        if choice is not None:
            yield name, choice
    for tp in axes:
        others = tuple(a for a in axes if a != tp)
        tensor = f"tensor parallel over {mesh.axis_names[tp]}"
        variants = [(tensor, ())] + (
            [(f"fully sharded over {_names(mesh, others)}, {tensor}", others)] if others else []
        )
        for name, split in variants:
            fixed = {n.name: _closest(n, ()) for n in space.nodes if n.kind in ("buffer", "input")}
            open_params = {n.name: _splits_over(n, tp, split) for n in space.nodes if n.kind == "param"}
            choice = _Completion(space, node_costs, transition_s, fixed, split, open_params, tp, **repeats).run()
            if choice is not None:
                yield name, choice


def _or_inf(seconds: float) -> float:
    """``seconds``, or infinity for NaN, so that strategies sort by their own cost."""
    return math.inf if math.isnan(seconds) else seconds


def _names(mesh: Mesh, axes: tuple[int, ...]) -> str:
    return " and ".join(mesh.axis_names[a] for a in axes)


def _split_axes(
    placements: Placements | None, axes: tuple[int, ...], dim: int = 0, free: int | None = None
) -> int | None:
    """How many of ``axes`` ``placements`` split along ``dim``, when they are whole over every
    other axis but ``free``; ``None`` when they are not of that form."""
    if placements is None:
        return None
    for a, p in enumerate(placements):
        if a != free and not isinstance(p, Replicate) and not (a in axes and p == Shard(dim)):
            return None
    return sum(p == Shard(dim) for a, p in enumerate(placements) if a != free)


def _closest(node: NodeSpace, axes: tuple[int, ...]) -> int:
    """The strategy of a placeholder splitting its first dim over as many of ``axes`` as it
    can, replicated elsewhere (its first strategy when none is of that form: a pin, an input)."""
    ranked = [(s, k) for k, st in enumerate(node.strategies) if (s := _split_axes(st.outputs[0], axes)) is not None]
    return max(ranked, key=lambda sk: (sk[0], -sk[1]))[1] if ranked else 0


def _splits_over(node: NodeSpace, tp: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    """The strategies a parameter may take in a tensor-parallel layout: any placement over the
    tensor-parallel axis ``tp`` and, for each, over as many of ``axes`` as it can, a split of
    the first dim that ``tp`` does not split (so that gathering it over them is one all-gather),
    replicated over the rest (its first strategy when none is of that form: a pin)."""
    best: dict[object, tuple[int, int]] = {}
    for k, strategy in enumerate(node.strategies):
        placements = strategy.outputs[0]
        if placements is None:
            continue
        over_tp = placements[tp]
        dim = 1 if over_tp == Shard(0) else 0
        if (s := _split_axes(placements, axes, dim, free=tp)) is not None and (
            over_tp not in best or s > best[over_tp][0]
        ):
            best[over_tp] = (s, k)
    return tuple(k for _, k in best.values()) or (0,)


@dataclass
class _Open:
    """A node whose strategy waits for the first op that prices it: for each strategy it may
    take, the seconds it costs so far and, for each open operand, the strategy that operand
    then takes."""

    costs: dict[int, float]
    operands: dict[int, dict[str, int]] = field(default_factory=dict)


@dataclass
class _Completion:
    """Every node's strategy: ``fixed`` ones as given, the others, in graph order, the cheapest
    given the layouts their operands already have (operands not yet placed, such as a
    parameter's gradient, are left out).

    ``open_params`` (with ``tp``, the tensor-parallel axis) are parameters whose strategy the
    first op that prices them picks among those listed, as the module docstring says. Over the
    ``gathered`` axes parameters are split for storage only: an op reads a parameter, or a
    transpose or view of one, whole over them (FSDP's gather before use)."""

    space: StrategySpace
    node_costs: dict[str, list[float]]
    transition_s: TransitionCost
    fixed: dict[str, int]
    gathered: tuple[int, ...] = ()
    open_params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tp: int | None = None
    shared: dict[str, str] = field(default_factory=dict)
    value_kind: Callable[[ValueRef], Hashable] | None = None

    def __post_init__(self):
        self.by_name = self.space.index()
        self.choice: dict[str, int] = {}
        self.open: dict[str, _Open] = {}
        self.of_params: set[str] = set()  # parameters, and forward ops of parameters alone
        self.repeated: dict[tuple, int] = {}  # by :meth:`repeat_key`: the strategy a node took

    def run(self) -> dict[str, int] | None:
        """The strategy of every node; ``None`` when some node has no strategy of finite cost."""
        for n in self.space.nodes:
            if n.kind == "param" or (n.kind == "op" and n.args and all(a in self.of_params for a, _ in n.args)):
                self.of_params.add(n.name)
            if n.name in self.fixed:
                self.choice[n.name] = self.fixed[n.name]
            elif n.name in self.open_params:
                self.open[n.name] = _Open({k: self.node_costs[n.name][k] for k in self.open_params[n.name]})
            elif n.kind == "op" and n.args and all(name in self.open for name, _ in n.args):
                self.open[n.name] = self.priced(n, keep_all=True, strict=True)
            else:
                key = self.repeat_key(n)
                if key in self.repeated:
                    self.choice[n.name] = self.repeated[key]
                    continue
                options = self.priced(n, keep_all=False, strict=True)
                if not options.costs:
                    options = self.priced(n, keep_all=False, strict=False)
                if not options.costs:
                    return None
                self.settle(n.name, options, min(options.costs, key=options.costs.__getitem__))
                if key is not None:
                    self.repeated[key] = self.choice[n.name]
        for name, options in list(self.open.items()):  # read by nothing priced: its cheapest strategy
            if name not in self.choice and options.costs:
                self.settle(name, options, min(options.costs, key=options.costs.__getitem__))
        return self.choice if len(self.choice) == len(self.space.nodes) else None

    def repeat_key(self, n: NodeSpace) -> tuple | None:
        """What the strategy :meth:`run` gives ``n`` depends on once all its operands are placed:
        its counterpart in the layer it copies (or itself), its costs, and each operand's
        layout, kind and whether it is of the parameters alone. ``None`` while an operand is
        open, or without ``value_kind`` or repeated layers."""
        if self.value_kind is None or not self.shared or not all(name in self.choice for name, _ in n.args):
            return None
        return (
            self.shared.get(n.name, n.name),
            tuple(self.node_costs[n.name]),
            tuple(
                (self.made(name, self.choice[name], index), self.value_kind((name, index)), name in self.of_params)
                for name, index in n.args
            ),
        )

    def priced(self, n: NodeSpace, keep_all: bool, strict: bool) -> _Open:
        """The seconds of each strategy of ``n`` (all of them, or the cheapest), with its open
        operands' cheapest strategies for it. ``strict`` leaves out the strategies that move an
        operand against the layout's form (:meth:`move_s`)."""
        found, best, costs = _Open({}), math.inf, self.node_costs[n.name]
        order = range(len(costs)) if keep_all else sorted(range(len(costs)), key=lambda k: _or_inf(costs[k]))
        for k in order:
            seconds, operands, strategy = costs[k], {}, n.strategies[k]
            if not keep_all and seconds > best:
                break  # moves cost nothing or more: no strategy from here on is cheaper
            for ref, needed in zip(n.args, strategy.inputs):
                if not keep_all and seconds > best:
                    break
                name, index = ref
                if (
                    strict
                    and name in self.of_params
                    and any(not isinstance(needed[a], Replicate) for a in self.gathered)
                ):
                    seconds = math.inf
                elif name in self.choice:
                    j = self.choice[name]
                    seconds += self.move_s(ref, self.made(name, j, index), needed, strict)
                elif name in self.open:
                    moved = {
                        j: s + self.move_s(ref, self.made(name, j, index), needed, strict)
                        for j, s in self.candidates(name, index, splits=keep_all or self.splits(n))
                    }
                    if not moved:
                        seconds = math.inf
                        continue
                    operands[name] = min(moved, key=moved.__getitem__)
                    seconds += moved[operands[name]]
            if keep_all and seconds < math.inf:
                found.costs[k], found.operands[k] = seconds, operands
            elif seconds < best or (seconds == best < math.inf and k < min(found.costs)):
                found, best = _Open({k: seconds}, {k: operands}), seconds
        return found

    def candidates(self, name: str, index: int, splits: bool) -> list[tuple[int, float]]:
        """The strategies open node ``name`` may still take, with their seconds so far: only
        those replicated over the tensor-parallel axis unless ``splits`` (a matmul reads it, or
        an op that leaves it open)."""
        options = list(self.open[name].costs.items())
        if splits:
            return options
        whole = [(k, s) for k, s in options if isinstance(self.made(name, k, index)[self.tp], Replicate)]
        return whole or options

    def splits(self, n: NodeSpace) -> bool:
        """Whether ``n`` may read an open parameter split over the tensor-parallel axis: a matmul,
        or an op reading a value already split there (a bias added to a column split's output)."""
        return n.target in _MATMULS or any(
            name in self.choice and isinstance(self.made(name, self.choice[name], index)[self.tp], Shard)
            for name, index in n.args
        )

    def made(self, name: str, k: int, index: int) -> Placements | None:
        return self.by_name[name].strategies[k].outputs[index]

    def move_s(self, ref: ValueRef, made: Placements | None, needed: Placements, strict: bool) -> float:
        """The seconds of moving ``ref`` from ``made`` to ``needed``; when ``strict`` in a
        tensor-parallel layout, infinite for a move over its axis to anything but whole or
        another split of a split tensor: nothing is sliced or made partial there, but a
        parameter's value, made partial for a row split's bias (no communication). Priced by
        ``transition_s``, which keeps its answers (:meth:`~autopar.cost_model.estimate.CostModel.transition_s`)."""
        if made == needed:
            return 0.0
        if (
            strict
            and self.tp is not None
            and not isinstance(needed[self.tp], (Replicate, type(made[self.tp])))
            and not (ref[0] in self.of_params and isinstance(needed[self.tp], Partial))
        ):
            return math.inf
        return self.transition_s(ref, made, needed)

    def settle(self, name: str, options: _Open, k: int) -> None:
        """Fix ``name`` at strategy ``k`` and its open operands at theirs for it."""
        self.choice[name] = k
        for operand, j in options.operands.get(k, {}).items():
            if operand not in self.choice:
                self.settle(operand, self.open[operand], j)
