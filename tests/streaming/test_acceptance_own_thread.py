"""Acceptance tests, written from the documentation only, for the receiver on its own thread.

docs/streaming.md "The transport", paragraph "Receiving off the training's thread":
``SampleReceiver(buffer, ..., own_thread=True)`` (or ``stream.open_receiver(...,
own_thread=True)``) serves the producers on a thread of its own with its own event loop; the
``async with`` starts the thread and joins it on leaving; what the owner reads or awaits is
unchanged; a failure on the thread cancels the block or raises in ``wait_all_done`` and is
raised on leaving; the sink must be a ``StreamBuffer`` (whose ``on_evict`` then runs on the
receiver's thread).  Everything else the page promises (every sample exactly as often as the
policy says, training through ``buffer_batches``, checkpoints of the stream, the stop while
no sample comes) must hold with the thread as without it.

Each sample carries its id as ``x[0]``; the tests count every id themselves.  Not written from
lamploop's source, nor from tests/streaming/test_stream_receiver_thread.py.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
import torch
from support import WORKERS, wait_until
from workers import warm_start

import lamploop
from lamploop.errors import (
    ConfigurationError,
    HandshakeError,
    StreamEnded,
    StreamingError,
    TransportError,
)
from lamploop.streaming import (
    FifoBuffer,
    FiroBuffer,
    ReservoirBuffer,
    Sample,
    StreamBuffer,
    StreamState,
    buffer_batches,
)
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
from lamploop.streaming.receiver import SampleReceiver

TOKEN = secrets.token_hex(16)
ANYIO_POOL = "AnyIO worker thread"  # the caller's loop's own pool (anyio.to_thread), not the receiver's


# --------------------------------------------------------------------------------------------
# shared helpers


def _sample(ident: int) -> dict[str, torch.Tensor]:
    """Sample ``ident``: ``x = [ident, noise x3]`` (float32, exact ids below 2**24), ``y`` a class."""
    generator = torch.Generator().manual_seed(ident)
    x = torch.cat([torch.tensor([float(ident)]), torch.randn(3, generator=generator)])
    return {"x": x, "y": (x[1:].sum() > 0).long()}


def _ident(sample: Sample) -> int:
    return int(sample.tensors["x"][0])


class _Recording(torch.nn.Module):
    """A linear layer that records ``x[:, 0]`` (the ids) of every batch it is trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)
        self.trained: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.trained.extend(int(v) for v in x[:, 0].tolist())
        out: torch.Tensor = self.linear(x)
        return out


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def _receiver_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before``, other than the caller's loop's anyio pool."""
    return [t for t in _new_threads(before) if t.name != ANYIO_POOL]


def _run_and_check_threads(main: Any, *args: Any) -> Any:
    """``anyio.run(main, *args)``, then no thread of it may outlive it (within 2 s)."""
    before = set(threading.enumerate())
    result = anyio.run(main, *args)
    wait_until(lambda: not _new_threads(before), timeout=2.0, what="the run's threads ending")
    return result


async def _async_producer(address: tuple[str, int], name: str, base: int, count: int) -> None:
    async with AsyncProducer(address, name=name, token=TOKEN, reconnect_timeout=20.0) as producer:
        for seq in range(count):
            await producer.send(_sample(base + seq))
        await producer.done()


def _blocking_producer(address: tuple[str, int], name: str, base: int, count: int) -> None:
    with BlockingProducer(address, name=name, token=TOKEN, reconnect_timeout=20.0) as producer:
        producer.send_many(_sample(base + seq) for seq in range(count))
        producer.done()


async def _process_producer(address: tuple[str, int], name: str, base: int, count: int) -> None:
    """The producer in another process (tests/workers/acceptance_stream_producer.py)."""
    script = str(WORKERS / "acceptance_stream_producer.py")
    env = {**os.environ, "ACCEPTANCE_STREAM_TOKEN": TOKEN}
    result = await anyio.run_process(
        [sys.executable, script, str(address[1]), name, str(base), str(count)], env=env, check=False
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]


async def _close_when_done(receiver: SampleReceiver, buffer: StreamBuffer) -> None:
    """docs/streaming.md: the producers are done (``wait_all_done``), then ``close()`` the buffer."""
    await receiver.wait_all_done()
    buffer.close()


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the members of exception groups among them."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        members = getattr(e, "exceptions", None)  # an exception group's
        if isinstance(members, tuple):
            todo.extend(members)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return seen


# --------------------------------------------------------------------------------------------
# 1. Every sample arrives as its policy says, from three kinds of producer


COUNT = 120  # samples per producer
PRODUCERS = {"async": 0, "blocking": 10_000, "process": 20_000}  # name -> the first id
ALL_IDS = {base + seq for base in PRODUCERS.values() for seq in range(COUNT)}
CAPACITY = 16


@pytest.mark.parametrize("policy", ["fifo", "firo", "reservoir"])
def test_every_sample_arrives_as_its_policy_says_with_the_receiver_on_its_thread(policy: str) -> None:
    """streaming.md "The buffers" (FIFO and FIRO read every sample exactly ``max_reads`` times; a
    reservoir never makes producers wait, evicts, respects ``capacity`` and ``max_reads``) and
    "Receiving off the training's thread" (the trainer only draws; ``on_evict`` runs on the
    receiver's thread; ``wait_all_done``, ``acknowledged`` unchanged), with an ``AsyncProducer``,
    a ``BlockingProducer`` and a producer process feeding one receiver on its own thread."""
    main_thread = threading.get_ident()
    read_threads: set[int] = set()
    evicted: dict[int, int] = {}  # id -> its seen count when evicted
    evict_threads: set[int] = set()
    by_key: dict[tuple[str, int], int] = {
        (name, seq): base + seq for name, base in PRODUCERS.items() for seq in range(COUNT)
    }

    def on_read(key: tuple[str, int], seen: int) -> None:
        read_threads.add(threading.get_ident())

    def on_evict(key: tuple[str, int], seen: int) -> None:
        evict_threads.add(threading.get_ident())
        evicted[by_key[key]] = seen

    buffer: StreamBuffer
    if policy == "fifo":
        buffer = FifoBuffer(capacity=CAPACITY, watermark=4, on_read=on_read)
    elif policy == "firo":
        buffer = FiroBuffer(capacity=CAPACITY, watermark=4, seed=1, max_reads=2, on_read=on_read)
    else:
        buffer = ReservoirBuffer(
            capacity=CAPACITY, watermark=4, seed=2, max_reads=2, on_read=on_read, on_evict=on_evict
        )
    reads: Counter[int] = Counter()
    order: list[int] = []
    fills: list[int] = []

    async def main() -> tuple[dict[str, int], set[str], set[int | None]]:
        with anyio.fail_after(30):
            before = set(threading.enumerate())
            async with SampleReceiver(
                buffer, token=TOKEN, expected_producers=list(PRODUCERS), own_thread=True
            ) as receiver:
                own = _receiver_threads(before)
                assert own, "no thread of the receiver's own while it listens"
                address = receiver.address
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_async_producer, address, "async", PRODUCERS["async"], COUNT)
                    tg.start_soon(
                        anyio.to_thread.run_sync,
                        _blocking_producer,
                        address,
                        "blocking",
                        PRODUCERS["blocking"],
                        COUNT,
                    )
                    tg.start_soon(_process_producer, address, "process", PRODUCERS["process"], COUNT)
                    tg.start_soon(_close_when_done, receiver, buffer)
                    while True:  # the trainer: draws batches on this loop, slower than the producers
                        fills.append(buffer.fill)
                        try:
                            batch = await buffer.get_batch(4)
                        except StreamEnded:
                            break
                        order.extend(_ident(sample) for sample in batch)
                        reads.update(order[-len(batch) :])
                        fills.append(buffer.fill)
                        await anyio.sleep(0.002)
                acknowledged = receiver.acknowledged
                done = set(receiver.producers_done)
                assert receiver.stats.samples == len(ALL_IDS)
            assert not any(t.is_alive() for t in own), "the receiver's thread outlived its block"
            return acknowledged, done, {t.ident for t in own}

    acknowledged, done, receiver_threads = _run_and_check_threads(main)

    assert acknowledged == dict.fromkeys(PRODUCERS, COUNT - 1)
    assert done == set(PRODUCERS)
    assert buffer.received == len(ALL_IDS)  # every sample put once: duplicates were dropped
    assert max(fills) <= CAPACITY
    assert read_threads == {main_thread}  # reads happen where the trainer draws
    if policy != "reservoir":  # the buffer filled: the thread's puts waited for the trainer's reads
        assert max(fills) == CAPACITY
    if policy == "fifo":
        assert reads == dict.fromkeys(ALL_IDS, 1)
        for base in PRODUCERS.values():  # first in, first out: each producer's samples in seq order
            assert [i for i in order if base <= i < base + COUNT] == list(range(base, base + COUNT))
    elif policy == "firo":
        assert reads == dict.fromkeys(ALL_IDS, 2)
    else:
        assert set(reads) <= ALL_IDS
        assert max(reads.values()) <= 2  # leaves at its max_reads-th read
        assert evicted, "a reservoir fed faster than it is read evicts"
        assert evict_threads <= receiver_threads  # on_evict runs on the receiver's thread
        for ident in ALL_IDS:  # each sample was evicted, or it left by its reads (or the drain)
            if ident in evicted:
                assert reads[ident] == evicted[ident], ident  # never read after its eviction
                assert evicted[ident] < 2, ident
            else:
                assert reads[ident] >= 1, ident


@pytest.mark.parametrize("policy", ["firo", "reservoir"])
def test_a_buffer_filled_on_the_receivers_thread_draws_as_on_one_thread(policy: str) -> None:
    """streaming.md: a ``StreamBuffer`` "takes puts and reads from two threads (...) the same
    draws as on one thread", and "Every random choice comes from the buffer's own seeded
    generator, so the same puts and gets give the same draws"; a reservoir's put never waits
    (all 60 samples are acknowledged into a reservoir of 16 that nobody reads)."""
    count = 60

    def make(evicted: list[tuple[str, int]]) -> StreamBuffer:
        if policy == "firo":
            return FiroBuffer(capacity=64, watermark=8, seed=5, max_reads=2)
        return ReservoirBuffer(
            capacity=16, watermark=8, seed=5, max_reads=2, on_evict=lambda key, seen: evicted.append(key)
        )

    async def drain(buffer: StreamBuffer) -> list[int]:
        buffer.close()
        return [_ident(sample) async for sample in buffer]

    async def on_its_thread() -> tuple[list[int], list[tuple[str, int]]]:
        evicted: list[tuple[str, int]] = []
        buffer = make(evicted)
        with anyio.fail_after(20):
            async with SampleReceiver(
                buffer, token=TOKEN, expected_producers=["sim"], own_thread=True
            ) as receiver:
                await _async_producer(receiver.address, "sim", 0, count)
                await receiver.wait_all_done()
                assert receiver.acknowledged == {"sim": count - 1}
            return await drain(buffer), evicted

    async def on_one_thread() -> tuple[list[int], list[tuple[str, int]]]:
        evicted: list[tuple[str, int]] = []
        buffer = make(evicted)
        for seq in range(count):
            assert buffer.try_put(Sample("sim", seq, _sample(seq)))
        return await drain(buffer), evicted

    threaded = _run_and_check_threads(on_its_thread)
    reference = anyio.run(on_one_thread)
    assert threaded == reference
    reads, evicted = reference
    if policy == "firo":
        assert sorted(reads) == sorted(2 * list(range(count)))
        assert reads != sorted(reads)  # drawn at random, not in order
    else:
        assert len(evicted) == count - 16
        assert len(reads) == 16


# --------------------------------------------------------------------------------------------
# 2. Training through buffer_batches: the same ids with the thread as without


def test_training_on_the_stream_trains_the_same_ids_with_and_without_the_thread() -> None:
    """streaming.md "Training on the stream" (an epoch is ``batches_per_epoch`` batches; the
    closed, drained buffer ends the run) and "Receiving off the training's thread": a FIFO
    stream from one producer trains on every sample once, in arrival (= seq) order, whichever
    thread receives."""
    count, batch, per_epoch = 120, 8, 5

    async def train(own_thread: bool) -> tuple[list[int], int]:
        buffer = FifoBuffer(capacity=16, watermark=1)
        module = _Recording()
        with anyio.fail_after(30):
            async with SampleReceiver(
                buffer, token=TOKEN, expected_producers=["sim"], own_thread=own_thread
            ) as receiver:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_async_producer, receiver.address, "sim", 0, count)
                    tg.start_soon(_close_when_done, receiver, buffer)
                    state = await lamploop.fit_async(
                        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
                        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                        train_batches=buffer_batches(buffer, batch_size=batch, batches_per_epoch=per_epoch),
                        max_epochs=1000,
                        reporters=[],
                    )
                assert receiver.stats.samples == count
                assert receiver.acknowledged == {"sim": count - 1}
        assert state is not None
        return module.trained, state.epoch

    on_the_loop = _run_and_check_threads(train, False)
    on_its_thread = _run_and_check_threads(train, True)
    assert on_the_loop == (list(range(count)), count // (batch * per_epoch))
    assert on_its_thread == on_the_loop


# --------------------------------------------------------------------------------------------
# 3. Failures: the sink's put raises, the buffer is closed, a sink that is no buffer


class _SinkBroke(RuntimeError):
    pass


class _BrokenBuffer(FifoBuffer):
    """A ``StreamBuffer`` whose every put raises (a sink that fails, docs: "the buffer's put raised")."""

    def try_put(self, sample: Sample) -> bool:
        raise _SinkBroke(f"broken sink: put of {sample.key}")

    def try_put_many(self, samples: Sequence[Sample]) -> int:
        raise _SinkBroke(f"broken sink: put of {len(samples)} samples")

    async def put(self, sample: Sample) -> None:
        raise _SinkBroke(f"broken sink: put of {sample.key}")


@pytest.mark.parametrize("own_thread", [True, False], ids=["own_thread", "one_loop"])
@pytest.mark.parametrize("body", ["waits", "draws", "wait_all_done"])
def test_a_failing_put_on_the_thread_cancels_the_block_or_wait_all_done_and_is_raised_on_leaving(
    body: str, own_thread: bool
) -> None:
    """streaming.md "Receiving off the training's thread": "a failure on the thread (the buffer's
    put raised) cancels the block, or raises in ``wait_all_done``, and is raised on leaving, as
    without the thread"; SampleReceiver's docstring: leaving raises ``ControlChannelError``
    (``TransportError``) from the sink's error; ``wait_all_done`` raises ``StreamingError``.
    Run both ways: the one-loop receiver is the reference the thread must match."""

    async def main() -> tuple[BaseException, BaseException | None, bool]:
        buffer = _BrokenBuffer(capacity=8, watermark=1)
        in_wait: BaseException | None = None
        body_cancelled = True
        with anyio.fail_after(15):  # a block that is not cancelled ends here: TimeoutError, not the sink's
            async with anyio.create_task_group() as producers:
                try:
                    before = set(threading.enumerate())
                    async with SampleReceiver(
                        buffer, token=TOKEN, expected_producers=["sim"], own_thread=own_thread
                    ) as receiver:
                        own = _receiver_threads(before)
                        producers.start_soon(_async_producer, receiver.address, "sim", 0, 4)
                        if body == "wait_all_done":
                            try:
                                await receiver.wait_all_done()
                            except StreamingError as exc:
                                in_wait = exc
                            body_cancelled = False
                        elif body == "draws":  # the trainer waits for a batch that never comes
                            await buffer.get_batch(4)
                            raise AssertionError("a batch from a buffer that took nothing")
                        else:
                            await anyio.sleep_forever()
                except TransportError as exc:
                    left = exc
                else:
                    raise AssertionError("leaving the receiver's block raised nothing")
                finally:
                    producers.cancel_scope.cancel()
                if own_thread:  # (on one loop, what started is the loop's own executor)
                    assert not any(t.is_alive() for t in own), "the receiver's thread outlived its block"
        return left, in_wait, body_cancelled

    left, in_wait, body_cancelled = _run_and_check_threads(main)
    assert any(isinstance(e, _SinkBroke) for e in _chain(left)), repr(left)
    if body == "wait_all_done":
        assert isinstance(in_wait, StreamingError)
        assert not body_cancelled
    else:
        assert body_cancelled


def test_a_sample_after_the_buffer_closed_refuses_its_producer_and_the_run_goes_on() -> None:
    """streaming.md "Who may send": "A sample that arrives after the buffer was closed ... refuses
    its producer (``StreamingError: ... arrived after the trainer closed its buffer``) and never
    ends the run" -- with the receiver on its own thread, the buffer closed on the trainer's."""

    async def main() -> tuple[BaseException, int]:
        buffer = FifoBuffer(capacity=8, watermark=1)
        with anyio.fail_after(20):
            async with SampleReceiver(buffer, token=TOKEN, own_thread=True) as receiver:
                buffer.close()
                try:
                    async with AsyncProducer(
                        receiver.address, name="late", token=TOKEN, reconnect_timeout=5.0
                    ) as producer:
                        await producer.send(_sample(0))
                        await producer.done()
                except StreamingError as exc:
                    refused: BaseException = exc
                else:
                    raise AssertionError("the late producer was not refused")
                refusals = receiver.refusals
            # leaving the block did not raise: the refusal did not end the run
        return refused, refusals

    refused, refusals = _run_and_check_threads(main)
    assert "arrived after the trainer closed its buffer" in str(refused)
    assert refusals >= 1


