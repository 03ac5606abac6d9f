"""The reporters fed synthetic event sequences: progress, TensorBoard, Prometheus, metrics files."""

from __future__ import annotations

import csv
import io
import json
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lamploop.errors import ConfigurationError, MissingDependencyError
from lamploop.reporting import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    Event,
    LoggingReporter,
    MetricsFileReporter,
    MlflowReporter,
    PeerJoined,
    PeerLost,
    ProgressReporter,
    ProgressSampled,
    PrometheusReporter,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    StepBreakdown,
    TensorBoardReporter,
    ValidationFinished,
    WandbReporter,
    report_all,
)
from lamploop.reporting.global_step import GlobalStep
from lamploop.reporting.metrics_file import STEP_COLUMNS
from lamploop.state import LearningCurveEntry, LoopState

T0 = 1_700_000_000.0  # the events' wall clock

ENTRY_0 = LearningCurveEntry(
    0,
    0.75,
    validation_loss=(0.7, 0.65),
    training_metrics={"accuracy": 0.5},
    validation_metrics={"accuracy": (0.55, 0.6)},
    learning_rate_factor=1.0,
)
ENTRY_1 = LearningCurveEntry(1, 0.5, training_metrics={"accuracy": 0.7}, learning_rate_factor=0.5)


def sample(
    epoch: int,
    steps_done: int,
    examples: int,
    *,
    total_steps: int,
    total_examples: int,
    steps: int,
    at: float,
    loss: float | None = 0.8,
) -> ProgressSampled:
    return ProgressSampled(
        epoch=epoch,
        steps_done=steps_done,
        examples=examples,
        loss=loss,
        steps=steps,
        seconds_per_step=0.25,
        communication_seconds_per_step=0.05,
        examples_per_second=256.0,
        total_steps=total_steps,
        total_examples=total_examples,
        time=at,
    )


def run_events(end: Event | None = None) -> list[Event]:
    """Two epochs (40 and 35 steps of 64 examples); the samples miss the last steps of each."""
    state_0 = LoopState(epoch=1, learning_curve=[ENTRY_0])
    state_1 = LoopState(epoch=2, learning_curve=[ENTRY_0, ENTRY_1])
    return [
        RunStarted(nranks=3, epoch=0, max_epochs=2, time=T0),
        PeerJoined(rank=1, nranks=3, time=T0),
        PeerJoined(rank=2, nranks=3, time=T0),
        EpochStarted(epoch=0, learning_rate_factor=1.0, time=T0 + 1),
        sample(0, 1, 64, total_steps=1, total_examples=64, steps=1, at=T0 + 1, loss=2.0),
        sample(0, 30, 1920, total_steps=30, total_examples=1920, steps=29, at=T0 + 8, loss=0.9),
        CheckpointWritten(epoch=0, steps_done=30, seconds=0.5, time=T0 + 9),
        ValidationFinished(epoch=0, loss=0.65, metrics={"accuracy": 0.6}, seconds=1.0, time=T0 + 11),
        EpochFinished(state_0, seconds=10.0, steps=40, examples=2560, time=T0 + 11),
        CheckpointWritten(epoch=1, steps_done=0, path="/ckpt/1", seconds=0.25, time=T0 + 12),
        EpochStarted(epoch=1, learning_rate_factor=0.5, expected_steps=40, time=T0 + 12),
        sample(1, 1, 64, total_steps=41, total_examples=2624, steps=1, at=T0 + 12, loss=0.6),
        sample(1, 20, 1280, total_steps=60, total_examples=3840, steps=19, at=T0 + 17, loss=0.55),
        EpochFinished(state_1, seconds=8.0, steps=35, examples=2240, time=T0 + 20),
        end if end is not None else RunFinished(state_1, time=T0 + 21),
    ]


def feed(reporter: Any, events: list[Event]) -> None:
    for event in events:
        reporter.report(event)


# -- ProgressReporter -------------------------------------------------------------------------

PLAIN_LINES = [
    "training on 3 rank(s) from epoch 0 to 2",
    "epoch 0: train loss 0.7500, validation loss 0.6500 (smoothed 0.7000), train accuracy 0.5000, "
    "validation accuracy 0.6000 (smoothed 0.5500) (10.0 s, 256 examples/s)",
    "epoch 1: train loss 0.5000, train accuracy 0.7000 (8.0 s, 280 examples/s)",
]


