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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_streaming_example_trains_on_every_simulated_sample(tmp_path: Path) -> None:
    import train  # examples/streaming_heat/train.py

    state, received, reads = train.main(
        ["--producers", "3", "--samples", "300", "--max-reads", "2", "--out", str(tmp_path / "run")]
    )
    assert received == 900  # every simulated sample arrived once
    assert reads == 1800  # and was trained on exactly max_reads times
    assert state.epoch == 6  # 1800 reads / (10 batches x 32) = 5.6 epochs: the stream ended the run
    first, last = state.learning_curve[0].validation_loss, state.learning_curve[-1].validation_loss
    assert first is not None
    assert last is not None
    assert last[1] < 0.8 * first[1]
