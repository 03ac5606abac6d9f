"""WandbReporter in offline mode, read back from the run's own ``.wandb`` file.

The installed wandb has no reader of its run files any more (``wandb.sdk.internal.datastore``
is gone since the Go core writes them), so :func:`records` reads the format itself: the
LevelDB log format (32 KiB blocks of CRC-checked chunks) behind wandb's 7-byte header,
each record a ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lamploop
from lamploop.metrics import accuracy
from lamploop.reporting import Event, ProgressSampled, RunStarted, RunStopped, WandbReporter

pytest.importorskip("wandb")

_BLOCK = 32 * 1024
_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, in order (each chunk's CRC checked)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(_HEADER)] == _HEADER, data[:8]
    position, pending = len(_HEADER), b""
    while True:
        left = _BLOCK - position % _BLOCK
        if left < 7:  # too little room for a chunk header: the block's padding
            position += left
            continue
        if position + 7 > len(data):
            break
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        if kind == 0 and length == 0:  # zeros to the end of the block
            position += left
            continue
        if position + 7 + length > len(data):  # a chunk still being written
            break
        chunk = data[position + 7 : position + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, position
        position += 7 + length
        if kind == _FULL:
            yield wandb_internal_pb2.Record.FromString(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        else:
            assert kind == _LAST, kind
            yield wandb_internal_pb2.Record.FromString(pending + chunk)


class OfflineRun:
    """What an offline run's file says: config, history rows, metric axes, exit code."""

    def __init__(self, path: Path) -> None:
        self.config: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.step_metrics: dict[str, str] = {}
        self.exit_code: int | None = None
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind in ("run", "config"):
                config = record.run.config if kind == "run" else record.config
                for item in config.update:
                    key = "/".join(item.nested_key) if item.nested_key else item.key
                    self.config[key] = json.loads(item.value_json)
            elif kind == "history":
                row = {}
                for item in record.history.item:
                    key = "/".join(item.nested_key) if item.nested_key else item.key
                    row[key] = json.loads(item.value_json)
                self.rows.append(row)
            elif kind == "metric" and record.metric.step_metric:
                self.step_metrics[record.metric.name] = record.metric.step_metric
            elif kind == "exit":
                self.exit_code = record.exit.exit_code

    def series(self, x: str, y: str) -> list[tuple[Any, Any]]:
        return [(row[x], row[y]) for row in self.rows if y in row]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Offline mode, every wandb directory under tmp_path; the wandb service stopped after."""
    import wandb

    # A wandb set up earlier in this process (another module's test on the same worker) keeps
    # the settings it read then: start from none, so that this environment is the one read.
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout alone
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    yield tmp_path / "runs"
    wandb.teardown()


def finished_run(directory: Path, timeout: float = 60.0) -> OfflineRun:
    """The offline run under ``directory``, read once its exit record is on disk.

    ``run.finish()`` returns when the wandb service has the exit record; its writer puts it
    in the file a moment later (50 ms here), so the wait is bounded, not skipped.
    """
    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    while (run := OfflineRun(path)).exit_code is None:
        assert time.monotonic() < deadline, f"{path}: no exit record within {timeout:g} s"
        time.sleep(0.05)
    return run


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def report(self, event: Event) -> None:
        self.events.append(event)


def test_a_fit_run_read_back_from_its_offline_files(offline: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=generator), torch.randint(0, 2, (256,), generator=generator)
    reporter = WandbReporter(project="lamploop-test", dir=offline, config={"lr": 0.1}, tags=["test"])
    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(
            torch.nn.Linear(8, 2), lamploop.cross_entropy_loss, metrics={"accuracy": accuracy}
        ),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x[:192], y[:192], batch_size=32),  # 6 steps an epoch
        validation_batches=lamploop.tensor_batches(x[192:], y[192:], batch_size=64, shuffle=False),
        max_epochs=3,
        reporters=[reporter, recorder],
    )
    assert state is not None
    assert reporter.run is not None
    assert reporter.run.settings.mode == "offline"
    run = finished_run(offline)

    assert run.exit_code == 0
    assert {k: run.config[k] for k in ("lr", "nranks", "max_epochs", "start_epoch")} == {
        "lr": 0.1,
        "nranks": 1,
        "max_epochs": 3,
        "start_epoch": 0,
    }
    # One row per epoch against "epoch": the learning curve, exactly.
    curve = state.learning_curve
    assert run.series("epoch", "train/loss") == [(e.epoch, e.training_loss) for e in curve]
    validated = [(e.epoch, e.validation_loss) for e in curve if e.validation_loss is not None]
    assert len(validated) == 3
    assert run.series("epoch", "validation/loss") == [(epoch, raw) for epoch, (_, raw) in validated]
    assert run.series("epoch", "validation/loss_smoothed") == [(epoch, s) for epoch, (s, _) in validated]
    assert run.series("epoch", "train/accuracy") == [(e.epoch, e.training_metrics["accuracy"]) for e in curve]
    assert run.series("epoch", "validation/accuracy") == [
        (e.epoch, e.validation_metrics["accuracy"][1]) for e in curve
    ]
    assert run.series("global_step", "train/loss") == [
        (6, curve[0].training_loss),
        (12, curve[1].training_loss),
        (18, curve[2].training_loss),
    ]
    # One row per sample against "global_step": every sample the run made.
    samples = [e for e in recorder.events if isinstance(e, ProgressSampled)]
    assert len(samples) >= 3  # every epoch's first step at least
    assert run.series("global_step", "train/loss_sampled") == [
        (s.total_steps, s.loss) for s in samples if s.loss is not None
    ]
    assert run.series("epoch", "perf/examples_per_second") == [
        (s.epoch, s.examples_per_second) for s in samples
    ]
    # The axes are declared: a chart of each metric is drawn against its own.
    assert run.step_metrics["train/loss"] == "epoch"
    assert run.step_metrics["validation/loss"] == "epoch"
    assert run.step_metrics["train/loss_sampled"] == "global_step"
    assert run.step_metrics["perf/examples_per_second"] == "global_step"


def test_a_stopped_run_exits_143_and_an_unfinished_one_1(offline: Path) -> None:
    stopped = WandbReporter(project="lamploop-test", mode="offline", dir=offline / "stopped")
    stopped.start()
    stopped.report(RunStarted(nranks=1, epoch=0, max_epochs=2))
    stopped.report(RunStopped("SIGTERM", "stopped after step 3 of epoch 0"))
    stopped.report(RunStarted(nranks=1, epoch=0, max_epochs=2))  # after the end: nothing
    stopped.close()
    assert finished_run(offline / "stopped").exit_code == 143

    unfinished = WandbReporter(project="lamploop-test", mode="offline", dir=offline / "unfinished")
    unfinished.report(RunStarted(nranks=1, epoch=0, max_epochs=2))  # no start(): the first event starts it
    unfinished.close()
    unfinished.close()
    run = finished_run(offline / "unfinished")
    assert run.exit_code == 1
    assert run.config["max_epochs"] == 2
