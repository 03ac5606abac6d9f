"""``fit`` runs of the worker script that tests stop, kill and resume (tests/workers/rank.py, ``fit``).

Shared by tests/checkpoint/test_graceful_stop.py (a SIGTERM) and tests/checkpoint/test_sigkills.py
(a dozen SIGKILLs), two modules so that the suite's workers run them side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from workers import rank as worker

EVERY_N_STEPS = 3
"""The runs checkpoint every this many steps (and at every epoch's end)."""


def start_fit(procs: worker.Processes, name: str, out: Path) -> Any:
    """Start (or resume, from ``out``'s checkpoints) the stoppable 2-rank run writing into ``out``."""
    command = [
        worker.sys.executable,
        str(worker.WORKER_SCRIPT),
        "fit",
        str(out),
        "stoppable",
        str(EVERY_N_STEPS),
    ]
    return procs.start(name, command)


def run_uninterrupted(out: Path) -> Path:
    """The same run, never interrupted: the reference (``out``)."""
    with worker.Processes(out) as procs:
        start_fit(procs, "root", out)
        assert procs.wait("root", 120) == 0, procs.logs()
    return out


def result(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A finished run's loop state (JSON) and parameters."""
    state = json.loads((out / "result.json").read_text())["state"]
    return state, worker.load_file(str(out / "params.safetensors"))


def assert_same(out: Path, reference: Path) -> None:
    """The run in ``out`` ended with the reference's learning curve and parameters, bit for bit."""
    state, params = result(out)
    expected_state, expected_params = result(reference)
    assert state == expected_state  # the learning curve, bit for bit
    for key, value in expected_params.items():
        assert torch.equal(params[key], value), key