def test_progress_off_a_terminal_prints_plain_lines_and_no_sample() -> None:
    out = io.StringIO()  # isatty() is False
    progress = ProgressReporter(out)
    assert not progress.terminal
    feed(progress, run_events())
    progress.close()
    progress.close()
    assert out.getvalue().splitlines() == [*PLAIN_LINES, "finished after epoch 1 (21.0 s)"]
    assert "\x1b" not in out.getvalue()


@pytest.mark.parametrize(
    "end",
    [
        RunStopped("SIGTERM", "at epoch 1 step 20", time=T0 + 21),
        RunFailed("PeerLostError: rank 2 died", time=T0 + 21),
    ],
)
def test_progress_says_nothing_of_a_stop_or_a_failure_its_caller_says_it(end: Event) -> None:
    out = io.StringIO()
    progress = ProgressReporter(out, terminal=False)
    feed(progress, run_events(end))
    assert out.getvalue().splitlines() == PLAIN_LINES


def test_progress_off_a_terminal_says_something_every_30_seconds_at_most() -> None:
    out = io.StringIO()
    progress = ProgressReporter(out)
    progress.report(RunStarted(nranks=1, epoch=0, max_epochs=1, time=T0))
    progress.report(EpochStarted(epoch=0, learning_rate_factor=1.0, expected_steps=500, time=T0))
    for at, steps_done in [(1, 1), (20, 100), (31, 150), (45, 200), (60, 260), (62, 270)]:
        progress.report(
            sample(
                0, steps_done, 64 * steps_done, total_steps=steps_done, total_examples=0, steps=1, at=T0 + at
            )
        )
    progress.report(PeerLost(rank=1, how="silent", message="no heartbeat for 30 s", time=T0 + 63))
    assert out.getvalue().splitlines() == [
        "training on 1 rank(s) from epoch 0 to 1",
        "epoch 0: step 150/500, loss 0.8000, 256 examples/s",  # 31 s after the first line
        "epoch 0: step 270/500, loss 0.8000, 256 examples/s",  # 31 s after that one
        "rank 1 lost (silent): no heartbeat for 30 s",
    ]


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_draws_bars_and_prints_epoch_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    out = _Tty()
    progress = ProgressReporter(out, refresh_per_second=50)  # a terminal: found by isatty()
    assert progress.terminal
    events = run_events()
    feed(progress, events[:13])  # up to the second epoch's last sample
    deadline = time.monotonic() + 30
    while "20/40" not in out.getvalue() and time.monotonic() < deadline:  # drawn by rich's thread
        time.sleep(0.01)
    drawn = _plain(out.getvalue())
    assert "loss 0.5500  256 ex/s" in drawn  # the steps bar: loss, speed, steps and time left
    assert "20/40" in drawn
    # 20 steps left at 0.25 s: 5 s, counting down from the update on rich's thread, which a
    # loaded machine may run seconds late (4 or 5 missed under CI's load).
    assert re.search(r"ETA 0:00:0[1-5]", drawn)
    feed(progress, events[13:])
    text = out.getvalue()
    progress.close()
    progress.close()
    assert "\x1b[" in text  # cursor moves and colours
    plain = _plain(text)
    for line in PLAIN_LINES:
        assert plain.count(line) == 1, line  # printed once, above the bars
    assert plain.rstrip("\n").endswith("finished after epoch 1 (21.0 s)")
    assert "35/35" in plain  # at its end, the epoch's bar is full
    assert "2/2" in plain


def test_progress_terminal_forced_and_unknown_epoch_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    out = io.StringIO()
    progress = ProgressReporter(out, terminal=True)
    progress.report(RunStarted(nranks=1, epoch=0, max_epochs=5, time=T0))
    progress.report(EpochStarted(epoch=0, learning_rate_factor=1.0, time=T0))
    progress.report(sample(0, 7, 448, total_steps=7, total_examples=448, steps=7, at=T0 + 2, loss=1.5))
    progress.close()  # ends the display without a run end
    plain = _plain(out.getvalue())
    assert "7/?" in plain
    assert "loss 1.5000" in plain
    assert "ETA -:--:--" in plain
    assert "\x1b[?25h" in out.getvalue()  # the cursor is shown again


def test_progress_rejects_a_non_positive_refresh() -> None:
    with pytest.raises(ConfigurationError, match="refresh_per_second"):
        ProgressReporter(io.StringIO(), refresh_per_second=0)


