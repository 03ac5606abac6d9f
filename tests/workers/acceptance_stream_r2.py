"""Processes for tests/streaming/test_acceptance_docs_streaming_r2.py (docs/streaming.md).

``python acceptance_stream_r2.py JOB_FILE``: the process imports torch and lamploop (seconds
on the 2-core machine), prints ``LOADED``, then waits (at most 600 s) for JOB_FILE, a JSON
``{"mode": ..., "args": [...]}`` that the test writes once it needs the process, so that
the imports overlap the tests that run before.  Modes:

``sigterm CKPT_DIR TOKEN``
    A trainer (``fit_async``) over a FIFO buffer holding 3 samples (fewer than a batch of 8)
    whose receiver waits for a producer that never comes.  Prints ``WAITING`` when the first
    epoch's batch stream is made; on ``TrainingInterrupted`` prints ``INTERRUPTED {json}``.

``hold CAPACITY TOKEN``
    A receiver into a FIFO buffer that nobody reads.  Prints ``PORT <port>`` and waits.

``bproducer PORT TOKEN RECONNECT_TIMEOUT``
    A ``BlockingProducer`` (``resend_window=4``) that sends until ``send`` fails.  Prints
    ``STARTED`` after its first sample and ``FAILED {json}`` when it fails (exit status 3).

``resume PORT CKPT_DIR TOKEN LOG_PATH NPRODUCERS SLEEP_S``
    A resumable trainer: a FIRO buffer (capacity 16, watermark 8, seed 0, ``max_reads=2``)
    as a checkpoint extra, restored before its receiver opens, batches of 8, 3 batches an
    epoch.  Appends ``B <ids>`` to LOG_PATH for every batch trained (the ids in column 0 of
    ``x``) and ``E <epoch>`` after every epoch; prints ``READY`` and ``DONE {json}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch

import lamploop
from lamploop.errors import TrainingInterrupted
from lamploop.streaming import FifoBuffer, FiroBuffer, Sample, StreamState, buffer_batches
from lamploop.streaming.producer import BlockingProducer
from lamploop.streaming.receiver import SampleReceiver


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _wait_job(path: str) -> dict[str, Any]:
    """Wait (at most 600 s) for the test's job file (written whole: renamed into place)."""
    _emit("LOADED")
    deadline = time.monotonic() + 600
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no job file {path}")
        time.sleep(0.005)
    with open(path) as job:
        return json.load(job)


async def _sigterm(ckpt_dir: str, token: str) -> int:
    buffer = FifoBuffer(capacity=16, watermark=1)
    for seq in range(3):
        buffer.try_put(Sample("pre", seq, {"x": torch.zeros(3), "y": torch.tensor(0)}))
    inner = buffer_batches(buffer, batch_size=8, batches_per_epoch=2)

    def factory(context: Any) -> Any:
        _emit("WAITING")
        return inner(context)

    async with SampleReceiver(buffer, token=token, expected_producers=["sim-0"]):
        try:
            await lamploop.fit_async(
                model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=factory,
                max_epochs=100,
                checkpoint_dir=ckpt_dir,
                reporters=[],
                device="cpu",
            )
        except TrainingInterrupted as error:
            caught = time.time()
            _emit(
                "INTERRUPTED "
                + json.dumps(
                    {
                        "t": caught,
                        "epoch": error.epoch,
                        "steps_done": error.steps_done,
                        "reason": error.reason,
                        "fill": buffer.fill,
                        "read_total": buffer.read_total,
                        "checkpoint_files": sorted(os.listdir(ckpt_dir)),
                    }
                )
            )
            return 0
    _emit("NOT INTERRUPTED")
    return 1


async def _hold(capacity: int, token: str) -> int:
    buffer = FifoBuffer(capacity=capacity, watermark=1)
    async with SampleReceiver(buffer, token=token) as receiver:
        _emit(f"PORT {receiver.address[1]}")
        await anyio.sleep(120)
    return 0


def _bproducer(port: int, token: str, reconnect_timeout: float) -> int:
    try:
        with BlockingProducer(
            ("127.0.0.1", port),
            name="sim-0",
            token=token,
            resend_window=4,
            reconnect_timeout=reconnect_timeout,
        ) as producer:
            for seq in range(1_000_000):
                producer.send({"x": torch.tensor([1.0, float(seq), 0.5])})  # as the test's
                if seq == 0:
                    _emit("STARTED")
    except Exception as error:
        _emit("FAILED " + json.dumps({"t": time.time(), "type": type(error).__name__, "msg": str(error)}))
        return 3
    _emit("FINISHED")
    return 0


async def _resume(
    port: int, ckpt_dir: str, token: str, log_path: str, nproducers: int, sleep_s: float
) -> int:
    buffer = FiroBuffer(capacity=16, watermark=8, seed=0, max_reads=2)
    stream = StreamState(buffer)
    restored = stream.restore(ckpt_dir)
    log = open(log_path, "a", buffering=1)  # noqa: ASYNC230, SIM115 (open for the whole process)
    log.write(f"START {json.dumps(restored)}\n")

    class Logged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            log.write("B " + " ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
            time.sleep(sleep_s)
            return self.linear(x[:, 1:])

    names = [f"sim-{index}" for index in range(nproducers)]
    async with stream.open_receiver(token=token, producers=names, port=port) as receiver:
        _emit("READY")

        async def close_when_done() -> None:
            await receiver.wait_all_done()
            buffer.close()

        async with anyio.create_task_group() as group:
            group.start_soon(close_when_done)
            state = await lamploop.fit_async(
                model=lamploop.SupervisedModel(Logged(), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
                train_batches=buffer_batches(buffer, batch_size=8, batches_per_epoch=3),
                max_epochs=1000,
                checkpoint_dir=ckpt_dir,
                checkpoint_extras={"stream": stream},
                on_epoch=lambda state: log.write(f"E {state.epoch}\n"),
                reporters=[],
                device="cpu",
            )
    assert state is not None
    _emit("DONE " + json.dumps({"epoch": state.epoch, "fill": buffer.fill}))
    return 0


def main(argv: list[str]) -> int:
    job = _wait_job(argv[0])
    mode, args = job["mode"], job["args"]
    if mode == "sigterm":
        return anyio.run(_sigterm, args[0], args[1])
    if mode == "hold":
        return anyio.run(_hold, int(args[0]), args[1])
    if mode == "bproducer":
        return _bproducer(int(args[0]), args[1], float(args[2]))
    if mode == "resume":
        return anyio.run(_resume, int(args[0]), args[1], args[2], args[3], int(args[4]), float(args[5]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
