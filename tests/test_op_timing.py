"""Op times measured on this host, for profiles that describe the host that runs."""

import dataclasses
import mmap
import time

import pytest
import torch
from autopar.cost_model.estimate import CostModel
from autopar.cost_model.hardware import CPU, Fitted
from autopar.cost_model.op_timing import OpTimer
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.propagate import propagate

from autopar import Mesh
from autopar.core.placement import R, S
from autopar.core.strategy import Strategy


def _mm():
    captured = capture(MLP(512, 2048, num_layers=2), (torch.randn(256, 512), torch.randn(256, 512)))
    return captured, next(n for n in captured.graph.graph.nodes if n.op == "call_function" and "addmm" in str(n.target))


def test_an_op_split_four_ways_is_timed_on_its_piece_and_each_call_is_timed_once_per_process():
    _, addmm = _mm()  # addmm(bias [2048], x [256, 512], weight.t() [512, 2048])
    timer = OpTimer(Mesh((4,), ("x",)))
    timer.times.clear()
    whole = timer.node_s(addmm, Strategy(((R,),), ((R,), (R,), (R,))))
    rows = timer.node_s(addmm, Strategy(((S(0),),), ((R,), (S(0),), (R,))))
    assert whole is not None and rows is not None and whole > 0 and rows > 0
    timed_shapes = sorted(key[2] for key in timer.times)  # (target, whole shapes, local shapes, ...)
    assert timed_shapes == [((2048,), (64, 512), (512, 2048)), ((2048,), (256, 512), (512, 2048))]
    timer.node_s(addmm, Strategy(((S(0),),), ((R,), (S(0),), (R,))))
    assert OpTimer(Mesh((4,), ("x",))).node_s(addmm, Strategy(((R,),), ((R,), (R,), (R,)))) == whole
    assert len(timer.times) == 2


def test_a_fresh_timer_times_every_call_again_and_leaves_the_process_times_alone():
    _, addmm = _mm()
    strategy = Strategy(((R,),), ((R,), (R,), (R,)))
    OpTimer(Mesh((4,), ("x",))).node_s(addmm, strategy)
    shared = dict(OpTimer.times)
    fresh = OpTimer(Mesh((4,), ("x",)), fresh=True)
    assert fresh.times == {}
    assert fresh.node_s(addmm, strategy) is not None and len(fresh.times) == 1
    assert OpTimer.times == shared


def test_a_profile_of_this_host_prices_ops_by_their_timing_plus_the_node_overhead_times_the_contention():
    captured, addmm = _mm()
    mesh = Mesh((2,), ("x",))
    space = propagate(captured, mesh)
    node = next(n for n in space.nodes if n.name == addmm.name)
    host = dataclasses.replace(CPU, fitted=Fitted(timed_ops=True, node_overhead_s=1e-3, contention=2.0, step_scale=1.5))
    roofline = CostModel(captured, mesh, CPU).compute_costs(space)[node.name]
    model = CostModel(captured, mesh, host)
    timed = model.compute_costs(space)[node.name]
    for strategy, seconds, estimate in zip(node.strategies, timed, roofline):
        alone = model.timer.node_s(addmm, strategy)
        assert alone is not None and seconds == pytest.approx(
            1.5 * alone * 2.0 + 1e-3 * 2.0
        )  # the step scale stretches the op alone
        assert model.node_overhead_s(node.name, strategy) == 1e-3 * 2.0
        assert seconds != estimate
    assert (
        CostModel(captured, mesh, CPU).node_overhead_s(node.name, node.strategies[0]) == 0.0
    )  # priced by the roofline


def test_ops_too_big_to_time_keep_the_roofline(monkeypatch):
    from autopar.cost_model import op_timing

    _, addmm = _mm()
    monkeypatch.setattr(op_timing, "TIMED_BYTES_LIMIT", 1024)
    assert OpTimer(Mesh((4,), ("x",))).node_s(addmm, Strategy(((R,),), ((R,), (R,), (R,)))) is None


