"""The example programs run to the end (each in a process of its own, bounded)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from workers import warm_start

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", ["two_processes.py", "digits_epochs.py"])
def test_example_program_runs(script: str, tmp_path: Path) -> None:
    result = warm_start.run(
        [sys.executable, str(ROOT / "examples" / script)],
        cwd=tmp_path,
        # Tiny models: one intra-op thread is fastest, and immune to a busy second core.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
