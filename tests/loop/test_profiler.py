"""The profiler (``torch.profiler`` over a window of steps, a Chrome trace per rank) and the
always-on step breakdown (data wait, forward+backward, communication wait, optimizer, checkpoint).

Real training passes: ``one_epoch`` in this process for one rank, and two Gloo processes
(``tests/workers/profile_rank.py``) that run each epoch on a worker thread as a real run does.
The traces are read back as Chrome trace JSON.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support import ROOT, free_port
from workers import warm_start

import lamploop
from lamploop import SupervisedModel, one_epoch
from lamploop.errors import ConfigurationError
from lamploop.inspection import format_report, inspect_checkpoint
from lamploop.loop.boundary import StepProgress
from lamploop.loop.profiler import Profile, StepProfiler, trace_file_pattern
from lamploop.loop.step_timing import PARTS, StepBreakdown, StepTimes
from lamploop.reporting import EpochFinished, MetricsFileReporter
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.epoch_events import EpochEvents
from lamploop.reporting.metrics_file import STEP_COLUMNS
from lamploop.state import LearningCurveEntry, LoopState

pytestmark = pytest.mark.timeout(120)

ROOT = ROOT
BATCH = 8
SLEEP_S = 0.25  # rank 1's sleep before each batch in the two-rank test


def _model() -> SupervisedModel:
    torch.manual_seed(0)
    return SupervisedModel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    )


def _batches(
    n: int, *, sleep: float = 0.0, seed: int = 0
) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(n):
            if sleep > 0:
                await anyio.sleep(sleep)  # a producer that cannot keep up
            x = torch.randn(BATCH, 16, generator=generator)
            yield x, (x.sum(dim=1) > 0).long()

    return stream()


def _train(epochs: int, batches: int, **how: Any) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.1)
    sleep = how.pop("sleep", 0.0)

    async def main() -> None:
        for epoch in range(epochs):
            await one_epoch(
                model=model,
                batches=_batches(batches, sleep=sleep, seed=epoch),
                step_optimizer=optimizer.step,
                epoch=epoch,
                **how,
            )

    anyio.run(main)


def _step_spans(trace: Path) -> list[str]:
    """The names of the ``ProfilerStep#N`` spans of a Chrome trace, in step order."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = [
        e["name"] for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    return sorted(names, key=lambda name: int(name.split("#")[1]))


# -- the profiler ---------------------------------------------------------------------------


def test_one_rank_traces_exactly_the_active_steps_across_an_epoch_end(tmp_path: Path) -> None:
    profile = Profile(out_dir=tmp_path / "traces", wait=1, warmup=1, active=3)
    profiler = StepProfiler(profile, rank=0)
    _train(2, 4, profiler=profiler)  # steps 0-7; the window's active steps 2, 3, 4 span both epochs
    assert not profiler.running  # done after its 5th step, before the run's end
    profiler.close()
    (trace,) = (tmp_path / "traces").glob(trace_file_pattern(0))
    assert trace.name.startswith("rank0.")
    assert trace.name.endswith(".pt.trace.json")
    assert _step_spans(trace) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert profile.recorded_steps() == [2, 3, 4]


