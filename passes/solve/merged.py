"""Plans of a mesh with two adjacent axes merged into one, read as plans of the mesh itself.

A mesh of three axes has many more layouts per tensor than one of two, and its integer program
grows with them (the LLaMA-3-8B shape at 8 layers: 56k variables on 8×8, 798k on 2×4×8). Every
plan of the mesh with axes ``a`` and ``a + 1`` merged is also a plan of the mesh: the merged
axis's ``Shard(d)`` is ``Shard(d)`` over both (split over ``a``, then each piece over ``a + 1``,
as the row-major merged axis orders its devices), its ``Replicate()`` and ``Partial()`` are
the same over both. So the planner solves the smaller program of a merged mesh and starts the
search of the whole mesh from that plan, which is then never predicted slower than it.
"""

from autopar.core.mesh import Mesh
from autopar.core.placement import Placements
from autopar.core.strategy import StrategySpace


def merged_mesh(mesh: Mesh, axis: int) -> Mesh:
    """``mesh`` with axes ``axis`` and ``axis + 1`` merged into one named ``"a*b"``."""
    if not 0 <= axis < mesh.ndim - 1:
        raise ValueError(f"axis {axis} and the next are not both axes of {mesh}")
    shape, names = list(mesh.shape), list(mesh.axis_names)
    shape[axis : axis + 2] = [shape[axis] * shape[axis + 1]]
    names[axis : axis + 2] = [f"{names[axis]}*{names[axis + 1]}"]
    return Mesh(tuple(shape), tuple(names))


def _unmerged(placements: Placements | None, axis: int) -> Placements | None:
    if placements is None:
        return None
    return (*placements[: axis + 1], placements[axis], *placements[axis + 1 :])


def lifted(merged: StrategySpace, choice: dict[str, int], space: StrategySpace, axis: int) -> dict[str, int]:
    """The strategy of each node of ``space`` (the whole mesh's) that places its tensors as
    ``choice`` does on the mesh with ``axis`` and ``axis + 1`` merged (``merged``'s strategies),
    for every node that has one."""
    return _matched(merged, choice, space, lambda p: _unmerged(p, axis))


def same_strategies(other: StrategySpace, choice: dict[str, int], space: StrategySpace) -> dict[str, int]:
    """The strategy of each node of ``space`` that places its tensors as ``choice`` does in
    ``other``, a space of the same graph and mesh (planned under other pins), for every node
    that has one."""
    return _matched(other, choice, space, lambda p: p)


def _matched(other: StrategySpace, choice: dict[str, int], space: StrategySpace, placed) -> dict[str, int]:
    """The strategy of each node of ``space`` whose placements are those of its strategy in
    ``choice`` of ``other``'s, each read through ``placed``."""
    of_other = other.index()
    found = {}
    for n in space.nodes:
        if n.name not in of_other or n.name not in choice:
            continue
        chosen = of_other[n.name].strategies[choice[n.name]]
        wanted = tuple(placed(p) for p in chosen.outputs), tuple(placed(p) for p in chosen.inputs)
        for k, strategy in enumerate(n.strategies):
            if (strategy.outputs, strategy.inputs) == wanted:
                found[n.name] = k
                break
    return found
