"""Planning: capture → propagate → cost → solve → ShardingPlan, with no devices needed."""

import logging
import time
from collections.abc import Mapping, Sequence

import torch

from autopar.cost_model.estimate import CostModel
from autopar.cost_model.hardware import Profile, resolve_profile
from autopar.mesh import Mesh
from autopar.placement import Placement, Placements, parse_placements
from autopar.plan import ShardingPlan
from autopar.passes.capture import Captured, capture
from autopar.passes.planning import build_plan
from autopar.passes.propagate import propagate
from autopar.passes.solver import solve

log = logging.getLogger("autopar")

Pins = Mapping[str, "str | Sequence[str | Placement]"]


def parse_pins(pins: Pins | None, mesh: Mesh) -> dict[str, Placements]:
    if pins is None:
        return {}
    if not isinstance(pins, Mapping):
        raise TypeError(f"pins must map parameter or input names to placements, got {type(pins).__name__}")
    return {name: parse_placements(value, mesh.ndim) for name, value in pins.items()}


def check_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, e.g. Mesh((2, 2), ('dp', 'tp')), got {type(mesh).__name__}")


def plan_captured(captured: Captured, mesh: Mesh, *, hardware: "str | Profile" = "h100",
                  pins: Pins | None = None, fallback: bool = True,
                  solver_time_limit_s: float = 120.0) -> ShardingPlan:
    """Plan an already captured graph (see :func:`autopar.plan`)."""
    check_mesh(mesh)
    profile = resolve_profile(hardware)
    parsed = parse_pins(pins, mesh)
    t0 = time.perf_counter()
    space = propagate(captured, mesh, pins=parsed, fallback=fallback)
    t1 = time.perf_counter()
    costs = CostModel(captured, mesh, profile)
    node_costs = costs.node_costs(space)
    t2 = time.perf_counter()
    solution = solve(space, node_costs, costs.transition_s, time_limit_s=solver_time_limit_s)
    t3 = time.perf_counter()
    result = build_plan(captured, space, solution, costs, hardware_name=profile.name, pinned=tuple(parsed))
    log.debug("propagate %.2fs (%d nodes, %d strategies), cost %.2fs, solve %.2fs, plan %.2fs",
              t1 - t0, len(space.nodes), sum(len(n.strategies) for n in space.nodes), t2 - t1, t3 - t2,
              time.perf_counter() - t3)
    log.info("planned %d nodes on %s: %s, predicted step %.3g s, peak %.3g GB per device, %d collectives",
             len(space.nodes), mesh, solution.info.status, result.predicted_step_s,
             result.peak_memory_bytes / 1e9, len(result.collectives))
    return result


def plan(model: torch.nn.Module, mesh: Mesh, example_inputs: Sequence[torch.Tensor], *,
         hardware: "str | Profile" = "h100", pins: Pins | None = None, fallback: bool = True,
         solver_time_limit_s: float = 120.0) -> ShardingPlan:
    """Plan ``model`` for ``mesh`` without any process group or device.

    Args:
        model: the single-device module; ``model(*example_inputs)`` returns the loss (or any
            tensors; gradients are taken of the first output's tangent as torch does).
        mesh: the logical mesh, e.g. ``Mesh((2, 2), ("dp", "tp"))``.
        example_inputs: global-batch tensors with the shapes of training.
        hardware: ``"h100"``, ``"a100"``, ``"cpu"`` or a profile object.
        pins: fixed placements by parameter qualified name or forward argument name, one
            placement per mesh axis (a string for 1-D meshes): ``{"fc1.weight": ("R", "S(0)")}``.
        fallback: run ops that have no sharding rule replicated (with a warning) instead of
            raising :class:`~autopar.errors.UnsupportedOpError`.
        solver_time_limit_s: stop the MIP after this long with the best plan found.
    """
    check_mesh(mesh)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError("example_inputs must be a tuple of tensors, e.g. (x, y)")
    resolve_profile(hardware)
    parse_pins(pins, mesh)
    return plan_captured(capture(model, tuple(example_inputs)), mesh, hardware=hardware, pins=pins,
                         fallback=fallback, solver_time_limit_s=solver_time_limit_s)
