"""Communication time of collectives under the α-β model, ring algorithms.

With ``n`` ranks on the axis, latency α and seconds per byte β (``B`` as defined by
:attr:`autopar.passes.redistribute.Step.bytes`):

- all-reduce: ``2(n-1)·α + 2(n-1)/n·B·β``
- all-gather, reduce-scatter, all-to-all: ``(n-1)·α + (n-1)/n·B·β``
"""

from autopar.cost_model.hardware import Profile
from autopar.mesh import Mesh
from autopar.passes.redistribute import Step


def step_time_s(step: Step, mesh: Mesh, hardware: Profile) -> float:
    """Modelled time of one transition step; local steps cost nothing."""
    if not step.is_collective:
        return 0.0
    n = mesh.shape[step.axis]
    if n == 1:
        return 0.0
    link = hardware.link(mesh, step.axis)
    rounds = 2 if step.kind == "all_reduce" else 1
    return rounds * ((n - 1) * link.latency_s + (n - 1) / n * step.bytes * link.s_per_byte)
