"""A dozen SIGKILLs at random moments of a ``fit`` that checkpoints every few steps lose nothing.

Each kill lands while the 2-rank run trains (after it wrote a new checkpoint, at a random
moment); the next start resumes from what is on disk. The last run ends with the
uninterrupted run's learning curve and parameters, bit for bit. Apart from
tests/checkpoint/test_graceful_stop.py so that the suite's workers run the two side by side.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from workers import fit_runs
from workers import rank as worker

KILLS = 12  # random moments; 20 took 110 s of the 10-minute suite for little more coverage


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_runs.run_uninterrupted(tmp_path_factory.mktemp("uninterrupted"))


@pytest.mark.timeout(420)  # the reference run and 12 starts of 2 processes: 100-200 s under load
def test_a_dozen_sigkills_at_random_moments_lose_nothing(uninterrupted: Path, tmp_path: Path) -> None:
    latest = tmp_path / "checkpoints" / "latest"
    with worker.Processes(tmp_path) as procs:
        for kill in range(KILLS):
            proc = fit_runs.start_fit(procs, f"try{kill}", tmp_path)
            seen = latest.read_text() if latest.exists() else ""
            deadline = time.monotonic() + 60
            # Once training has moved on (a new checkpoint), kill at a random moment.
            while (latest.read_text() if latest.exists() else "") == seen and proc.poll() is None:
                assert time.monotonic() < deadline, procs.logs()
                time.sleep(0.01)
            time.sleep(random.uniform(0.0, 0.2))
            if proc.poll() is None:
                worker.os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert not (tmp_path / "result.json").exists(), (
                f"the run finished after {kill} kills: make it longer"
            )
        fit_runs.start_fit(procs, "last", tmp_path)
        assert procs.wait("last", 120) == 0, procs.logs()
    fit_runs.assert_same(tmp_path, uninterrupted)
