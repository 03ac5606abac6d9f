"""The streaming example's solver: finite differences agree with the analytic solution."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "streaming_heat"))

import heat


@pytest.mark.parametrize("seed", range(5))
def test_solver_matches_the_exact_solution(seed: int) -> None:
    parameters = heat.random_parameters(np.random.default_rng(seed))
    numeric = heat.solve(parameters, points=32)
    exact = heat.exact_solution(parameters, points=32)
    assert numeric[0] == numeric[-1] == 0.0
    assert np.abs(numeric - exact).max() < 5e-3  # O(dx^2) with dx = 1/31
    finer = heat.solve(parameters, points=64)
    assert np.abs(finer - heat.exact_solution(parameters, points=64)).max() < np.abs(numeric - exact).max()