def test_ops_that_overflow_l2_are_timed_on_copies_spanning_the_step_working_set_up_to_past_the_last_level_cache(
    monkeypatch,
):
    from autopar.cost_model import op_timing
    from autopar.cost_model.estimate import step_working_set

    l2, last_level = op_timing.cache_bytes()
    assert 0 < l2 <= last_level
    monkeypatch.setattr(op_timing, "cache_bytes", lambda: (2**20, 8 * 2**20))
    weight, rows = torch.empty(1024, 1024), torch.empty(8, 1024)  # 4 MiB and 32 KiB
    mib = 2**20
    assert OpTimer._copies([rows, weight], torch.empty(8, 1024), 0) == 1
    assert OpTimer._copies([rows, weight], torch.empty(8, 1024), 8 * mib) == 2  # 2 x 4 MiB span 8 MiB
    assert OpTimer._copies([rows, weight], torch.empty(8, 1024), 64 * mib) == 3  # 3 x 4 MiB > 8 MiB + 4 MiB
    assert OpTimer._copies([rows, rows], torch.empty(8, 8), 64 * mib) == 1  # fits in L2
    assert OpTimer._copies([rows], torch.empty(1024, 1024), 64 * mib) == op_timing._MAX_COPIES  # a 4 MiB output
    large = capture(MLP(256, 4096), (torch.randn(8, 256), torch.randn(8, 256)))  # 8 MiB of parameters
    params = sum(p.nbytes for p in MLP(256, 4096).parameters())
    assert step_working_set(large, Mesh((2,), ("x",))) == 2 * 4 * params  # per rank: weights, gradients, Adam's 2
    timed = dataclasses.replace(CPU, fitted=Fitted(timed_ops=True))
    assert CostModel(large, Mesh((2, 2), ("x", "y")), timed).timer.working_set == 4 * 4 * params


def _map_fresh_pages(kept: list) -> None:
    """Map and write 2 MiB afresh: a fault per page, whatever the allocator holds."""
    pages = mmap.mmap(-1, 2**21)
    pages[:: mmap.PAGESIZE] = b"x" * (2**21 // mmap.PAGESIZE)
    kept.append(pages)


def test_an_op_is_timed_on_samples_that_map_no_fresh_pages_or_on_all_where_none_is_clean():
    from autopar.cost_model import op_timing

    kept, calls = [], []

    def slow_fresh_pages():
        _map_fresh_pages(kept)
        time.sleep(0.01)

    def faults_every_other_call():
        calls.append(None)
        if len(calls) % 2:
            slow_fresh_pages()

    samples = op_timing._samples([faults_every_other_call], 1, 3)
    assert len(samples) == 3 and max(samples) < 0.01  # the three calls that faulted are left out
    assert len(calls) >= 6  # 6, unless another thread faults meanwhile
    calls.clear()
    samples = op_timing._samples([lambda: (calls.append(None), slow_fresh_pages())], 1, 3)
    assert len(samples) == len(calls) == op_timing._MAX_SAMPLES and min(samples) >= 0.01
    called = []
    op_timing._samples([lambda i=i: called.append(i) for i in range(4)], 1, 3)
    assert called[:3] == [0, 1, 2]  # one call a sample still goes through the copies in turn


def test_an_op_is_timed_only_once_every_copy_was_read_and_its_calls_map_no_fresh_pages():
    from autopar.cost_model import op_timing

    kept, calls = [], []

    def settles_after_three():
        calls.append(None)
        if len(calls) <= 3:
            _map_fresh_pages(kept)

    op_timing._warm_up([settles_after_three])
    assert 4 <= len(calls) < op_timing._MAX_WARMUP_CALLS  # 4, unless another thread faults meanwhile
    calls.clear()
    op_timing._warm_up([lambda: (calls.append(None), _map_fresh_pages(kept))])  # never settles
    assert len(calls) == 1 + op_timing._MAX_WARMUP_CALLS
    called = []
    op_timing._warm_up([lambda i=i: called.append(i) for i in range(5)])
    assert called[:6] == [0, 1, 2, 3, 4, 0]  # every copy read once before the calls that may settle
