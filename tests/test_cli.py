"""The ``lamploop`` command: exit statuses and what a person sees on stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import stopped_by

import lamploop
from lamploop.cli import EXIT_FAILED, EXIT_INTERRUPTED

pytestmark = pytest.mark.timeout(120)

COMMAND = [sys.executable, "-m", "lamploop.cli"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, text=True, timeout=90, check=False)


def test_version(tmp_path: Path) -> None:
    result = _run(["--version"], tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == f"lamploop {lamploop.__version__}"


def test_python_dash_m_lamploop_is_the_command(tmp_path: Path) -> None:
    """docs/cli.md: ``python -m lamploop`` is the same command (it said "No module named
    lamploop.__main__" before; found by tests/test_acceptance_leaks.py's author)."""
    result = subprocess.run(
        [sys.executable, "-m", "lamploop", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"lamploop {lamploop.__version__}"


def test_a_failed_run_is_one_line_on_stderr_and_status_1(tmp_path: Path) -> None:
    result = _run(["demo", "--world-size", "0", "--epochs", "1", "--out", str(tmp_path / "runs")], tmp_path)
    assert result.returncode == EXIT_FAILED, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["lamploop: ConfigurationError: world_size must be an int >= 1, got 0"]
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_with_one_line_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [*COMMAND, "demo", "--epochs", "500", "--out", str(out)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which Ctrl-C in a terminal signals
    )
    try:
        deadline = time.monotonic() + 90
        while not (out / "latest").exists():  # training is under way on both ranks
            assert proc.poll() is None, proc.stderr
            assert time.monotonic() < deadline, "no checkpoint within 90 s"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == EXIT_INTERRUPTED, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # The signal may land in a validation instead of a step (each of the demo's epochs ends with
    # one; under load CI saw it): the run then stops at that epoch's end, or discards it.
    how = stopped_by("SIGINT", lines[0])
    assert how is not None, lines[0]
    if how == "step":  # the next run resumes from that step boundary
        assert "-step-" in (out / "latest").read_text()


def test_federated_approve_adds_the_plans_hash_to_the_allow_list_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lamploop.cli import main
    from lamploop.federated import load_allow_list, plan_hash, save_plan
    from tests.workers.federated_harness import make_plan

    plan = make_plan()
    plan_file = save_plan(plan, tmp_path / "plan.json")
    allow = tmp_path / "node" / "allow.json"
    assert main(["federated", "approve", str(plan_file), "--allow-list", str(allow)]) == 0
    assert main(["federated", "approve", str(plan_file), "--allow-list", str(allow)]) == 0
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first == f"approved: {plan_hash(plan)} (test-plan) in {allow}"
    assert second.startswith("already approved: ")
    assert [entry.hash for entry in load_allow_list(allow).approved] == [plan_hash(plan)]
    plan_file.write_text(plan_file.read_text().replace('"learning_rate": 0.5', '"learning_rate": "fast"'))
    assert main(["federated", "approve", str(plan_file), "--allow-list", str(allow)]) == EXIT_FAILED
    (line,) = capsys.readouterr().err.strip().splitlines()
    expected = f"lamploop: ConfigurationError: {plan_file}: optimizer.learning_rate: expected a number"
    assert line.startswith(expected)
