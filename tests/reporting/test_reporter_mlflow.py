"""MlflowReporter against a real MLflow tracking server, read back with MlflowClient.

One ``mlflow server`` (sqlite backend, a local artifact root) per module: it takes from
about 15 s to two minutes to start on the loaded 2-core machine, so the wait is bounded
at SERVER_START_S and the module's tests get a timeout that covers it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import free_port

import lamploop
from lamploop.checkpoint import load_checkpoint
from lamploop.errors import ConfigurationError
from lamploop.metrics import accuracy
from lamploop.reporting import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    Event,
    MlflowReporter,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
)
from lamploop.state import LearningCurveEntry, LoopState

pytest.importorskip("mlflow")

SERVER_START_S = 300.0
pytestmark = pytest.mark.timeout(SERVER_START_S + 120)

T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of an ``mlflow server`` started for this module (killed, with its children, after)."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--default-artifact-root", str(root / "artifacts")]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner process
    log = (root / "server.log").open("wb")
    # A session of its own: the server's uvicorn child goes with it when the group is killed.
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else "not up in time"
                tail = (root / "server.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"mlflow server {why} ({SERVER_START_S:g} s at most):\n{tail}")
            time.sleep(0.5)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def report(self, event: Event) -> None:
        self.events.append(event)


def history(client: object, run_id: str, key: str) -> list[tuple[int, float]]:
    metrics = client.get_metric_history(run_id, key)  # type: ignore[attr-defined]
    return sorted((m.step, m.value) for m in metrics)


def test_a_fit_run_read_back_from_the_server(server: str, tmp_path: Path) -> None:
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=generator), torch.randint(0, 2, (256,), generator=generator)
    reporter = MlflowReporter(
        server, experiment_name="lamploop-fit", run_name="fit", params={"lr": 0.1, "batch_size": 32}
    )
    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(
            torch.nn.Linear(8, 2), lamploop.cross_entropy_loss, metrics={"accuracy": accuracy}
        ),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x[:192], y[:192], batch_size=32),  # 6 steps an epoch
        validation_batches=lamploop.tensor_batches(x[192:], y[192:], batch_size=64, shuffle=False),
        max_epochs=3,
        checkpoint_dir=tmp_path / "checkpoints",
        reporters=[reporter, recorder],
    )
    assert state is not None
    curve = state.learning_curve
    assert reporter.run_id is not None
    client = MlflowClient(server)
    run = client.get_run(reporter.run_id)

    assert run.info.status == "FINISHED"
    assert run.info.run_name == "fit"
    assert client.get_experiment(run.info.experiment_id).name == "lamploop-fit"
    assert run.data.params == {"lr": "0.1", "batch_size": "32", "nranks": "1", "max_epochs": "3"}
    assert run.data.tags["lamploop.start_epoch"] == "0"

    # Per epoch, at step = epoch: the learning curve, exactly.
    assert history(client, run.info.run_id, "train/loss") == [(e.epoch, e.training_loss) for e in curve]
    assert all(e.validation_loss is not None for e in curve)
    raw = [(e.epoch, e.validation_loss[1]) for e in curve if e.validation_loss is not None]
    smoothed = [(e.epoch, e.validation_loss[0]) for e in curve if e.validation_loss is not None]
    assert history(client, run.info.run_id, "validation/loss") == raw
    assert history(client, run.info.run_id, "validation/loss_smoothed") == smoothed
    train_accuracy = [(e.epoch, e.training_metrics["accuracy"]) for e in curve]
    assert history(client, run.info.run_id, "train/accuracy") == train_accuracy
    validation_accuracy = [(e.epoch, e.validation_metrics["accuracy"][1]) for e in curve]
    assert history(client, run.info.run_id, "validation/accuracy") == validation_accuracy
    assert len(history(client, run.info.run_id, "perf/epoch_seconds")) == 3

    # Per step, at step = the global step: every sample the run made.
    samples = [e for e in recorder.events if isinstance(e, ProgressSampled)]
    assert len(samples) >= 3  # every epoch's first step at least
    sampled = [(s.total_steps, s.loss) for s in samples if s.loss is not None]
    assert history(client, run.info.run_id, "train/loss_sampled") == sorted(sampled)
    speeds = [(s.total_steps, s.examples_per_second) for s in samples]
    assert history(client, run.info.run_id, "perf/examples_per_second") == sorted(speeds)
    # Where each epoch ended on the global step axis; the end-of-epoch checkpoints there.
    assert history(client, run.info.run_id, "epoch") == [(6, 0.0), (12, 1.0), (18, 2.0)]
    assert [step for step, _ in history(client, run.info.run_id, "checkpoint/seconds")] == [6, 12, 18]

    # The last checkpoint, uploaded when the run ended, byte for byte.
    (last,) = client.list_artifacts(run.info.run_id, "checkpoints")
    assert last.path == "checkpoints/epoch-000003"
    assert last.is_dir
    local = tmp_path / "checkpoints" / "epoch-000003"
    downloaded = Path(
        download_artifacts(
            run_id=run.info.run_id,
            artifact_path="checkpoints",
            dst_path=str(tmp_path / "down"),
            tracking_uri=server,
        )
    )
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert files  # a checkpoint has files
    assert (
        sorted(p.relative_to(downloaded / "epoch-000003") for p in downloaded.rglob("*") if p.is_file())
        == files
    )
    for name in files:
        assert (downloaded / "epoch-000003" / name).read_bytes() == (local / name).read_bytes()
    loaded = load_checkpoint(downloaded)  # the checkpoints directory, as a run's checkpoint_dir
    assert loaded.state.loop_state.learning_curve == curve


def epoch_events(epoch: int, loss: float, *, start: float) -> list[Event]:
    entry = LearningCurveEntry(epoch, loss, validation_loss=(loss + 0.1, loss + 0.2))
    return [
        EpochStarted(epoch=epoch, learning_rate_factor=1.0, time=start),
        ProgressSampled(
            epoch, 4, 128, loss, 4, 0.1, 0.0, 320.0, total_steps=4, total_examples=128, time=start
        ),
        EpochFinished(
            LoopState(epoch=epoch + 1, learning_curve=[entry]), steps=4, examples=128, time=start + 1
        ),
    ]


def test_stopped_failed_and_unfinished_runs_and_a_run_gone_on_with(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server)
    ends: dict[str, Event | None] = {
        "stopped": RunStopped("SIGTERM", "stopped after step 4 of epoch 1", time=T0 + 5),
        "failed": RunFailed("PeerLostError: rank 1 died", time=T0 + 5),
        "unfinished": None,  # closed with no end heard
    }
    runs = {}
    for name, end in ends.items():
        reporter = MlflowReporter(server, experiment_name="lamploop-ends", run_name=name)
        events = [RunStarted(nranks=2, epoch=0, max_epochs=2, time=T0), *epoch_events(0, 0.5, start=T0)]
        for event in [*events, end] if end is not None else events:
            reporter.report(event)  # no start(): the first event starts it
        reporter.close()
        reporter.close()
        assert reporter.run_id is not None
        runs[name] = client.get_run(reporter.run_id)
    assert runs["stopped"].info.status == "KILLED"
    assert runs["stopped"].data.tags["lamploop.stop_reason"] == "SIGTERM"
    assert runs["failed"].info.status == "FAILED"
    assert runs["failed"].data.tags["lamploop.error"] == "PeerLostError: rank 1 died"
    assert runs["unfinished"].info.status == "FAILED"
    assert "closed before the run ended" in runs["unfinished"].data.tags["lamploop.error"]
    for run in runs.values():
        assert history(client, run.info.run_id, "train/loss") == [(0, 0.5)]
        assert history(client, run.info.run_id, "train/loss_sampled") == [(4, 0.5)]

    # A resumed training goes on with the stopped run: status, parameters, the curve's next epoch.
    stopped = runs["stopped"].info.run_id
    again = MlflowReporter(server, run_id=stopped)
    again.start()
    assert client.get_run(stopped).info.status == "RUNNING"
    with caplog.at_level(logging.WARNING, logger="lamploop"):
        again.report(RunStarted(nranks=2, epoch=1, max_epochs=3, time=T0 + 10))
    assert "keeps its parameter max_epochs='2'" in caplog.text
    for event in epoch_events(1, 0.25, start=T0 + 10):
        again.report(event)
    state = LoopState(epoch=2, learning_curve=[LearningCurveEntry(0, 0.5), LearningCurveEntry(1, 0.25)])
    again.report(RunFinished(state, time=T0 + 12))
    again.close()
    run = client.get_run(stopped)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"nranks": "2", "max_epochs": "2"}
    assert run.data.tags["lamploop.start_epoch"] == "1"
    assert history(client, stopped, "train/loss") == [(0, 0.5), (1, 0.25)]


def test_an_unreachable_server_stops_fit_before_it_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    recorder = Recorder()
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    with pytest.raises(ConfigurationError, match=f"MlflowReporter: cannot start a run at {url}"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=16),
            max_epochs=1,
            reporters=[MlflowReporter(url), recorder],
        )
    assert not [e for e in recorder.events if isinstance(e, (EpochStarted, CheckpointWritten))]


def test_close_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="close_timeout"):
        MlflowReporter(close_timeout=0)
