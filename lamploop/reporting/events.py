"""The events of a run, as plain frozen data."""

from __future__ import annotations

from typing import TypeAlias

import attrs

from lamploop.state import LoopState

__all__ = ["EpochFinished", "Event", "RunFailed", "RunFinished", "RunStarted"]


@attrs.frozen
class RunStarted:
    """The run starts (or resumes) at ``epoch`` on ``nranks`` ranks."""

    nranks: int
    epoch: int
    max_epochs: int


@attrs.frozen
class EpochFinished:
    """An epoch ended; ``state.learning_curve[-1]`` is what it measured."""

    state: LoopState


@attrs.frozen
class RunFinished:
    """The run ended normally with ``state``."""

    state: LoopState


@attrs.frozen
class RunFailed:
    """The run failed; ``error`` is ``"Type: message"`` of the error raised."""

    error: str


Event: TypeAlias = RunStarted | EpochFinished | RunFinished | RunFailed
"""Everything a reporter may receive."""