# -- TensorBoardReporter ----------------------------------------------------------------------


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    board = TensorBoardReporter(log_dir)
    assert not log_dir.exists()  # made at the first event
    feed(board, run_events())
    board.close()
    board.close()
    board.report(run_events()[4])  # after close: nothing, no error

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()

    def scalars(tag: str) -> list[tuple[int, object]]:
        return [(s.step, pytest.approx(s.value)) for s in accumulator.Scalars(tag)]

    # One x axis, the global step: the samples' total_steps, an epoch's last step (40: the
    # 10 steps after the last sample of epoch 0; 75 = 40 + 35), a checkpoint's step boundary.
    assert scalars("epoch") == [(1, 0), (30, 0), (40, 0), (41, 1), (60, 1), (75, 1)]
    assert scalars("train/loss_sampled") == [(1, 2.0), (30, 0.9), (41, 0.6), (60, 0.55)]
    assert scalars("perf/examples_per_second") == [(1, 256.0), (30, 256.0), (41, 256.0), (60, 256.0)]
    assert scalars("perf/step_seconds")[1] == (30, 0.25)
    assert scalars("perf/communication_seconds")[3] == (60, 0.05)
    assert scalars("train/loss") == [(40, 0.75), (75, 0.5)]
    assert scalars("validation/loss") == [(40, 0.65)]
    assert scalars("validation/loss_smoothed") == [(40, 0.7)]
    assert scalars("train/accuracy") == [(40, 0.5), (75, 0.7)]
    assert scalars("validation/accuracy") == [(40, 0.6)]
    assert scalars("validation/accuracy_smoothed") == [(40, 0.55)]
    assert scalars("schedule/learning_rate_factor") == [(40, 1.0), (75, 0.5)]
    assert scalars("perf/epoch_seconds") == [(40, 10.0), (75, 8.0)]
    assert scalars("checkpoint/seconds") == [(30, 0.5), (40, 0.25)]
    assert accumulator.Scalars("train/loss")[0].wall_time == pytest.approx(T0 + 11)


def test_global_step_of_a_resumed_epoch_and_of_epochs_no_sample_saw() -> None:
    steps = GlobalStep()
    # A process resumed inside epoch 2, after its step 10: it counts the steps it trains.
    assert steps.see(RunStarted(nranks=1, epoch=2, max_epochs=4)) == 0
    assert steps.see(EpochStarted(epoch=2, learning_rate_factor=1.0, steps_done=10, examples_done=640)) == 0
    assert steps.see(sample(2, 11, 704, total_steps=1, total_examples=64, steps=1, at=T0)) == 1
    assert steps.see(CheckpointWritten(epoch=2, steps_done=15, time=T0)) == 5
    finished = LoopState(epoch=3, learning_curve=[LearningCurveEntry(2, 0.5)])
    assert steps.see(EpochFinished(finished, steps=25, examples=1600, time=T0)) == 15
    assert steps.see(CheckpointWritten(epoch=3, steps_done=0, time=T0)) == 15
    # An epoch without EpochStarted or samples (fed by hand): it goes on from the last step.
    finished = LoopState(epoch=4, learning_curve=[LearningCurveEntry(3, 0.5)])
    assert steps.see(EpochFinished(finished, steps=25, examples=1600, time=T0)) == 40
    assert steps.see(RunFinished(finished, time=T0)) == 40


# -- PrometheusReporter -----------------------------------------------------------------------


