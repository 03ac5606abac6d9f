"""The events of a run, as plain frozen data.

A run on the root rank produces, in order::

    RunStarted
    PeerJoined (once per follower, multi-rank runs)
    for each epoch:
        EpochStarted
        ProgressSampled (every ``progress_interval`` seconds of training, and after the first step)
        CheckpointWritten (inside the epoch, when a step-boundary checkpoint is written)
        ValidationFinished (epochs that validate)
        EpochFinished
        CheckpointWritten (the end-of-epoch checkpoint, with a checkpoint directory)
    RunFinished | RunStopped | RunFailed (PeerLost first, when a rank was lost)

A streamed run (:mod:`lamploop.streaming`) also reports ``IngestionSampled`` every second or
so, from :func:`lamploop.streaming.ingestion.report_ingestion`.

Every event carries ``time``: ``time.time()`` when it was made (wall clock, for logs and
dashboards).  Rates and durations inside events come from a monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TypeAlias

import attrs

from lamploop.loop.step_timing import StepBreakdown
from lamploop.state import LoopState
from lamploop.summary import ModelSummary

__all__ = [
    "CheckpointWritten",
    "EpochFinished",
    "EpochStarted",
    "Event",
    "IngestionSampled",
    "PeerJoined",
    "PeerLost",
    "ProgressSampled",
    "RunFailed",
    "RunFinished",
    "RunStarted",
    "RunStopped",
    "StepBreakdown",
    "ValidationFinished",
]


def _now() -> float:
    return time.time()


def _floats(value: Mapping[str, float]) -> dict[str, float]:
    return {str(name): float(v) for name, v in dict(value).items()}


@attrs.frozen
class RunStarted:
    """The run starts (or resumes) at ``epoch`` on ``nranks`` ranks; it ends at ``max_epochs`` at most.

    ``model_summary``: the model's parameters per top-level module and in all
    (:func:`lamploop.summary.summarize`, computed once per run when anyone listens), or
    ``None`` where the run's driver did not make one.
    """

    nranks: int
    epoch: int
    max_epochs: int
    model_summary: ModelSummary | None = attrs.field(default=None, kw_only=True)
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class PeerJoined:
    """Follower ``rank`` joined the run (from ``address``, when the control channel knows it)."""

    rank: int
    nranks: int
    address: str = ""
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class PeerLost:
    """Rank ``rank`` was lost (``how``: ``"died"``, ``"silent"``, ``"aborted"``...); the run fails next."""

    rank: int
    how: str
    message: str
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class EpochStarted:
    """Epoch ``epoch`` starts training with the schedule's ``learning_rate_factor``.

    ``steps_done`` and ``examples_done`` (every rank's) are not 0 when the epoch resumes at
    a step-boundary checkpoint; ``expected_steps`` is the previous epoch's step count
    (``None`` in the first epoch this process runs, also after a resume): a guess of the
    epoch's length for progress bars.
    """

    epoch: int
    learning_rate_factor: float
    steps_done: int = 0
    expected_steps: int | None = None
    examples_done: int = 0
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class ProgressSampled:
    """Training progress inside epoch ``epoch``, sampled without waiting on the device.

    Attributes:
        epoch: the epoch in progress.
        steps_done: optimizer steps done in the epoch so far (a resumed epoch's included).
        examples: examples of every rank trained on in the epoch so far (likewise).
        loss: the mean training loss per example over the steps since the previous sample
            (every rank's), or ``None`` when no step finished since.
        steps: the steps since the previous sample (0 in none).
        seconds_per_step: mean wall-clock seconds per step since the previous sample.
        communication_seconds_per_step: of those, the mean seconds the root spent blocked
            waiting on collectives (what overlapping with compute did not hide).
        examples_per_second: examples of every rank per second since the previous sample.
        total_steps: optimizer steps done in the run so far (every epoch).
        total_examples: examples trained on in the run so far (every epoch, every rank).
    """

    epoch: int
    steps_done: int
    examples: int
    loss: float | None
    steps: int
    seconds_per_step: float
    communication_seconds_per_step: float
    examples_per_second: float
    total_steps: int
    total_examples: int
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class ValidationFinished:
    """Epoch ``epoch`` validated: the raw mean validation ``loss`` and ``metrics`` over every rank."""

    epoch: int
    loss: float
    metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_floats, hash=False)
    seconds: float = 0.0
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class EpochFinished:
    """An epoch ended; ``state.learning_curve[-1]`` is what it measured.

    ``seconds``: its wall-clock time (training and validation) in this process; ``steps``
    and ``examples``: the optimizer steps it took and the examples of every rank it trained
    on (a resumed epoch's: those before the checkpoint included).

    ``step_breakdown``: where the root's training steps of the epoch spent their time, summed
    (data wait, forward+backward, communication wait, optimizer, checkpoint; see
    :mod:`lamploop.loop.step_timing`); the steps this process ran (a resumed epoch's after
    the checkpoint), or ``None`` where the run's driver measured none.
    """

    state: LoopState
    seconds: float = 0.0
    steps: int = 0
    examples: int = 0
    step_breakdown: StepBreakdown | None = attrs.field(default=None, kw_only=True)
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class CheckpointWritten:
    """A checkpoint was written at ``epoch`` after ``steps_done`` steps of it (0: the epoch's start).

    ``path`` is its directory when the writer names one; ``seconds`` how long writing took.
    """

    epoch: int
    steps_done: int
    path: str | None = None
    seconds: float = 0.0
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class IngestionSampled:
    """A streamed run's intake since the previous sample (one rank's receiver and buffer).

    Attributes:
        rank: whose receiver and buffer.
        samples: samples put into the buffer in all; ``samples_per_second`` and
            ``bytes_per_second`` since the previous sample.
        put_seconds_mean: the mean time a put waited since the previous sample (a full
            buffer's back-pressure).
        fill, capacity: the samples the buffer holds now, and the most it holds.
        reads: reads from the buffer in all; ``evicted``: samples a reservoir evicted.
        duplicates, refusals: resent samples dropped, and connections refused, in all.
        seen_histogram: how many resident samples have been read how many times.
        closed: whether every producer is done.
    """

    rank: int
    samples: int
    samples_per_second: float
    bytes_per_second: float
    put_seconds_mean: float
    fill: int
    capacity: int
    reads: int
    evicted: int
    duplicates: int
    refusals: int
    seen_histogram: Mapping[int, int] = attrs.field(factory=dict, hash=False)
    closed: bool = False
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class RunFinished:
    """The run ended normally with ``state``; ``reason`` says why it ended before ``max_epochs``
    (``"early stopping: ..."``, the schedule's factor, the end of the streams; empty otherwise)."""

    state: LoopState
    reason: str = attrs.field(default="", kw_only=True)
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class RunStopped:
    """The run stopped on request (``reason``: ``"SIGINT"``, ``"SIGTERM"``...); ``message`` says where."""

    reason: str
    message: str
    time: float = attrs.field(factory=_now, kw_only=True)


@attrs.frozen
class RunFailed:
    """The run failed; ``error`` is ``"Type: message"`` of the error raised."""

    error: str
    time: float = attrs.field(factory=_now, kw_only=True)


Event: TypeAlias = (
    RunStarted
    | PeerJoined
    | PeerLost
    | EpochStarted
    | ProgressSampled
    | ValidationFinished
    | EpochFinished
    | CheckpointWritten
    | IngestionSampled
    | RunFinished
    | RunStopped
    | RunFailed
)
"""Everything a reporter may receive."""