def test_repeated_windows_write_a_trace_each(tmp_path: Path) -> None:
    profile = Profile(out_dir=tmp_path, wait=1, warmup=1, active=1, repeat=2, skip_first=1)
    profiler = StepProfiler(profile, rank=3)
    _train(1, 8, profiler=profiler)
    traces = sorted(tmp_path.glob(trace_file_pattern(3)), key=lambda p: int(p.name.split(".")[1]))
    assert [_step_spans(t) for t in traces] == [["ProfilerStep#3"], ["ProfilerStep#6"]]
    assert profile.recorded_steps() == [3, 6]


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded_when_closed(tmp_path: Path) -> None:
    profiler = StepProfiler(Profile(out_dir=tmp_path, wait=0, warmup=1, active=10), rank=0)
    _train(1, 4, profiler=profiler)
    assert profiler.running
    assert list(tmp_path.iterdir()) == []
    profiler.close()
    profiler.close()
    (trace,) = tmp_path.glob(trace_file_pattern(0))
    assert _step_spans(trace)[:3] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def test_two_gloo_ranks_each_write_their_trace_and_measure_their_waits(tmp_path: Path) -> None:
    """Rank 1's stream sleeps 250 ms before each batch: rank 1 waits for data, rank 0 for rank 1.

    Both ranks' communication waits hold the all-reduce's own time, which grows with the
    machine's load; only rank 0's also holds rank 1's sleep. So rank 0's wait is checked against
    rank 1's by their difference, not their ratio: in a CI run (3 workers on 2 cores, 150 ms
    sleeps) rank 0 waited 0.93 s and rank 1 0.49 s, 0.44 s apart but under twice. The sleep must
    dwarf what load adds to a step: a step's forward and backward took 90-110 ms there.
    """
    port, script = free_port(), str(ROOT / "tests/workers/profile_rank.py")
    ranks = [
        warm_start.popen(
            [sys.executable, script, str(rank), "2", str(port), str(tmp_path), "--data-sleep", str(sleep)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, sleep in ((0, 0.0), (1, SLEEP_S))
    ]
    for rank, proc in enumerate(ranks):
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, f"rank {rank}:\n{out}"
    for rank in (0, 1):
        (trace,) = (tmp_path / "traces").glob(trace_file_pattern(rank))
        assert _step_spans(trace) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    breakdowns = [json.loads((tmp_path / f"breakdown-rank{r}.json").read_text()) for r in (0, 1)]
    for b in breakdowns:
        assert b["steps"] == 8
        assert all(b[part] >= 0 for part in PARTS)
        assert sum(b[part] for part in PARTS) <= b["seconds"] + 1e-9
    assert breakdowns[1]["data_wait"] >= 8 * SLEEP_S  # its 8 batches, each after a sleep
    assert breakdowns[0]["data_wait"] < breakdowns[1]["data_wait"] / 4, breakdowns
    # Rank 0 is blocked on rank 1 at every step; rank 1, arriving last, waits for the all-reduce alone.
    assert breakdowns[0]["communication_wait"] >= 8 * SLEEP_S / 2, breakdowns
    waited_for_rank_1 = breakdowns[0]["communication_wait"] - breakdowns[1]["communication_wait"]
    assert waited_for_rank_1 >= 8 * SLEEP_S / 4, breakdowns


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"active": 0}, "Profile: active must be an int >= 1, got 0"),
        ({"wait": -1}, "Profile: wait must be an int >= 0, got -1"),
        ({"warmup": 1.5}, "Profile: warmup must be an int >= 0, got 1.5"),
        ({"repeat": "2"}, "Profile: repeat must be an int >= 0, got '2'"),
        ({"skip_first": True}, "Profile: skip_first must be an int >= 0, got True"),
        ({"record_shapes": 1}, "Profile: record_shapes must be True or False, got 1"),
        ({"out_dir": 3}, "Profile: out_dir must be a directory path (str or Path), got 3"),
        ({"out_dir": ""}, "Profile: out_dir must be a directory path (str or Path), got ''"),
    ],
)
def test_bad_profile_values_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
        Profile(**{"out_dir": "traces", **fields})


def test_an_out_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "traces"
    taken.write_text("")
    with pytest.raises(ConfigurationError, match="is a file; name a directory for the traces"):
        Profile(out_dir=taken)


# -- the step breakdown ---------------------------------------------------------------------


def test_the_parts_are_non_negative_and_within_the_step_time() -> None:
    times = StepTimes()
    _train(2, 6, step_times=times, accumulate_gradient_over_n_batches=2)
    b = times.snapshot()
    assert b.steps == 6  # 3 steps of 2 batches per epoch
    assert all(value >= 0 for value in b.parts().values())
    assert sum(b.parts().values()) <= b.seconds
    assert b.forward_backward > 0
    assert b.optimizer > 0
    assert b.communication_wait == 0.0
    assert b.checkpoint == 0.0


