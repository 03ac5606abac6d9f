"""``Profile``: ``torch.profiler`` over a window of training steps, one trace per rank.

A :class:`Profile` says which optimizer steps to record and where the traces go::

    skip_first steps, then `repeat` times:  wait steps | warmup steps | active steps
                                            (nothing)    (profiler on,   (recorded; a trace
                                                          discarded)      is written after them)

A training pass given a :class:`StepProfiler` starts it at its first step and calls
:meth:`StepProfiler.step` after every optimizer step, on every rank (steps are counted across
epochs, so the window may span an epoch's end; a step's span then also holds what ran
between the two epochs, validation included).  Each rank writes
``<out_dir>/rank<R>.<milliseconds>.pt.trace.json`` after each active window, a Chrome trace
that TensorBoard's profiler plugin (``tensorboard --logdir <out_dir>``), Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open; its ``ProfilerStep#N`` spans are the
recorded steps, ``N`` counting from 0 at the first step profiled.

The profiler stops once its last window is written; a run that ends inside a window writes
what that window recorded when the profiler is closed (:meth:`StepProfiler.close`).
Profiling costs time while the profiler is on (warm-up and active steps), nothing after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from lamploop.checks import check_bool, int_at_least
from lamploop.errors import ConfigurationError

__all__ = ["Profile", "StepProfiler", "trace_file_pattern"]


def _out_dir(value: object) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, Path)) or not str(value):
        msg = f"Profile: out_dir must be a directory path (str or Path), got {value!r}"
        raise ConfigurationError(msg)
    return Path(value)


def _flag(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_bool(f"Profile: {attribute.name}", value)


@attrs.frozen(kw_only=True)
class Profile:
    """Which training steps ``torch.profiler`` records, and where each rank's trace goes.

    Attributes:
        out_dir: the directory of the traces (made when the first is written).  It must not
            be a file.
        wait: steps with the profiler off at the start of each window.
        warmup: steps with the profiler on but discarded (its start-up costs land here).
        active: steps recorded, >= 1.
        repeat: windows in all; 0 repeats them until the run ends.
        skip_first: steps skipped once before the first window (the first steps of a run
            compile, allocate and warm caches).
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.

    Raises:
        ConfigurationError: a count that is not an int (or below its minimum), a flag that is
            not a bool, an ``out_dir`` that is not a path or is an existing file.

    >>> Profile(out_dir="traces", wait=1, warmup=1, active=2).steps_in_all
    4
    >>> Profile(out_dir="traces", active=0)
    Traceback (most recent call last):
    ...
    lamploop.errors.ConfigurationError: Profile: active must be an int >= 1, got 0
    """

    out_dir: Path = attrs.field(converter=_out_dir)
    wait: int = attrs.field(default=1, validator=int_at_least("Profile", 0))
    warmup: int = attrs.field(default=1, validator=int_at_least("Profile", 0))
    active: int = attrs.field(default=3, validator=int_at_least("Profile", 1))
    repeat: int = attrs.field(default=1, validator=int_at_least("Profile", 0))
    skip_first: int = attrs.field(default=0, validator=int_at_least("Profile", 0))
    record_shapes: bool = attrs.field(default=False, validator=_flag)
    profile_memory: bool = attrs.field(default=False, validator=_flag)
    with_stack: bool = attrs.field(default=False, validator=_flag)

    def __attrs_post_init__(self) -> None:
        if self.out_dir.exists() and not self.out_dir.is_dir():
            msg = f"Profile: out_dir {str(self.out_dir)!r} is a file; name a directory for the traces"
            raise ConfigurationError(msg)

    @property
    def steps_in_all(self) -> int | None:
        """The steps after which the profiler is done (``None`` with ``repeat=0``: never)."""
        if self.repeat == 0:
            return None
        return self.skip_first + (self.wait + self.warmup + self.active) * self.repeat

    def recorded_steps(self) -> list[int]:
        """The indices (from 0, the first step profiled) of the steps the traces hold (finite ``repeat``)."""
        cycle = self.wait + self.warmup + self.active
        return [
            self.skip_first + window * cycle + self.wait + self.warmup + i
            for window in range(self.repeat)
            for i in range(self.active)
        ]


def trace_file_pattern(rank: int) -> str:
    """The glob of rank ``rank``'s trace files in a :class:`Profile`'s ``out_dir``."""
    return f"rank{rank}.*.pt.trace.json"


class StepProfiler:
    """The loop's side of a :class:`Profile` on one rank: start, one :meth:`step` per optimizer step, close.

    Args:
        profile: the window and the directory.
        rank: this rank (in the trace files' names).
        device: where the rank trains; CUDA activity is recorded on a CUDA device.
    """

    def __init__(self, profile: Profile, *, rank: int, device: torch.device | None = None) -> None:
        self.profile = profile
        self.rank = rank
        self.device = device
        self.steps = 0  # optimizer steps since start()
        self._profiler: torch.profiler.profile | None = None
        self._done = False

    @property
    def running(self) -> bool:
        """Whether the profiler has started and is not done."""
        return self._profiler is not None

    def start(self) -> None:
        """Turn the profiler on before the first step profiled (later calls do nothing)."""
        if self._profiler is not None or self._done:
            return
        p = self.profile
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=p.wait, warmup=p.warmup, active=p.active, repeat=p.repeat, skip_first=p.skip_first
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(p.out_dir), worker_name=f"rank{self.rank}"
            ),
            record_shapes=p.record_shapes,
            profile_memory=p.profile_memory,
            with_stack=p.with_stack,
        )
        profiler.start()
        self._profiler = profiler

    def step(self) -> None:
        """An optimizer step is done; after the last window's, the profiler is turned off."""
        profiler = self._profiler
        if profiler is None:
            return
        profiler.step()  # writes a trace when this step ends an active window
        self.steps += 1
        last = self.profile.steps_in_all
        if last is not None and self.steps >= last:
            self._stop()

    def close(self) -> None:
        """Turn the profiler off; a window in progress writes what it recorded (later calls do nothing)."""
        if self._profiler is not None:
            self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        self._done = True
        if profiler is not None:
            profiler.stop()
