import pytest
import torch

from autopar import calibrate
from autopar.calibrate import _after_work_s, _fit, oversubscribed
from autopar.step_scales import fit_scales, training_step


def test_fit_recovers_an_exact_alpha_beta_line():
    points = [(x, 1e-3 + 2e-9 * x) for x in (4096, 65536, 2**20, 2**24)]
    alpha, beta = _fit(points)
    assert alpha == pytest.approx(1e-3)
    assert beta == pytest.approx(2e-9)


def test_fit_lets_small_messages_set_alpha():
    # 0.7 ms for small messages, then a steeper slope past 1 MiB than the small sizes suggest,
    # as gloo measures on a loaded host: a plain least-squares line through these points puts
    # α near 0.4 ms, below every small message's time.
    points = [
        (2048, 0.69e-3),
        (8192, 0.71e-3),
        (32768, 0.88e-3),
        (131072, 0.82e-3),
        (524288, 1.13e-3),
        (2097152, 5.04e-3),
        (8388608, 21.2e-3),
    ]
    alpha, beta = _fit(points)
    assert 0.55e-3 < alpha < 0.8e-3
    worst = max(abs((alpha + beta * x) / t - 1) for x, t in points)
    assert worst < 0.4


def test_fit_clamps_at_zero():
    assert _fit([(1.0, 2e-3), (2.0, 1e-3)])[1] == 0.0
    alpha, beta = _fit([(1e6, 1e-3), (2e6, 3e-3)])
    assert alpha == 0.0 and beta > 0


def test_the_step_and_collective_scales_are_recovered_from_layouts_that_differ_in_collectives():
    points = [(ops, coll, 0.0, 1.2 * (ops + 2.5 * coll)) for ops, coll in ((4e-3, 1e-3), (3e-3, 6e-3), (5e-3, 3e-3))]
    step, collective = fit_scales(points)
    assert step == pytest.approx(1.2) and collective == pytest.approx(2.5)


def test_the_overheads_are_not_stretched_by_the_scales():
    points = [
        (ops, coll, fixed, fixed + 1.2 * (ops + 2.5 * coll))
        for ops, coll, fixed in ((4e-3, 1e-3, 2e-3), (3e-3, 6e-3, 1e-3), (5e-3, 3e-3, 4e-3))
    ]
    step, collective = fit_scales(points)
    assert step == pytest.approx(1.2) and collective == pytest.approx(2.5)
    alike = [(2e-3, 1e-3, 1e-3, 5.5e-3), (4e-3, 2e-3, 1e-3, 8.8e-3), (6e-3, 3e-3, 1e-3, 14.5e-3)]
    assert fit_scales(alike) == (pytest.approx(1.5), 1.0)  # the median of 1.5, 1.3 and 1.5, the overhead left out


def test_layouts_alike_in_collectives_or_a_negative_scale_give_one_scale():
    alike = [
        (2e-3, 1e-3, 0.0, 4.5e-3),
        (4e-3, 2e-3, 0.0, 7.8e-3),
        (6e-3, 3e-3, 0.0, 13.5e-3),
    ]  # every point a third collectives
    assert fit_scales(alike) == (pytest.approx(1.5), 1.0)  # the median of 1.5, 1.3 and 1.5
    negative = [
        (4e-3, 1e-3, 0.0, 9e-3),
        (1e-3, 4e-3, 0.0, 1e-3),
    ]  # more collectives, less time: a negative collective scale
    assert fit_scales(negative) == (pytest.approx((9 / 5 + 1 / 5) / 2), 1.0)


def test_a_step_may_stretch_its_ops_more_than_its_collectives():
    faster = [(ops, coll, 0.0, 1.5 * (ops + 0.8 * coll)) for ops, coll in ((4e-3, 1e-3), (3e-3, 6e-3), (5e-3, 3e-3))]
    step, collective = fit_scales(faster)
    assert step == pytest.approx(1.5) and collective == pytest.approx(0.8)


def test_more_ranks_than_cores_is_said_to_share_them():
    assert oversubscribed(2, 2) is None and oversubscribed(2, 16) is None
    note = oversubscribed(4, 2)
    assert note is not None and note.startswith("4 ranks share 2 CPU cores")


class _Clock:
    """A clock that moves only when told: timings independent of the host's load."""

    def __init__(self):
        self.now_s = 0.0

    def perf_counter(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def test_a_collective_is_timed_without_the_compute_before_it(fake_world, monkeypatch):
    fake_world(1)
    clock = _Clock()
    monkeypatch.setattr(calibrate, "time", clock)
    monkeypatch.setattr(calibrate, "_WORK", (8, 3))
    monkeypatch.setattr(calibrate.torch, "mm", lambda a, b: clock.advance(0.5e-3))  # each matmul "takes" 0.5 ms
    seconds = _after_work_s(lambda: clock.advance(1e-3))
    assert seconds == pytest.approx(1e-3)


def test_a_training_step_times_its_forward_and_backward_and_not_its_optimizer(fake_world, monkeypatch):
    from autopar import step_scales

    fake_world(1)
    clock = _Clock()
    monkeypatch.setattr(step_scales, "time", clock)
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 1), torch.randn(8, 4)

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            clock.advance(1.0)
            return super().step(closure)

    opt = SlowSGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.full_like(model.weight, 1e6)  # a stale gradient, to be dropped
    before = model.weight.detach().clone()
    expected = torch.autograd.grad(model(x).sum(), model.weight)[0]

    seconds = training_step(lambda v: model(v).sum(), (x,), opt)

    assert seconds == 0.0  # the optimizer's second is not counted
    assert torch.allclose(model.weight, before - 0.1 * expected)  # stepped once, on this step's gradient alone