def test_a_stream_that_sleeps_shows_as_data_wait() -> None:
    quick, slow = StepTimes(), StepTimes()
    _train(1, 6, step_times=quick)
    _train(1, 6, step_times=slow, sleep=0.02)
    assert slow.snapshot().data_wait >= 6 * 0.02
    # Sleeps are attributed to the data wait, not more: the quick stream's wait is small beside
    # (a margin a descheduled process cannot eat, unlike a difference of 12 ms).
    assert quick.snapshot().data_wait < slow.snapshot().data_wait / 2
    assert slow.snapshot().data_wait <= slow.snapshot().seconds


class _CheckpointEveryStep:
    """A step boundary that asks for a checkpoint after every step and takes 25 ms to write it."""

    def __init__(self) -> None:
        self.written = 0

    def requests(self, steps_done: int) -> tuple[bool, bool]:
        return True, False

    async def reached(self, progress: StepProgress, *, stop: bool) -> None:
        await anyio.sleep(0.025)
        self.written += 1


def test_a_step_boundary_checkpoint_shows_as_checkpoint() -> None:
    times, boundary = StepTimes(), _CheckpointEveryStep()
    _train(1, 4, step_times=times, boundary=boundary)
    b = times.snapshot()
    assert boundary.written == b.steps == 4
    assert b.checkpoint >= 4 * 0.025
    assert b.data_wait < b.checkpoint / 2  # the boundary's time is the checkpoint's, not the data's
    assert sum(b.parts().values()) <= b.seconds


def test_the_epoch_events_carry_each_epoch_s_own_breakdown() -> None:
    heard: list[Any] = []

    class Recorder:
        def report(self, event: Any) -> None:
            heard.append(event)

    model = _model()
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.1)
    curve: list[LearningCurveEntry] = []

    async def main() -> None:
        events = EpochEvents(EventEmitter([Recorder()]), lambda: 0.0)  # made on the event loop
        assert events.step_times is not None
        for epoch, steps in enumerate((3, 5)):
            events.epoch_started(epoch, 1.0)
            loss = await one_epoch(
                model=model,
                batches=_batches(steps, seed=epoch),
                step_optimizer=optimizer.step,
                after_step=events.after_step,
                step_times=events.step_times,
            )
            curve.append(LearningCurveEntry(epoch, float(loss)))
            events.epoch_finished(LoopState(epoch=epoch + 1, learning_curve=tuple(curve)))

    anyio.run(main)
    finished = [e for e in heard if isinstance(e, EpochFinished)]
    assert [e.steps for e in finished] == [3, 5]
    breakdowns = [e.step_breakdown for e in finished]
    assert all(isinstance(b, StepBreakdown) for b in breakdowns)
    assert [b.steps for b in breakdowns if b is not None] == [3, 5]  # each epoch's, not the run's so far
    for b, e in zip(breakdowns, finished, strict=True):
        assert b is not None
        assert 0 < b.seconds <= e.seconds


def test_no_reporters_no_step_times() -> None:
    async def main() -> None:
        assert EpochEvents(EventEmitter([]), lambda: 0.0).step_times is None

    anyio.run(main)


# -- through fit ---------------------------------------------------------------------------------


def test_fit_profiles_its_window_and_its_metrics_file_holds_the_breakdown(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    model = _model()
    lamploop.fit(
        model=model,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),  # 4 steps per epoch
        max_epochs=2,
        checkpoint_dir=tmp_path / "run",
        reporters=[MetricsFileReporter(tmp_path / "run" / "metrics.csv")],
        profile=Profile(out_dir=tmp_path / "traces", wait=1, warmup=1, active=3),  # type: ignore[call-arg]
    )
    (trace,) = (tmp_path / "traces").glob(trace_file_pattern(0))
    assert _step_spans(trace) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    with (tmp_path / "run" / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["steps"]) for row in rows] == [4, 4]
    for row in rows:
        parts = [float(row[column]) for column in STEP_COLUMNS]
        assert all(part >= 0 for part in parts)
        assert sum(parts[1:]) <= parts[0] <= float(row["seconds"])
    report = format_report(inspect_checkpoint(tmp_path / "run"))
    assert "where the training steps' time went" in report