async def _until_dropped(stream: anyio.abc.SocketStream) -> None:
    """Read until the receiver closes (or resets) the connection; the test's deadline bounds it."""
    try:
        while await stream.receive():
            pass
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return


def test_refusals_on_the_thread_are_told_to_the_producer_and_the_others_go_on() -> None:
    """streaming.md "Who may send" and "Samples of one kind", with the receiver on its thread: a
    name not among ``open_receiver(producers=...)`` is refused at the handshake
    (``HandshakeError: producer 'sim-7' refused ...: producer 'sim-7' is not one of this run's
    producers (['sim-0', 'sim-1'])``); a sample unlike the stream's first refuses its producer
    for good, told why; its earlier samples stay, ``wait_all_done`` does not wait for it and
    the honest producer's samples all arrive."""

    async def main() -> tuple[BaseException, BaseException, list[int], dict[str, str], tuple[int, int]]:
        buffer = FifoBuffer(capacity=64, watermark=1)
        stream = StreamState(buffer)
        with anyio.fail_after(20):
            async with stream.open_receiver(
                token=TOKEN, producers=["sim-0", "sim-1"], own_thread=True, handshake_timeout=0.5
            ) as receiver:
                try:
                    async with AsyncProducer(receiver.address, name="sim-7", token=TOKEN) as stranger:
                        await stranger.send(_sample(999))
                        await stranger.done()
                except HandshakeError as exc:
                    stranger_refused: BaseException = exc
                else:
                    raise AssertionError("the stranger was not refused")
                # strangers: garbage, then silence past handshake_timeout (streaming.md "The transport")
                async with await anyio.connect_tcp(*receiver.address) as garbage:
                    await garbage.send(b"\xff not a frame \x00" * 64)
                    await _until_dropped(garbage)
                async with await anyio.connect_tcp(*receiver.address) as silent:
                    await _until_dropped(silent)  # the challenge, then the drop
                strangers = receiver.refusals
                await _async_producer(receiver.address, "sim-0", 0, 20)
                try:
                    async with AsyncProducer(receiver.address, name="sim-1", token=TOKEN) as odd:
                        await odd.send(_sample(100))
                        await odd.send({"x": torch.zeros(6), "y": torch.tensor(0)})
                        await odd.done()
                except StreamingError as exc:
                    odd_refused: BaseException = exc
                else:
                    raise AssertionError("the producer of an unlike sample was not refused")
                await receiver.wait_all_done()  # not waiting for the refused sim-1
                refused = dict(receiver.producers_refused)
                refusals = receiver.refusals
            buffer.close()
            ids = [_ident(sample) async for sample in buffer]
        return stranger_refused, odd_refused, ids, refused, (strangers, refusals)

    stranger, odd, ids, refused, (strangers, refusals) = _run_and_check_threads(main)
    assert "producer 'sim-7' is not one of this run's producers (['sim-0', 'sim-1'])" in str(stranger)
    assert "sample seq 1 does not match the stream's samples" in str(odd)
    assert "tensor 'x' has shape [6]" in str(odd)
    assert set(refused) == {"sim-1"}
    assert strangers >= 3  # the name not allowed, the garbage, the silence
    assert refusals >= strangers + 1
    assert sorted(ids) == [*range(20), 100]  # sim-1's sample before the unlike one stays


