"""Sharding propagation: ops of the same signature share their strategies, and only they; splits
that only elementwise and view ops carry are dropped."""

import pytest
import torch
from autopar.examples import make_example
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.propagate import _op_signature, _op_strategies, propagate

from autopar import Mesh


@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
def test_every_op_gets_the_strategies_its_own_rule_gives_less_transit_splits(name):
    mesh = Mesh((2, 2), ("dp", "tp"))
    model, inputs = make_example(name)
    captured = capture(model, inputs)
    space = propagate(captured, mesh)
    nodes = {n.name: n for n in captured.graph.graph.nodes}
    ops = [n for n in space.nodes if n.kind == "op"]
    assert len({_op_signature(nodes[n.name]) for n in ops}) < len(ops)  # repeated layers repeat signatures
    for n in ops:
        own = _op_strategies(nodes[n.name], mesh)
        assert n.strategies == tuple(s for s in own if s in set(n.strategies)), n.name  # in the rule's order


def test_signatures_tell_apart_ops_that_differ_only_in_a_constant_or_an_operand():
    class Sums(torch.nn.Module):
        def forward(self, x, y):
            return x.sum(0).sum() + x.sum(1).sum() + (x * x).sum() + (x * y).sum()

    x = torch.randn(4, 4, requires_grad=True)
    captured = capture(Sums(), (x, torch.randn(4, 4)))
    by_target: dict = {}
    for node in captured.graph.graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mul.Tensor):
            by_target.setdefault(node.target, []).append(node)
    sums, muls = by_target[torch.ops.aten.sum.dim_IntList][:2], by_target[torch.ops.aten.mul.Tensor][:2]
    assert [n.args[1] for n in sums] == [[0], [1]]
    assert _op_signature(sums[0]) != _op_signature(sums[1])
    assert _op_signature(muls[0]) != _op_signature(muls[1])  # x * x reads one value twice, x * y two
