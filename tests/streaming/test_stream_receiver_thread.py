"""A buffer filled from another thread's event loop, and ``SampleReceiver(own_thread=True)``.

Real threads, each with its own event loop, real TCP on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence

import anyio
import pytest
import torch

from lamploop.errors import ConfigurationError, StreamingError
from lamploop.streaming import FifoBuffer, FiroBuffer, Sample
from lamploop.streaming.producer import AsyncProducer
from lamploop.streaming.receiver import SampleReceiver

pytestmark = pytest.mark.anyio

TOKEN = "thread-token"


def sample(seq: int, producer: str = "sim") -> Sample:
    return Sample(producer, seq, {"x": torch.full((4,), float(seq)), "y": torch.tensor(seq % 2)})


def on_thread(work: Callable[[], Awaitable[None]]) -> tuple[threading.Thread, list[BaseException]]:
    """``work`` run by its own event loop on a new thread (started); the thread and its errors."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(work)
        except BaseException as exc:  # the test's own assertion reports it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


async def joined(thread: threading.Thread, errors: list[BaseException]) -> None:
    await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    assert errors == []


async def test_a_read_waiting_on_one_loop_is_woken_by_puts_from_another_threads_loop() -> None:
    buffer = FifoBuffer(capacity=8, watermark=4)

    async def put_slowly() -> None:
        for seq in range(6):
            await anyio.sleep(0.02)
            buffer.try_put(sample(seq))
        buffer.close()

    with anyio.fail_after(10):
        thread, errors = on_thread(put_slowly)
        first = await buffer.get_batch(4)  # waits: the watermark is reached on the other thread
        rest = [s.seq async for s in buffer]
        await joined(thread, errors)
    assert [s.seq for s in first] == [0, 1, 2, 3]
    assert rest == [4, 5]


async def test_a_full_buffers_put_on_another_thread_waits_for_reads_on_this_one() -> None:
    buffer = FifoBuffer(capacity=2, watermark=1)
    count = 40
    put_done = threading.Event()

    async def put_all() -> None:
        for seq in range(count):
            await buffer.put(sample(seq))  # waits while full: woken by this loop's reads
        put_done.set()
        buffer.close()

    with anyio.fail_after(20):
        thread, errors = on_thread(put_all)
        await anyio.sleep(0.1)
        assert buffer.fill == 2  # full, and the other thread waits
        assert not put_done.is_set()
        seqs = []
        async for got in buffer:
            seqs.append(got.seq)
            assert buffer.fill <= 2
        await joined(thread, errors)
    assert seqs == list(range(count))
    assert buffer.stats().received == buffer.stats().read_total == count


def test_a_read_cancelled_on_an_ended_loop_leaves_no_stale_wait_behind() -> None:
    # A thread that ran a loop whose read was cancelled waits again on a new loop: the puts of
    # another thread must wake the new loop, not the ended one.
    buffer = FifoBuffer(capacity=4, watermark=1)

    async def cancelled_read() -> None:
        with anyio.move_on_after(0.05):
            await buffer.get()

    anyio.run(cancelled_read)

    async def read_while_another_thread_puts() -> int:
        async def put_later() -> None:
            await anyio.sleep(0.05)
            buffer.try_put(sample(0))

        with anyio.fail_after(10):
            thread, errors = on_thread(put_later)
            got = await buffer.get()
            await joined(thread, errors)
        return got.seq

    assert anyio.run(read_while_another_thread_puts) == 0


async def test_firo_draws_stay_those_of_one_thread_when_puts_come_from_another() -> None:
    # The same puts and the same reads, in the same order, draw the same samples wherever the
    # puts come from: the lock serialises them, the generator is the buffer's own.
    def reference() -> list[int]:
        buffer = FiroBuffer(capacity=16, watermark=16, seed=7, max_reads=2)
        for seq in range(16):
            buffer.try_put(sample(seq))
        buffer.close()
        reads = []
        while (got := buffer.try_get()) is not None:
            reads.append(got.seq)
            if buffer.ended:
                break
        return reads

    buffer = FiroBuffer(capacity=16, watermark=16, seed=7, max_reads=2)

    async def put_all() -> None:
        for seq in range(16):
            await buffer.put(sample(seq))
        buffer.close()

    with anyio.fail_after(10):
        thread, errors = on_thread(put_all)
        reads = [s.seq async for s in buffer]
        await joined(thread, errors)
    assert reads == reference()
    assert sorted(reads) == sorted(list(range(16)) * 2)


