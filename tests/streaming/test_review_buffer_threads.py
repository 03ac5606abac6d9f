"""Review of ``StreamBuffer`` and ``SampleReceiver(own_thread=True)`` across two threads.

Real threads, each with its own event loop; the interpreter switches threads often
(``sys.setswitchinterval``) so that interleavings show up within a second; every wait is bounded.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from lamploop.errors import BufferClosedError, StreamEnded
from lamploop.streaming import FifoBuffer, FiroBuffer, ReservoirBuffer, Sample
from lamploop.streaming.buffers import StreamBuffer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.receiver_thread import ServingThread
from lamploop.transport.supervisor import Supervisor

pytestmark = pytest.mark.anyio


def sample(seq: int, producer: str = "sim") -> Sample:
    return Sample(producer, seq, {"x": torch.tensor([float(seq)])})


@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def on_thread(work: Callable[[], Awaitable[None]]) -> tuple[threading.Thread, list[BaseException]]:
    """``work`` run by its own event loop on a new daemon thread (started); the thread and its errors."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(work)
        except BaseException as exc:  # the test's own assertion reports it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


async def joined(thread: threading.Thread, errors: list[BaseException]) -> None:
    await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    assert errors == []


@pytest.mark.usefixtures("fast_switching")
async def test_no_wake_up_is_lost_between_puts_and_reads_on_two_loops() -> None:
    """Single-slot FIFO: every put waits for a read and every read for a put, 2000 times over."""
    buffer = FifoBuffer(capacity=1, watermark=1)
    count = 2000

    async def put_all() -> None:
        for seq in range(count):
            await buffer.put(sample(seq))
        buffer.close()

    with anyio.fail_after(30):
        thread, errors = on_thread(put_all)
        got = [s.seq async for s in buffer]
        await joined(thread, errors)
    assert got == list(range(count))


@pytest.mark.usefixtures("fast_switching")
async def test_batches_on_this_loop_see_every_put_from_another_loop() -> None:
    buffer = FiroBuffer(capacity=4, watermark=4, seed=3, max_reads=2)
    count = 600

    async def put_all() -> None:
        for seq in range(count):
            await buffer.put(sample(seq))
        buffer.close()

    seen: list[int] = []
    with anyio.fail_after(30):
        thread, errors = on_thread(put_all)
        while True:
            try:
                seen += [s.seq for s in await buffer.get_batch(3)]
            except StreamEnded:
                break
        await joined(thread, errors)
    assert sorted(seen) == sorted(list(range(count)) * 2)  # each read exactly max_reads times


async def test_close_from_another_thread_ends_a_waiting_get_and_a_waiting_put() -> None:
    empty = FifoBuffer(capacity=2, watermark=1)
    full = FifoBuffer(capacity=1, watermark=1)
    full.try_put(sample(0))
    outcomes: list[str] = []

    async def wait_on_both() -> None:
        async def read() -> None:
            with pytest.raises(StreamEnded):
                await empty.get()
            outcomes.append("get ended")

        async def write() -> None:
            with pytest.raises(BufferClosedError):
                await full.put(sample(1))
            outcomes.append("put refused")

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            tg.start_soon(write)

    with anyio.fail_after(10):
        thread, errors = on_thread(wait_on_both)
        await anyio.sleep(0.1)  # both wait on the other loop now
        empty.close()
        full.close()
        await joined(thread, errors)
    assert sorted(outcomes) == ["get ended", "put refused"]


async def test_load_state_dict_wakes_a_reader_waiting_on_another_loop() -> None:
    source = FifoBuffer(capacity=2, watermark=1)
    source.try_put(sample(5))
    tensors, meta = source.state_dict()
    target = FifoBuffer(capacity=2, watermark=1)
    got: list[int] = []

    async def read() -> None:
        got.append((await target.get()).seq)

    with anyio.fail_after(10):
        thread, errors = on_thread(read)
        await anyio.sleep(0.1)
        target.load_state_dict(tensors, meta)
        await joined(thread, errors)
    assert got == [5]


