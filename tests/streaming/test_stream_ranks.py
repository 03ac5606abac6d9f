"""A streamed run of two ranks, each with its own buffer (issue 10: several ranks, nothing lost).

Real processes: ``fit(world_size=2)`` started by rank 0 (tests/workers/stream_ranks.py), a
Gloo process group, each rank's buffer filled by its own producer with a different number
of samples.  What must hold:

- the rank that runs dry first takes part with zero examples while the other goes on, and
  the run ends by itself at the first epoch with no batch on any rank;
- every sample is read exactly ``max_reads`` times, also when rank 0 is SIGKILLed inside an
  epoch and the run resumed: each rank restores its own buffer from the root's checkpoint
  (``stream`` for rank 0, ``stream.rank1`` for rank 1) and its producer resends the rest;
- ranks that disagree on checkpoint extras are refused before training, on every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, WORKERS
from workers import warm_start

from lamploop.checkpoint import latest_checkpoint, load_checkpoint

ROOT = ROOT
WORKER = WORKERS / "stream_ranks.py"
COUNTS = (12, 28)  # rank 0 runs dry long before rank 1


def _start(checkpoints: Path, log_prefix: Path, policy: str, *extra: str) -> Any:
    counts = ",".join(str(c) for c in COUNTS)
    return warm_start.popen(
        [sys.executable, str(WORKER), str(checkpoints), str(log_prefix), policy, counts, *extra],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the followers it starts are killed with it if a test fails
    )


def _finish(process: Any, seconds: float, what: str) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"{what} did not end within {seconds} s; its output:\n{out}")
    return process.returncode, out


def _reads(path: Path) -> list[tuple[int, str, int]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) == 3:  # a half-written last line of a killed process is replayed anyway
            rows.append((int(parts[0]), parts[1], int(parts[2])))
    return rows


def _logs(tmp_path: Path, prefix: str, rank: int) -> dict[int, list[tuple[int, str, int]]]:
    """Each process's reads on ``rank``, by pid."""
    return {int(p.name.rsplit(".", 1)[1]): _reads(p) for p in tmp_path.glob(f"{prefix}.rank{rank}.*")}


def _epoch_of_latest(directory: Path) -> int:
    latest = latest_checkpoint(directory) if directory.exists() else None
    return -1 if latest is None else int(latest.name.split("-")[1])


def _check_counts(reads: list[tuple[str, int]], max_reads: int) -> None:
    counts = Counter(reads)
    expected = {(f"p{rank}", seq) for rank, n in enumerate(COUNTS) for seq in range(n)}
    assert not sorted(expected - set(counts)), f"never read: {sorted(expected - set(counts))}"
    assert set(counts) <= expected, f"read but never produced: {sorted(set(counts) - expected)}"
    wrong = {key: n for key, n in counts.items() if n != max_reads}
    assert not wrong, f"read other than {max_reads} times: {wrong}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(120)
def test_uneven_streams_end_the_run_by_themselves_and_every_sample_is_read_once(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    rc, out = _finish(_start(checkpoints, tmp_path / "reads", "fifo"), 90, "the run")
    assert rc == 0, out
    assert "finished at epoch" in out
    by_rank = [next(iter(_logs(tmp_path, "reads", rank).values())) for rank in range(2)]
    _check_counts([(p, s) for rows in by_rank for _, p, s in rows], 1)
    last_epoch = [max(e for e, _, _ in rows) for rows in by_rank]
    assert last_epoch[0] < last_epoch[1], f"rank 0 should run dry first (last epochs {last_epoch})"
    final = int(out.split("finished at epoch")[1].split()[0])
    assert final == last_epoch[1] + 1, "the run did not end right after the last epoch with a batch"
    checkpoint = load_checkpoint(checkpoints)
    assert set(checkpoint.extras) == {"stream", "stream.rank1"}
    assert (checkpoint.path / "extra-stream.rank1.safetensors").is_file()
    # Both buffers drained and closed in the last checkpoint: nothing left to resend or read.
    for name in ("stream", "stream.rank1"):
        _, meta = checkpoint.extras[name]
        assert meta["buffer"]["closed"] is True, meta


@pytest.mark.timeout(150)
def test_rank_0_sigkilled_inside_an_epoch_resumes_and_every_sample_is_read_twice(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    first = _start(checkpoints, tmp_path / "first", "firo")
    try:
        deadline = time.monotonic() + 60
        while (latest := _epoch_of_latest(checkpoints)) < 2 or not any(
            e == latest for rows in _logs(tmp_path, "first", 1).values() for e, _, _ in rows
        ):
            assert first.poll() is None, f"the run ended before the kill:\n{first.communicate()[0]}"
            assert time.monotonic() < deadline, "no read on rank 1 after a checkpoint of epoch 2 within 60 s"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)  # rank 0 only: rank 1 must notice and exit by itself
        first.communicate(timeout=10)
        resumed_at = _epoch_of_latest(checkpoints)
        followers = list(_logs(tmp_path, "first", 1))
        gone_by = time.monotonic() + 30
        while any(_alive(pid) for pid in followers):
            assert time.monotonic() < gone_by, "rank 1 did not exit within 30 s of rank 0's death"
            time.sleep(0.05)
        rc, out = _finish(_start(checkpoints, tmp_path / "second", "firo"), 90, "the resumed run")
        assert rc == 0, out
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    kept: list[tuple[str, int]] = []
    for rank in range(2):
        (before,) = _logs(tmp_path, "first", rank).values()
        (after,) = _logs(tmp_path, "second", rank).values()
        kept += [(p, s) for e, p, s in before if e < resumed_at] + [(p, s) for e, p, s in after]
        assert all(e >= resumed_at for e, _, _ in after), f"rank {rank} resumed before epoch {resumed_at}"
    _check_counts(kept, 2)


@pytest.mark.timeout(90)
def test_a_rank_without_the_extras_is_refused_before_training(tmp_path: Path) -> None:
    rc, out = _finish(_start(tmp_path / "checkpoints", tmp_path / "reads", "fifo", "0"), 60, "the run")
    assert rc != 0
    assert "the ranks disagree on checkpoint extras" in out, out
    assert not any(_reads(p) for p in tmp_path.glob("reads.rank*")), "a rank trained although they disagree"