async def test_a_receiver_on_its_own_thread_delivers_every_sample_in_order() -> None:
    buffer = FifoBuffer(capacity=16, watermark=1)
    count = 300
    with anyio.fail_after(30):
        async with SampleReceiver(
            buffer, token=TOKEN, expected_producers=["a", "b"], own_thread=True
        ) as receiver:
            serving = [t for t in threading.enumerate() if t.name.startswith("lamploop-receiver")]
            assert len(serving) == 1
            assert serving[0] is not threading.current_thread()

            async def produce(name: str) -> None:
                async with AsyncProducer(receiver.address, name=name, token=TOKEN, resend_window=8) as p:
                    for seq in range(count):
                        await p.send({"x": torch.full((4,), float(seq)), "y": torch.tensor(seq % 2)})
                    await p.done()

            got: dict[str, list[int]] = {"a": [], "b": []}

            async def drain() -> None:
                while sum(map(len, got.values())) < 2 * count:
                    for s in await buffer.get_batch(1):
                        assert torch.equal(s.tensors["x"], torch.full((4,), float(s.seq)))
                        got[s.producer].append(s.seq)

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce, "a")
                tg.start_soon(produce, "b")
                tg.start_soon(drain)
            await receiver.wait_all_done()
            assert receiver.producers_done == {"a", "b"}
            assert receiver.acknowledged == {"a": count - 1, "b": count - 1}
            assert receiver.stats.samples == 2 * count
    assert got == {"a": list(range(count)), "b": list(range(count))}
    assert not [t for t in threading.enumerate() if t is serving[0]]  # joined on leaving


async def test_a_cancelled_block_still_joins_the_receivers_thread() -> None:
    before = set(threading.enumerate())
    with anyio.fail_after(10):
        with anyio.move_on_after(0.2) as scope:
            async with SampleReceiver(FifoBuffer(capacity=4, watermark=1), token=TOKEN, own_thread=True):
                await anyio.sleep(30)  # cancelled from outside
        assert scope.cancelled_caught
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith("lamploop-receiver")]
    assert left == []


class BrokenAfter(FifoBuffer):
    """A buffer whose puts fail from the ``limit``-th sample on (the owner's code failing)."""

    limit = 5

    def try_put_many(self, samples: Sequence[Sample]) -> int:
        if samples and samples[-1].seq >= self.limit:
            msg = "the sink broke"
            raise RuntimeError(msg)
        return super().try_put_many(samples)


async def test_a_failing_put_on_the_receivers_thread_cancels_the_block_and_is_raised() -> None:
    reached = False

    async def receive() -> None:
        nonlocal reached
        async with (
            SampleReceiver(BrokenAfter(capacity=64, watermark=1), token=TOKEN, own_thread=True) as receiver,
            AsyncProducer(receiver.address, name="sim", token=TOKEN, resend_window=64) as producer,
        ):
            for seq in range(10):
                await producer.send({"x": torch.full((4,), float(seq))})
            await anyio.sleep(30)  # cancelled by the receiver's failure
            reached = True

    with anyio.fail_after(20), pytest.raises(StreamingError, match=r"sink's put failed for sample \('sim', "):
        await receive()
    assert not reached


async def test_a_failing_put_is_raised_by_wait_all_done_on_the_owners_loop() -> None:
    caught: list[BaseException] = []

    async def produce(address: tuple[str, int]) -> None:
        async with AsyncProducer(address, name="sim", token=TOKEN) as producer:
            for seq in range(10):
                await producer.send({"x": torch.full((4,), float(seq))})
            await anyio.sleep(30)  # cancelled once wait_all_done raised

    async def receive() -> None:
        async with (
            SampleReceiver(
                BrokenAfter(capacity=64, watermark=1),
                token=TOKEN,
                expected_producers=["sim"],
                own_thread=True,
            ) as receiver,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(produce, receiver.address)
            try:
                await receiver.wait_all_done()
            except StreamingError as exc:
                caught.append(exc)
            tg.cancel_scope.cancel()

    with anyio.fail_after(20), pytest.raises(StreamingError, match="sink's put failed"):  # and on leaving
        await receive()
    assert len(caught) == 1
    assert "sink's put failed for sample ('sim', " in str(caught[0])


def test_own_thread_needs_a_stream_buffer() -> None:
    class ListSink:
        async def put(self, sample: Sample) -> None:
            pass

    with pytest.raises(ConfigurationError, match="own_thread=True needs a StreamBuffer sink"):
        SampleReceiver(ListSink(), token=TOKEN, own_thread=True)
    with pytest.raises(ConfigurationError, match="own_thread must be a bool"):
        SampleReceiver(FifoBuffer(capacity=1, watermark=1), token=TOKEN, own_thread=1)  # type: ignore[arg-type]