def scrape(reporter: PrometheusReporter) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(reporter.url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def test_prometheus_counts_exactly_and_frees_its_port() -> None:
    reporter = PrometheusReporter(port=0)
    other = PrometheusReporter(port=0)  # a registry each: no clash
    assert reporter.port is None  # bound at the first event: a follower, hearing none, never binds
    reporter.start()
    other.start()
    assert reporter.port != other.port
    other.close()
    events = run_events(RunFailed("PeerLostError: rank 2 died", time=T0 + 21))
    try:
        feed(reporter, events[:6])  # into the first epoch: two samples
        seen = scrape(reporter)
        assert seen["lamploop_steps_total"] == 30
        assert seen["lamploop_examples_total"] == 1920
        assert seen["lamploop_loss"] == 0.9
        assert seen["lamploop_peers_alive"] == 3
        assert seen["lamploop_ranks"] == 3
        assert seen["lamploop_run_state"] == 0
        assert seen["lamploop_epochs_total"] == 0
        assert 0 <= seen["lamploop_seconds_since_checkpoint"] < 60

        feed(reporter, events[6:9])  # a checkpoint, validation, the epoch's end
        seen = scrape(reporter)
        assert seen["lamploop_steps_total"] == 40  # the 10 steps no sample saw
        assert seen["lamploop_examples_total"] == 2560
        assert seen["lamploop_epochs_total"] == 1
        assert seen["lamploop_checkpoints_total"] == 1
        assert seen["lamploop_validation_loss"] == 0.65
        assert seen["lamploop_metric{name=accuracy,split=validation}"] == 0.6
        assert seen["lamploop_step_seconds"] == 0.25
        assert seen["lamploop_communication_seconds"] == 0.05
        assert seen["lamploop_examples_per_second"] == 256
        assert seen["lamploop_epoch"] == 1

        feed(reporter, events[9:12])
        assert scrape(reporter)["lamploop_steps_total"] == 41  # total_steps goes on from 40
        feed(reporter, events[12:])
        seen = scrape(reporter)
        assert seen["lamploop_steps_total"] == 40 + 35
        assert seen["lamploop_examples_total"] == 2560 + 2240
        assert seen["lamploop_epochs_total"] == 2
        assert seen["lamploop_checkpoints_total"] == 2
        assert seen["lamploop_learning_rate_factor"] == 0.5
        assert seen["lamploop_run_state"] == 3  # failed
        reporter.report(PeerLost(rank=2, how="died", message="", time=T0 + 22))
        assert scrape(reporter)["lamploop_peers_alive"] == 2
    finally:
        reporter.close()
    reporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(reporter.url, timeout=2)
    with socket.socket() as s:  # the port is free again (as a server binds it: TIME_WAIT allowed)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", reporter.port))
        s.listen()


COUNTERS = {f"lamploop_{name}_total" for name in ("steps", "examples", "epochs", "checkpoints")}


def test_prometheus_gauges_are_absent_until_first_measured() -> None:
    """A gauge no event has measured yet is not in the scrape at all (not a made-up 0)."""
    reporter = PrometheusReporter(port=0)

    def shown() -> set[str]:
        return {name for name in scrape(reporter) if not name.endswith("_created")}

    try:
        reporter.start()
        assert shown() == COUNTERS  # counters count from 0: they are there
        reporter.report(RunStarted(nranks=1, epoch=0, max_epochs=2, time=T0))
        run = {"lamploop_ranks", "lamploop_peers_alive", "lamploop_epoch", "lamploop_run_state"}
        run |= {"lamploop_seconds_since_checkpoint"}
        assert shown() == COUNTERS | run
        reporter.report(EpochStarted(epoch=0, learning_rate_factor=1.0, time=T0))
        run |= {"lamploop_learning_rate_factor"}
        assert shown() == COUNTERS | run
        # A sample before any step finished: a speed, but no loss and no step time yet.
        reporter.report(sample(0, 0, 0, total_steps=0, total_examples=0, steps=0, at=T0, loss=None))
        run |= {"lamploop_examples_per_second"}
        assert shown() == COUNTERS | run
        reporter.report(sample(0, 5, 320, total_steps=5, total_examples=320, steps=5, at=T0 + 1))
        run |= {"lamploop_loss", "lamploop_step_seconds", "lamploop_communication_seconds"}
        assert shown() == COUNTERS | run
        # No validation yet: an epoch's end brings its loss and time, and the train metric.
        state = LoopState(epoch=1, learning_curve=[ENTRY_1])
        reporter.report(EpochFinished(state, seconds=8.0, steps=5, examples=320, time=T0 + 2))
        run |= {"lamploop_epoch_training_loss", "lamploop_epoch_seconds"}
        assert shown() == COUNTERS | run | {"lamploop_metric{name=accuracy,split=train}"}
        seen = scrape(reporter)
        assert "lamploop_validation_loss" not in seen
        assert "lamploop_checkpoint_seconds" not in seen
        assert seen["lamploop_loss"] == 0.8
    finally:
        reporter.close()


def test_prometheus_rejects_a_bad_port() -> None:
    with pytest.raises(ConfigurationError, match="port"):
        PrometheusReporter(port=70000)


def test_prometheus_on_a_port_in_use_fails_at_start_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        reporter = PrometheusReporter(port=port)
        with pytest.raises(ConfigurationError, match=f"cannot serve on 127.0.0.1:{port}"):
            reporter.start()


# -- MetricsFileReporter ----------------------------------------------------------------------


def test_csv_rows_and_resume_without_a_second_header(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "curve.csv"
    first = MetricsFileReporter(path)
    feed(first, run_events()[:9])  # the first epoch
    first.close()
    second = MetricsFileReporter(path)  # the run resumes
    feed(second, run_events()[9:])
    second.close()
    second.close()

    lines = path.read_text().splitlines()
    assert sum(line.startswith("epoch,") for line in lines) == 1
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "epoch",
        "training_loss",
        "validation_loss",
        "validation_loss_smoothed",
        "learning_rate_factor",
        "seconds",
        "steps",
        "examples",
        "train_accuracy",
        "validation_accuracy",
    ]
    assert rows == [
        {
            "epoch": "0",
            "training_loss": "0.75",
            "validation_loss": "0.65",
            "validation_loss_smoothed": "0.7",
            "learning_rate_factor": "1.0",
            "seconds": "10.0",
            "steps": "40",
            "examples": "2560",
            "train_accuracy": "0.5",
            "validation_accuracy": "0.6",
        },
        {
            "epoch": "1",
            "training_loss": "0.5",
            "validation_loss": "",
            "validation_loss_smoothed": "",
            "learning_rate_factor": "0.5",
            "seconds": "8.0",
            "steps": "35",
            "examples": "2240",
            "train_accuracy": "0.7",
            "validation_accuracy": "",
        },
    ]


def test_csv_resume_refuses_another_header(tmp_path: Path) -> None:
    path = tmp_path / "curve.csv"
    path.write_text("epoch,loss\n0,1.0\n")
    rows = MetricsFileReporter(path)
    finished = run_events()[8]
    with pytest.raises(ConfigurationError, match=re.escape(repr(str(path)))):
        rows.report(finished)
    rows.report(finished)  # refused once: nothing more is written
    rows.close()
    assert path.read_text() == "epoch,loss\n0,1.0\n"


def test_csv_new_column_later_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "curve.csv"
    rows = MetricsFileReporter(path)
    feed(rows, run_events())
    late = LearningCurveEntry(2, 0.4, training_metrics={"accuracy": 0.8, "top5": 0.9})
    state = LoopState(epoch=3, learning_curve=[ENTRY_0, ENTRY_1, late])
    with caplog.at_level(logging.ERROR, logger="lamploop"):
        rows.report(EpochFinished(state, seconds=1.0, steps=1, examples=1))
        rows.report(EpochFinished(state, seconds=1.0, steps=1, examples=1))
    rows.close()
    assert [r.getMessage().count("train_top5") for r in caplog.records] == [1]
    with path.open(newline="") as f:
        last = list(csv.DictReader(f))[-1]
    assert last["train_accuracy"] == "0.8"
    assert "train_top5" not in last


def test_jsonl_rows(tmp_path: Path) -> None:
    path = tmp_path / "curve.jsonl"
    rows = MetricsFileReporter(path)
    feed(rows, run_events()[:9])
    rows.close()
    rows = MetricsFileReporter(path)  # appended to
    feed(rows, run_events()[9:])
    rows.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["epoch"] for row in lines] == [0, 1]
    assert lines[0]["time"] == T0 + 11
    assert lines[0]["validation_accuracy"] == 0.6
    assert lines[1]["validation_loss"] is None
    assert lines[1]["steps"] == 35


