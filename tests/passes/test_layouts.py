"""The standard layouts as complete plans of the solver's program."""

import torch
from autopar.cost_model.estimate import CostModel
from autopar.cost_model.hardware import resolve_profile
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.propagate import propagate
from autopar.passes.solve.layouts import standard_layouts

from autopar import Mesh
from autopar.core.placement import Partial, R, Shard


def _layouts(mesh: Mesh, model=None, inputs=None):
    torch.manual_seed(0)
    if model is None:
        model, inputs = MLP(16, 32, num_layers=2), (torch.randn(8, 16), torch.randn(8, 16))
    captured = capture(model, inputs)
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
        "tensor parallel over dp": (Shard(0), R),
        "tensor parallel over tp": (R, Shard(0)),
        "fully sharded over tp, tensor parallel over dp": (Shard(0), Shard(1)),
        "fully sharded over dp, tensor parallel over tp": (Shard(1), Shard(0)),
    }
    assert set(layouts) == set(placed)
    weight = next(n for n in space.nodes if n.target == "layers.0.weight")
    first = next(n for n in space.nodes if n.kind == "op" and n.target == "aten.addmm.default")
    for name, choice in layouts.items():
        assert set(choice) == {n.name for n in space.nodes}  # every node has a strategy
        assert weight.strategies[choice[weight.name]].outputs[0] == placed[name], name
    tensor = layouts["tensor parallel over tp"]
    for name, placed in {
        "layers.0.bias": (R, Shard(0)),
        "layers.1.weight": (R, Shard(1)),
        "layers.1.bias": (R, R),
    }.items():
        node = next(n for n in space.nodes if n.target == name)
        assert node.strategies[tensor[node.name]].outputs[0] == placed, name  # Megatron's pair, biases included
    ddp = layouts["data parallel"]
    assert first.strategies[ddp[first.name]].outputs[0] == (Shard(0), Shard(0))  # the batch sliced from the input


def test_tensor_parallel_layouts_pair_megatrons_column_and_row_splits():
    from autopar.examples.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, dim=512, num_heads=8, num_kv_heads=4, hidden=1024, num_layers=2, max_seq=128)
    torch.manual_seed(0)
    model, inputs = Llama(cfg), (torch.randint(0, 512, (8, 128)), torch.randint(0, 512, (8, 128)))
    space, layouts = _layouts(Mesh((2, 2), ("dp", "tp")), model, inputs)
    column, row = ("wq", "wk", "wv", "w1", "w3", "head"), ("wo", "w2")
    by_name = space.index()
    for name, over_dp in (("tensor parallel over tp", {}), ("fully sharded over dp, tensor parallel over tp", None)):
        choice = layouts[name]
        for n in space.nodes:
            if n.kind != "param":
                continue
            placed = n.strategies[choice[n.name]].outputs[0]
            leaf = n.target.split(".")[-2]
            tp = Shard(0) if leaf in column else Shard(1) if leaf in row else R
            dp = R if over_dp is not None else Shard(1) if tp == Shard(0) else Shard(0)
            assert placed == (dp, tp), (name, n.target, placed)
        # the matmuls of the column splits read their input whole over tp and give their output split,
        # those of the row splits give partial sums: one all-reduce per pair
        for n in space.nodes:
            if n.target != "aten.mm.default" or n.phase != "forward":
                continue
            weight = by_name[n.args[1][0]]
            if weight.target != "aten.t.default":
                continue
            leaf = by_name[weight.args[0][0]].target.split(".")[-2]
            strategy = n.strategies[choice[n.name]]
            if leaf in row:
                assert strategy.outputs[0][1] == Partial(), (name, leaf)
            else:
                assert strategy.inputs[0][1] == R and strategy.outputs[0][1] == Shard(1), (name, leaf)


class _Stack(torch.nn.Module):
    """Identical linear layers: Megatron's layouts alternate column and row splits over them."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def test_repeated_layers_take_their_counterparts_strategies_as_pricing_every_node_would():
    """A node of a repeated layer whose operands come as its counterpart's did takes the
    counterpart's strategy without being priced again: every layout is the one found by pricing
    each node, also where the layers alternate."""
    from autopar.cost_model.estimate import memory_terms
    from autopar.passes.solve.layers import repeated_layers

    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"))
    torch.manual_seed(0)
    captured = capture(_Stack(), (torch.randn(64, 32), torch.randn(64, 32)))
    space = propagate(captured, mesh)
    costs = CostModel(captured, mesh, resolve_profile("h100"))
    node_costs = costs.node_costs(space, costs.compute_costs(space))
    classes = repeated_layers(captured, space, node_costs, memory_terms(space, costs))
    assert classes.num_shared_layers >= 2
    each = dict(standard_layouts(space, mesh, node_costs, costs.transition_s))
    reused = dict(standard_layouts(space, mesh, node_costs, costs.transition_s, classes.template, costs.value_kind))
    assert len(each) == 11 and reused == each
    weights = [next(n.name for n in space.nodes if n.target == f"layers.{i}.weight") for i in range(4)]
    by_name = space.index()
    megatron = each["tensor parallel over tp"]
    over_tp = [by_name[w].strategies[megatron[w]].outputs[0][2] for w in weights]
    assert over_tp[0] != over_tp[1] and over_tp[0] == over_tp[2]  # column, row, column, row
