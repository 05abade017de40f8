"""The fits that the benchmark report states growth with (bench/scale.py)."""

from __future__ import annotations

import pytest

from bench.scale import fit_line, fit_quadratic, growth

GiB = 1 << 30


def test_a_line_is_fitted_exactly() -> None:
    xs = [1.0, 2.0, 4.0, 8.0]
    line = fit_line(xs, [0.5 + 0.25 * x for x in xs])
    assert line is not None
    assert line.intercept == pytest.approx(0.5) and line.slope == pytest.approx(0.25)
    assert fit_line([1.0, 1.0], [2.0, 3.0]) is None  # one distinct x: no slope


def test_quadratic_fit_finds_the_square_term() -> None:
    xs = [1.0, 2.0, 3.0, 5.0]
    a, b, c = fit_quadratic(xs, [1 + 2 * x + 3 * x * x for x in xs]) or (0.0, 0.0, 0.0)
    assert (a, b, c) == (pytest.approx(1), pytest.approx(2), pytest.approx(3))
    assert fit_quadratic([1.0, 2.0], [1.0, 2.0]) is None


def test_growth_states_the_rate_and_flags_a_super_linear_term() -> None:
    xs = [g * GiB for g in (0.0625, 0.25, 1.0, 4.0, 8.0)]
    rate, intercept, verdict = growth(xs, [0.3 + x / 2e9 for x in xs])  # 2 GB/s + 0.3 s
    assert rate == "2.00" and intercept == "0.30" and verdict.startswith("linear")
    square = [0.3 + x / 2e9 + (x / GiB) ** 2 * 0.5 for x in xs]  # 32 s of x² at 8 GiB
    assert "super-linear" in growth(xs, square)[2]
    assert growth(xs[:1], [1.0])[2] == "needs two sizes"
