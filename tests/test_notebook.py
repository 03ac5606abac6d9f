"""``fit`` inside a running event loop, as in a Jupyter cell.

Jupyter runs each cell inside its asyncio event loop, where ``anyio.run`` fails with
"Already running asyncio in this thread".  These tests call the blocking ``fit`` from inside
a running loop (a plain ``asyncio`` loop, as a kernel has, with Python's own SIGINT handler
that raises ``KeyboardInterrupt``): on one rank, on two ranks with a launch command, without
one (a clear error), and with Ctrl-C (a stop at the next step boundary, with a checkpoint).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
import torch
from fit_reference import single_process_fit
from workers import rank as worker

import lamploop
from lamploop.checkpoint import load_checkpoint
from lamploop.errors import ConfigurationError, TrainingInterrupted

T = TypeVar("T")


def in_a_running_loop(call: Callable[[], T]) -> T:
    """``call()`` from inside a coroutine on a running asyncio loop, as a notebook cell runs."""

    async def cell() -> T:
        asyncio.get_running_loop()  # we are inside the loop
        return call()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(cell())
    finally:
        loop.close()


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LAMPLOOP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_launcher")
def test_fit_on_one_rank_inside_a_running_loop_equals_fit_outside() -> None:
    def run() -> tuple[lamploop.LoopState | None, dict[str, torch.Tensor]]:
        kwargs = worker.fit_kwargs(0, 16)
        return lamploop.fit(**kwargs), kwargs["model"].module.state_dict()

    inside, inside_params = in_a_running_loop(run)
    outside, outside_params = run()
    assert inside is not None
    assert outside is not None
    assert inside.learning_curve == outside.learning_curve
    for name, value in outside_params.items():
        assert torch.equal(inside_params[name], value), name


@pytest.mark.timeout(200)
@pytest.mark.usefixtures("no_launcher")
def test_fit_on_two_ranks_inside_a_running_loop(tmp_path: Path) -> None:
    command = [sys.executable, str(worker.WORKER_SCRIPT), "fit", str(tmp_path), "spawn"]
    kwargs = worker.fit_kwargs(0, worker.FIT_BATCH)
    state = in_a_running_loop(
        lambda: lamploop.fit(**kwargs, world_size=2, launch_command=command, strategy="reduce_to_root")
    )
    assert state is not None
    expected, expected_params = single_process_fit()
    assert state.epoch == expected.epoch == worker.FIT_EPOCHS
    for got, want in zip(state.learning_curve, expected.learning_curve, strict=True):
        assert got.training_loss == pytest.approx(want.training_loss, abs=1e-9, rel=0)
    for name, value in expected_params.items():
        torch.testing.assert_close(kwargs["model"].module.state_dict()[name], value, atol=1e-6, rtol=0)
    assert json.loads((tmp_path / "follower-1.json").read_text())["rank"] == 1


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("no_launcher")
def test_two_ranks_from_a_notebook_without_a_launch_command_say_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = "/usr/lib/python3/site-packages/ipykernel_launcher.py"
    monkeypatch.setattr(sys, "argv", [kernel, "-f", "/tmp/kernel-1.json"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "ipykernel_launcher", "-f", "k.json"])
    with pytest.raises(ConfigurationError) as info:
        in_a_running_loop(lambda: lamploop.fit(**worker.fit_kwargs(0, 8), world_size=2))
    text = str(info.value)
    assert "this is a notebook kernel" in text
    assert "launch_command=[sys.executable, 'train.py']" in text


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_launcher")
def test_ctrl_c_in_a_notebook_stops_at_a_step_boundary_with_a_checkpoint(tmp_path: Path) -> None:
    (x, y), _ = worker.fit_data()
    steps: list[int] = []
    started = threading.Event()

    def interrupt_after_some_steps() -> None:
        started.wait(30)
        # Ctrl-C in Jupyter: a real SIGINT, which Python turns into KeyboardInterrupt in the main thread
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def model() -> lamploop.SupervisedModel:
        module = worker.make_module({"seed": 5}, 0)

        def count(*_: object) -> None:
            steps.append(1)
            if len(steps) == 3:
                started.set()

        module.register_forward_hook(count)
        return lamploop.SupervisedModel(module)

    kwargs: dict[str, Any] = {
        "model": model(),
        "optimizer_factory": worker.optimizer_factory({"name": "sgd", "lr": 0.05}),
        "train_batches": worker.iterable_batches_sleeping(lamploop.tensor_batches(x, y, batch_size=4), 0.05),
        "max_epochs": 50,
        "checkpoint_dir": tmp_path,
    }
    interrupter = threading.Thread(target=interrupt_after_some_steps)
    interrupter.start()
    try:
        with pytest.raises(TrainingInterrupted) as info:
            in_a_running_loop(lambda: lamploop.fit(**kwargs))
    finally:
        interrupter.join(30)
    assert info.value.reason == "SIGINT"
    assert info.value.epoch == 0
    assert 3 <= info.value.steps_done < 24
    saved = load_checkpoint(tmp_path)
    assert saved.position is not None
    assert saved.position.steps_done == info.value.steps_done


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_launcher")
def test_a_second_ctrl_c_in_a_notebook_stops_at_once() -> None:
    (x, y), _ = worker.fit_data()
    started = threading.Event()
    began: list[float] = []  # when the stream began to wait
    first_batches = lamploop.tensor_batches(x, y, batch_size=4)

    def slow_start(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            began.append(time.monotonic())
            started.set()
            await anyio.sleep(40)  # no step boundary comes before both interrupts
            async for batch in first_batches(context):
                yield batch

        return stream()

    def interrupt_twice() -> None:
        started.wait(30)
        main = threading.main_thread().ident or 0
        signal.pthread_kill(main, signal.SIGINT)  # after the step in progress...
        # Not merged with the first while it is pending, and before the first ends the stream's
        # wait by itself (lamploop.loop.stop_aware.OWN_STREAM_GRACE_S, 1 s after it).
        time.sleep(0.3)
        signal.pthread_kill(main, signal.SIGINT)  # ...no: at once

    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(worker.make_module({"seed": 5}, 0)),
        "optimizer_factory": worker.optimizer_factory({"name": "sgd", "lr": 0.05}),
        "train_batches": slow_start,
        "max_epochs": 5,
    }
    interrupter = threading.Thread(target=interrupt_twice)
    interrupter.start()
    try:
        with pytest.raises(TrainingInterrupted, match="stopped at once by a second SIGINT"):
            in_a_running_loop(lambda: lamploop.fit(**kwargs))
    finally:
        interrupter.join(30)
    assert time.monotonic() - began[0] < 25  # the 40 s wait before the first batch was cut short
