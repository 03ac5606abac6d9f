"""The events a run reports: their order, their numbers, and how a run that fails or stops ends.

Real runs: ``fit`` in this process for one rank, and a real two-process run (lamploop's
own launcher) whose root writes every event to a file (``tests/workers/events_fit.py``).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support import ROOT, free_port
from workers import warm_start

import lamploop
from lamploop.errors import NonFiniteLossError, TrainingInterrupted
from lamploop.reporting import events as ev
from lamploop.reporting import sampler
from tests.workers import events_fit

ROOT = ROOT


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.closed = 0

    def report(self, event: ev.Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed += 1

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _fit(recorder: Recorder, tmp_path: Path, **overrides: Any) -> lamploop.LoopState | None:
    x, y = events_fit.data()
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    n = events_fit.N_TRAIN
    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1),
        "train_batches": lamploop.tensor_batches(x[:n], y[:n], batch_size=16),
        "validation_batches": lamploop.tensor_batches(x[n:], y[n:], batch_size=64, shuffle=False),
        "max_epochs": 3,
        "learning_rate_schedule": lamploop.linear(start=1.0, end=0.5, max_steps=3),
        "checkpoint_dir": tmp_path / "checkpoints",
        "reporters": [recorder],
        "world_size": 1,
    }
    kwargs.update(overrides)
    return lamploop.fit(**kwargs)


def test_one_rank_reports_every_event_in_order_with_exact_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler, "DEFAULT_PROGRESS_INTERVAL_S", 0.0)  # a sample after every step
    recorder = Recorder()
    state = _fit(recorder, tmp_path)
    assert state is not None
    kinds = [type(e).__name__ for e in recorder.events]
    assert kinds[0] == "RunStarted"
    assert kinds[-1] == "RunFinished"
    assert recorder.closed == 1
    per_epoch = "".join(
        {"EpochStarted": "S", "ProgressSampled": "p", "ValidationFinished": "V", "EpochFinished": "E"}.get(
            k, ""
        )
        + ("C" if k == "CheckpointWritten" else "")
        for k in kinds
    )
    assert per_epoch == ("S" + "p" * 24 + "VEC") * 3  # 384 examples / 16 = 24 steps per epoch
    started = recorder.of(ev.EpochStarted)
    assert [e.expected_steps for e in started] == [None, 24, 24]
    assert [e.learning_rate_factor for e in started] == pytest.approx([1.0, 1 - 0.5 / 3, 1 - 1 / 3])
    finished = recorder.of(ev.EpochFinished)
    assert [(e.steps, e.examples) for e in finished] == [(24, 384)] * 3
    for epoch, done in enumerate(finished):
        entry = done.state.learning_curve[-1]
        assert entry.learning_rate_factor == started[epoch].learning_rate_factor
        samples = [s for s in recorder.of(ev.ProgressSampled) if s.epoch == epoch]
        # The samples' losses, weighted by their examples, add up to the epoch's training loss.
        weighted, previous = 0.0, 0
        for s in samples:
            weighted += s.loss * (s.examples - previous)
            previous = s.examples
        assert weighted / previous == pytest.approx(entry.training_loss, rel=1e-9)
        assert [s.steps_done for s in samples] == list(range(1, 25))
        assert all(s.steps == 1 and s.seconds_per_step > 0 and s.examples_per_second > 0 for s in samples)
        validated = recorder.of(ev.ValidationFinished)[epoch]
        assert validated.loss == entry.validation_loss[1]  # type: ignore[index]
    totals = [s.total_examples for s in recorder.of(ev.ProgressSampled)]
    assert totals == [16 * i for i in range(1, 73)]
    written = recorder.of(ev.CheckpointWritten)
    assert [(c.epoch, c.steps_done) for c in written] == [(1, 0), (2, 0), (3, 0)]
    assert all(c.path is not None and Path(c.path).is_dir() for c in written)


def test_a_failing_run_reports_the_failure_last_and_closes_the_reporters(tmp_path: Path) -> None:
    x, y = events_fit.data()
    x = x.clone()
    x[100] = math.nan  # batch 6 of the first epoch (unshuffled): a NaN loss
    n = events_fit.N_TRAIN
    recorder = Recorder()
    with pytest.raises(NonFiniteLossError):
        _fit(
            recorder,
            tmp_path,
            train_batches=lamploop.tensor_batches(x[:n], y[:n], batch_size=16, shuffle=False),
        )
    kinds = [type(e).__name__ for e in recorder.events]
    assert kinds[:2] == ["RunStarted", "EpochStarted"]
    assert kinds[-1] == "RunFailed"
    assert "NonFiniteLossError" in recorder.events[-1].error
    assert "RunFinished" not in kinds
    assert recorder.closed == 1


def test_a_stopped_run_reports_its_checkpoint_then_the_stop(tmp_path: Path) -> None:
    x, y = events_fit.data()
    n = events_fit.N_TRAIN
    inner = lamploop.tensor_batches(x[:n], y[:n], batch_size=16)

    def interrupted(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            async for i, batch in _enumerate(inner(context)):
                if context.epoch == 1 and i == 5:
                    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, inside the epoch
                    await anyio.sleep(0.05)  # the signal's handler runs on the event loop
                yield batch

        return stream()

    recorder = Recorder()
    with pytest.raises(TrainingInterrupted):
        _fit(recorder, tmp_path, train_batches=interrupted)
    stopped = recorder.events[-1]
    assert isinstance(stopped, ev.RunStopped)
    assert stopped.reason == "SIGINT"
    last_checkpoint = recorder.events[-2]
    assert isinstance(last_checkpoint, ev.CheckpointWritten)
    assert last_checkpoint.epoch == 1
    assert 5 <= last_checkpoint.steps_done <= 7
    assert recorder.closed == 1


async def _enumerate(stream: Any) -> Any:
    i = 0
    async for item in stream:
        yield i, item
        i += 1


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_report_to_prometheus_tensorboard_and_csv_while_training(tmp_path: Path) -> None:
    """A real 2-process run: scrape its Prometheus endpoint while it trains, then read the
    TensorBoard event file and the CSV back, and the events the root heard."""
    out, port = tmp_path / "run", free_port()
    command = [sys.executable, str(ROOT / "tests/workers/events_fit.py"), str(out), "--world-size", "2"]
    command += ["--epochs", "4", "--batch-sleep", "0.05", "--prometheus-port", str(port)]
    command += ["--tensorboard", str(tmp_path / "tb"), "--metrics-file", str(tmp_path / "curve.csv")]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scrapes: list[dict[str, float]] = []
    try:
        deadline = time.monotonic() + 100
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # not serving yet, or already closed
                scrapes.append(_scrape(port))
            time.sleep(0.1)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err[-3000:]
    # The counters moved while it trained, never backwards, and the peers were both there.
    steps = [s["lamploop_steps_total"] for s in scrapes]
    assert len(set(steps)) >= 3, steps
    assert steps == sorted(steps)
    # The gauge is served from RunStarted on (absent until measured): a scrape may come before.
    alive = [s["lamploop_peers_alive"] for s in scrapes if "lamploop_peers_alive" in s]
    assert alive, "no scrape saw lamploop_peers_alive"
    assert max(alive) == 2
    assert max(s["lamploop_examples_total"] for s in scrapes) <= 4 * 384

    events = list(events_fit.iter_events(out / "events.jsonl"))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["RunStarted", "PeerJoined"]
    assert events[1]["rank"] == 1
    assert kinds[-2:] == ["RunFinished", "closed"]
    finished = [e for e in events if e["type"] == "EpochFinished"]
    # 384 examples in batches of 16 shared by 2 ranks: 12 steps of 32 examples per epoch.
    assert [(e["steps"], e["examples"]) for e in finished] == [(12, 384)] * 4
    samples = [e for e in events if e["type"] == "ProgressSampled"]
    assert all(s["examples"] % 32 == 0 and 0 < s["examples"] <= 384 for s in samples)
    assert all(0 <= s["communication_seconds_per_step"] <= s["seconds_per_step"] for s in samples)
    # The follower sleeps as long as the root: the root waits on collectives, a little.
    assert any(s["communication_seconds_per_step"] > 0 for s in samples)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    train_loss = [(s.step, s.value) for s in board.Scalars("train/loss")]
    # On the global step (12 steps an epoch), the epoch a scalar of its own.
    assert train_loss == [
        (12 * (e["epoch"] + 1), pytest.approx(e["training_loss"], rel=1e-6)) for e in finished
    ]
    epoch_at = {s.step: s.value for s in board.Scalars("epoch")}
    assert all(epoch_at[12 * (e["epoch"] + 1)] == e["epoch"] for e in finished)
    factors = [s.value for s in board.Scalars("schedule/learning_rate_factor")]
    assert factors == pytest.approx([e["learning_rate_factor"] for e in finished])
    assert len(board.Scalars("perf/examples_per_second")) == len(samples)

    with (tmp_path / "curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["training_loss"]) for r in rows] == pytest.approx([e["training_loss"] for e in finished])
    assert all(0 <= float(r["train_accuracy"]) <= 1 for r in rows)


def test_fit_shows_one_line_per_epoch_without_any_logging_set_up(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch, lamploop
        x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=16),
            max_epochs=2,
            checkpoint_dir={str(tmp_path / "c")!r},
        )
        """
    )
    done = warm_start.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert lines[0] == "lamploop: training on 1 rank(s) from epoch 0 to 2"
    assert lines[1] == "lamploop: model: Linear, 10 parameters (10 trainable, 0 non-trainable), 0.000 MB"
    assert lines[2].startswith("lamploop: epoch 0: train loss ")
    assert lines[3].startswith("lamploop: epoch 1: train loss ")
    assert lines[4] == "lamploop: finished after epoch 1"
    assert len(lines) == 5
    assert done.stdout == ""


