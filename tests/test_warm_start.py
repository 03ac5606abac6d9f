"""A worker forked by the warm server (tests/workers/warm_start.py) is the process ``exec`` makes.

The same probe script runs started cold (``subprocess``) and warm; what it reports of itself
(argv, ``sys.orig_argv``, ``sys.path[0]``, working directory, environment, session, ``__name__``,
torch's thread count) must be equal, and so must exit statuses, output and a SIGKILL's status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workers import warm_start

pytestmark = pytest.mark.timeout(120)

PROBE = """
import json, os, sys
import numpy, torch
print(json.dumps({
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": os.environ.get("WARM_PROBE"),
    "session_leader": os.getsid(0) == os.getpid(),
    "name": __name__,
    "threads": torch.get_num_threads(),
    "draw": int(numpy.random.randint(1 << 30)),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WARM_PROBE": "seen"}


def _report(out: str) -> dict[str, object]:
    return json.loads(out.splitlines()[0])


@pytest.mark.parametrize("how", ["script", "-c"])
def test_a_warm_worker_sees_itself_as_a_cold_one_does(tmp_path: Path, how: str) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    argv = [sys.executable, str(script), "7"] if how == "script" else [sys.executable, "-c", PROBE, "7"]
    cold = subprocess.run(
        argv, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    warm = warm_start.popen(
        argv, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert isinstance(warm, warm_start.WarmProcess)
    out, err = warm.communicate(timeout=60)
    assert warm.returncode == cold.returncode == 7, (out, err, cold.stderr)
    assert err == cold.stderr == "to stderr\n"
    seen, expected = _report(out), _report(cold.stdout)
    seen.pop("draw"), expected.pop("draw")
    assert seen == expected


def test_warm_workers_draw_their_own_random_numbers(tmp_path: Path) -> None:
    """numpy's global generator is seeded afresh in each child, as in each fresh process."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    draws = set()
    for _ in range(3):
        done = warm_start.run(
            [sys.executable, str(script), "0"], env=_env(), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        draws.add(_report(done.stdout)["draw"])
    assert len(draws) == 3


def test_a_sigkilled_warm_worker_reports_the_signal_and_its_log_is_kept(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    code = "import sys, time; print('started', flush=True); time.sleep(60)"
    warm = warm_start.popen(
        [sys.executable, "-c", code], env=_env(), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
    )
    assert isinstance(warm, warm_start.WarmProcess)
    deadline = time.monotonic() + 60
    while "started" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the worker did not start within 60 s"
        time.sleep(0.05)
    assert warm.poll() is None
    os.killpg(warm.pid, signal.SIGKILL)  # it leads its own process group, as with start_new_session
    assert warm.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        warm_start.run([sys.executable, "-c", code], env=_env(), timeout=0.5)


def test_a_command_that_cannot_be_forked_starts_cold(tmp_path: Path) -> None:
    """``-m``, another program, or an environment with more OpenMP threads: a real Popen."""
    for argv, env in (
        ([sys.executable, "-m", "json.tool", "--help"], _env()),
        (["true"], _env()),
        ([sys.executable, "-c", "pass"], {**_env(), "OMP_NUM_THREADS": "2"}),
    ):
        proc = warm_start.popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL)
        assert isinstance(proc, subprocess.Popen), argv
        assert proc.wait(timeout=60) == 0
