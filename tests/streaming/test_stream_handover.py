"""Issue 21, throughput: a ``BlockingProducer`` hands its samples to its event loop in chunks.

``send`` keeps a sample on the caller's thread and the loop takes a chunk at a time (64
samples, 1 MiB, or 2 ms after the first of them); ``flush`` and leaving the block hand over
the rest.  These tests check what must not change with it: the order, that nothing is lost or
repeated, the flush on leaving, and that back-pressure (a receiver that takes nothing) still
bounds what a simulation holds.  Also ``send_many``, frames of many samples decoded together,
and the receiver's copies of large frames in runs.  Real TCP on 127.0.0.1; every wait bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.to_thread
import pytest
import torch

from lamploop.errors import StreamingError
from lamploop.streaming import FifoBuffer
from lamploop.streaming.producer import (
    BLOCKING_AHEAD,
    BLOCKING_AHEAD_BYTES,
    HANDOVER_SAMPLES,
    AsyncProducer,
    BlockingProducer,
)
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.sample import Sample
from lamploop.streaming.wire import SamplesFrame, decode_body, encode_frame

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = "the handover secret"


class ListSink:
    """Takes every sample at once."""

    def __init__(self) -> None:
        self.items: list[Sample] = []

    async def put(self, sample: Sample) -> None:
        self.items.append(sample)


def tensors(seq: int, floats: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(floats, dtype=torch.float32) + seq, "seq": torch.tensor(seq)}


def check(samples: list[Sample], count: int, floats: int = 4) -> None:
    """Every seq 0..count-1 once, in order, each with its own tensors."""
    assert [s.seq for s in samples] == list(range(count))
    for sample in samples:
        expected = tensors(sample.seq, floats)
        assert torch.equal(sample.tensors["x"], expected["x"])
        assert int(sample.tensors["seq"]) == sample.seq


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 (another thread's or task's state)
            await anyio.sleep(0.005)


@pytest.mark.parametrize("floats", [4, 256, 65_536], ids=["16 B", "1 KiB", "256 KiB"])
async def test_samples_sent_in_chunks_arrive_in_order_each_once(floats: int) -> None:
    """Many chunks' worth (by count for small samples, by bytes for large ones), sent as fast as
    the thread can: every sample arrives once, in order, with its tensors; the seqs returned
    are 0, 1, 2, ..."""
    count = 3 * HANDOVER_SAMPLES + 5 if floats < 65_536 else 40
    sink = ListSink()
    seqs: list[int] = []
    with anyio.fail_after(45):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["sim"]) as receiver:

            def produce() -> None:
                with BlockingProducer(receiver.address, name="sim", token=TOKEN) as producer:
                    seqs.extend(producer.send(tensors(seq, floats)) for seq in range(count))

            await anyio.to_thread.run_sync(produce)
            await receiver.wait_all_done()
    assert seqs == list(range(count))
    check(sink.items, count, floats)


async def test_leaving_the_block_hands_over_what_waits_and_flush_does_it_at_once() -> None:
    sink = ListSink()
    in_block = threading.Event()
    leave = threading.Event()
    with anyio.fail_after(30):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["sim"]) as receiver:

            def produce() -> None:
                with BlockingProducer(receiver.address, name="sim", token=TOKEN) as producer:
                    for seq in range(3):  # fewer than a chunk
                        producer.send(tensors(seq))
                    producer.flush()  # handed over and kept: they go out without waiting for more
                    in_block.set()
                    assert leave.wait(20)
                    for seq in range(3, 8):  # fewer than a chunk again: leaving hands them over
                        producer.send(tensors(seq))

            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, produce)
                await eventually(lambda: len(sink.items) == 3)  # while the block is still open
                # flush() returned (the samples may arrive before the thread's next line runs)
                assert await anyio.to_thread.run_sync(in_block.wait, 10)
                leave.set()
            await receiver.wait_all_done()
    check(sink.items, 8)


async def test_a_lone_sample_goes_out_within_the_handover_delay_without_a_flush() -> None:
    """A slow simulation (one sample, then a long computation) is not held back by the chunking."""
    sink = ListSink()
    leave = threading.Event()
    with anyio.fail_after(30):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["sim"]) as receiver:

            def produce() -> None:
                with BlockingProducer(receiver.address, name="sim", token=TOKEN) as producer:
                    producer.send(tensors(0))
                    assert leave.wait(20)  # "computing"
                    producer.send(tensors(1))
                    assert leave.wait(20)

            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, produce)
                await eventually(lambda: len(sink.items) == 1, within=5.0)
                leave.set()
            await receiver.wait_all_done()
    check(sink.items, 2)


@pytest.mark.parametrize(
    ("floats", "ahead"),
    [(4, BLOCKING_AHEAD), (262_144, BLOCKING_AHEAD_BYTES // (262_144 * 4))],
    ids=["by count", "by bytes"],
)
async def test_back_pressure_still_bounds_what_the_simulation_holds(floats: int, ahead: int) -> None:
    """A receiver whose buffer nobody reads: ``send`` blocks once the buffer, the resend window
    and the samples handed over but not kept are full; reading the buffer lets it go on, and
    every sample arrives once, in order."""
    capacity, window, count = 8, 4, 3 * BLOCKING_AHEAD if floats == 4 else 40
    buffer = FifoBuffer(capacity=capacity, watermark=1, seed=0)
    sent: list[int] = []
    held: list[int] = []
    with anyio.fail_after(50):
        async with SampleReceiver(buffer, token=TOKEN, expected_producers=["sim"]) as receiver:

            def produce() -> None:
                with BlockingProducer(receiver.address, name="sim", token=TOKEN, resend_window=window) as p:
                    for seq in range(count):
                        p.send(tensors(seq, floats))
                        sent.append(seq)
                        with p._lock:
                            held.append(len(p._inbox) + p._in_hand)

            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, produce)
                # Let it run until it stops: send() waits for room.
                last, steady_since = -1, time.monotonic()
                while time.monotonic() - steady_since < 1.0:
                    await anyio.sleep(0.05)
                    if len(sent) != last:
                        last, steady_since = len(sent), time.monotonic()
                stalled_at = len(sent)
                assert stalled_at < count  # it waits: the window and the buffer are full
                # The buffer, the window (sent, not acknowledged: the buffer is full), the samples
                # handed over but not kept, and the one send() waiting to hand its sample over.
                assert stalled_at <= capacity + window + ahead + 1
                assert max(held) <= ahead
                samples = [sample async for sample in _drain(buffer, count)]
            await receiver.wait_all_done()
    check(samples, count, floats)


async def _drain(buffer: FifoBuffer, count: int) -> AsyncIterator[Sample]:
    for _ in range(count):
        yield await buffer.get()


async def test_send_many_keeps_the_order_on_both_producers_and_returns_the_seqs() -> None:
    sink = ListSink()
    with anyio.fail_after(30):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["async", "blocking"]) as receiver:
            async with AsyncProducer(receiver.address, name="async", token=TOKEN) as producer:
                first = await producer.send_many(tensors(seq) for seq in range(150))
                second = await producer.send_many([tensors(seq) for seq in range(150, 160)])

            def produce() -> list[int]:
                with BlockingProducer(receiver.address, name="blocking", token=TOKEN) as blocking:
                    return blocking.send_many(tensors(seq) for seq in range(70))

            third = await anyio.to_thread.run_sync(produce)
            await receiver.wait_all_done()
    assert first == list(range(150))
    assert second == list(range(150, 160))
    assert third == list(range(70))
    check([s for s in sink.items if s.producer == "async"], 160)
    check([s for s in sink.items if s.producer == "blocking"], 70)


async def test_a_blocking_producer_refuses_sends_after_done_and_outside_its_block() -> None:
    with anyio.fail_after(30):
        async with SampleReceiver(ListSink(), token=TOKEN) as receiver:

            def produce() -> None:
                producer = BlockingProducer(receiver.address, name="sim", token=TOKEN)
                with pytest.raises(StreamingError, match="send\\(\\) outside `with`"):
                    producer.send(tensors(0))
                with pytest.raises(StreamingError, match="flush\\(\\) outside `with`"):
                    producer.flush()
                with producer:
                    producer.send(tensors(0))
                    producer.done()
                    with pytest.raises(StreamingError, match="send\\(\\) after done\\(\\)"):
                        producer.send(tensors(1))

            await anyio.to_thread.run_sync(produce)


def test_a_frame_of_many_samples_of_one_kind_decodes_to_views_of_runs_not_of_the_frame() -> None:
    """Samples of one kind are decoded together; a frame of more than 8 samples (and 64 KiB) is
    copied in runs, so that a sample kept long holds its run's memory, not the whole frame's."""
    small = [tensors(seq, 256) for seq in range(200)]  # 200 x 1 KiB: runs of about 64 KiB
    body = bytearray(encode_frame(SamplesFrame("sim", 0, small))[4:])
    stride = len(body) // 200
    decoded = decode_body(body)
    assert isinstance(decoded, SamplesFrame)
    for seq, sample in enumerate(decoded.samples):
        assert torch.equal(sample["x"], small[seq]["x"])
        assert int(sample["seq"]) == seq
    storages = {sample["x"].untyped_storage().data_ptr() for sample in decoded.samples}
    assert 3 <= len(storages) <= 4
    assert max(sample["x"].untyped_storage().nbytes() for sample in decoded.samples) <= 65_536 + stride
    assert len({id(signature) for signature in decoded.signatures}) == 1  # one object: checked once
    # A frame of a few large samples: views of the frame itself, no copy.
    big = [tensors(seq, 4096) for seq in range(3)]
    body = bytearray(encode_frame(SamplesFrame("sim", 0, big))[4:])
    decoded = decode_body(body)
    assert isinstance(decoded, SamplesFrame)
    base = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    for seq, sample in enumerate(decoded.samples):
        assert torch.equal(sample["x"], big[seq]["x"])
        assert base <= sample["x"].data_ptr() < base + len(body)
