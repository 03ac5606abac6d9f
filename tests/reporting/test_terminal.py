"""``lamploop demo`` on a real pseudo-terminal: live bars, and Ctrl-C says one line.

The demo runs in a pty (as in a terminal window, with its followers on the same
terminal and in the same process group); Ctrl-C is a real SIGINT to that group.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import stopped_by
from workers import warm_start

from lamploop.cli import EXIT_INTERRUPTED

COMMAND = [sys.executable, "-m", "lamploop.cli"]
COLUMNS, ROWS = 120, 60


def _screen(raw: bytes) -> list[str]:
    """What the terminal shows after ``raw``: its non-blank lines (a VT100 emulator, pyte)."""
    import pyte

    screen = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(screen)
    stream.feed(raw.replace(b"\n", b"\r\n"))  # a pty's output post-processing (onlcr)
    return [line.rstrip() for line in screen.display if line.strip()]


DEMO_MODEL = "model: Sequential, 17,226 parameters (17,226 trainable, 0 non-trainable), 0.069 MB"


def _without_summary(lines: list[str]) -> list[str]:
    """``lines`` less the model summary printed below the first one: a heading and a row per module."""
    assert lines[1] == DEMO_MODEL, lines[:3]
    assert lines[2].split() == ["name", "type", "parameters", "trainable"]
    assert [row.split()[:2] for row in lines[3:8]] == [
        ["0", "Linear"],
        ["1", "ReLU"],
        ["2", "Linear"],
        ["3", "ReLU"],
        ["4", "Linear"],
    ]
    return [lines[0], *lines[8:]]


class Terminal:
    """A command on a fresh pty; :meth:`read_until` collects its output with a deadline."""

    def __init__(self, command: list[str], cwd: Path) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": str(COLUMNS), "LINES": str(ROWS), "TERM": "xterm-256color"}
        self.proc = subprocess.Popen(
            command, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env
        )
        os.close(slave)
        self.output = b""

    def read_until(self, done: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(done) and done(self.output):
                return
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the other side closed: the command ended
                    return
                if not chunk:
                    return
                self.output += chunk
            elif self.proc.poll() is not None and not callable(done):
                return
        if callable(done):
            pytest.fail(
                f"not seen within {timeout} s; output so far:\n{self.output.decode(errors='replace')}"
            )

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        os.close(self.master)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_on_a_terminal_shows_live_bars_and_keeps_one_line_per_epoch(tmp_path: Path) -> None:
    term = Terminal([*COMMAND, "demo", "--epochs", "3", "--out", "run"], tmp_path)
    try:
        term.read_until(None, timeout=100)
        assert term.proc.wait(timeout=20) == 0
    finally:
        term.close()
    raw = term.output
    assert b"\x1b[" in raw  # a live display: cursor movements and colours
    assert "━".encode() in raw  # rich's bar
    assert b"ex/s" in raw  # the sampled throughput in the steps bar
    screen = _without_summary(_screen(raw))  # the bars are gone; the lines stay
    assert screen[0] == "training on 2 rank(s) from epoch 0 to 3"
    assert [line.split(":")[0] for line in screen[1:4]] == ["epoch 0", "epoch 1", "epoch 2"]
    assert screen[4].startswith("finished after epoch 2 (")
    assert screen[5].startswith("best epoch ")
    assert len(screen) == 6


def test_demo_in_a_pipe_prints_plain_lines(tmp_path: Path) -> None:
    done = subprocess.run(
        [*COMMAND, "demo", "--epochs", "2", "--world-size", "1", "--out", str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        timeout=100,
        check=True,
    )
    assert b"\x1b" not in done.stdout
    lines = _without_summary(done.stdout.decode().splitlines())
    assert lines[0] == "training on 1 rank(s) from epoch 0 to 2"
    assert lines[1].startswith("epoch 0: train loss ")
    assert lines[2].startswith("epoch 1: train loss ")
    assert lines[3].startswith("finished after epoch 1 (")
    assert lines[4].startswith("best epoch ")
    assert len(lines) == 5
    assert done.stderr == b""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ctrl_c_on_a_terminal_says_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    term = Terminal([*COMMAND, "demo", "--epochs", "500", "--batch-size", "8", "--out", str(out)], tmp_path)
    try:
        term.read_until(lambda seen: b"epoch 1: train loss" in seen, timeout=100)
        os.killpg(term.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        term.read_until(None, timeout=60)
        assert term.proc.wait(timeout=20) == EXIT_INTERRUPTED
    finally:
        term.close()
    screen = _without_summary(_screen(term.output))
    assert screen[0] == "training on 2 rank(s) from epoch 0 to 500"
    epochs = screen[1:-1]
    assert len(epochs) >= 2
    assert all(re.match(rf"epoch {i}: train loss", line) for i, line in enumerate(epochs)), screen
    said = screen[-1:]
    assert stopped_by("SIGINT", said[0]) is not None, said  # in a step, or in a validation
    assert "Traceback" not in term.output.decode(errors="replace")


FIT_SCRIPT = """
import torch, lamploop
torch.manual_seed(0)
x, y = torch.randn(1024, 16), torch.randint(0, 3, (1024,))
module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
lamploop.fit(
    model=lamploop.SupervisedModel(module),
    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05),
    train_batches=lamploop.tensor_batches(x, y, batch_size=8),
    max_epochs=2,
)
"""


@pytest.mark.timeout(120)
def test_fit_shows_progress_bars_by_default_on_a_terminal_and_lines_in_a_pipe(tmp_path: Path) -> None:
    term = Terminal([sys.executable, "-c", FIT_SCRIPT], tmp_path)
    try:
        term.read_until(None, timeout=100)
        assert term.proc.wait(timeout=20) == 0
    finally:
        term.close()
    assert "━".encode() in term.output  # rich's bar, with no reporter asked for
    screen = _screen(term.output)
    assert [line.split(":")[0] for line in screen if line.startswith("epoch ")] == ["epoch 0", "epoch 1"]
    piped = warm_start.run(
        [sys.executable, "-c", FIT_SCRIPT], cwd=tmp_path, capture_output=True, timeout=100, check=True
    )
    assert b"\x1b" not in piped.stderr
    assert [line.split(":")[:2] for line in piped.stderr.decode().splitlines() if "epoch 0:" in line] == [
        ["lamploop", " epoch 0"]
    ]
