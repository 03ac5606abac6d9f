"""``ProgressReporter``: live progress bars on a terminal, a few plain lines anywhere else.

On a terminal it shows two bars, the epochs of the run and the steps of the epoch in
progress (with the latest sampled loss, examples per second and the time left), and
prints one permanent line per finished epoch above them.  Written to a file or a pipe it
prints plain lines only: one when the run starts, one per epoch, one at the end (and one
every 30 seconds at most inside a long epoch), without escape codes.

It needs rich (``pip install "lamploop[progress]"``).

>>> import io
>>> from lamploop.reporting import EpochFinished, ProgressReporter, RunFinished, RunStarted
>>> from lamploop.state import LearningCurveEntry, LoopState
>>> out = io.StringIO()
>>> progress = ProgressReporter(out)  # not a terminal: plain lines
>>> state = LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5, validation_loss=(0.6, 0.7))])
>>> progress.report(RunStarted(nranks=1, epoch=0, max_epochs=1, time=0.0))
>>> progress.report(EpochFinished(state, seconds=2.0, steps=10, examples=640, time=2.0))
>>> progress.report(RunFinished(state, time=2.5))
>>> progress.close()
>>> print(out.getvalue(), end="")
training on 1 rank(s) from epoch 0 to 1
epoch 0: train loss 0.5000, validation loss 0.7000 (smoothed 0.6000) (2.0 s, 320 examples/s)
finished after epoch 0 (2.5 s)
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from lamploop.checks import check_bool
from lamploop.errors import ConfigurationError
from lamploop.reporting.events import (
    EpochFinished,
    EpochStarted,
    Event,
    PeerLost,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
)
from lamploop.reporting.extras import require_extra
from lamploop.reporting.logging_reporter import (
    describe_epoch,
    describe_run_started,
    describe_step_breakdown,
    finished_line,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = ["QUIET_LINE_SECONDS", "ProgressReporter"]

QUIET_LINE_SECONDS = 30.0
"""Off a terminal, an epoch in progress prints one line at most this often (by the events' clock)."""


def _eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "ETA -:--:--"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"ETA {hours}:{rest // 60:02d}:{rest % 60:02d}"


def _finished_line(event: EpochFinished, *, breakdown: bool = True) -> str:
    seconds = f"{event.seconds:.1f}" if event.seconds >= 1 else f"{event.seconds:.3f}"
    text = f"{describe_epoch(event)} ({seconds} s"
    if event.seconds > 0:
        text += f", {event.examples / event.seconds:.0f} examples/s"
    if breakdown and event.step_breakdown is not None:
        text += f"; {describe_step_breakdown(event.step_breakdown)}"
    return text + ")"


def _progress_columns() -> list[Any]:
    """The bars' columns; rich is imported by then."""
    from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, Task, TextColumn
    from rich.text import Text

    class _EtaColumn(ProgressColumn):
        """Counts down to the task's ``deadline`` field (a ``time.monotonic()`` value)."""

        def render(self, task: Task) -> Text:
            deadline = task.fields.get("deadline")
            left = None if deadline is None else deadline - time.monotonic()
            return Text(_eta_text(left), style="progress.remaining")

    return [
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        _EtaColumn(),
    ]


class ProgressReporter:
    """Shows a run's progress: rich progress bars on a terminal, plain lines elsewhere.

    Args:
        file: where to write; ``sys.stdout`` by default.
        terminal: ``True`` draws the live bars whatever ``file`` is, ``False`` never does;
            ``None`` (the default) draws them when ``file.isatty()``.
        refresh_per_second: ``None`` (the default): the display redraws when an event comes
            (a progress sample every 0.5 s), on the reporter's thread: no thread of its own
            competes with training for the cores.  A number: rich redraws that often on a
            thread of its own (the time left then counts down between samples).

    On a terminal: ``RunStarted`` prints a line (and the model's summary below it, when the
    run made one: :mod:`lamploop.summary`) and starts the display (an epochs bar and,
    from ``EpochStarted``, a steps bar sized by ``expected_steps``, indeterminate when that
    is unknown); ``ProgressSampled`` moves the steps bar and shows its loss, examples per
    second and the time left; ``EpochFinished`` prints :func:`describe_epoch`'s line, the
    epoch's seconds and examples per second (and where its steps' time went, when the event
    carries a step breakdown) above the bars; ``PeerLost`` prints a line;
    ``RunFinished`` stops the display and prints a last line; ``RunStopped`` and ``RunFailed``
    only stop it (the caller gets the error or the stop, and says it once).

    Elsewhere the same lines are printed, without escape codes, and the bars are left out:
    ``ProgressSampled`` prints nothing unless :data:`QUIET_LINE_SECONDS` passed (by the
    events' ``time``) since the previous line.

    Raises:
        MissingDependencyError: rich is not installed.
        ConfigurationError: ``refresh_per_second`` is a number that is not positive.
    """

    def __init__(
        self,
        file: TextIO | None = None,
        *,
        terminal: bool | None = None,
        refresh_per_second: float | None = None,
    ) -> None:
        require_extra("ProgressReporter", "rich", "progress", "rich.console")
        from rich.console import Console

        if file is not None and not callable(getattr(file, "write", None)):
            what = type(file).__name__
            msg = f"ProgressReporter: file must be a text stream with write() (e.g. sys.stderr), got {what}"
            raise ConfigurationError(msg)
        if getattr(file, "closed", False) is True:
            msg = "ProgressReporter: file is closed; give an open text stream (e.g. sys.stderr)"
            raise ConfigurationError(msg)
        if terminal is not None:
            check_bool("ProgressReporter: terminal", terminal)
        if refresh_per_second is not None and not refresh_per_second > 0:
            msg = f"ProgressReporter: refresh_per_second must be > 0, got {refresh_per_second!r}"
            raise ConfigurationError(msg)
        self.file: TextIO = file if file is not None else sys.stdout
        if terminal is None:
            isatty = getattr(self.file, "isatty", None)
            terminal = bool(isatty()) if callable(isatty) else False
        self.terminal = terminal
        self.refresh_per_second = float(refresh_per_second) if refresh_per_second is not None else None
        self._console: Console | None = (
            Console(file=self.file, force_terminal=True, highlight=False) if terminal else None
        )
        self._progress: Progress | None = None
        self._epochs_task: TaskID | None = None
        self._steps_task: TaskID | None = None
        self._max_epochs: int | None = None
        self._started_at: float | None = None  # RunStarted.time
        self._last_line_at: float | None = None  # the time of the event of the last plain line
        self._expected_steps: int | None = None
        self._epoch_seconds: list[float] = []

    # -- output ---------------------------------------------------------------------------

    def _line(self, text: str, when: float) -> None:
        self._last_line_at = when
        if self._console is None:
            self.file.write(text + "\n")
            self.file.flush()
        elif self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self._console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _display(self) -> Progress | None:
        """The live display (started on first use), or ``None`` off a terminal."""
        if self._console is None:
            return None
        if self._progress is None:
            from rich.progress import Progress

            self._progress = Progress(
                *_progress_columns(),
                console=self._console,
                # Measured (bench_reporters.py): a redraw thread costs 3-4% of a 2-core
                # machine's training; redrawing per event costs nothing measurable.
                auto_refresh=self.refresh_per_second is not None,
                refresh_per_second=self.refresh_per_second or 1.0,
                transient=True,  # the bars leave with the run; the epoch lines stay
                # Only the process's own streams are worth catching above the bars.
                redirect_stdout=self.file is sys.stdout,
                redirect_stderr=self.file is sys.stderr,
            )
            self._progress.start()
            self._epochs_task = self._progress.add_task(
                "epochs", total=self._max_epochs, info="", deadline=None
            )
        return self._progress

    def _stop_display(self) -> None:
        progress, self._progress = self._progress, None
        self._epochs_task = self._steps_task = None
        if progress is not None:
            progress.stop()

    def _mean_epoch_seconds(self) -> float | None:
        return sum(self._epoch_seconds) / len(self._epoch_seconds) if self._epoch_seconds else None

    def _epochs_deadline(self, epochs_after: int, current_left: float | None) -> float | None:
        """When the last epoch should end: ``current_left`` seconds, then ``epochs_after`` epochs."""
        mean = self._mean_epoch_seconds()
        if mean is None or current_left is None:
            return None
        return time.monotonic() + current_left + mean * max(0, epochs_after)

    # -- events ---------------------------------------------------------------------------

    def report(self, event: Event) -> None:
        """Take one event (see the class docstring for what each one shows)."""
        if isinstance(event, ProgressSampled):
            self._sampled(event)
        elif isinstance(event, EpochStarted):
            self._epoch_started(event)
        elif isinstance(event, EpochFinished):
            self._epoch_finished(event)
        elif isinstance(event, RunStarted):
            self._run_started(event)
        elif isinstance(event, PeerLost):
            self._line(f"rank {event.rank} lost ({event.how}): {event.message}", event.time)
        elif isinstance(event, RunFinished | RunStopped | RunFailed):
            self._run_ended(event)
        if self._progress is not None and self.refresh_per_second is None:
            self._progress.refresh()

    def _run_started(self, event: RunStarted) -> None:
        self._stop_display()  # a reporter reused for a second run starts afresh
        self._max_epochs, self._started_at = event.max_epochs, event.time
        self._epoch_seconds = []
        self._line(describe_run_started(event), event.time)
        if event.model_summary is not None:  # a heading and a table of the top-level modules
            self._line(str(event.model_summary), event.time)
        progress = self._display()
        if progress is not None and self._epochs_task is not None:
            progress.update(self._epochs_task, total=event.max_epochs, completed=event.epoch)

    def _epoch_started(self, event: EpochStarted) -> None:
        self._expected_steps = event.expected_steps
        progress = self._display()
        if progress is None:
            return
        if self._steps_task is not None:
            progress.remove_task(self._steps_task)
        self._steps_task = progress.add_task(
            f"epoch {event.epoch}",
            total=event.expected_steps,
            completed=event.steps_done,
            info="",
            deadline=None,
        )
        if self._epochs_task is not None:
            progress.update(self._epochs_task, completed=event.epoch)

    def _sampled(self, event: ProgressSampled) -> None:
        progress = self._display()
        if progress is None:
            if self._last_line_at is not None and event.time - self._last_line_at < QUIET_LINE_SECONDS:
                return
            total = f"/{self._expected_steps}" if self._expected_steps is not None else ""
            loss = f", loss {event.loss:.4f}" if event.loss is not None else ""
            self._line(
                f"epoch {event.epoch}: step {event.steps_done}{total}{loss}, "
                f"{event.examples_per_second:.0f} examples/s",
                event.time,
            )
            return
        if self._steps_task is None:  # no EpochStarted seen: a bar of unknown length
            self._steps_task = progress.add_task(f"epoch {event.epoch}", total=None, info="", deadline=None)
        step_left: float | None = None
        if self._expected_steps is not None and event.steps > 0:
            step_left = max(0, self._expected_steps - event.steps_done) * event.seconds_per_step
        loss = f"loss {event.loss:.4f}" if event.loss is not None else "loss -"
        progress.update(
            self._steps_task,
            completed=event.steps_done,
            info=f"{loss}  {event.examples_per_second:,.0f} ex/s",
            deadline=None if step_left is None else time.monotonic() + step_left,
        )
        if self._epochs_task is not None and self._max_epochs is not None:
            deadline = self._epochs_deadline(self._max_epochs - event.epoch - 1, step_left)
            progress.update(self._epochs_task, deadline=deadline)

    def _epoch_finished(self, event: EpochFinished) -> None:
        self._epoch_seconds.append(event.seconds)
        # On a terminal one epoch is one screen line: the step breakdown would wrap it (it is in
        # the metrics file, lamploop inspect and the log lines of a pipe).
        self._line(_finished_line(event, breakdown=self._console is None), event.time)
        progress = self._display()
        if progress is not None and self._steps_task is not None:  # its length is known now
            done = max(event.steps, 1)
            progress.update(self._steps_task, total=done, completed=done, deadline=time.monotonic())
        if progress is not None and self._epochs_task is not None:
            epochs_left = (self._max_epochs or 0) - event.state.epoch
            progress.update(
                self._epochs_task,
                completed=event.state.epoch,
                info=f"last: {event.seconds:.1f} s",
                deadline=self._epochs_deadline(epochs_left, 0.0),
            )

    def _run_ended(self, event: RunFinished | RunStopped | RunFailed) -> None:
        self._stop_display()
        if not isinstance(event, RunFinished):
            return  # the caller gets the error or the stop, and says it (the CLI: one line)
        took = f" ({event.time - self._started_at:.1f} s)" if self._started_at is not None else ""
        self._line(finished_line(event) + took, event.time)

    def close(self) -> None:
        """Stop the live display, if one runs (calling it again does nothing)."""
        self._stop_display()

    def __repr__(self) -> str:
        mode = "terminal" if self.terminal else "plain"
        return f"ProgressReporter({getattr(self.file, 'name', self.file)!r}, {mode})"
