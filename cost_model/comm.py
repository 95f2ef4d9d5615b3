"""Communication time of collectives under the α-β model.

α is the latency of one collective call and β the seconds per byte of the link under the mesh
axis. With ``n`` ranks on the axis and ``B`` bytes as defined by
:attr:`autopar.passes.redistribute.Step.bytes`, bandwidth terms follow the ring algorithms:

- all-reduce: ``α + 2(n-1)/n·B·β``
- all-gather, reduce-scatter, all-to-all: ``α + (n-1)/n·B·β``

so an all-reduce costs one α less than the reduce-scatter and all-gather that move the same bytes.
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
    return link.latency_s + rounds * (n - 1) / n * step.bytes * link.s_per_byte
