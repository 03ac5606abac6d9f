"""A streamed run survives a SIGKILL of its trainer (issue 10, "nothing lost").

Real processes: a trainer (tests/workers/stream_trainer.py: a receiver, a buffer, fit with
the buffer as a checkpoint extra) and two producers (tests/workers/stream_producer.py,
BlockingProducer).  The trainer is SIGKILLed after a few checkpoints and started again: it
restores the stream from the latest checkpoint, reopens its receiver on the same port,
the producers reconnect and resend what the restored buffer does not hold, and the run
ends with the stream.  Every trainer process logs each read with its epoch; the reads
that count are the first process's in the epochs before the checkpoint the second
resumed from, and the second's from there on.  Each sample must be read exactly
``max_reads`` times in all.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, WORKERS, free_port
from workers import warm_start

from lamploop.checkpoint import latest_checkpoint

ROOT = ROOT
WORKERS = WORKERS
SAMPLES = 40
NAMES = ("sim-a", "sim-b")


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "LAMPLOOP_STREAM_TOKEN": token}


def _epoch_of_latest(directory: Path) -> int:
    latest = latest_checkpoint(directory) if directory.exists() else None
    if latest is None:
        return -1
    return int(latest.name.split("-")[1])


def _wait(process: Any, seconds: float, what: str) -> str:
    try:
        out, _ = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        pytest.fail(f"{what} did not end within {seconds} s; its output:\n{out}")
    assert process.returncode == 0, f"{what} failed ({process.returncode}):\n{out}"
    return out


def _reads(log: Path) -> list[tuple[int, str, int]]:
    rows = []
    for line in log.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue  # the last line, half-written when the trainer was killed (its epoch is replayed)
        epoch, producer, seq = parts
        rows.append((int(epoch), producer, int(seq)))
    return rows


def _read_in(log: Path, epoch: int) -> bool:
    return log.exists() and any(e == epoch for e, _, _ in _reads(log))


def _start(args: list[str], token: str) -> Any:
    return warm_start.popen(
        [sys.executable, *args],
        env=_env(token),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("policy", "max_reads"), [("fifo", 1), ("firo", 2)])
def test_a_sigkilled_trainer_resumes_and_every_sample_is_read_max_reads_times(
    tmp_path: Path, policy: str, max_reads: int
) -> None:
    token = secrets.token_hex(16)
    port = free_port()
    checkpoints = tmp_path / "checkpoints"

    def trainer(log: Path) -> Any:
        args = [str(WORKERS / "stream_trainer.py"), str(port), str(checkpoints), str(log), policy]
        return _start([*args, *NAMES], token)

    first_log, second_log = tmp_path / "reads-1.log", tmp_path / "reads-2.log"
    first = trainer(first_log)
    producers = [
        _start([str(WORKERS / "stream_producer.py"), str(port), name, str(SAMPLES)], token) for name in NAMES
    ]
    try:
        deadline = time.monotonic() + 60
        # Killed inside an epoch after the third: reads since the checkpoint are then replayed.
        while (latest := _epoch_of_latest(checkpoints)) < 3 or not _read_in(first_log, latest):
            assert first.poll() is None, f"the trainer ended before it was killed:\n{first.communicate()[0]}"
            assert time.monotonic() < deadline, "no read after a checkpoint of epoch 3 within 60 s"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
        resumed_at = _epoch_of_latest(checkpoints)
        assert all(p.poll() is None for p in producers), "a producer ended before the kill: nothing resent"

        second = trainer(second_log)
        out = _wait(second, 60, "the resumed trainer")
        for producer, name in zip(producers, NAMES, strict=True):
            _wait(producer, 30, f"producer {name}")
    finally:
        for process in (first, *producers):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert "finished at epoch" in out

    before, after = _reads(first_log), _reads(second_log)
    assert after, "the resumed trainer read nothing"
    assert min(epoch for epoch, _, _ in after) == resumed_at, "the resumed trainer did not start there"
    kept = [(p, s) for epoch, p, s in before if epoch < resumed_at] + [(p, s) for _, p, s in after]
    counts = Counter(kept)
    expected = {(name, seq) for name in NAMES for seq in range(SAMPLES)}
    missing = sorted(expected - set(counts))
    strangers = sorted(set(counts) - expected)
    wrong = {key: n for key, n in counts.items() if n != max_reads}
    assert not missing, f"never read: {missing}"
    assert not strangers, f"read but never produced: {strangers}"
    assert not wrong, f"read other than {max_reads} times: {wrong}"


@pytest.mark.timeout(120)
def test_a_sigkilled_producer_restarts_from_zero_and_nothing_is_read_twice(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    port = free_port()
    checkpoints, log = tmp_path / "checkpoints", tmp_path / "reads.log"
    trainer = _start(
        [str(WORKERS / "stream_trainer.py"), str(port), str(checkpoints), str(log), "firo", *NAMES], token
    )

    def producer(name: str) -> Any:
        return _start([str(WORKERS / "stream_producer.py"), str(port), name, str(SAMPLES)], token)

    producers = {name: producer(name) for name in NAMES}
    restarted: Any | None = None
    try:
        deadline = time.monotonic() + 60
        while _epoch_of_latest(checkpoints) < 2:
            assert trainer.poll() is None, f"the trainer ended early:\n{trainer.communicate()[0]}"
            assert time.monotonic() < deadline, "no checkpoint of epoch 2 within 60 s"
            time.sleep(0.01)
        killed = producers[NAMES[0]]
        assert killed.poll() is None, "the producer ended before the kill: nothing resent"
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=10)
        restarted = producer(NAMES[0])  # the same samples again from seq 0: those held are skipped
        out = _wait(trainer, 60, "the trainer")
        _wait(restarted, 30, "the restarted producer")
        _wait(producers[NAMES[1]], 30, "the other producer")
    finally:
        for process in (trainer, *producers.values(), *([restarted] if restarted else [])):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert "finished at epoch" in out
    counts = Counter((p, s) for _, p, s in _reads(log))
    assert set(counts) == {(name, seq) for name in NAMES for seq in range(SAMPLES)}
    assert {key: n for key, n in counts.items() if n != 2} == {}


@pytest.mark.timeout(120)
def test_a_producer_done_before_the_crash_is_not_waited_for_after_it(tmp_path: Path) -> None:
    """The checkpoint records the producers that finished: the resumed run does not wait for them."""
    token = secrets.token_hex(16)
    port = free_port()
    checkpoints = tmp_path / "checkpoints"
    counts = {"sim-a": 6, "sim-b": SAMPLES}

    def trainer(log: Path) -> Any:
        args = [str(WORKERS / "stream_trainer.py"), str(port), str(checkpoints), str(log), "fifo"]
        return _start([*args, *counts], token)

    first_log, second_log = tmp_path / "reads-1.log", tmp_path / "reads-2.log"
    first = trainer(first_log)
    # The long one paces its samples (8 s in all) so that it is still sending when the trainer
    # is killed, two checkpoints after the short one finished, however fast the transport is.
    short, long = (
        _start([str(WORKERS / "stream_producer.py"), str(port), name, str(n), str(pace)], token)
        for (name, n), pace in zip(counts.items(), (0.005, 0.2), strict=True)
    )
    try:
        _wait(short, 30, "the short producer")  # done, acknowledged, gone
        done_by = _epoch_of_latest(checkpoints)
        deadline = time.monotonic() + 60
        while _epoch_of_latest(checkpoints) < done_by + 2:  # a checkpoint that knows it is done
            assert first.poll() is None, f"the trainer ended before it was killed:\n{first.communicate()[0]}"
            assert time.monotonic() < deadline, "no checkpoint after the short producer finished within 60 s"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
        resumed_at = _epoch_of_latest(checkpoints)
        assert long.poll() is None, "the long producer ended before the kill"
        out = _wait(trainer(second_log), 60, "the resumed trainer (waiting for a producer that is gone?)")
        _wait(long, 30, "the long producer")
    finally:
        for process in (first, short, long):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert "finished at epoch" in out
    kept = [(p, s) for e, p, s in _reads(first_log) if e < resumed_at] + [
        (p, s) for _, p, s in _reads(second_log)
    ]
    assert Counter(kept) == Counter({(name, seq): 1 for name, n in counts.items() for seq in range(n)})