class _ListSink:
    """A ``SampleSink`` that is no ``StreamBuffer``."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    async def put(self, sample: Sample) -> None:
        self.samples.append(sample)


def test_a_sink_that_is_no_buffer_is_refused_with_own_thread() -> None:
    """SampleReceiver's docstring: with ``own_thread`` "``sink`` must be a ``StreamBuffer``";
    an argument of the wrong type raises ``ConfigurationError`` (``__init__``'s Raises)."""
    with pytest.raises(ConfigurationError) as refused:
        SampleReceiver(_ListSink(), token=TOKEN, own_thread=True)
    assert "own_thread" in str(refused.value)
    SampleReceiver(_ListSink(), token=TOKEN)  # the same sink on the caller's loop is fine


# --------------------------------------------------------------------------------------------
# 4. Leaving the block joins the thread


class _BodyFailed(Exception):
    pass


@pytest.mark.parametrize("how", ["normally", "raising", "cancelled", "cancelled_with_a_put_waiting"])
def test_leaving_the_block_joins_the_receivers_thread(how: str) -> None:
    """streaming.md: "The ``async with`` starts the thread once it listens and joins it on
    leaving" -- normally, with the body's own error (which comes out unchanged), cancelled, and
    cancelled while the thread's put waits for room in a full FIFO buffer (back-pressure).
    Nothing of the receiver's outlives the run either."""

    async def main() -> tuple[int, bool]:
        buffer = FifoBuffer(capacity=4, watermark=1)
        own: list[threading.Thread] = []
        with anyio.fail_after(15):
            with anyio.CancelScope() as scope:
                before = set(threading.enumerate())
                async with SampleReceiver(
                    buffer, token=TOKEN, expected_producers=["sim"], own_thread=True
                ) as r:
                    own.extend(_receiver_threads(before))
                    assert own, "no thread of the receiver's own while it listens"
                    if how == "normally":
                        await _async_producer(r.address, "sim", 0, 3)
                        await r.wait_all_done()
                    elif how == "raising":
                        await _async_producer(r.address, "sim", 0, 2)
                        raise _BodyFailed("the body's own error")
                    elif how == "cancelled":
                        scope.cancel()
                        await anyio.sleep_forever()
                    else:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(_async_producer, r.address, "sim", 0, 200)
                            # full: the next put waits (it fills on another thread: no event to await)
                            while buffer.fill < buffer.capacity:  # noqa: ASYNC110
                                await anyio.sleep(0.01)
                            await anyio.sleep(0.2)
                            scope.cancel()
            alive = [t.name for t in own if t.is_alive()]
            assert not alive, f"left {how}, the receiver's threads still run: {alive}"
        return buffer.fill, scope.cancelled_caught

    if how == "raising":  # the body's error comes out as it is
        with pytest.raises(_BodyFailed, match="the body's own error"):
            _run_and_check_threads(main)
        return
    fill, cancelled = _run_and_check_threads(main)
    assert cancelled == (how != "normally")
    assert fill == (3 if how == "normally" else 0 if how == "cancelled" else 4)


def test_a_receiver_that_cannot_listen_fails_on_entering_as_without_the_thread() -> None:
    """streaming.md: the ``async with`` "starts the thread once it listens": a port already taken
    fails the entry, with the same error as on one loop, and leaves no thread behind."""

    async def enter(port: int, own_thread: bool) -> BaseException:
        before = set(threading.enumerate())
        with anyio.fail_after(10):
            try:
                async with SampleReceiver(
                    FifoBuffer(capacity=4, watermark=1), token=TOKEN, port=port, own_thread=own_thread
                ):
                    raise AssertionError(f"listening on a taken port {port}")
            except (OSError, TransportError) as exc:
                failed: BaseException = exc
        if own_thread:
            assert not _receiver_threads(before), "a thread outlived the failed entry"
        return failed

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        on_one_loop = anyio.run(enter, port, False)
        on_its_thread = _run_and_check_threads(enter, port, True)
    assert type(on_its_thread) is type(on_one_loop)
    assert str(port) in str(on_its_thread)


# --------------------------------------------------------------------------------------------
# 5. Checkpoints of the stream


def test_stream_checkpoint_with_the_thread_keeps_acknowledged_and_done_producers(tmp_path: Path) -> None:
    """streaming.md "Surviving a crash": ``StreamState(buffer)`` as a checkpoint extra, restored
    before ``open_receiver`` (here with ``own_thread=True``), hands the receiver the restored
    positions and the producers that had finished; a producer restarted from scratch resends
    from 0 and the receiver drops what it holds; every sample is read exactly once (FIFO)."""
    checkpoints = tmp_path / "checkpoints"
    count_a, count_b, batch, per_epoch = 24, 120, 4, 4

    def fit(module: _Recording, buffer: StreamBuffer, stream: StreamState, max_epochs: int) -> Any:
        return lamploop.fit_async(
            model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=buffer_batches(buffer, batch_size=batch, batches_per_epoch=per_epoch),
            max_epochs=max_epochs,
            checkpoint_dir=checkpoints,
            checkpoint_extras={"stream": stream},
            reporters=[],
        )

    async def first_run() -> tuple[list[int], dict[str, int]]:
        """Producer "a" finishes, "b" is part-way (back-pressure) when the run stops at epoch 2."""
        buffer = FifoBuffer(capacity=32, watermark=1)
        stream = StreamState(buffer)
        assert stream.restore(checkpoints) == {}
        module = _Recording()
        with anyio.fail_after(30):
            async with stream.open_receiver(token=TOKEN, producers=["a", "b"], own_thread=True) as receiver:
                await _async_producer(receiver.address, "a", 0, count_a)
                # set on the receiver's thread (no event to await); bounded by the fail_after
                while "a" not in receiver.producers_done:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_async_producer, receiver.address, "b", 10_000, count_b)
                    state = await fit(module, buffer, stream, max_epochs=2)
                    tg.cancel_scope.cancel()  # "b" is killed mid-stream
                assert state is not None
                assert state.epoch == 2
        return module.trained, buffer.last_seqs()

    async def second_run() -> tuple[list[int], dict[str, int], dict[str, int], set[str]]:
        """Restored; "a" is gone for good, "b" restarts from seq 0."""
        buffer = FifoBuffer(capacity=32, watermark=1)
        stream = StreamState(buffer)
        restored = stream.restore(checkpoints)
        module = _Recording()
        with anyio.fail_after(30):
            async with stream.open_receiver(token=TOKEN, producers=["a", "b"], own_thread=True) as receiver:
                at_open = receiver.acknowledged
                done_at_open = set(receiver.producers_done)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_async_producer, receiver.address, "b", 10_000, count_b)
                    tg.start_soon(_close_when_done, receiver, buffer)  # must not wait for "a"
                    state = await fit(module, buffer, stream, max_epochs=1000)
                assert state is not None
        return module.trained, restored, at_open, done_at_open

    trained_1, _ = _run_and_check_threads(first_run)
    trained_2, restored, at_open, done_at_open = _run_and_check_threads(second_run)

    assert len(trained_1) == 2 * per_epoch * batch
    assert restored["a"] == count_a - 1
    assert restored["b"] >= len(trained_1) - count_a - 1  # at least what was trained of "b"
    assert restored["b"] < count_b - 1  # "b" was part-way: the restarted one must resend the rest
    assert at_open == restored  # the receiver starts from the restored positions
    assert "a" in done_at_open
    ids = [*range(count_a), *range(10_000, 10_000 + count_b)]
    assert sorted(trained_1 + trained_2) == ids  # each sample trained on exactly once
    assert trained_1 + trained_2 == ids  # and in FIFO order: "a" first, then "b" by seq


