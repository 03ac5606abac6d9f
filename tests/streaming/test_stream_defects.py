"""Issue 21, "Nothing waits forever": a producer whose trainer is gone, a producer not in the
run's list, a sample of another shape.

Real TCP on 127.0.0.1 and, for the blocking producer, a real process; every wait is bounded
(a regression fails the test, it does not hang it).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream
from support import ROOT

import lamploop
from lamploop.errors import HandshakeError, StreamingError
from lamploop.streaming import FifoBuffer, Sample, StreamState, buffer_batches
from lamploop.streaming.producer import AsyncProducer
from lamploop.streaming.receiver import SampleReceiver

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = "the streaming secret of issue 21"
ROOT = ROOT


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Poll ``condition`` (state of another task or process) until true; TimeoutError after ``within`` s."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 (polling another object's state, not an event of ours)
            await anyio.sleep(0.01)


def tensors(seq: int, size: int = 4) -> dict[str, torch.Tensor]:
    x = torch.randn(size, generator=torch.Generator().manual_seed(seq))
    return {"x": x, "y": (x.sum() > 0).long()}


# -- 1. a simulation whose trainer is gone exits, raising the failure --

BLOCKING_SCRIPT = """
import os, sys
import torch
from lamploop.streaming.producer import BlockingProducer

port, mode = int(sys.argv[1]), sys.argv[2]
try:
    token = os.environ["STREAM_TOKEN"]
    address = ("127.0.0.1", port)
    options = {"reconnect_timeout": 2.0, "resend_window": 4}
    with BlockingProducer(address, name="sim", token=token, **options) as producer:
        for seq in range(20):
            producer.send({"x": torch.full((4,), float(seq))})
        print("handed", flush=True)
        if mode == "raise":
            raise RuntimeError("the simulation broke")
except Exception as exc:
    print(f"left with {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
print("left normally", flush=True)
"""


async def _start_blocking(port: int, mode: str) -> anyio.abc.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAM_TOKEN": TOKEN}
    return await anyio.open_process(
        [sys.executable, "-c", BLOCKING_SCRIPT, str(port), mode], env=env, stderr=subprocess.STDOUT
    )


async def _lines(process: anyio.abc.Process) -> AsyncIterator[str]:
    assert process.stdout is not None
    reader = BufferedByteReceiveStream(process.stdout)
    while True:
        try:
            line = await reader.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            return
        yield line.decode()


async def _until(lines: AsyncIterator[str], wanted: str, seen: list[str]) -> None:
    async for line in lines:
        seen.append(line)
        if line == wanted:
            return
    raise AssertionError(f"the producer ended before printing {wanted!r}: {seen}")


async def _exit_within(process: anyio.abc.Process, lines: AsyncIterator[str], seconds: float) -> list[str]:
    """The rest of the process's output once it exited within ``seconds``; fails (killing it) otherwise."""
    rest: list[str] = []
    try:
        with anyio.fail_after(seconds):
            rest.extend([line async for line in lines])
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"the producer process did not exit within {seconds:g} s: it waits forever ({rest})")
    return rest


async def test_a_blocking_producer_whose_trainer_is_gone_raises_on_leaving_within_the_reconnect_bound() -> (
    None
):
    """The block hands over 20 samples; the buffer (capacity 4) is never read, so sends wait for
    the window; the receiver closes: leaving the block raises within reconnect_timeout (2 s)."""
    buffer = FifoBuffer(capacity=4, watermark=1, seed=0)
    seen: list[str] = []
    with anyio.fail_after(45):
        async with SampleReceiver(buffer, token=TOKEN) as receiver:
            process = await _start_blocking(receiver.address[1], "leave")
            lines = _lines(process)
            await _until(lines, "handed", seen)  # every sample handed over; leaving the block now
            await eventually(lambda: buffer.fill == 4)  # full, never read: the window stays full
        closed = anyio.current_time()  # the trainer is gone
        rest = await _exit_within(process, lines, 2.0 + 8.0)
        took = anyio.current_time() - closed
    assert process.returncode == 3, seen + rest
    assert rest[-1].startswith("left with StreamingError: producer 'sim' could not reach"), rest
    assert "for 2 s" in rest[-1]
    assert took < 2.0 + 8.0


