"""``PrometheusReporter``: a run's progress as Prometheus metrics, served over HTTP.

The reporter serves ``/metrics`` from a thread of its own, from its own registry (two
reporters in a process do not clash), on ``127.0.0.1`` by default.  It needs
prometheus_client (``pip install "lamploop[prometheus]"``).

The port is bound at the first event (or by :meth:`PrometheusReporter.start`): every rank
of a run builds the same reporters, and only the root, which hears the events, serves.
Before that, :attr:`~PrometheusReporter.port` is ``None`` and
:attr:`~PrometheusReporter.url` raises :class:`~lamploop.errors.ConfigurationError`
saying the reporter has not started.

>>> from lamploop.reporting import PrometheusReporter, RunStarted
>>> prometheus = PrometheusReporter(port=0)  # any free port
>>> prometheus.report(RunStarted(nranks=1, epoch=0, max_epochs=3))
>>> prometheus.url.startswith("http://127.0.0.1:")
True
>>> prometheus.close()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lamploop.errors import ConfigurationError, MissingDependencyError
from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    Event,
    IngestionSampled,
    PeerJoined,
    PeerLost,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    ValidationFinished,
)
from lamploop.reporting.extras import require_extra

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry, Gauge
    from prometheus_client.metrics_core import Metric

__all__ = ["RUN_STATES", "PrometheusReporter"]

RUN_STATES = {"running": 0, "finished": 1, "stopped": 2, "failed": 3}
"""The values of the ``<namespace>_run_state`` gauge."""


class _UntilSet:
    """A gauge left out of the scrape until it is first set: never a made-up 0 before.

    It takes its name in the registry at once, so a clash is found when the reporter is
    made, not at the first event.
    """

    def __init__(self, gauge: Gauge, registry: CollectorRegistry) -> None:
        self.gauge = gauge
        self.measured = False
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return self.gauge.describe()

    def collect(self) -> Iterable[Metric]:
        return self.gauge.collect() if self.measured else []

    def set(self, value: float) -> None:
        self.gauge.set(value)
        self.measured = True

    def inc(self, amount: float = 1) -> None:
        self.gauge.inc(amount)
        self.measured = True

    def dec(self, amount: float = 1) -> None:
        self.gauge.dec(amount)
        self.measured = True


class PrometheusReporter:
    """Serves a run's progress as Prometheus metrics (names below with the default namespace).

    Args:
        port: the TCP port to serve on; 0 picks a free one (see :attr:`port`).
        host: the address to bind; ``"0.0.0.0"`` lets other machines scrape it.
        registry: the registry to put the metrics in (and serve); a new one by default.
        namespace: the metric names' prefix.

    Counters: ``lamploop_steps_total`` and ``lamploop_examples_total`` advance with each
    ``ProgressSampled`` by what it adds to its epoch's ``steps_done``/``examples``, and at
    ``EpochFinished`` by what the samples missed of that epoch's ``steps``/``examples`` (so
    they then count exactly the steps and examples this process trained: a resumed epoch's
    steps before its checkpoint are not counted again); ``lamploop_epochs_total`` counts
    ``EpochFinished``, ``lamploop_checkpoints_total`` ``CheckpointWritten``.

    Gauges: ``lamploop_loss`` (the latest sampled training loss), ``lamploop_step_seconds``,
    ``lamploop_communication_seconds`` (per step) and ``lamploop_examples_per_second`` from
    ``ProgressSampled``; ``lamploop_epoch`` (the epoch in progress, from ``EpochStarted``,
    then the next one after ``EpochFinished``); ``lamploop_learning_rate_factor``;
    ``lamploop_validation_loss`` (raw, from ``ValidationFinished`` and ``EpochFinished``);
    ``lamploop_epoch_training_loss`` and ``lamploop_epoch_seconds`` (the last finished
    epoch); ``lamploop_metric{split="train"|"validation", name=...}`` (raw);
    ``lamploop_checkpoint_seconds`` (the last write); ``lamploop_ranks`` (the run's) and
    ``lamploop_peers_alive`` (1 at ``RunStarted``, one more per ``PeerJoined``, one less per
    ``PeerLost``); ``lamploop_seconds_since_checkpoint`` (computed when scraped: since the
    last checkpoint, else since ``RunStarted``);
    ``lamploop_run_state`` (see :data:`RUN_STATES`: 0 running, 1 finished, 2 stopped,
    3 failed).  A gauge is left out of the scrape until the event that measures it first
    comes (the loss until the first sample that saw a step, the validation loss until the
    first validation...): a value never measured is absent, not 0.  The counters are
    there from the start, at 0.

    A streamed run's ``IngestionSampled``, labelled by ``rank``: ``lamploop_ingest_samples``,
    ``lamploop_ingest_samples_per_second``, ``lamploop_ingest_bytes_per_second``,
    ``lamploop_ingest_put_seconds`` (the mean wait of a put), ``lamploop_buffer_fill``,
    ``lamploop_buffer_capacity``, ``lamploop_buffer_reads`` and ``lamploop_buffer_seen``
    (resident samples by their ``reads`` count).

    Raises:
        MissingDependencyError: prometheus_client is not installed.
        ConfigurationError: the port is out of range or cannot be bound.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        namespace: str = "lamploop",
    ) -> None:
        """Check the port and make every gauge and counter (absent until measured); serving starts
        at the first event or at :meth:`start`, not here."""
        require_extra("PrometheusReporter", "prometheus_client", "prometheus")
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            msg = f"PrometheusReporter: port must be an int in [0, 65535], got {port!r}"
            raise ConfigurationError(msg)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.namespace = namespace
        self.host = host

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, namespace=namespace, registry=self.registry)

        def gauge(name: str, documentation: str) -> _UntilSet:
            return _UntilSet(Gauge(name, documentation, namespace=namespace, registry=None), self.registry)

        def labelled(name: str, documentation: str, labels: tuple[str, ...]) -> Gauge:
            # Exported without samples until a labelled child is set.
            return Gauge(name, documentation, labels, namespace=namespace, registry=self.registry)

        self.steps = counter("steps", "Optimizer steps trained.")
        self.examples = counter("examples", "Examples trained on (every rank).")
        self.epochs = counter("epochs", "Epochs finished.")
        self.checkpoints = counter("checkpoints", "Checkpoints written.")
        self.loss = gauge("loss", "The latest sampled training loss (mean per example).")
        self.validation_loss = gauge("validation_loss", "The latest raw validation loss.")
        self.epoch_training_loss = gauge("epoch_training_loss", "The last finished epoch's training loss.")
        self.epoch_seconds = gauge("epoch_seconds", "The last finished epoch's wall-clock seconds.")
        self.metric = labelled("metric", "The last finished epoch's metrics (raw).", ("split", "name"))
        self.step_seconds = gauge("step_seconds", "Mean seconds per step over the latest sample.")
        self.communication_seconds = gauge(
            "communication_seconds", "Mean seconds per step the root waited on collectives."
        )
        self.examples_per_second = gauge("examples_per_second", "Examples per second (every rank).")
        self.epoch = gauge("epoch", "The epoch in progress (0-based).")
        self.learning_rate_factor = gauge("learning_rate_factor", "The learning-rate schedule's factor.")
        self.ranks = gauge("ranks", "The ranks of the run.")
        self.peers_alive = gauge("peers_alive", "Ranks alive: the root and the followers that joined.")
        self.checkpoint_seconds = gauge("checkpoint_seconds", "Seconds the last checkpoint took to write.")
        self.seconds_since_checkpoint = gauge(
            "seconds_since_checkpoint", "Seconds since the last checkpoint (or since the run started)."
        )
        self.run_state = gauge("run_state", "0 running, 1 finished, 2 stopped, 3 failed.")
        rank = ("rank",)
        self.ingest_samples = labelled("ingest_samples", "Streamed samples received in all.", rank)
        self.ingest_samples_per_second = labelled(
            "ingest_samples_per_second", "Streamed samples per second.", rank
        )
        self.ingest_bytes_per_second = labelled("ingest_bytes_per_second", "Streamed bytes per second.", rank)
        self.ingest_put_seconds = labelled("ingest_put_seconds", "Mean wait of a put into the buffer.", rank)
        self.buffer_fill = labelled("buffer_fill", "Samples the stream buffer holds.", rank)
        self.buffer_capacity = labelled("buffer_capacity", "The most samples the stream buffer holds.", rank)
        self.buffer_reads = labelled("buffer_reads", "Reads from the stream buffer in all.", rank)
        self.buffer_seen = labelled(
            "buffer_seen", "Resident samples by how many times they were read.", (*rank, "reads")
        )

        self._port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        """The port the server listens on, once started (the one picked when ``port`` was 0)."""
        self._since = time.monotonic()  # the last checkpoint, or the run's start
        self.seconds_since_checkpoint.gauge.set_function(lambda: time.monotonic() - self._since)
        # Per epoch: where its counting starts, and what was counted of it.
        self._counted_epoch: int | None = None
        self._last_steps_done = 0
        self._last_examples = 0
        self._epoch_steps = 0
        self._epoch_examples = 0

    def start(self) -> None:
        """Start serving (the first event does it; calling it again does nothing).

        Raises:
            ConfigurationError: the port cannot be bound.
        """
        if self.port is not None:
            return
        import prometheus_client

        try:
            served = prometheus_client.start_http_server(self._port, addr=self.host, registry=self.registry)
        except OSError as exc:
            msg = f"PrometheusReporter: cannot serve on {self.host}:{self._port}: {exc}"
            raise ConfigurationError(msg) from exc
        if not isinstance(served, tuple):  # prometheus_client < 0.17 gives no handle to stop it
            msg = 'PrometheusReporter needs prometheus_client >= 0.17: pip install "lamploop[prometheus]"'
            raise MissingDependencyError(msg)
        self._server, self._thread = served
        self.port = self._server.server_port

    @property
    def url(self) -> str:
        """``http://host:port/metrics``, once started (also after :meth:`close`: where it served).

        Raises:
            ConfigurationError: the reporter has not started yet: its port is bound at the
                first event or by :meth:`start` (with ``port=0`` there is no port before).
        """
        if self.port is None:
            port = "a free port" if self._port == 0 else f"port {self._port}"
            msg = (
                f"PrometheusReporter.url: the reporter has not started yet, so it serves nowhere "
                f"({port} on {self.host} is bound at the run's first event, or by start())"
            )
            raise ConfigurationError(msg)
        return f"http://{self._address(self.port)}/metrics"

    def _address(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"

    def _start_epoch(self, epoch: int, steps_done: int = 0, examples_done: int = 0) -> None:
        # A resumed epoch: what it did before the checkpoint counted in an earlier process.
        self._counted_epoch = epoch
        self._last_steps_done, self._last_examples = steps_done, examples_done
        self._epoch_steps, self._epoch_examples = steps_done, examples_done

    def _count(self, steps: int, examples: int) -> None:
        if steps > 0:
            self.steps.inc(steps)
            self._epoch_steps += steps
        if examples > 0:
            self.examples.inc(examples)
            self._epoch_examples += examples

    def report(self, event: Event) -> None:
        """Update the metrics from ``event`` (see the class docstring); serve from the first on."""
        self.start()
        if isinstance(event, ProgressSampled):
            if event.epoch != self._counted_epoch:  # no EpochStarted seen for it
                self._start_epoch(event.epoch)
            self._count(event.steps_done - self._last_steps_done, event.examples - self._last_examples)
            self._last_steps_done = max(self._last_steps_done, event.steps_done)
            self._last_examples = max(self._last_examples, event.examples)
            if event.loss is not None:
                self.loss.set(event.loss)
            if event.steps > 0:
                self.step_seconds.set(event.seconds_per_step)
                self.communication_seconds.set(event.communication_seconds_per_step)
            self.examples_per_second.set(event.examples_per_second)
        elif isinstance(event, EpochStarted):
            self._start_epoch(event.epoch, event.steps_done, event.examples_done)
            self.epoch.set(event.epoch)
            self.learning_rate_factor.set(event.learning_rate_factor)
        elif isinstance(event, EpochFinished):
            self._epoch_finished(event)
        elif isinstance(event, ValidationFinished):
            self.validation_loss.set(event.loss)
        elif isinstance(event, CheckpointWritten):
            self.checkpoints.inc()
            self.checkpoint_seconds.set(event.seconds)
            self._since = time.monotonic()
            self.seconds_since_checkpoint.measured = True
        elif isinstance(event, RunStarted):
            self._since = time.monotonic()
            self.seconds_since_checkpoint.measured = True
            self.ranks.set(event.nranks)
            self.peers_alive.set(1)
            self.epoch.set(event.epoch)
            self.run_state.set(RUN_STATES["running"])
        elif isinstance(event, PeerJoined):
            self.peers_alive.inc()
        elif isinstance(event, PeerLost):
            self.peers_alive.dec()
        elif isinstance(event, RunFinished):
            self.run_state.set(RUN_STATES["finished"])
        elif isinstance(event, RunStopped):
            self.run_state.set(RUN_STATES["stopped"])
        elif isinstance(event, RunFailed):
            self.run_state.set(RUN_STATES["failed"])
        elif isinstance(event, IngestionSampled):
            self._ingested(event)

    def _ingested(self, event: IngestionSampled) -> None:
        rank = str(event.rank)
        self.ingest_samples.labels(rank=rank).set(event.samples)
        self.ingest_samples_per_second.labels(rank=rank).set(event.samples_per_second)
        self.ingest_bytes_per_second.labels(rank=rank).set(event.bytes_per_second)
        self.ingest_put_seconds.labels(rank=rank).set(event.put_seconds_mean)
        self.buffer_fill.labels(rank=rank).set(event.fill)
        self.buffer_capacity.labels(rank=rank).set(event.capacity)
        self.buffer_reads.labels(rank=rank).set(event.reads)
        for reads, count in event.seen_histogram.items():
            self.buffer_seen.labels(rank=rank, reads=str(reads)).set(count)

    def _epoch_finished(self, event: EpochFinished) -> None:
        entry = event.state.learning_curve[-1]
        if entry.epoch != self._counted_epoch:
            self._start_epoch(entry.epoch)
        # What the samples did not see of the epoch (its last steps, usually).
        self._count(event.steps - self._epoch_steps, event.examples - self._epoch_examples)
        self._counted_epoch = None  # a sample of this epoch after it finished would count afresh
        self.epochs.inc()
        self.epoch.set(event.state.epoch)
        self.epoch_training_loss.set(entry.training_loss)
        self.epoch_seconds.set(event.seconds)
        if entry.validation_loss is not None:
            self.validation_loss.set(entry.validation_loss[1])
        for name, value in entry.training_metrics.items():
            self.metric.labels(split="train", name=name).set(value)
        for name, (_, raw) in entry.validation_metrics.items():
            self.metric.labels(split="validation", name=name).set(raw)
        if entry.learning_rate_factor is not None:
            self.learning_rate_factor.set(entry.learning_rate_factor)

    def close(self) -> None:
        """Stop serving and free the port (calling it again does nothing)."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __repr__(self) -> str:
        if self.port is None:
            return f"PrometheusReporter({self._address(self._port)!r}, not started)"
        return f"PrometheusReporter({self.url!r})"
