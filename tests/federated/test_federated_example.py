"""examples/federated_digits runs small: 3 node processes, 2 rounds, then resumed for 2 more."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from support import ROOT
from workers import warm_start

ROOT = ROOT


@pytest.mark.timeout(100)
def test_the_federated_digits_example_runs(tmp_path: Path) -> None:
    script = ROOT / "examples" / "federated_digits" / "run.py"
    result = warm_start.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--rounds", "3"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    trained = re.findall(r"^(node-\d): trained rounds \[0, 1, 2\]", out, re.MULTILINE)
    assert sorted(trained) == ["node-0", "node-1", "node-2"], out
    # Non-IID: node-0 holds mostly its own classes, 0 to 3.
    counts = re.search(r"node-0: \d+ training examples, per class \[([\d, ]+)\]", out)
    assert counts is not None
    per_class = [int(n) for n in counts.group(1).split(",")]
    assert sum(per_class[:4]) > 4 * sum(per_class[4:])
    assert re.findall(r"^\s+(\d)\s+3\s+[\d.]+", out, re.MULTILINE) == ["0", "1", "2"]
    # The global model learns: round 2's global model validates better than round 0's.
    losses = [float(v) for v in re.findall(r"^\s+\d\s+3\s+[\d.]+\s+([\d.]+)", out, re.MULTILINE)]
    assert losses[2] < losses[0]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "epoch-000003"
