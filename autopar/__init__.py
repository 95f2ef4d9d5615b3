"""autopar: automatic parallelization of PyTorch training on a device mesh.

``autopar.plan(model, mesh, example_inputs)`` captures the training step, solves for the
placement of every tensor and returns a :class:`ShardingPlan`; ``autopar.compile(model, mesh)``
also rewrites the step into one program per rank and runs it on torch.distributed.
"""

from autopar.api import compile
from autopar.core.errors import (
    AutoparError,
    CaptureError,
    CollectiveError,
    InfeasiblePlanError,
    InputError,
    RewriteError,
    StalePlanError,
    UnsupportedOpError,
)
from autopar.core.explain import annotated_graph
from autopar.core.mesh import Mesh
from autopar.core.pipeline import Pipeline
from autopar.core.plan import Collective, ShardingPlan
from autopar.core.precision import MixedPrecision
from autopar.cost_model.hardware import A100, CPU, H100, Fitted, HardwareProfile, Link, SyntheticProfile
from autopar.passes.analysis.hooks import differentiate_forward
from autopar.planner import plan

__all__ = [
    "A100",
    "CPU",
    "H100",
    "AutoparError",
    "CaptureError",
    "Collective",
    "CollectiveError",
    "Fitted",
    "HardwareProfile",
    "InfeasiblePlanError",
    "InputError",
    "Link",
    "Mesh",
    "MixedPrecision",
    "Pipeline",
    "RewriteError",
    "ShardingPlan",
    "StalePlanError",
    "SyntheticProfile",
    "UnsupportedOpError",
    "annotated_graph",
    "compile",
    "differentiate_forward",
    "plan",
]
__version__ = "0.1.0"