# --------------------------------------------------------------------------------------------
# 6. A stop while no sample comes


@pytest.mark.parametrize("mode", ["empty", "stalled", "flowing"])
def test_sigterm_stops_a_run_waiting_for_samples_with_the_receiver_on_its_thread(
    mode: str, tmp_path: Path
) -> None:
    """streaming.md "When no sample comes": a rank waiting for samples waits as long as it takes;
    SIGTERM ends the wait: the pass steps with the batches it already holds, ``fit`` raises
    ``TrainingInterrupted`` (143).  Here the receiver runs on its own thread
    (tests/workers/acceptance_stream_trainer.py): ``empty`` has no producer, ``stalled`` one
    that sent 3 batches and stalls without Done, ``flowing`` one that never stops (the stop
    comes while samples flow, the receiver's puts waiting on a full buffer)."""
    script = str(WORKERS / "acceptance_stream_trainer.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = warm_start.popen(
        [sys.executable, script, str(tmp_path), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: (tmp_path / "waiting.json").exists() or process.poll() is not None,
            timeout=30.0,
            what="the trainer waiting for samples",
        )
        assert process.poll() is None, process.communicate()[1].decode()[-2000:]
        time.sleep(0.5)  # it waits; it would wait for ever
        assert process.poll() is None
        signalled = time.time()  # the worker's clock too: one machine
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15.0)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 143, stderr.decode()[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["message"], "fit did not raise TrainingInterrupted"
    stopped_in = result["at"] - signalled
    assert 0.0 < stopped_in < 5.0, stopped_in  # docs: about 0.15 s on one rank; a bound, not a timing
    trained = result["trained"]
    if mode == "flowing":  # FIFO: a prefix of the stream, whole batches, each sample once
        assert len(trained) >= 12
        assert len(trained) % 4 == 0
        assert trained == list(range(len(trained)))
        return
    # the pass stepped with the batches it held: every sample put was trained on, once
    assert trained == ([] if mode == "empty" else list(range(12)))
    # "they stop where they waited: at the start of the epoch, whose checkpoint that is"; with
    # checkpoint_extras "a stop inside an epoch writes no checkpoint"
    has_checkpoint = lamploop.latest_checkpoint(tmp_path / "checkpoints") is not None
    assert has_checkpoint == (mode == "empty")
    assert [name for name in result["threads"] if name != ANYIO_POOL] == []
