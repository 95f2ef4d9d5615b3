"""The liveness of the program a plan lowers to (:mod:`autopar.passes.analysis.liveness`), for
the first rank of its mesh."""

from autopar.passes.analysis.liveness import Liveness, step_liveness
from autopar.passes.lower.partition import partition
from autopar.passes.lower.rewrite import rewrite


def plan_liveness(captured, plan) -> Liveness:
    """The liveness peaks of the program ``plan`` gives the first rank of its mesh, traced on
    fake tensors (no devices or process group needed)."""

    mesh = plan.mesh
    joint = rewrite(captured, plan, coordinate=(0,) * mesh.ndim, group_names=[f"planning-{a}" for a in mesh.axis_names])
    parts = partition(
        joint,
        [k.kind == "tangent" for k in captured.inputs],
        [None if k is None else k.kind == "grad" for k in captured.outputs],
    )
    state = [k for k in captured.inputs if k.kind != "tangent"]
    return step_liveness(
        parts.forward,
        parts.backward,
        [k.kind for k in state],
        on_host=[k.name in plan.host_optimizer for k in state],
        host_inputs=[k.name in plan.host_params for k in state],
        optimizer_slots=plan.optimizer_slots,
    )
