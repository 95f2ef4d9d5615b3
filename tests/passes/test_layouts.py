"""The standard layouts as complete plans of the solver's program."""

import torch
from autopar.cost_model.estimate import CostModel
from autopar.cost_model.hardware import resolve_profile
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.propagate import propagate
from autopar.passes.solve.layouts import standard_layouts

from autopar import Mesh
from autopar.core.placement import R, Shard


def _layouts(mesh: Mesh):
    torch.manual_seed(0)
    captured = capture(MLP(16, 32, num_layers=2), (torch.randn(8, 16), torch.randn(8, 16)))
    space = propagate(captured, mesh)
    costs = CostModel(captured, mesh, resolve_profile("h100"))
    node_costs = costs.node_costs(space, costs.compute_costs(space))
    return space, dict(standard_layouts(space, mesh, node_costs, costs.transition_s))


def test_standard_layouts_place_the_parameters_as_ddp_fsdp_and_hsdp_and_data_parallel_splits_the_batch():
    space, layouts = _layouts(Mesh((2, 2), ("dp", "tp")))
    placed = {
        "data parallel": (R, R),
        "fully sharded": (Shard(0), Shard(0)),
        "sharded over dp": (Shard(0), R),
        "sharded over tp": (R, Shard(0)),
    }
    assert set(layouts) == set(placed)
    weight = next(n for n in space.nodes if n.target == "layers.0.weight")
    first = next(n for n in space.nodes if n.kind == "op" and n.target == "aten.addmm.default")
    for name, choice in layouts.items():
        assert set(choice) == {n.name for n in space.nodes}  # every node has a strategy
        assert weight.strategies[choice[weight.name]].outputs[0] == placed[name], name
    ddp = layouts["data parallel"]
    assert first.strategies[ddp[first.name]].outputs[0] == (Shard(0), Shard(0))  # the batch sliced from the input
