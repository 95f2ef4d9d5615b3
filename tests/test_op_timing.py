"""Op times measured on this host, for profiles that describe the host that runs."""

import dataclasses

import torch

from autopar import Mesh
from autopar.cost_model.estimate import CostModel
from autopar.cost_model.hardware import CPU
from autopar.cost_model.op_timing import OpTimer
from autopar.examples.mlp import MLP
from autopar.passes.capture import capture
from autopar.passes.propagate import propagate
from autopar.placement import R, S
from autopar.passes.strategy import Strategy


def _mm():
    captured = capture(MLP(512, 2048, num_layers=2), (torch.randn(256, 512), torch.randn(256, 512)))
    return captured, next(n for n in captured.graph.graph.nodes if n.op == "call_function" and "addmm" in str(n.target))


def test_an_op_split_four_ways_is_timed_faster_than_whole_and_each_call_is_timed_once():
    _, addmm = _mm()  # addmm(bias [2048], x [256, 512], weight.t() [512, 2048])
    timer = OpTimer(Mesh((4,), ("x",)))
    whole = timer.node_s(addmm, Strategy(((R,),), ((R,), (R,), (R,))))
    rows = timer.node_s(addmm, Strategy(((S(0),),), ((R,), (S(0),), (R,))))
    assert whole is not None and rows is not None and rows < whole
    assert len(timer.times) == 2
    timer.node_s(addmm, Strategy(((S(0),),), ((R,), (S(0),), (R,))))
    assert len(timer.times) == 2


def test_a_profile_of_this_host_prices_ops_by_their_timing_plus_the_node_overhead_times_the_contention():
    captured, addmm = _mm()
    mesh = Mesh((2,), ("x",))
    space = propagate(captured, mesh)
    node = next(n for n in space.nodes if n.name == addmm.name)
    host = dataclasses.replace(CPU, timed_ops=True, node_overhead_s=1e-3, contention=2.0)
    roofline = CostModel(captured, mesh, CPU).compute_costs(space)[node.name]
    model = CostModel(captured, mesh, host)
    timed = model.compute_costs(space)[node.name]
    for strategy, seconds, estimate in zip(node.strategies, timed, roofline):
        alone = model.timer.node_s(addmm, strategy)
        assert alone is not None and seconds == (alone + 1e-3) * 2.0
        assert seconds != estimate


def test_ops_too_big_to_time_keep_the_roofline(monkeypatch):
    from autopar.cost_model import op_timing

    _, addmm = _mm()
    monkeypatch.setattr(op_timing, "TIMED_BYTES_LIMIT", 1024)
    assert OpTimer(Mesh((4,), ("x",))).node_s(addmm, Strategy(((R,),), ((R,), (R,), (R,)))) is None
