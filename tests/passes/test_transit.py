"""Transit splits: a dim that only elementwise and view ops split is not offered; the splits
that ops compute on, and those of parameters and inputs, are."""

import torch
from autopar.examples import make_example
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.propagate import _op_strategies, propagate

from autopar import Mesh
from autopar.core.placement import Shard


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        h = self.conv2(torch.relu(self.norm(self.conv1(x))))
        return torch.nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


def _split_dims(space, node_names=None):
    """``(node, operand or output, dim)`` of every split some op strategy makes."""
    found = set()
    for n in space.nodes:
        if n.kind != "op" or (node_names is not None and n.name not in node_names):
            continue
        for s in n.strategies:
            for side, layouts in (("in", s.inputs), ("out", s.outputs)):
                for k, p in enumerate(layouts):
                    for q in p or ():
                        if isinstance(q, Shard):
                            found.add((n.name, side, k, q.dim))
    return found


def test_a_convolutional_net_splits_no_image_rows_or_columns_but_batch_and_channels():
    model = _ConvNet()
    captured = capture(model, (torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))))
    mesh = Mesh((2, 2), ("dp", "tp"))
    space = propagate(captured, mesh)
    nodes = {n.name: n for n in captured.graph.graph.nodes}
    four_d = {n.name for n in space.nodes if n.kind == "op" and getattr(nodes[n.name].meta.get("val"), "ndim", 0) == 4}
    dims = {d for _, side, _, d in _split_dims(space, four_d) if side == "out"}
    assert dims == {0, 1}  # the batch and the channels, never rows (2) or columns (3)
    offered = {n: _op_strategies(nodes[n], mesh) for n in four_d}
    assert any(  # the rules offer them: the elementwise ops between the convolutions would split rows
        isinstance(q, Shard) and q.dim == 2 for s in (t for ts in offered.values() for t in ts) for q in s.outputs[0]
    )


def test_splits_that_ops_compute_on_stay():
    """GPT's norms split the sequence, its matmuls the heads and the hidden dim (Megatron)."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    model, inputs = make_example("gpt")
    captured = capture(model, inputs)
    space = propagate(captured, mesh)
    nodes = {n.name: n for n in captured.graph.graph.nodes}
    for n in space.nodes:
        if n.target in ("aten.native_layer_norm.default", "aten.mm.default", "aten.addmm.default"):
            own = _op_strategies(nodes[n.name], mesh)
            assert n.strategies == own, n.name  # norms and matmuls split nothing that is only carried
    params = [n for n in space.nodes if n.kind == "param"]
    assert all(len(n.strategies) > 1 for n in params)  # parameters keep every placement
