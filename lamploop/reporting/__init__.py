"""Reporting: what a run says about itself, as plain events handed to reporters.

A :class:`Reporter` receives :data:`Event` values (frozen attrs data) on the root rank;
:class:`LoggingReporter`, the default of :func:`lamploop.fit`, writes one log line per
epoch on the ``"lamploop"`` logger.  The other reporters, each in a module of its own:

* :class:`ProgressReporter`: live progress bars on a terminal, plain lines elsewhere
  (needs ``lamploop[progress]``);
* :class:`TensorBoardReporter`: TensorBoard scalars (needs ``lamploop[tensorboard]``);
* :class:`PrometheusReporter`: Prometheus metrics over HTTP (needs ``lamploop[prometheus]``);
* :class:`MetricsFileReporter`: one CSV or JSON-lines row per epoch;
* :class:`MlflowReporter`: an MLflow tracking run (needs ``lamploop[mlflow]``);
* :class:`WandbReporter`: a Weights & Biases run, online or offline (needs ``lamploop[wandb]``).

Their optional dependencies are imported when a reporter is made, never by
``import lamploop``; a missing one raises :class:`~lamploop.errors.MissingDependencyError`
with the ``pip install`` command.

.. versionadded:: 0.2
"""

from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    Event,
    PeerJoined,
    PeerLost,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    StepBreakdown,
    ValidationFinished,
)
from lamploop.reporting.logging_reporter import LoggingReporter
from lamploop.reporting.metrics_file import MetricsFileReporter
from lamploop.reporting.mlflow import MlflowReporter
from lamploop.reporting.progress import ProgressReporter
from lamploop.reporting.prometheus import PrometheusReporter
from lamploop.reporting.reporter import Reporter, report_all
from lamploop.reporting.tensorboard import TensorBoardReporter
from lamploop.reporting.wandb import WandbReporter

__all__ = [
    "CheckpointWritten",
    "EpochFinished",
    "EpochStarted",
    "Event",
    "LoggingReporter",
    "MetricsFileReporter",
    "MlflowReporter",
    "PeerJoined",
    "PeerLost",
    "ProgressReporter",
    "ProgressSampled",
    "PrometheusReporter",
    "Reporter",
    "RunFailed",
    "RunFinished",
    "RunStarted",
    "RunStopped",
    "StepBreakdown",
    "TensorBoardReporter",
    "ValidationFinished",
    "WandbReporter",
    "report_all",
]
