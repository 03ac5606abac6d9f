"""``WandbReporter``: a run's settings, learning curve and progress in Weights & Biases.

The reporter starts a W&B run when the training starts, logs the settings it hears of to
the run's config, each epoch's metrics against ``epoch`` and the sampled progress against
``global_step`` (both logged beside the metrics, and declared with ``define_metric``), and
finishes the run with an exit code: 0 finished, 130 or 143 stopped by SIGINT or SIGTERM
(as ``lamploop`` exits), 1 failed.  It needs the ``wandb`` package
(``pip install "lamploop[wandb]"``).

``mode="offline"`` (or ``WANDB_MODE=offline``) needs no account and no network: the run is
written under ``<dir>/wandb/offline-run-*`` and ``wandb sync`` uploads it later.

>>> import tempfile
>>> from lamploop.reporting import WandbReporter
>>> board = WandbReporter(project="demo", mode="offline", dir=tempfile.mkdtemp())
>>> board.run is None  # the run starts at start(), or at the first event
True
>>> board.close()
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lamploop.errors import ConfigurationError
from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    Event,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
)
from lamploop.reporting.extras import require_extra
from lamploop.reporting.global_step import GlobalStep
from lamploop.reporting.scalars import epoch_scalars, progress_scalars

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

__all__ = ["WandbReporter", "exit_code_of"]


def exit_code_of(event: RunFinished | RunStopped | RunFailed) -> int:
    """The exit code a run's end gives its W&B run: 0 finished, 128 + the signal's number
    stopped by one (130 SIGINT, 143 SIGTERM), 1 failed or stopped otherwise.

    >>> from lamploop.reporting import RunStopped
    >>> exit_code_of(RunStopped("SIGTERM", "stopped after step 12"))
    143
    """
    if isinstance(event, RunFinished):
        return 0
    if isinstance(event, RunStopped):
        try:
            return 128 + int(signal.Signals[event.reason])
        except KeyError:
            return 1
    return 1


class WandbReporter:
    """Logs a run to Weights & Biases (metric names as :class:`TensorBoardReporter`'s).

    Args:
        project, entity, name, group, tags, notes: the W&B run's.
        config: your own settings, in the run's config from the start.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; ``None``: ``WANDB_MODE``, else
            online.
        dir: where the run's local files go (``<dir>/wandb/``); ``None``: ``WANDB_DIR``, else
            the working directory.
        id, resume: go on with an existing run (a resumed training), as ``wandb.init``'s.
        settings: a ``wandb.Settings`` (or a dict of them), for anything else.

    :meth:`start` (which :func:`lamploop.fit` calls on the root before training, and the
    first event otherwise) starts the run with ``wandb.init`` (a run of its own beside any
    other in the process), so a refused login or project stops the training before it
    starts.  The other ranks, which make the same reporters and hear no event, only close
    theirs: they start no run.

    Config: ``config``, then ``nranks``, ``max_epochs`` and ``start_epoch`` (the epoch the
    run starts or resumes at) from ``RunStarted``.

    Against ``epoch`` (``EpochFinished``, one row per epoch, with ``global_step``: where
    the epoch's last step brought it): ``train/loss``, ``validation/loss`` (raw) and
    ``validation/loss_smoothed`` (epochs that validated), ``train/<metric>``,
    ``validation/<metric>`` (raw) and ``validation/<metric>_smoothed``,
    ``schedule/learning_rate_factor`` (when recorded) and ``perf/epoch_seconds``.

    Against ``global_step`` (the optimizer steps this process trained, see
    :class:`~lamploop.reporting.global_step.GlobalStep`; one row per event, with ``epoch``):
    ``train/loss_sampled``, ``perf/examples_per_second``, ``perf/step_seconds`` and
    ``perf/communication_seconds`` (``ProgressSampled``), ``checkpoint/seconds``
    (``CheckpointWritten``).  W&B's own ``_step`` counts the rows.

    The end: ``RunFinished``, ``RunStopped`` or ``RunFailed`` finishes the run with
    :func:`exit_code_of` the event; closed with none heard, it finishes with 1.

    Attributes:
        run: the W&B run, once started (``run.dir``, ``run.id``...).

    Raises:
        MissingDependencyError: wandb is not installed.
        ConfigurationError: from :meth:`start`, ``wandb.init`` refused the run.
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] | None = None,
        notes: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: Literal["online", "offline", "disabled"] | None = None,
        dir: str | Path | None = None,
        id: str | None = None,
        resume: bool | Literal["allow", "never", "must", "auto"] | None = None,
        settings: Any = None,
    ) -> None:
        require_extra("WandbReporter", "wandb", "wandb")
        self.project = project
        self.mode = mode
        self.dir = Path(dir) if dir is not None else None
        self._init: dict[str, Any] = {
            "project": project,
            "entity": entity,
            "name": name,
            "group": group,
            "tags": list(tags) if tags is not None else None,
            "notes": notes,
            "config": dict(config) if config is not None else None,
            "mode": mode,
            "dir": str(dir) if dir is not None else None,
            "id": id,
            "resume": resume,
            "settings": settings,
        }
        self.run: Run | None = None
        self._steps = GlobalStep()
        self._defined: set[str] = set()
        self._finished = False
        self._closed = False
        self._refused = False  # start() failed: the events are dropped, not retried each time

    def start(self) -> None:
        """Start the W&B run (the first event does it; calling it again does nothing).

        Raises:
            ConfigurationError: ``wandb.init`` refused the run (not logged in, no such
                project or run to resume...).
        """
        if self.run is not None or self._closed:
            return
        import wandb

        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(**self._init, reinit="create_new")
        except Exception as exc:  # wandb's UsageError, CommError, AuthenticationError...
            self._refused = True
            msg = f"WandbReporter: wandb.init refused the run: {type(exc).__name__}: {exc}"
            raise ConfigurationError(msg) from exc

    def report(self, event: Event) -> None:
        """Log what ``event`` says (see the class docstring); nothing after the run's end."""
        if self._closed or self._finished or self._refused:
            return
        self.start()
        run = self.run
        assert run is not None
        step = self._steps.see(event)
        if isinstance(event, ProgressSampled):
            axes = {"global_step": step, "epoch": event.epoch}
            self._log(run, progress_scalars(event), "global_step", axes)
        elif isinstance(event, EpochFinished):
            axes = {"epoch": event.state.learning_curve[-1].epoch, "global_step": step}
            self._log(run, epoch_scalars(event), "epoch", axes)
        elif isinstance(event, CheckpointWritten):
            self._log(run, {"checkpoint/seconds": event.seconds}, "global_step", {"global_step": step})
        elif isinstance(event, RunStarted):
            settings = {"nranks": event.nranks, "max_epochs": event.max_epochs, "start_epoch": event.epoch}
            config: Any = run.config  # wandb's Config.update is untyped
            config.update(settings, allow_val_change=True)
        elif isinstance(event, (RunFinished, RunStopped, RunFailed)):
            self._finish(exit_code_of(event))

    def _log(self, run: Run, values: Mapping[str, float], against: str, axes: Mapping[str, int]) -> None:
        for name in values:
            if name not in self._defined:
                run.define_metric(name, step_metric=against)
                self._defined.add(name)
        run.log({**axes, **values})

    def _finish(self, exit_code: int) -> None:
        self._finished = True
        if self.run is not None:
            self.run.finish(exit_code=exit_code)

    def close(self) -> None:
        """Finish the run with exit code 1 if no end event did (calling it again does nothing)."""
        if self._closed:
            return
        if not self._finished:
            self._finish(1)
        self._closed = True

    def __repr__(self) -> str:
        run = f", run={self.run.id!r}" if self.run is not None else ""
        return f"WandbReporter(project={self.project!r}, mode={self.mode!r}{run})"
