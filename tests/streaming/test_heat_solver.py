"""The streaming example: its solver agrees with the analytic solution, and the example trains two ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import ROOT
from workers import warm_start

ROOT = ROOT
EXAMPLE = ROOT / "examples" / "streaming_heat"
sys.path.insert(0, str(EXAMPLE))

import heat  # noqa: E402 (the example's directory is not a package)


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
@pytest.mark.timeout(150)
def test_the_streaming_example_trains_two_ranks_on_every_simulated_sample(tmp_path: Path) -> None:
    """The example as a user runs it: two ranks (started by fit), three simulation processes."""
    command = [sys.executable, str(EXAMPLE / "train.py"), "--ranks", "2", "--producers", "3"]
    command += [
        "--samples",
        "300",
        "--max-reads",
        "2",
        "--batches-per-epoch",
        "5",
        "--out",
        str(tmp_path / "run"),
    ]
    try:
        done = warm_start.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the example did not end within 120 s:\n{exc.stdout}\n{exc.stderr}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    ranks = {
        int(r): (int(n), int(reads))
        for r, n, reads in re.findall(r"rank (\d): received (\d+) samples, (\d+) reads", out)
    }
    assert set(ranks) == {0, 1}, out
    assert sum(n for n, _ in ranks.values()) == 900  # every simulated sample arrived once, somewhere
    assert ranks[0][0] == 600  # two simulations on rank 0 (round-robin over sorted names)
    assert ranks[1][0] == 300  # one on rank 1
    assert all(reads == 2 * n for n, reads in ranks.values())  # each trained on exactly max_reads times
    found = re.search(
        r"(\d+) epochs on 2 ranks from 3 simulations; validation loss per example (\S+) -> (\S+)", out
    )
    assert found is not None, out
    epochs, first, last = found.groups()
    assert int(epochs) == 8  # rank 0's 1200 reads / (5 batches x 32) = 7.5 epochs: its stream ended the run
    assert float(last) < 0.9 * float(first)
