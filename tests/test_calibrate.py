import pytest

from autopar.calibrate import _fit


def test_fit_recovers_an_exact_alpha_beta_line():
    points = [(x, 1e-3 + 2e-9 * x) for x in (4096, 65536, 2**20, 2**24)]
    alpha, beta = _fit(points)
    assert alpha == pytest.approx(1e-3)
    assert beta == pytest.approx(2e-9)


def test_fit_lets_small_messages_set_alpha():
    # 0.7 ms for small messages, then a steeper slope past 1 MiB than the small sizes suggest,
    # as gloo measures on a loaded host: a plain least-squares line through these points puts
    # α near 0.4 ms, below every small message's time.
    points = [(2048, 0.69e-3), (8192, 0.71e-3), (32768, 0.88e-3), (131072, 0.82e-3),
              (524288, 1.13e-3), (2097152, 5.04e-3), (8388608, 21.2e-3)]
    alpha, beta = _fit(points)
    assert 0.55e-3 < alpha < 0.8e-3
    worst = max(abs((alpha + beta * x) / t - 1) for x, t in points)
    assert worst < 0.4


def test_fit_clamps_at_zero():
    assert _fit([(1.0, 2e-3), (2.0, 1e-3)])[1] == 0.0
    alpha, beta = _fit([(1e6, 1e-3), (2e6, 3e-3)])
    assert alpha == 0.0 and beta > 0