BREAKDOWN = StepBreakdown(
    steps=40,
    seconds=8.0,
    data_wait=0.4,
    forward_backward=5.6,
    communication_wait=0.8,
    optimizer=0.8,
    checkpoint=0.16,
)


def _with_breakdown() -> EpochFinished:
    return EpochFinished(
        LoopState(epoch=1, learning_curve=[ENTRY_0]),
        seconds=10.0,
        steps=40,
        examples=2560,
        step_breakdown=BREAKDOWN,
        time=T0 + 11,
    )


def test_csv_and_jsonl_rows_carry_the_step_breakdown(tmp_path: Path) -> None:
    for name in ("curve.csv", "curve.jsonl"):
        rows = MetricsFileReporter(tmp_path / name)
        rows.report(_with_breakdown())
        rows.close()
    with (tmp_path / "curve.csv").open(newline="") as f:
        (row,) = csv.DictReader(f)
    assert list(row)[8:14] == list(STEP_COLUMNS)  # after the base columns, before the metrics
    expected = {
        "step_seconds": 8.0,
        "data_wait_seconds": 0.4,
        "forward_backward_seconds": 5.6,
        "communication_wait_seconds": 0.8,
        "optimizer_seconds": 0.8,
        "checkpoint_seconds": 0.16,
    }
    assert {k: float(row[k]) for k in STEP_COLUMNS} == expected
    (line,) = (tmp_path / "curve.jsonl").read_text().splitlines()
    assert {k: json.loads(line)[k] for k in STEP_COLUMNS} == expected


