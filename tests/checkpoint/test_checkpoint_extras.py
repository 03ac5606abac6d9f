"""Checkpoint extras: named state beside the model, saved with every checkpoint, restored on resume."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lamploop
from lamploop.batches import BatchContext
from lamploop.checkpoint import (
    Checkpointer,
    checkpoint_name,
    extra_file,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lamploop.errors import CheckpointError, ConfigurationError, TrainingInterrupted
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.streaming import FifoBuffer, Sample, StreamState


class Counter:
    """A checkpoint extra: counts the batches trained on."""

    def __init__(self) -> None:
        self.batches = 0
        self.loaded: list[int] = []

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"batches": torch.tensor([self.batches])}, {"batches": self.batches, "note": ["plain", None]}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        assert int(tensors["batches"]) == meta["batches"]
        self.batches = meta["batches"]
        self.loaded.append(self.batches)


def _state() -> LoopStateWithModelAndOptimizerData:
    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return LoopStateWithModelAndOptimizerData(
        loop_state=LoopState(epoch=1),
        model=module.state_dict(),
        optimizer=optimizer.state_dict(),
        best_model={},
    )


def test_an_extra_round_trips_with_its_sha256_listed(tmp_path: Path) -> None:
    counter = Counter()
    counter.batches = 7
    path = save_checkpoint(tmp_path, _state(), extras={"counter": counter.state_dict()})
    descriptor = json.loads((path / "checkpoint.json").read_text())
    assert descriptor["extras"] == {"counter": {"batches": 7, "note": ["plain", None]}}
    assert extra_file("counter") in descriptor["files"]
    tensors, meta = load_checkpoint(path).extras["counter"]
    assert meta == {"batches": 7, "note": ["plain", None]}
    assert torch.equal(tensors["batches"], torch.tensor([7]))
    data = bytearray((path / extra_file("counter")).read_bytes())
    data[-1] ^= 1
    (path / extra_file("counter")).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"extra-counter\.safetensors: sha256 mismatch"):
        load_checkpoint(path)


def test_without_extras_the_descriptor_is_as_before(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, _state())
    assert "extras" not in json.loads((path / "checkpoint.json").read_text())
    assert load_checkpoint(path).extras == {}


def test_the_checkpointer_takes_the_extras_state_at_the_call(tmp_path: Path) -> None:
    counter = Counter()
    checkpointer = Checkpointer(tmp_path, extras={"counter": counter})

    async def save() -> None:
        counter.batches = 3
        await checkpointer(_state(), None)
        counter.batches = 4

    anyio.run(save)
    assert load_checkpoint(tmp_path).extras["counter"][1]["batches"] == 3


@pytest.mark.parametrize(
    ("extras", "match"),
    [
        ({"../x": Counter()}, "is not 1 to 100 of"),
        ({"counter": object()}, "has no state_dict"),
    ],
)
def test_unfit_extras_are_refused(tmp_path: Path, extras: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Checkpointer(tmp_path, extras=extras)


# --- fit ---------------------------------------------------------------------------------------


def _batches(counter: Counter, stop_at: tuple[int, int] | None = None) -> lamploop.BatchStreamFactory:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, generator=generator)
    y = x.sum(dim=1, keepdim=True)

    def factory(context: BatchContext) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            for i in range(4):
                if stop_at == (context.epoch, i):
                    os.kill(os.getpid(), signal.SIGTERM)  # a stop inside this epoch, after step i
                counter.batches += 1
                yield x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]

        return stream()

    return factory


def _fit(directory: Path | None, counter: Counter, max_epochs: int, **options: Any) -> lamploop.LoopState:
    torch.manual_seed(0)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(2, 1), lamploop.mse_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
        train_batches=options.pop("train_batches", _batches(counter)),
        max_epochs=max_epochs,
        checkpoint_dir=directory,
        checkpoint_extras={"counter": counter},
        reporters=[],
        world_size=1,
        **options,
    )
    assert state is not None
    return state


def test_fit_saves_extras_with_every_checkpoint_and_restores_them_on_resume(tmp_path: Path) -> None:
    first = Counter()
    _fit(tmp_path, first, 2)
    assert load_checkpoint(tmp_path).extras["counter"][1]["batches"] == 8
    second = Counter()
    state = _fit(tmp_path, second, 3)
    assert second.loaded == [8]
    assert second.batches == 12
    assert state.epoch == 3


def test_fit_refuses_to_resume_without_the_extras_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(2, 1), lamploop.mse_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
        train_batches=_batches(Counter()),
        max_epochs=1,
        checkpoint_dir=tmp_path,
        reporters=[],
        world_size=1,
    )
    with pytest.raises(CheckpointError, match=r"has no state for the checkpoint extras \['counter'\]"):
        _fit(tmp_path, Counter(), 2)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"checkpoint_every_n_steps": 2},
            "checkpoint_every_n_steps cannot be combined with checkpoint_extras",
        ),
        (
            {"checkpoint_every_seconds": 1.0},
            "checkpoint_every_seconds cannot be combined with checkpoint_extras",
        ),
    ],
)
def test_fit_refuses_step_checkpoints_with_extras(tmp_path: Path, options: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _fit(tmp_path, Counter(), 1, **options)


def test_fit_refuses_extras_without_a_checkpoint_dir() -> None:
    with pytest.raises(ConfigurationError, match="but checkpoint_dir is None"):
        _fit(None, Counter(), 1)


def test_a_stop_inside_an_epoch_writes_no_checkpoint_and_the_run_resumes_at_its_start(
    tmp_path: Path,
) -> None:
    first = Counter()
    with pytest.raises(TrainingInterrupted, match="no checkpoint was written there") as stopped:
        _fit(tmp_path, first, 6, train_batches=_batches(first, stop_at=(1, 1)))
    epoch = stopped.value.epoch
    assert stopped.value.steps_done > 0  # inside the epoch
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    assert latest.name == checkpoint_name(epoch)  # its start: the stop inside it wrote none
    second = Counter()
    state = _fit(tmp_path, second, epoch + 1)
    assert second.loaded == [4 * epoch]  # the count at the epoch's start: it is done again in full
    assert second.batches == 4 * (epoch + 1)
    assert state.epoch == epoch + 1


# --- StreamState -------------------------------------------------------------------------------


def _sample(seq: int) -> Sample:
    return Sample("sim", seq, {"x": torch.full((2,), float(seq)), "y": torch.zeros(1)})


def test_stream_state_restores_the_buffer_and_returns_its_acknowledged_positions(tmp_path: Path) -> None:
    async def main() -> None:
        buffer = FifoBuffer(capacity=8, watermark=1, seed=0)
        for seq in range(5):
            await buffer.put(_sample(seq))
        await buffer.get_batch(2)
        save_checkpoint(tmp_path, _state(), extras={"stream": StreamState(buffer).state_dict()})

        assert StreamState(FifoBuffer(capacity=8, watermark=1, seed=0)).restore(tmp_path / "none") == {}
        restored = FifoBuffer(capacity=8, watermark=1, seed=0)
        stream = StreamState(restored)
        assert stream.restore(tmp_path) == {"sim": 4}
        assert restored.fill == 3
        tensors, meta = load_checkpoint(tmp_path).extras["stream"]
        await restored.put(_sample(5))
        stream.load_state_dict(tensors, meta)  # fit's restore of the same state: left alone
        assert restored.fill == 4

        late = FifoBuffer(capacity=8, watermark=1, seed=0)
        await late.put(_sample(0))  # the receiver was opened before the restore
        with pytest.raises(CheckpointError, match=r"Call StreamState\.restore"):
            StreamState(late).load_state_dict(tensors, meta)

    anyio.run(main)


def test_inspect_checks_the_extras_files(tmp_path: Path) -> None:
    from lamploop.inspection import inspect_checkpoint

    path = save_checkpoint(tmp_path, _state(), extras={"counter": Counter().state_dict()})
    report = inspect_checkpoint(path)
    assert any(f.name == extra_file("counter") and f.ok for f in report.files)
    (path / extra_file("counter")).unlink()
    report = inspect_checkpoint(path)
    assert any(f.name == extra_file("counter") and not f.ok for f in report.files)