def test_a_run_that_ends_before_max_epochs_says_why() -> None:
    """Early stopping, a schedule's zero factor: the RunFinished event and the log line say which."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    noise = torch.randn(64, 4) * 10  # validation on noise: no new best after the first epochs

    class Seen:
        def __init__(self) -> None:
            self.events: list[ev.Event] = []

        def report(self, event: ev.Event) -> None:
            self.events.append(event)

    def run(**settings: Any) -> list[ev.Event]:
        seen = Seen()
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=2.0),
            train_batches=lamploop.tensor_batches(x, y, batch_size=16),
            validation_batches=lamploop.tensor_batches(noise, y, batch_size=64),
            max_epochs=30,
            reporters=[seen],
            **settings,
        )
        return seen.events

    events = run(early_stopping_patience=2, return_min_validation_loss_model=lamploop.ALL_EPOCHS)
    (finished,) = [e for e in events if isinstance(e, ev.RunFinished)]
    assert finished.state.epoch < 30
    best = finished.state.min_validation_epoch
    assert finished.reason == (
        f"early stopping: 2 validations without a new best since epoch {best} (early_stopping_patience=2)"
    )
    line = lamploop.reporting.logging_reporter.finished_line(finished)
    assert line == f"finished after epoch {finished.state.epoch - 1}: {finished.reason}"

    stepped = run(learning_rate_schedule=lamploop.step_after(3, 0.0))
    (finished,) = [e for e in stepped if isinstance(e, ev.RunFinished)]
    assert finished.state.epoch == 3
    assert finished.reason.startswith("the learning-rate schedule gave factor 0 for epoch 3")

    (finished,) = [e for e in run() if isinstance(e, ev.RunFinished)]
    assert (finished.state.epoch, finished.reason) == (30, "")