def test_csv_from_before_step_breakdowns_is_carried_on_without_them(tmp_path: Path) -> None:
    path = tmp_path / "curve.csv"
    old = MetricsFileReporter(path)
    feed(old, run_events()[:9])  # rows without a breakdown fix the header
    old.close()
    resumed = MetricsFileReporter(path)
    resumed.report(_with_breakdown())  # not refused
    resumed.close()
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert "step_seconds" not in rows[1]
    assert rows[1]["train_accuracy"] == "0.5"


def test_the_epoch_lines_say_where_the_steps_time_went(caplog: pytest.LogCaptureFixture) -> None:
    expected = (
        "per step 200.00 ms: data wait 5%, forward+backward 70%, communication wait 10%, optimizer 10%, "
        "checkpoint 2%, other 3%"
    )
    with caplog.at_level(logging.INFO, logger="lamploop"):
        LoggingReporter().report(_with_breakdown())
    (record,) = caplog.records
    assert record.getMessage().endswith(f"validation accuracy 0.6000 (smoothed 0.5500) ({expected})")
    out = io.StringIO()
    ProgressReporter(out).report(_with_breakdown())
    assert out.getvalue().rstrip().endswith(f"(10.0 s, 256 examples/s; {expected})")


def test_metrics_file_format(tmp_path: Path) -> None:
    for name, format, expected in [
        ("a.CSV", None, "csv"),
        ("b.ndjson", None, "jsonl"),
        ("c.log", "jsonl", "jsonl"),
    ]:
        rows = MetricsFileReporter(tmp_path / name, format=format)  # type: ignore[arg-type]
        rows.close()
        assert rows.format == expected
    with pytest.raises(ConfigurationError, match="suffix"):
        MetricsFileReporter(tmp_path / "a.txt")
    with pytest.raises(ConfigurationError, match="format"):
        MetricsFileReporter(tmp_path / "a.csv", format="xml")  # type: ignore[arg-type]


# -- shared -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "make", "extra"),
    [
        ("rich", lambda _: ProgressReporter(io.StringIO()), "progress"),
        ("tensorboard", lambda tmp: TensorBoardReporter(tmp), "tensorboard"),
        ("prometheus_client", lambda _: PrometheusReporter(), "prometheus"),
        ("mlflow", lambda _: MlflowReporter(), "mlflow"),
        ("wandb", lambda tmp: WandbReporter(dir=tmp), "wandb"),
    ],
)
def test_a_missing_extra_says_what_to_install(
    module: str, make: Callable[[Path], object], extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # "import <module>" fails
    with pytest.raises(MissingDependencyError, match=re.escape(f'pip install "lamploop[{extra}]"')) as caught:
        make(tmp_path)
    assert isinstance(caught.value, ConfigurationError)


def test_import_lamploop_needs_no_extra() -> None:
    code = (
        "import sys, lamploop, lamploop.reporting\n"
        "extras = ('rich', 'tensorboard', 'prometheus_client', 'mlflow', 'wandb')\n"
        "print(sorted(m for m in extras if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_a_failing_reporter_does_not_stop_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def report(self, event: Event) -> None:
            raise RuntimeError("broken")

    rows = MetricsFileReporter(tmp_path / "curve.jsonl")
    with caplog.at_level(logging.ERROR, logger="lamploop"):
        for event in run_events():
            report_all([Broken(), rows], event)
    rows.close()
    assert len((tmp_path / "curve.jsonl").read_text().splitlines()) == 2
    assert len(caplog.records) == len(run_events())