async def test_a_blocking_producer_whose_block_fails_leaves_without_waiting_for_a_full_window() -> None:
    """The trainer is alive but reads nothing: a block that fails does not wait for room in the window."""
    buffer = FifoBuffer(capacity=4, watermark=1, seed=0)
    seen: list[str] = []
    with anyio.fail_after(45):
        async with SampleReceiver(buffer, token=TOKEN) as receiver:
            process = await _start_blocking(receiver.address[1], "raise")
            lines = _lines(process)
            await _until(lines, "handed", seen)
            rest = await _exit_within(process, lines, 8.0)
    assert process.returncode == 3, seen + rest
    assert rest[-1] == "left with RuntimeError: the simulation broke", rest


# -- 2. a producer not in the run's list is refused; a closed buffer never kills the trainer --


async def test_a_producer_not_in_the_runs_list_is_refused_at_the_handshake_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    buffer = FifoBuffer(capacity=64, watermark=1, seed=0)
    stream = StreamState(buffer)
    with anyio.fail_after(30), caplog.at_level(logging.WARNING):
        async with stream.open_receiver(token=TOKEN, producers=["sim-0"]) as receiver:

            async def listed() -> None:
                async with AsyncProducer(receiver.address, name="sim-0", token=TOKEN) as producer:
                    for seq in range(40):
                        await producer.send(tensors(seq))
                        await anyio.sleep(0.005)  # still streaming while the stranger comes
                await receiver.wait_all_done()
                buffer.close()

            async def unlisted() -> None:
                async with AsyncProducer(receiver.address, name="sim-7", token=TOKEN) as producer:
                    await producer.send(tensors(0))
                    await producer.done()

            async with anyio.create_task_group() as tg:
                tg.start_soon(listed)
                await eventually(lambda: receiver.stats.samples >= 5)
                with pytest.raises(HandshakeError) as during:
                    await unlisted()
                keys = [sample.key async for sample in buffer]
            with pytest.raises(HandshakeError) as after:  # after the end too, and the receiver lives on
                await unlisted()
            refusals = receiver.recent_refusals
            assert receiver.refusals == receiver.stats.refusals == 2
    for info in (during, after):
        assert "producer 'sim-7' refused by the receiver at 127.0.0.1:" in str(info.value)
        assert "producer 'sim-7' is not one of this run's producers (['sim-0'])" in str(info.value)
    assert all("producer 'sim-7' is not one of this run's producers" in r for r in refusals), refusals
    assert any("sim-7" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert keys == [("sim-0", seq) for seq in range(40)]  # nothing of sim-7 was taken


async def test_a_sample_put_after_the_buffer_was_closed_refuses_its_producer_not_the_trainer() -> None:
    """The documented recipe closes the buffer once the listed producers are done; a sample
    arriving after that (a producer the receiver does not check the names of) is refused."""
    buffer = FifoBuffer(capacity=16, watermark=1, seed=0)
    with anyio.fail_after(30):
        async with SampleReceiver(buffer, token=TOKEN, expected_producers=["sim-0"]) as receiver:
            async with AsyncProducer(receiver.address, name="sim-0", token=TOKEN) as producer:
                for seq in range(5):
                    await producer.send(tensors(seq))
            await receiver.wait_all_done()
            buffer.close()

            async def late(name: str) -> None:
                async with AsyncProducer(receiver.address, name=name, token=TOKEN) as producer:
                    for seq in range(8):  # "sim-0" again: 0..4 are skipped, 5 is the first one put
                        await producer.send(tensors(seq))
                    await producer.done()

            for name, seq in (("sim-7", 0), ("sim-0", 5)):
                with pytest.raises(StreamingError) as info:
                    await late(name)
                assert f"producer {name!r} refused by the receiver" in str(info.value)
                assert f"sample seq {seq} arrived after the trainer closed its buffer" in str(info.value)
            keys = [sample.key async for sample in buffer]
            assert receiver.refusals == 2
    assert keys == [("sim-0", seq) for seq in range(5)]


# -- 3. a sample of another shape --


async def test_a_sample_of_another_shape_refuses_its_producer_at_the_receiver_and_the_run_goes_on() -> None:
    reads: Counter[tuple[str, int]] = Counter()
    buffer = FifoBuffer(capacity=32, watermark=8, seed=0, on_read=lambda key, _: reads.update([key]))
    stream = StreamState(buffer)
    refused: list[StreamingError] = []
    with anyio.fail_after(45):
        async with stream.open_receiver(token=TOKEN, producers=["sim-0", "sim-1"]) as receiver:

            async def good() -> None:
                async with AsyncProducer(receiver.address, name="sim-0", token=TOKEN) as producer:
                    for seq in range(40):
                        await producer.send(tensors(seq))

            async def send_a_bad_seq_7() -> None:
                async with AsyncProducer(receiver.address, name="sim-1", token=TOKEN) as producer:
                    for seq in range(12):
                        await producer.send(tensors(seq, size=6 if seq == 7 else 4))
                        await anyio.sleep(0.002)

            async def bad() -> None:
                with pytest.raises(StreamingError) as info:
                    await send_a_bad_seq_7()
                refused.append(info.value)

            async def end() -> None:
                await receiver.wait_all_done()  # sim-1, refused for good, is not waited for
                buffer.close()

            async with anyio.create_task_group() as tg:
                for task in (good, bad, end):
                    tg.start_soon(task)
                torch.manual_seed(0)
                state = await lamploop.fit_async(
                    model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                    train_batches=buffer_batches(buffer, batch_size=8, batches_per_epoch=2),
                    max_epochs=1000,
                    reporters=[],
                    world_size=1,
                )
            assert set(receiver.producers_refused) == {"sim-1"}
            assert receiver.refusals == 1
            with pytest.raises(HandshakeError, match="producer 'sim-1' was refused for good: sample seq 7"):
                await bad_again(receiver.address)
            assert receiver.refusals == 2
            assert stream.state_dict()[1]["producers_done"] == ["sim-0", "sim-1"]  # not waited for on resume
    message = str(refused[0])
    assert message.startswith("producer 'sim-1' refused by the receiver at 127.0.0.1:"), message
    assert (
        "sample seq 7 does not match the stream's samples: tensor 'x' has shape [6] (float32), not [4]"
        in message
    )
    assert state is not None
    expected = {("sim-0", seq): 1 for seq in range(40)} | {("sim-1", seq): 1 for seq in range(7)}
    assert reads == Counter(expected)  # every sample before the bad one was trained on, once


async def bad_again(address: tuple[str, int]) -> None:
    """The refused producer, started again: it is refused at the handshake now."""
    async with AsyncProducer(address, name="sim-1", token=TOKEN) as producer:
        for seq in range(8):
            await producer.send(tensors(seq))
        await producer.done()


async def test_samples_of_another_shape_in_a_batch_name_the_producer_seq_field_shapes_epoch_and_batch() -> (
    None
):
    from lamploop.errors import BatchError, SampleMismatchError  # new with issue 21

    buffer = FifoBuffer(capacity=64, watermark=1, seed=0)

    async def train() -> Any:
        # Put first, in this order, and read in this order (FIFO); no receiver here.
        for seq in range(16):
            await buffer.put(Sample("sim-0", seq, tensors(seq)))
        for seq in range(8):
            await buffer.put(Sample("sim-1", seq, tensors(seq, size=6 if seq == 7 else 4)))
        buffer.close()
        return await lamploop.fit_async(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=buffer_batches(buffer, batch_size=4, batches_per_epoch=2),
            max_epochs=1000,
            reporters=[],
            world_size=1,
        )

    with anyio.fail_after(30), pytest.raises(SampleMismatchError) as info:
        await train()
    error = info.value
    assert isinstance(error, BatchError)
    # Epochs 0 and 1 read sim-0's 16 samples; epoch 2's batch 1 holds sim-1's 4..7.
    assert (error.producer, error.seq, error.field) == ("sim-1", 7, "x")
    assert (error.shape, error.expected_shape) == ((6,), (4,))
    assert (error.epoch, error.batch) == (2, 1)
    assert str(error) == (
        "epoch 2, batch 1: sample seq 7 of producer 'sim-1' does not match the batch's first sample "
        "(seq 4 of producer 'sim-1'): tensor 'x' has shape [6] (float32), not [4] (float32)"
    )