@pytest.mark.usefixtures("fast_switching")
async def test_callbacks_under_the_lock_may_look_at_the_buffer_while_another_thread_reads() -> None:
    """on_evict (putter's thread) and on_read (reader's thread) re-enter the buffer: no deadlock."""
    looks: list[int] = []
    buffer: StreamBuffer

    def look(key: tuple[str, int], seen: int) -> None:
        looks.append(len(buffer.seen_counts()) + buffer.stats().fill)

    buffer = ReservoirBuffer(capacity=8, watermark=4, seed=0, on_evict=look, on_read=look)
    count = 400

    async def put_all() -> None:
        for seq in range(count):
            await buffer.put(sample(seq))
            if seq % 16 == 0:
                await anyio.lowlevel.checkpoint()
        buffer.close()

    with anyio.fail_after(30):
        thread, errors = on_thread(put_all)
        reads = 0
        async for _ in buffer:
            reads += 1
        await joined(thread, errors)
    assert buffer.evicted > 0
    assert len(looks) == reads + buffer.evicted


class SlowToCount(FifoBuffer):
    """A FIFO whose ``fill`` takes a moment after counting (as a busy interpreter may): it
    widens the window between two counters' reads without changing what is read."""

    @property
    def fill(self) -> int:
        counted = super().fill
        time.sleep(0.0005)  # lets the GIL go: another thread may put or read now
        return counted


def test_stats_is_one_snapshot_while_another_thread_puts_and_reads() -> None:
    """Concern: ``stats()`` (and ``fill``/``received``/``read_total``, ``ended``, ``repr``) read the
    counters without the lock, so a put or read on another thread lands between two of them.

    FIFO, ``max_reads=1``, nothing evicted: ``received == fill + read_total`` after every change.
    """
    buffer = SlowToCount(capacity=64, watermark=1)
    stop = threading.Event()

    def churn() -> None:  # puts a few, lets the GIL go, reads them
        seq = 0
        while not stop.is_set():
            for _ in range(1 + seq % 3):
                buffer.try_put(sample(seq))
                seq += 1
            time.sleep(0)
            while buffer.try_get() is not None:
                pass

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    torn: list[tuple[int, int, int]] = []
    try:
        for _ in range(200):
            stats = buffer.stats()
            if stats.received != stats.fill + stats.read_total:
                torn.append((stats.received, stats.fill, stats.read_total))
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert torn == [], (
        f"stats() mixed two states {len(torn)} times in 200, e.g. (received, fill, read_total) = {torn[0]}"
    )


# --------------------------------------------------------------------------------------------
# SampleReceiver(own_thread=True) and its ServingThread

TOKEN = "review-token"


def receiver_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("lamploop-receiver")}


async def test_an_owner_cancelled_while_the_receivers_thread_starts_still_joins_it() -> None:
    before = receiver_threads()
    for delay in (0.0, 0.001, 0.005, 0.02):
        with anyio.fail_after(10):
            with anyio.move_on_after(delay):
                async with SampleReceiver(FifoBuffer(capacity=4, watermark=1), token=TOKEN, own_thread=True):
                    await anyio.sleep(30)
        assert receiver_threads() - before == set(), (
            f"a receiver thread left running (cancelled at {delay} s)"
        )


async def test_a_callback_for_the_receivers_thread_asked_for_before_its_loop_runs_is_not_lost() -> None:
    """Concern: ``ServingThread.call_soon`` drops a callback while the thread's loop does not
    exist yet; ``set_directory`` called while ``async with receiver`` is starting its thread
    (another task of the owner's loop) is then never seen by the handshakes."""
    ran = threading.Event()

    async def serve(*, task_status: anyio.abc.TaskStatus[tuple[str, int]]) -> None:
        task_status.started(("127.0.0.1", 1))
        await anyio.sleep_forever()

    serving = ServingThread(Supervisor(lambda: None), serve, lambda: None)
    with anyio.fail_after(10):
        serving.call_soon(ran.set)  # as set_directory does while the thread's loop is not up yet
        await serving.start("lamploop-receiver-review")
        try:
            seen = await anyio.to_thread.run_sync(ran.wait, 2.0)
        finally:
            error = await serving.stop()
    assert error is None
    assert seen, "the callback asked for before the receiver's loop ran was dropped"
