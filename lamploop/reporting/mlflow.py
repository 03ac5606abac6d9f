"""``MlflowReporter``: a run's parameters, learning curve, progress and last checkpoint in MLflow.

The reporter makes an MLflow run (or goes on with one, ``run_id=``) when the training
starts, logs the metrics of each epoch at ``step = epoch`` and the sampled progress at
``step`` = the global step, uploads the run's last checkpoint when it ends, and ends the
MLflow run as ``FINISHED``, ``KILLED`` (stopped by a signal) or ``FAILED``.  It needs the
``mlflow`` package (``pip install "lamploop[mlflow]"``).

Nothing reaches the tracking server from :meth:`MlflowReporter.report`, which runs between
training steps: the metrics go to a thread of the reporter's own, which sends them in
batches; :meth:`MlflowReporter.close` waits for it (at most ``close_timeout`` seconds).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

__all__ = ["MlflowReporter"]

logger = logging.getLogger("lamploop")

_BATCH = 1000  # the most metrics one log_batch request may carry
_PARAM_BATCH = 100  # and params


class MlflowReporter:
    """Logs a run to MLflow tracking (names below; the same as :class:`TensorBoardReporter`'s).

    Args:
        tracking_uri: the tracking server (``http://host:5000``) or a database
            (``sqlite:///mlflow.db``); ``None``: MLflow's default (``MLFLOW_TRACKING_URI``).
        experiment_name: the experiment of a new run, made when missing; ``None``:
            ``MLFLOW_EXPERIMENT_NAME``, else ``"Default"``.
        run_name: the new run's name (``None``: MLflow picks one).
        run_id: go on with this existing run instead (a resumed training): its status is
            set back to ``RUNNING`` and its metric histories go on.
        params: your own parameters, logged when the run starts (values as ``str(value)``).
        tags: tags of the run.
        artifact_location: where a new experiment keeps its runs' artifacts (only when
            the reporter makes the experiment; default: the server's choice).
        log_checkpoint: upload the run's last checkpoint when it ends (see below).
        close_timeout: the most seconds :meth:`close` waits for the last metrics and the
            checkpoint upload to reach the server.

    :meth:`start` (which :func:`lamploop.fit` calls on the root before training, and the
    first event otherwise) connects and makes the run, so an unreachable server or a
    refused run stops the training before it starts; MLflow's retries bound that wait
    (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT``).  The other
    ranks, which make the same reporters and hear no event, only close theirs: they make
    no run.

    Parameters: ``nranks`` and ``max_epochs`` (from ``RunStarted``) and ``params``; the
    epoch the run starts or resumes at is the tag ``lamploop.start_epoch``.  MLflow keeps
    a parameter's first value: a run gone on with (``run_id``) whose parameter changed
    keeps the old one, and a warning names it.

    Metrics at ``step = epoch`` (``EpochFinished``): ``train/loss``, ``validation/loss``
    (raw) and ``validation/loss_smoothed`` (epochs that validated), ``train/<metric>``,
    ``validation/<metric>`` (raw) and ``validation/<metric>_smoothed``,
    ``schedule/learning_rate_factor`` (when recorded) and ``perf/epoch_seconds``.

    Metrics at ``step`` = the global step (the optimizer steps this process trained, see
    :class:`~lamploop.reporting.global_step.GlobalStep`): ``train/loss_sampled``,
    ``perf/examples_per_second``, ``perf/step_seconds`` and ``perf/communication_seconds``
    (``ProgressSampled``); ``epoch`` (the epoch that finished, at its last step: how the
    two kinds of steps line up); ``checkpoint/seconds`` (``CheckpointWritten``).  Each
    metric carries its event's wall-clock time.

    The checkpoint: when the run ends (``RunFinished``, ``RunStopped`` or ``RunFailed``),
    the directory of the last checkpoint written (``CheckpointWritten.path``: an epoch's,
    or the step boundary a stop wrote) is uploaded as the artifacts
    ``checkpoints/<its name>/``: the checkpoint the run resumes from
    (``lamploop.checkpoint.load_checkpoint`` reads the downloaded ``checkpoints``
    directory).  Not every checkpoint: each holds the whole model and optimizer, and the
    local ones are rotated (``keep_last``) while the artifact store keeps everything.

    The end: ``RunFinished`` ends the MLflow run ``FINISHED``; ``RunStopped`` ``KILLED``,
    with the tag ``lamploop.stop_reason``; ``RunFailed`` ``FAILED``, with the tag
    ``lamploop.error``.  Closed with no end event heard, the run ends ``FAILED``.

    Attributes:
        run_id: the MLflow run's id, once started.
        experiment_id: its experiment's id, once started.

    Raises:
        MissingDependencyError: mlflow is not installed.
        ConfigurationError: ``close_timeout`` is not positive; or, from :meth:`start`,
            the run cannot be made or found there.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment_name: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        params: Mapping[str, object] | None = None,
        tags: Mapping[str, object] | None = None,
        artifact_location: str | None = None,
        log_checkpoint: bool = True,
        close_timeout: float = 300.0,
    ) -> None:
        require_extra("MlflowReporter", "mlflow", "mlflow")
        if not close_timeout > 0:
            msg = f"MlflowReporter: close_timeout must be > 0, got {close_timeout!r}"
            raise ConfigurationError(msg)
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.run_id: str | None = run_id
        self.experiment_id: str | None = None
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.artifact_location = artifact_location
        self.log_checkpoint = log_checkpoint
        self.close_timeout = float(close_timeout)
        self._client: MlflowClient | None = None
        self._logged_params: dict[str, str] = {}
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._steps = GlobalStep()
        self._last_checkpoint: str | None = None
        self._ended = False
        self._closed = False
        self._refused = False  # start() failed: the events are dropped, not retried each time

    # -- making the run (on the caller's thread) --------------------------------------------

    def start(self) -> None:
        """Connect and make the run (the first event does it; calling it again does nothing).

        Raises:
            ConfigurationError: the run cannot be made (or, with ``run_id``, found).
        """
        if self._client is not None or self._closed:
            return
        from mlflow.tracking import MlflowClient

        try:
            with warnings.catch_warnings():
                # mlflow's database store, when first made, trips SQLAlchemy's deprecation
                # warnings about mlflow's own mappings (mlflow 3 with SQLAlchemy 2.1): nothing
                # its user can act on, and an error under ``-W error``.
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"mlflow\.")
                client = MlflowClient(tracking_uri=self.tracking_uri)
                if self.run_id is None:
                    self.experiment_id = self._experiment_id(client)
                    run = client.create_run(self.experiment_id, run_name=self.run_name, tags=self.tags)
                else:
                    run = client.get_run(self.run_id)
                    client.update_run(run.info.run_id, status="RUNNING")
                    self.experiment_id = run.info.experiment_id
                    if self.tags:
                        self._log_tags(client, run.info.run_id, self.tags)
        except Exception as exc:  # MlflowException, or the HTTP client's own after its retries
            self._refused = True
            where = self.tracking_uri if self.tracking_uri is not None else "MLflow's default tracking URI"
            msg = f"MlflowReporter: cannot start a run at {where}: {type(exc).__name__}: {exc}"
            raise ConfigurationError(msg) from exc
        self.run_id = run.info.run_id
        self.run_name = run.info.run_name
        self._logged_params = dict(run.data.params)
        self._client = client
        self._thread = threading.Thread(target=self._work, name="lamploop-mlflow", daemon=True)
        self._thread.start()
        self._log_params(self.params)

    def _experiment_id(self, client: MlflowClient) -> str:
        from mlflow.exceptions import MlflowException

        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return client.create_experiment(name, artifact_location=self.artifact_location)
            except MlflowException:  # made meanwhile by another process
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            msg = f"MlflowReporter: the experiment {name!r} is deleted: restore it or name another"
            raise ConfigurationError(msg)
        return str(experiment.experiment_id)

    @staticmethod
    def _log_tags(client: MlflowClient, run_id: str, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    # -- events (on the event loop: only queued) --------------------------------------------

    def report(self, event: Event) -> None:
        """Queue what ``event`` logs (see the class docstring); nothing after :meth:`close`."""
        if self._closed or self._ended or self._refused:
            return
        self.start()
        step = self._steps.see(event)
        if isinstance(event, ProgressSampled):
            self._log_metrics(progress_scalars(event), step, event.time)
        elif isinstance(event, EpochFinished):
            epoch = event.state.learning_curve[-1].epoch
            self._log_metrics(epoch_scalars(event), epoch, event.time)
            self._log_metrics({"epoch": float(epoch)}, step, event.time)
        elif isinstance(event, CheckpointWritten):
            self._log_metrics({"checkpoint/seconds": event.seconds}, step, event.time)
            if event.path is not None:
                self._last_checkpoint = event.path
        elif isinstance(event, RunStarted):
            self._log_params({"nranks": str(event.nranks), "max_epochs": str(event.max_epochs)})
            self._queue.put(("tags", {"lamploop.start_epoch": str(event.epoch)}))
        elif isinstance(event, RunFinished):
            self._end("FINISHED")
        elif isinstance(event, RunStopped):
            self._end("KILLED", {"lamploop.stop_reason": event.reason})
        elif isinstance(event, RunFailed):
            self._end("FAILED", {"lamploop.error": event.error[:5000]})

    def _log_metrics(self, values: Mapping[str, float], step: int, at: float) -> None:
        from mlflow.entities import Metric

        milliseconds = int(at * 1000)
        self._queue.put(("metrics", [Metric(k, float(v), milliseconds, step) for k, v in values.items()]))

    def _log_params(self, params: Mapping[str, str]) -> None:
        new: dict[str, str] = {}
        for name, value in params.items():
            old = self._logged_params.get(name)
            if old is None:
                new[name] = self._logged_params[name] = value
            elif old != value:
                logger.warning(
                    "MlflowReporter: run %s keeps its parameter %s=%r (MLflow keeps a parameter's "
                    "first value); this run's %r is not logged",
                    self.run_id,
                    name,
                    old,
                    value,
                )
        if new:
            self._queue.put(("params", new))

    def _end(self, status: str, tags: Mapping[str, str] | None = None) -> None:
        self._ended = True
        if tags:
            self._queue.put(("tags", dict(tags)))
        if self.log_checkpoint and self._last_checkpoint is not None:
            self._queue.put(("checkpoint", self._last_checkpoint))
        self._queue.put(("end", status))

    # -- the sending thread -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:  # what queued meanwhile: its metrics go in as few requests as they fit
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            metrics: list[Metric] = []
            for item in items:
                if item is not None and item[0] == "metrics":
                    metrics.extend(item[1])
                    continue
                self._send("metrics", metrics)
                metrics = []
                if item is None:
                    return
                self._send(*item)
            self._send("metrics", metrics)

    def _send(self, kind: str, payload: Any) -> None:
        from mlflow.entities import Param, RunTag

        client, run_id = self._client, self.run_id
        assert client is not None
        assert run_id is not None
        try:
            if kind == "metrics":
                for first in range(0, len(payload), _BATCH):
                    client.log_batch(run_id, metrics=payload[first : first + _BATCH])
            elif kind == "params":
                params = [Param(k, v) for k, v in payload.items()]
                for first in range(0, len(params), _PARAM_BATCH):
                    client.log_batch(run_id, params=params[first : first + _PARAM_BATCH])
            elif kind == "tags":
                client.log_batch(run_id, tags=[RunTag(k, v) for k, v in payload.items()])
            elif kind == "checkpoint":
                path = Path(payload)
                client.log_artifacts(run_id, str(path), artifact_path=f"checkpoints/{path.name}")
            elif kind == "end":
                client.set_terminated(run_id, status=payload)
        except Exception as exc:  # the server gone, a checkpoint rotated away...: the run goes on
            name = type(exc).__name__
            logger.error("MlflowReporter: run %s: could not log the %s: %s: %s", run_id, kind, name, exc)

    def close(self) -> None:
        """End the run if no end event did, and wait (``close_timeout`` at most) for the last
        of it to be sent; calling it again does nothing."""
        if self._closed:
            return
        if self._client is not None and not self._ended:
            self._end("FAILED", {"lamploop.error": "the reporter was closed before the run ended"})
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(self.close_timeout)
        if thread.is_alive():
            logger.error(
                "MlflowReporter: run %s: gave up after %.0f s waiting to send its last metrics, "
                "checkpoint or status to %s",
                self.run_id,
                self.close_timeout,
                self.tracking_uri,
            )

    def __repr__(self) -> str:
        return f"MlflowReporter({self.tracking_uri!r}, run_id={self.run_id!r})"
