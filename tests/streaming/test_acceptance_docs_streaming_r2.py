"""Acceptance tests of streaming training, written from docs/streaming.md and the docstrings only.

Every promise is checked on real parts: TCP on 127.0.0.1, real producers of both kinds, real
processes and signals where the promise is about processes (the process script is
tests/workers/acceptance_stream_r2.py).  Sample ids are put into the tensors here, so the
counts are exact multisets; buffer draws are compared with a reference written from the
draw rules spelled out in ``lamploop.streaming.buffer_policy``'s docstring.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from support import cutting_relay, free_port

import lamploop
from lamploop.errors import (
    FrameError,
    HandshakeError,
    LamploopError,
    StreamEnded,
    StreamingError,
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

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "acceptance_stream_r2.py"


def _token() -> str:
    return secrets.token_hex(16)


def _sample(producer: int, seq: int) -> dict[str, torch.Tensor]:
    """A sample whose tensor names its producer and seq (its id)."""
    return {"x": torch.tensor([float(producer), float(seq), 0.5])}


def _ids(sample: Sample) -> tuple[int, int]:
    x = sample.tensors["x"]
    return int(x[0]), int(x[1])


def _user_threads() -> set[threading.Thread]:
    """Live threads, leaving out the thread pools of anyio and asyncio (they outlive tasks)."""
    return {
        thread
        for thread in threading.enumerate()
        if not thread.name.startswith(("AnyIO worker thread", "asyncio_"))
    }


async def _until(condition: Callable[[], bool]) -> None:
    """Poll another object's state (a producer's, a thread's, a process's)."""
    while not condition():  # noqa: ASYNC110 (another object's state, not an event of ours)
        await anyio.sleep(0.005)


async def _drain(buffer: StreamBuffer) -> list[Sample]:
    return [sample async for sample in buffer]


# --- processes -----------------------------------------------------------------------------


class _Process:
    """A worker process, started ahead of time: it imports torch and lamploop, then waits for
    its job (:meth:`run`).  Its stdout goes to a file (no pipe to fill)."""

    def __init__(self, directory: Path, label: str) -> None:
        self.label = label
        self.job = directory / f"{label}.job"
        self.out = directory / f"{label}.out"
        self.err = directory / f"{label}.err"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with self.out.open("w") as out, self.err.open("w") as err:
            self.popen = subprocess.Popen(
                [sys.executable, str(WORKER), str(self.job)],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=env,
            )

    def run(self, mode: str, *args: str) -> _Process:
        """Give it its job (written whole: renamed into place)."""
        temporary = self.job.with_suffix(".tmp")
        temporary.write_text(json.dumps({"mode": mode, "args": list(args)}))
        os.replace(temporary, self.job)
        return self

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def stderr(self) -> str:
        return self.err.read_text()[-3000:]

    async def wait_line(self, prefix: str, seconds: float) -> str:
        with anyio.fail_after(seconds):
            while True:
                exited = self.popen.poll() is not None
                for line in self.lines():
                    if line.startswith(prefix):
                        return line[len(prefix) :].strip()
                if exited:
                    raise AssertionError(
                        f"{self.label}: exited {self.popen.returncode} before {prefix!r}; "
                        f"stdout {self.lines()}; stderr {self.stderr()}"
                    )
                await anyio.sleep(0.02)

    async def wait_exit(self, seconds: float) -> int:
        with anyio.fail_after(seconds):
            await _until(lambda: self.popen.poll() is not None)
        return self.popen.returncode

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()  # SIGKILL also ends a SIGSTOPped process
        self.popen.wait(timeout=10)


# The worker processes each test of this module takes: started when the module's first test
# starts, so that their imports (about 3 s of CPU each) overlap the in-process tests.
WORKERS_NEEDED = {
    "test_sigterm_stops_a_trainer_that_waits_for_samples": 1,
    "test_producers_whose_trainer_is_frozen_or_killed_fail_within_their_bounds": 2,
    "test_a_trainer_sigkilled_mid_epoch_resumes_without_losing_or_repeating_a_read": 2,
}


class _Pool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.idle: list[_Process] = []
        self.every: list[_Process] = []

    def start(self) -> _Process:
        process = _Process(self.directory, f"worker-{len(self.every)}")
        self.every.append(process)
        return process

    def take(self) -> _Process:
        return self.idle.pop(0) if self.idle else self.start()

    def close(self) -> None:
        for process in self.every:
            process.stop()


@pytest.fixture(scope="module", autouse=True)
def _worker_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pool]:
    pool = _Pool(tmp_path_factory.mktemp("workers"))
    module = request.module.__name__
    needed = sum(
        WORKERS_NEEDED.get(item.name, 0)
        for item in request.session.items
        if item.module is not None and item.module.__name__ == module
    )
    try:
        pool.idle = [pool.start() for _ in range(needed)]
        yield pool
    finally:
        pool.close()


@pytest.fixture
def workers(_worker_pool: _Pool) -> Iterator[Any]:
    """``take()``: a loaded worker process (give it its job with ``run``), killed afterwards."""
    taken: list[_Process] = []

    def take() -> _Process:
        process = _worker_pool.take()
        taken.append(process)
        return process

    try:
        yield take
    finally:
        for process in taken:
            process.stop()


# --- a reference of the documented draws ---------------------------------------------------


class _Ended:
    pass


ENDED = _Ended()


class _ReferenceBuffer:
    """The draws of ``lamploop.streaming.buffer_policy``'s docstring, written apart from it."""

    def __init__(
        self, policy: str, *, capacity: int, watermark: int, seed: int, max_reads: int | None
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.watermark = watermark
        self.max_reads = max_reads
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.resident: list[list[Any]] = []  # [key, seen]
        self.received = 0
        self.reads = 0
        self.closed = False
        self.evicted: list[tuple[Any, int]] = []

    def try_put(self, key: Any) -> bool:
        if len(self.resident) == self.capacity:
            if self.policy != "reservoir":
                return False
            index = int(self.rng.integers(len(self.resident)))
            old_key, seen = self.resident[index]
            self.evicted.append((old_key, seen))
            self.resident[index] = [key, 0]
        else:
            self.resident.append([key, 0])
        self.received += 1
        return True

    def try_get(self) -> Any:
        if not self.resident:
            return ENDED if self.closed else None
        if self.received < self.watermark and not self.closed:
            return None
        index = 0 if self.policy == "fifo" else int(self.rng.integers(len(self.resident)))
        slot = self.resident[index]
        slot[1] += 1
        self.reads += 1
        leaves = (self.max_reads is not None and slot[1] >= self.max_reads) or (
            self.policy == "reservoir" and self.closed
        )
        if self.policy == "fifo":
            self.resident.pop(0)
            if not leaves:
                self.resident.append(slot)
        elif leaves:
            self.resident[index] = self.resident[-1]
            self.resident.pop()
        return slot[0]


def _make_buffer(
    policy: str, *, capacity: int, watermark: int, seed: int, max_reads: int | None, **kw: Any
) -> StreamBuffer:
    cls = {"fifo": FifoBuffer, "firo": FiroBuffer, "reservoir": ReservoirBuffer}[policy]
    return cls(capacity=capacity, watermark=watermark, seed=seed, max_reads=max_reads, **kw)


POLICY_CASES = [
    ("fifo", 1),
    ("fifo", 3),
    ("firo", 1),
    ("firo", 2),
    ("reservoir", None),
    ("reservoir", 2),
]


# --- the buffers ---------------------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("policy", "max_reads"), POLICY_CASES)
@pytest.mark.parametrize("ops_seed", [0, 1, 2])
def test_buffer_policies_make_exactly_the_documented_draws(
    policy: str, max_reads: int | None, ops_seed: int
) -> None:
    """Random interleavings of puts, reads and a close: every answer, eviction and count as
    the docstring's rules give them; FIFO and FIRO read every sample exactly max_reads times."""
    capacity, watermark, seed = 7, 4, 11 + ops_seed
    evicted: list[tuple[Any, int]] = []
    buffer = _make_buffer(
        policy,
        capacity=capacity,
        watermark=watermark,
        seed=seed,
        max_reads=max_reads,
        on_evict=lambda key, seen: evicted.append((key, seen)),
    )
    reference = _ReferenceBuffer(
        policy, capacity=capacity, watermark=watermark, seed=seed, max_reads=max_reads
    )
    ops = np.random.default_rng(ops_seed)
    next_seq = {"a": 0, "b": 0}
    put_keys: list[tuple[str, int]] = []
    reads: list[tuple[str, int]] = []
    for _ in range(400):
        if ops.random() < 0.55:
            producer = "a" if ops.random() < 0.5 else "b"
            key = (producer, next_seq[producer])
            taken = buffer.try_put(Sample(producer, key[1], {"x": torch.tensor([float(key[1])])}))
            assert taken == reference.try_put(key)
            if taken:
                next_seq[producer] += 1
                put_keys.append(key)
        else:
            got = buffer.try_get()
            expected = reference.try_get()
            assert (None if got is None else got.key) == expected
            if got is not None:
                reads.append(got.key)
        assert buffer.fill == len(reference.resident)
    buffer.close()
    reference.closed = True
    while True:
        expected = reference.try_get()
        if expected is ENDED:
            with pytest.raises(StreamEnded):
                buffer.try_get()
            break
        got = buffer.try_get()
        assert got is not None
        assert got.key == expected
        reads.append(got.key)
    assert evicted == reference.evicted
    assert buffer.received == len(put_keys) == reference.received
    assert buffer.read_total == len(reads) == reference.reads
    assert buffer.ended
    assert buffer.fill == 0
    counts = collections.Counter(reads)
    if policy != "reservoir":
        assert evicted == []
        assert counts == dict.fromkeys(put_keys, max_reads)
    else:
        # every sample put was read at least once, or evicted (possibly unread): none lost
        gone = {key for key, _ in evicted}
        assert set(put_keys) == set(counts) | gone
        if max_reads is not None:
            assert max(counts.values()) <= max_reads


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("policy", "max_reads"), POLICY_CASES)
async def test_get_batch_reads_like_successive_gets(policy: str, max_reads: int | None) -> None:
    """``get_batch(n)``: n reads in one step, the same draws as n ``get`` calls; after close,
    what is left (the last batch short)."""
    n_samples, batch = 23, 5
    buffer = _make_buffer(policy, capacity=32, watermark=n_samples, seed=4, max_reads=max_reads)
    reference = _ReferenceBuffer(policy, capacity=32, watermark=n_samples, seed=4, max_reads=max_reads)
    for seq in range(n_samples):
        await buffer.put(Sample("sim", seq, {"x": torch.tensor([float(seq)])}))
        reference.try_put(("sim", seq))
    with anyio.fail_after(5):
        first = [sample.key for sample in await buffer.get_batch(batch)]
    assert first == [reference.try_get() for _ in range(batch)]
    buffer.close()
    reference.closed = True
    expected_rest: list[Any] = []
    while (key := reference.try_get()) is not ENDED:
        expected_rest.append(key)
    got_batches: list[list[Any]] = []
    with anyio.fail_after(5):
        while True:
            try:
                got_batches.append([s.key for s in await buffer.get_batch(batch)])
            except StreamEnded:
                break
    assert [key for b in got_batches for key in b] == expected_rest
    assert all(len(b) == batch for b in got_batches[:-1])
    assert 1 <= len(got_batches[-1]) <= batch


@pytest.mark.timeout(10)
async def test_reads_wait_for_the_watermark_and_a_cancelled_wait_takes_nothing() -> None:
    buffer = FifoBuffer(capacity=10, watermark=5)
    for seq in range(4):
        await buffer.put(Sample("sim", seq, {"x": torch.zeros(1)}))
    assert buffer.try_get() is None  # 4 received < watermark 5
    with anyio.move_on_after(0.2) as scope:
        await buffer.get()
    assert scope.cancelled_caught
    with anyio.move_on_after(0.2) as scope:
        await buffer.get_batch(3)
    assert scope.cancelled_caught
    assert buffer.fill == 4
    assert buffer.read_total == 0
    await buffer.put(Sample("sim", 4, {"x": torch.zeros(1)}))
    assert [s.seq for s in await buffer.get_batch(3)] == [0, 1, 2]
    # the watermark counts samples received, not held: reads go on below it
    assert (await buffer.get()).seq == 3
    # a closed stream is read before its watermark
    closed = FifoBuffer(capacity=10, watermark=5)
    await closed.put(Sample("sim", 0, {"x": torch.zeros(1)}))
    closed.close()
    assert [s.seq for s in await _drain(closed)] == [0]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("policy", ["fifo", "firo", "reservoir"])
def test_a_buffer_restored_from_its_json_state_continues_the_same_draws(policy: str) -> None:
    """``state_dict`` (meta JSON-ready) restores a buffer exactly: the same reads, evictions
    and counters afterwards; a mistyped field is refused naming it, and changes nothing."""
    from lamploop.errors import CheckpointError

    def make() -> StreamBuffer:
        return _make_buffer(policy, capacity=6, watermark=2, seed=9, max_reads=2)

    original = make()
    ops = np.random.default_rng(5)
    seq = 0
    for _ in range(40):
        if ops.random() < 0.6:
            if original.try_put(Sample("sim", seq, {"x": torch.tensor([float(seq)])})):
                seq += 1
        else:
            original.try_get()
    tensors, meta = original.state_dict()
    meta = json.loads(json.dumps(meta))
    restored = make()
    restored.load_state_dict({name: t.clone() for name, t in tensors.items()}, meta)
    assert restored.seen_counts() == original.seen_counts()
    assert restored.last_seqs() == original.last_seqs() == {"sim": seq - 1}
    for step in range(60):
        if step % 3 == 0 and step < 45:
            for buffer in (original, restored):
                buffer.try_put(Sample("sim", seq, {"x": torch.tensor([float(seq)])}))
            seq += 1
        elif step == 45:
            original.close()
            restored.close()
        else:
            try:
                a = original.try_get()
            except StreamEnded:
                with pytest.raises(StreamEnded):
                    restored.try_get()
                continue
            b = restored.try_get()
            assert (None if a is None else (a.key, float(a.tensors["x"][0]))) == (
                None if b is None else (b.key, float(b.tensors["x"][0]))
            )
    assert original.stats() == restored.stats()
    # strictly read back: the docs' example of a mistyped field
    bad = json.loads(json.dumps(meta))
    bad["samples"][0]["seq"] = str(bad["samples"][0]["seq"])
    fresh = make()
    with pytest.raises(CheckpointError) as refused:
        fresh.load_state_dict(tensors, bad)
    name = type(fresh).__name__
    value = meta["samples"][0]["seq"]
    assert str(refused.value) == (
        f"{name}: malformed buffer state: samples[0].seq: expected an integer, got '{value}' (str)"
    )
    assert fresh.fill == 0
    assert fresh.received == 0
    assert fresh.last_seqs() == {}


def test_documented_configuration_errors() -> None:
    from lamploop.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        FifoBuffer(capacity=4, watermark=1, max_reads=None)  # puts wait: reads must end
    with pytest.raises(ConfigurationError):
        FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=None)
    with pytest.raises(ConfigurationError):
        buffer_batches(FifoBuffer(capacity=4, watermark=1), batch_size=5, batches_per_epoch=1)
    with pytest.raises(ConfigurationError):
        buffer_batches(FifoBuffer(capacity=4, watermark=1), batch_size=2, batches_per_epoch=0)
    assert StreamState(FifoBuffer(capacity=4, watermark=1)).restore(None) == {}


@pytest.mark.timeout(20)
async def test_samples_that_differ_within_a_batch_name_the_sample_epoch_and_batch() -> None:
    """Put without a receiver (nothing checks them), samples of another shape make
    ``stack_samples`` raise SampleMismatchError naming producer, seq, tensor, shapes, epoch
    and batch."""
    from lamploop.errors import BatchError, SampleMismatchError

    buffer = FifoBuffer(capacity=16, watermark=1)
    for seq in range(7):
        buffer.try_put(Sample("sim", seq, {"x": torch.zeros(4), "y": torch.tensor(0)}))
    buffer.try_put(Sample("sim", 7, {"x": torch.zeros(6), "y": torch.tensor(0)}))
    buffer.close()
    with anyio.fail_after(15), pytest.raises(SampleMismatchError) as mismatch:
        await lamploop.fit_async(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=buffer_batches(buffer, batch_size=4, batches_per_epoch=3),
            max_epochs=10,
            reporters=[],
            device="cpu",
        )
    error = mismatch.value
    assert isinstance(error, BatchError)
    assert (error.producer, error.seq, error.field) == ("sim", 7, "x")
    assert tuple(error.shape) == (6,)
    assert tuple(error.expected_shape) == (4,)
    assert (error.epoch, error.batch) == (0, 1)
    for part in ("'sim'", "7", "'x'", "6", "4"):
        assert part in str(error)


@pytest.mark.timeout(20)
async def test_uniform_samples_false_takes_samples_of_varying_shapes() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=16, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(
            buffer, token=token, expected_producers=["sim"], uniform_samples=False
        ) as receiver:
            async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                for length in (4, 6, 1, 9):
                    await producer.send({"x": torch.arange(float(length))})
                await producer.done()
            await receiver.wait_all_done()
            assert receiver.refusals == 0
            assert receiver.producers_refused == {}
            buffer.close()
            got = [s.tensors["x"] for s in await _drain(buffer)]
    assert [tuple(t.shape) for t in got] == [(4,), (6,), (1,), (9,)]
    assert all(torch.equal(torch.as_tensor(t), torch.arange(float(len(t)))) for t in got)


# --- the transport: which producer, exactly once, in order -----------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_thread", [False, True])
async def test_async_and_blocking_producers_deliver_every_sample_once_in_order(
    own_thread: bool,
) -> None:
    """Two AsyncProducers and two BlockingProducers (on threads of their own, as a plain
    simulation would be) into one FIFO smaller than what they send: every sample arrives
    exactly once, each producer's in its order, bit for bit."""
    n = 300
    token = _token()
    names = ["async-0", "async-1", "blocking-2", "blocking-3"]
    buffer = FifoBuffer(capacity=32, watermark=1)
    got: list[Sample] = []
    main_thread = threading.get_ident()

    def blocking(index: int, address: tuple[str, int]) -> tuple[int, int | None]:
        assert threading.get_ident() != main_thread
        with BlockingProducer(address, name=names[index], token=token, reconnect_timeout=20) as producer:
            for seq in range(n):
                assert producer.send(_sample(index, seq)) == seq
        return producer.next_seq, producer.acknowledged_seq

    results: dict[str, tuple[int, int | None]] = {}
    live: dict[str, AsyncProducer] = {}
    with anyio.fail_after(45):  # the module's worker processes may be loading meanwhile
        async with SampleReceiver(
            buffer, token=token, expected_producers=names, own_thread=own_thread
        ) as receiver:

            async def run_async(index: int) -> None:
                async with AsyncProducer(
                    receiver.address, name=names[index], token=token, reconnect_timeout=20
                ) as producer:
                    live[names[index]] = producer
                    for seq in range(n):
                        assert await producer.send(_sample(index, seq)) == seq
                    await producer.done()
                    results[names[index]] = (producer.next_seq, producer.acknowledged_seq)

            async def run_blocking(index: int) -> None:
                results[names[index]] = await anyio.to_thread.run_sync(blocking, index, receiver.address)

            async def consume() -> None:
                async for sample in buffer:
                    got.append(sample)

            async def close_when_done() -> None:
                await receiver.wait_all_done()
                buffer.close()

            async def acknowledged_only_once_in_the_buffer() -> None:
                while not buffer.closed:
                    for name, producer in live.items():
                        acknowledged = producer.acknowledged_seq  # read first
                        if acknowledged is not None and acknowledged >= 0:
                            assert acknowledged <= buffer.last_seqs()[name], name
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as group:
                group.start_soon(consume)
                group.start_soon(close_when_done)
                group.start_soon(acknowledged_only_once_in_the_buffer)
                group.start_soon(run_async, 0)
                group.start_soon(run_async, 1)
                group.start_soon(run_blocking, 2)
                group.start_soon(run_blocking, 3)
            assert receiver.acknowledged == dict.fromkeys(names, n - 1)
            assert receiver.refusals == 0
            assert receiver.stats.duplicates == 0
            assert receiver.stats.samples == 4 * n
            assert receiver.producers_done == frozenset(names)
    assert results == dict.fromkeys(names, (n, n - 1))
    assert len(got) == 4 * n
    per_producer: dict[str, list[int]] = collections.defaultdict(list)
    for sample in got:
        index, seq = _ids(sample)
        assert sample.producer == names[index]
        assert sample.seq == seq
        per_producer[sample.producer].append(seq)
        torch.testing.assert_close(
            torch.as_tensor(sample.tensors["x"]), _sample(index, seq)["x"], rtol=0, atol=0
        )
    assert dict(per_producer) == {name: list(range(n)) for name in names}


@pytest.mark.timeout(20)
async def test_async_producer_waits_exactly_at_its_window_and_a_full_buffer_is_no_failure() -> None:
    """``resend_window=N``: exactly N unacknowledged; a FIFO of capacity C nobody reads holds
    C, so C + N sends return and the next waits.  Waiting past ``reconnect_timeout`` (its
    connection renewed every ``ack_timeout``) is back-pressure, not a failure; once read,
    everything arrives once and in order."""
    token = _token()
    capacity, window, total = 8, 4, 40
    buffer = FifoBuffer(capacity=capacity, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            async with AsyncProducer(
                receiver.address,
                name="sim",
                token=token,
                resend_window=window,
                ack_timeout=0.5,
                reconnect_timeout=1.0,
            ) as producer:
                with anyio.move_on_after(2.0) as scope:  # 2 x reconnect_timeout
                    for seq in range(total):
                        await producer.send(_sample(0, seq))
                assert scope.cancelled_caught, "send never waited"
                assert producer.next_seq == capacity + window
                assert producer.acknowledged_seq == capacity - 1
                assert buffer.fill == capacity
                assert producer.stats.connections >= 3  # renewed every ack_timeout
                got: list[int] = []

                async def consume() -> None:
                    async for sample in buffer:
                        got.append(_ids(sample)[1])

                async with anyio.create_task_group() as group:
                    group.start_soon(consume)
                    for seq in range(producer.next_seq, total):
                        await producer.send(_sample(0, seq))
                    await producer.done()
                    await receiver.wait_all_done()
                    buffer.close()
            assert receiver.acknowledged == {"sim": total - 1}
    assert got == list(range(total))


@pytest.mark.timeout(20)
async def test_blocking_producer_send_waits_beyond_window_and_blocking_ahead() -> None:
    """``BlockingProducer.send`` waits only when its window (N) is full and beyond it
    ``BLOCKING_AHEAD`` (256) small samples wait for the loop: capacity + N + 256 sends return."""
    from lamploop.streaming.producer import BLOCKING_AHEAD

    token = _token()
    capacity, window = 8, 4
    buffer = FifoBuffer(capacity=capacity, watermark=1)
    sent = [0]
    release = threading.Event()

    def simulate(address: tuple[str, int]) -> None:
        with BlockingProducer(
            address, name="sim", token=token, resend_window=window, reconnect_timeout=20
        ) as producer:
            seq = 0
            while not (release.is_set() and seq >= 300):
                producer.send(_sample(0, seq))
                seq += 1
                sent[0] = seq

    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:  # noqa: SIM117
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, simulate, receiver.address)
                await anyio.sleep(0.8)
                stalled_at = sent[0]
                await anyio.sleep(0.3)
                assert sent[0] == stalled_at  # send waits
                release.set()
                got = []
                async for sample in buffer:
                    got.append(_ids(sample)[1])
                    if len(got) == sent[0] and release.is_set() and sent[0] >= 300:
                        await anyio.sleep(0.1)
                        if len(got) == sent[0]:
                            break
                await receiver.wait_all_done()
    assert stalled_at == capacity + window + BLOCKING_AHEAD
    assert got == list(range(sent[0]))


@pytest.mark.timeout(20)
async def test_a_restarted_producer_may_resend_from_zero_and_a_gap_is_refused() -> None:
    """A producer restarted from scratch resends from 0: the receiver holds each sample once
    (the producer learns what it holds and does not even send those); one that starts past
    what the receiver holds fails, naming the missing seqs."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)

    class Crash(Exception):
        pass

    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token) as receiver:
            with pytest.raises(Crash):  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim", token=token) as first:
                    for seq in range(10):
                        await first.send(_sample(0, seq))
                    await _until(lambda: first.acknowledged_seq == 9)
                    raise Crash
            async with AsyncProducer(receiver.address, name="sim", token=token) as again:
                for seq in range(15):
                    await again.send(_sample(0, seq))
                await again.done()
            assert again.stats.skipped == 10
            assert receiver.stats.duplicates == 0
            with pytest.raises(StreamingError, match=r"15\.\.19"):  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim", token=token, start_seq=20) as gap:
                    await gap.send(_sample(0, 20))
                    await gap.done()
            buffer.close()
            assert [_ids(s)[1] for s in await _drain(buffer)] == list(range(15))


def _awkward_sample(i: int, storage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors the caller reuses and changes after ``send``: views that are strided,
    expanded, offset, conjugate or negative, of several dtypes."""
    storage["base"].copy_(torch.arange(24, dtype=torch.float64).reshape(4, 6) + i)
    storage["complex"].copy_(torch.complex(torch.arange(3.0) + i, torch.full((3,), -1.0 - i)))
    storage["int"].fill_(i)
    return {
        "x": storage["base"].t()[1:4],  # strided and offset, float64
        "half": storage["base"][::2, ::3].to(torch.bfloat16),
        "expanded": storage["int"][:1].expand(5),  # int32, stride 0
        "flags": storage["base"][0] > (i % 6),  # bool
        "conj": storage["complex"].conj(),  # a conjugate view
        "neg": storage["complex"].conj().imag,  # float with the negative bit set
        "scalar": storage["int"][0],  # 0-d
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_send_copies_the_sample_so_the_caller_may_change_its_tensors(kind: str) -> None:
    n = 60
    token = _token()
    buffer = FifoBuffer(capacity=n, watermark=1)
    storage = {
        "base": torch.zeros(4, 6, dtype=torch.float64),
        "complex": torch.zeros(3, dtype=torch.complex64),
        "int": torch.zeros(2, dtype=torch.int32),
    }
    expected: list[dict[str, torch.Tensor]] = []

    def expect(sample: dict[str, torch.Tensor]) -> None:
        expected.append({k: v.resolve_conj().resolve_neg().clone() for k, v in sample.items()})

    def simulate(address: tuple[str, int]) -> None:
        with BlockingProducer(address, name="sim", token=token, reconnect_timeout=20) as p:
            for i in range(n):
                sample = _awkward_sample(i, storage)
                expect(sample)
                p.send(sample)  # returns at once; the loop sends it later
            for tensor in storage.values():
                tensor.fill_(-7)  # changed before the hand-over's 2 ms

    with anyio.fail_after(20):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            if kind == "blocking":
                await anyio.to_thread.run_sync(simulate, receiver.address)
            else:
                async with AsyncProducer(receiver.address, name="sim", token=token) as p:
                    for i in range(n):
                        sample = _awkward_sample(i, storage)
                        expect(sample)
                        await p.send(sample)
                    for tensor in storage.values():
                        tensor.fill_(-7)
            await receiver.wait_all_done()
            buffer.close()
            got = await _drain(buffer)
    assert [s.seq for s in got] == list(range(n))
    for sample, want in zip(got, expected, strict=True):
        assert set(sample.tensors) == set(want)
        for name, value in want.items():
            received = torch.as_tensor(sample.tensors[name])
            assert received.dtype == value.dtype, name
            assert received.shape == value.shape, name
            assert torch.equal(received.resolve_conj().resolve_neg(), value), name


@pytest.mark.timeout(20)
async def test_a_blocking_producers_lone_sample_is_handed_over_without_flush() -> None:
    """A slow simulation's sample does not wait for the next one (2 ms after it, documented)."""
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    sent = threading.Event()
    finish = threading.Event()

    def simulate(address: tuple[str, int]) -> None:
        with BlockingProducer(address, name="sim", token=token, reconnect_timeout=20) as p:
            p.send(_sample(0, 0))
            sent.set()
            finish.wait(10)  # computing the next sample

    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, simulate, receiver.address)
                await _until(sent.is_set)
                started = time.monotonic()
                while buffer.fill == 0:
                    assert time.monotonic() - started < 0.5, "the sample waited for the next"
                    await anyio.sleep(0.002)
                assert receiver.acknowledged == {"sim": 0} or buffer.fill == 1
                finish.set()
            await receiver.wait_all_done()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_producer_block_that_raises_leaves_without_waiting_for_room(kind: str) -> None:
    """Unacknowledged samples (a full buffer nobody reads) do not hold up a block that ends
    with an exception: it leaves at once, far within ``reconnect_timeout``."""
    token = _token()
    buffer = FifoBuffer(capacity=4, watermark=1)

    class SimulationFailed(Exception):
        pass

    def simulate(address: tuple[str, int]) -> float:
        with pytest.raises(SimulationFailed):  # noqa: PT012, SIM117
            with BlockingProducer(
                address, name="sim", token=token, resend_window=2, reconnect_timeout=20
            ) as p:
                for seq in range(100):  # 4 taken, 2 in the window, 94 ahead (< 256)
                    p.send(_sample(0, seq))
                time.sleep(0.3)
                failed_at = time.monotonic()
                raise SimulationFailed
        return time.monotonic() - failed_at

    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token) as receiver:
            if kind == "blocking":
                leaving = await anyio.to_thread.run_sync(simulate, receiver.address)
            else:
                with pytest.raises(SimulationFailed):  # noqa: PT012
                    async with AsyncProducer(
                        receiver.address,
                        name="sim",
                        token=token,
                        resend_window=2,
                        reconnect_timeout=20,
                    ) as p:
                        for seq in range(6):
                            await p.send(_sample(0, seq))
                        await anyio.sleep(0.3)
                        failed_at = time.monotonic()
                        raise SimulationFailed
                leaving = time.monotonic() - failed_at
            assert buffer.fill == 4
    assert leaving < 1.0, leaving


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("sample_bytes", "window"), [(1024, 256), (128 * 1024, 64)])
async def test_the_default_resend_window(sample_bytes: int, window: int) -> None:
    """Default window: up to 256 unacknowledged samples holding at most 4 MiB, and 64
    whatever their size; a FIFO of 8 nobody reads: 8 + window sends return."""
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    values = sample_bytes // 4
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:  # noqa: SIM117
            async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                with anyio.move_on_after(0.7) as scope:
                    for seq in range(400):
                        await producer.send({"x": torch.full((values,), float(seq))})
                assert scope.cancelled_caught
                assert producer.next_seq == 8 + window
                assert buffer.fill == 8
                got: list[int] = []

                async def consume() -> None:
                    async for sample in buffer:
                        got.append(int(sample.tensors["x"][0]))

                async with anyio.create_task_group() as group:
                    group.start_soon(consume)
                    await producer.done()
                    await receiver.wait_all_done()
                    buffer.close()
    assert got == list(range(8 + window))


@pytest.mark.timeout(20)
async def test_send_many_cancelled_part_of_the_way_keeps_the_samples_before_it() -> None:
    """``send_many`` cancelled while the window is full: ``next_seq`` says how many it kept,
    and nothing is lost or repeated afterwards."""
    token = _token()
    buffer = FifoBuffer(capacity=4, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:  # noqa: SIM117
            async with AsyncProducer(receiver.address, name="sim", token=token, resend_window=2) as producer:
                with anyio.move_on_after(0.5) as scope:
                    await producer.send_many(_sample(0, seq) for seq in range(20))
                assert scope.cancelled_caught
                assert producer.next_seq == 6  # 4 in the buffer, 2 in the window
                got: list[int] = []

                async def consume() -> None:
                    async for sample in buffer:
                        got.append(_ids(sample)[1])

                async with anyio.create_task_group() as group:
                    group.start_soon(consume)
                    seqs = await producer.send_many(_sample(0, seq) for seq in range(6, 12))
                    assert seqs == list(range(6, 12))
                    await producer.done()
                    await receiver.wait_all_done()
                    buffer.close()
    assert got == list(range(12))


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "kind",
    [
        "async",
        "blocking",
    ],
)
async def test_send_many_failing_part_of_the_way_keeps_the_samples_before_it(kind: str) -> None:
    """Docstring of ``send_many``: "Cancelled or failing part of the way, it has kept the
    samples before the one it stopped at (next_seq tells how many)"."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    batch = [_sample(0, 0), _sample(0, 1), {"x": torch.zeros(2000)}, _sample(0, 3)]
    outcome: dict[str, Any] = {}

    def simulate(address: tuple[str, int]) -> None:
        with BlockingProducer(
            address, name="sim", token=token, max_frame_bytes=4096, reconnect_timeout=20
        ) as producer:
            with pytest.raises(FrameError):  # 8,000 bytes > 4,096
                producer.send_many(batch)
            outcome["next_seq"] = producer.next_seq

    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            if kind == "blocking":
                await anyio.to_thread.run_sync(simulate, receiver.address)
            else:
                async with AsyncProducer(
                    receiver.address, name="sim", token=token, max_frame_bytes=4096
                ) as producer:
                    with pytest.raises(FrameError):
                        await producer.send_many(batch)
                    outcome["next_seq"] = producer.next_seq
            await receiver.wait_all_done()
            buffer.close()
            got = [_ids(s) for s in await _drain(buffer)]
    assert outcome["next_seq"] == 2
    assert got == [(0, 0), (0, 1)]


@pytest.mark.timeout(20)
async def test_strangers_are_refused_and_counted_and_honest_samples_untouched() -> None:
    """Garbage, a frame claiming to be huge, and silence past ``handshake_timeout``: each
    refused and counted, while an honest producer streams beside them."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(
            buffer, token=token, expected_producers=["sim"], handshake_timeout=0.5
        ) as receiver:
            host, port = receiver.address
            garbage = await anyio.connect_tcp(host, port)
            huge = await anyio.connect_tcp(host, port)
            silent = await anyio.connect_tcp(host, port)
            try:
                await garbage.send(b"GET / HTTP/1.1\r\n\r\n" * 50)
                await huge.send((2**31 - 1).to_bytes(4, "big") + b"x" * 64)
                async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                    for seq in range(50):
                        await producer.send(_sample(0, seq))
                    await producer.done()
                started = time.monotonic()
                while receiver.refusals < 3:
                    assert time.monotonic() - started < 5, receiver.recent_refusals
                    await anyio.sleep(0.02)
                assert receiver.refusals == 3, receiver.recent_refusals
            finally:
                for stream in (garbage, huge, silent):
                    await stream.aclose()
            await receiver.wait_all_done()
            buffer.close()
            assert [_ids(s) for s in await _drain(buffer)] == [(0, seq) for seq in range(50)]


@pytest.mark.timeout(20)
async def test_a_resumed_receiver_does_not_wait_for_finished_or_refused_producers() -> None:
    """The stream state records the producers that finished and those refused for good
    (docs: "checkpoints record it with the producers that finished"): a receiver opened from
    it waits for nobody else, and tells a finished producer that restarts from 0 what it
    holds."""
    token = _token()
    names = ["sim-0", "sim-1", "sim-2"]

    class Crash(Exception):
        pass

    buffer = FiroBuffer(capacity=64, watermark=1, seed=0, max_reads=2)
    stream = StreamState(buffer)
    with anyio.fail_after(15):
        async with stream.open_receiver(token=token, producers=names) as receiver:
            async with AsyncProducer(receiver.address, name="sim-0", token=token) as p:
                for seq in range(5):
                    await p.send(_sample(0, seq))
                await p.done()
            with pytest.raises(StreamingError):  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim-1", token=token) as p:
                    await p.send(_sample(1, 0))
                    await p.send({"x": torch.zeros(7)})
                    await p.done()
            with pytest.raises(Crash):  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim-2", token=token) as p:
                    for seq in range(3):
                        await p.send(_sample(2, seq))
                    await _until(lambda: p.acknowledged_seq == 2)
                    raise Crash  # sim-2 is not done: the run still waits for it
            with anyio.move_on_after(0.3) as waiting:
                await receiver.wait_all_done()
            assert waiting.cancelled_caught
            tensors, meta = stream.state_dict()
    assert set(meta["producers_done"]) == {"sim-0", "sim-1"}
    meta = json.loads(json.dumps(meta))
    resumed_buffer = FiroBuffer(capacity=64, watermark=1, seed=0, max_reads=2)
    resumed = StreamState(resumed_buffer)
    resumed.load_state_dict(tensors, meta)
    assert resumed_buffer.last_seqs() == {"sim-0": 4, "sim-1": 0, "sim-2": 2}
    with anyio.fail_after(15):
        async with resumed.open_receiver(token=token, producers=names) as receiver:
            async with AsyncProducer(receiver.address, name="sim-2", token=token) as p:
                for seq in range(6):  # restarted from 0
                    await p.send(_sample(2, seq))
                await p.done()
            assert p.stats.skipped == 3
            await receiver.wait_all_done()  # sim-0 finished, sim-1 refused: not waited for
            resumed_buffer.close()
            reads = collections.Counter(_ids(s) for s in await _drain(resumed_buffer))
    expected = {(0, seq): 2 for seq in range(5)} | {(1, 0): 2} | {(2, s): 2 for s in range(6)}
    assert reads == expected


@pytest.mark.timeout(20)
async def test_two_ranks_each_get_their_round_robin_share_of_the_producers() -> None:
    """Producers know rank 0's receiver only; once the ranks met it redirects each to its
    rank by round-robin over the sorted names (three producers, two ranks: rank 0 trains on
    two, rank 1 on one), and a producer that reconnects goes back to the same rank."""
    from lamploop.streaming.state import producers_of_rank

    token = _token()
    names = ["sim-c", "sim-a", "sim-b"]
    assert producers_of_rank(names, 0, 2) == ["sim-a", "sim-c"]
    assert producers_of_rank(names, 1, 2) == ["sim-b"]
    buffers = [FifoBuffer(capacity=64, watermark=1) for _ in range(2)]
    streams = [StreamState(buffer) for buffer in buffers]
    with anyio.fail_after(15):
        async with (
            streams[0].open_receiver(token=token, producers=names, nranks=2, rank=0) as root,
            streams[1].open_receiver(token=token, producers=names, nranks=2, rank=1) as other,
        ):
            infos = [stream.rank_info() for stream in streams]
            for rank, stream in enumerate(streams):
                stream.ranks_joined(infos, rank)
            await streams[0].wait_ranks_joined()

            async def produce(index: int, count: int) -> None:
                name = sorted(names)[index]
                async with AsyncProducer(root.address, name=name, token=token) as producer:
                    for seq in range(count):
                        await producer.send(_sample(index, seq))
                    await producer.done()

            async with anyio.create_task_group() as group:
                for index in range(3):
                    group.start_soon(produce, index, 10)
            await root.wait_all_done()
            await other.wait_all_done()
            for buffer in buffers:
                buffer.close()
            shares = [collections.Counter(s.producer for s in await _drain(b)) for b in buffers]
    assert shares == [{"sim-a": 10, "sim-c": 10}, {"sim-b": 10}]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_dropped_connections_lose_and_repeat_nothing(kind: str) -> None:
    """Connections cut after 100-800 KiB each: the producer reconnects and resends what was
    not acknowledged, the receiver drops the duplicates: every sample once, in order."""
    n = 2000
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    payload = torch.arange(256, dtype=torch.float32)  # 1 KiB

    def make(seq: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([0.0, float(seq), 0.5]), "payload": payload + seq}

    def simulate(address: tuple[str, int]) -> Any:
        with BlockingProducer(address, name="sim", token=token, reconnect_timeout=20) as p:
            for seq in range(n):
                p.send(make(seq))
        return p.stats

    got: list[Sample] = []
    with anyio.fail_after(30):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:  # noqa: SIM117
            async with anyio.create_task_group() as proxies:
                draws = np.random.default_rng(0)  # a flaky network: each connection cut after 100-800 KiB
                proxy = await cutting_relay(
                    receiver.address, lambda: int(draws.integers(100_000, 800_000)), proxies
                )

                async def consume() -> None:
                    async for sample in buffer:
                        got.append(sample)

                async with anyio.create_task_group() as group:
                    group.start_soon(consume)
                    if kind == "blocking":
                        stats = await anyio.to_thread.run_sync(simulate, proxy)
                    else:
                        async with AsyncProducer(
                            proxy, name="sim", token=token, reconnect_timeout=20
                        ) as producer:
                            for seq in range(n):
                                await producer.send(make(seq))
                        stats = producer.stats
                    await receiver.wait_all_done()
                    buffer.close()
                proxies.cancel_scope.cancel()
    assert stats.connections >= 5, stats  # it was cut, and came back
    assert [_ids(s)[1] for s in got] == list(range(n))
    for sample in got:
        seq = _ids(sample)[1]
        assert torch.equal(torch.as_tensor(sample.tensors["payload"]), payload + seq)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_producer_whose_receiver_never_listens_fails_after_reconnect_timeout(
    kind: str,
) -> None:
    """Nothing listens: the producer keeps trying for ``reconnect_timeout`` seconds, then the
    call that waits (``done``; for BlockingProducer also ``flush``) raises StreamingError."""
    token = _token()
    address = ("127.0.0.1", free_port())
    reconnect_timeout = 1.0

    def simulate() -> float:
        started = time.monotonic()
        with pytest.raises(StreamingError):  # noqa: PT012, SIM117
            with BlockingProducer(address, name="sim", token=token, reconnect_timeout=reconnect_timeout) as p:
                p.send(_sample(0, 0))
                p.flush()
        return time.monotonic() - started

    with anyio.fail_after(15):
        if kind == "blocking":
            elapsed = await anyio.to_thread.run_sync(simulate)
        else:
            started = time.monotonic()
            with pytest.raises(StreamingError):  # noqa: PT012
                async with AsyncProducer(
                    address, name="sim", token=token, reconnect_timeout=reconnect_timeout
                ) as producer:
                    await producer.send(_sample(0, 0))
                    await producer.done()
            elapsed = time.monotonic() - started
    assert reconnect_timeout * 0.75 <= elapsed <= reconnect_timeout + 2.0, elapsed


@pytest.mark.timeout(20)
async def test_a_blocking_producer_raises_a_refusal_on_its_next_call() -> None:
    """A failure in the background (a wrong token) is raised by the next ``send``, ``flush``
    or ``done``: here ``flush``, at once, as the HandshakeError."""
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)

    def simulate(address: tuple[str, int]) -> float:
        started = time.monotonic()
        with pytest.raises(HandshakeError, match="token"):  # noqa: PT012, SIM117
            with BlockingProducer(address, name="sim", token=_token(), reconnect_timeout=20) as p:
                p.send(_sample(0, 0))
                p.flush()
        return time.monotonic() - started

    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token) as receiver:
            elapsed = await anyio.to_thread.run_sync(simulate, receiver.address)
            assert receiver.refusals == 1
    assert elapsed < 5


@pytest.mark.timeout(20)
async def test_send_after_done_or_outside_the_block_raises_streaming_error() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token) as receiver:
            producer = AsyncProducer(receiver.address, name="sim", token=token)
            with pytest.raises(StreamingError):
                await producer.send(_sample(0, 0))  # not entered
            async with producer:
                await producer.send(_sample(0, 0))
                await producer.done()
                with pytest.raises(StreamingError):
                    await producer.send(_sample(0, 1))  # done
            assert buffer.fill == 1


@pytest.mark.timeout(20)
async def test_an_idle_connection_is_closed_and_the_producer_comes_back() -> None:
    """``idle_timeout``: a producer's silent connection is closed; it reconnects when it has
    something to send, and nothing is lost or repeated."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(
            buffer, token=token, idle_timeout=0.3, expected_producers=["sim"]
        ) as receiver:
            async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                for seq in range(5):
                    await producer.send(_sample(0, seq))
                await anyio.sleep(0.8)  # the simulation computes: the connection idles
                for seq in range(5, 10):
                    await producer.send(_sample(0, seq))
                await producer.done()
            await receiver.wait_all_done()
            assert receiver.refusals == 0
            buffer.close()
            assert [_ids(s)[1] for s in await _drain(buffer)] == list(range(10))
    assert producer.stats.connections == 2


@pytest.mark.timeout(20)
async def test_one_connection_too_many_handshaking_drops_the_oldest() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(
            buffer, token=token, handshake_timeout=10, max_pending_handshakes=2
        ) as receiver:
            streams = []
            try:
                for _ in range(3):
                    streams.append(await anyio.connect_tcp(*receiver.address))
                    await anyio.sleep(0.05)
                with anyio.fail_after(2):  # far within handshake_timeout
                    with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):  # noqa: PT012
                        while True:
                            await streams[0].receive()
                with anyio.move_on_after(0.3) as still_open:
                    while True:
                        await streams[2].receive()
                assert still_open.cancelled_caught
                assert receiver.refusals == 1
            finally:
                for stream in streams:
                    await stream.aclose()


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.timeout(20)
async def test_a_producer_not_in_the_list_is_refused_at_the_handshake_naming_it() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    stream = StreamState(buffer)
    with anyio.fail_after(15):
        async with stream.open_receiver(token=token, producers=["sim-0"]) as receiver:
            started = time.monotonic()
            with pytest.raises(HandshakeError) as refused:  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim-7", token=token) as stranger:
                    await stranger.send(_sample(7, 0))
                    await stranger.done()
            assert time.monotonic() - started < 5  # refused, not retried for reconnect_timeout
            host, port = receiver.address
            assert str(refused.value) == (
                f"producer 'sim-7' refused by the receiver at {host}:{port}: "
                "producer 'sim-7' is not one of this run's producers (['sim-0'])"
            )
            assert receiver.refusals == 1
            assert any("'sim-7'" in line for line in receiver.recent_refusals)
            async with AsyncProducer(receiver.address, name="sim-0", token=token) as honest:
                for seq in range(20):
                    await honest.send(_sample(0, seq))
                await honest.done()
            await receiver.wait_all_done()
            buffer.close()
            assert [_ids(s) for s in await _drain(buffer)] == [(0, seq) for seq in range(20)]


@pytest.mark.timeout(20)
async def test_a_wrong_token_is_refused_and_counted() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token) as receiver:
            with pytest.raises(HandshakeError, match="token") as refused:  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim", token=_token()) as p:
                    await p.send(_sample(0, 0))
                    await p.done()
            assert "'sim'" in str(refused.value)
            assert receiver.refusals == 1
            assert buffer.fill == 0
            assert buffer.received == 0


@pytest.mark.timeout(30)
async def test_a_sample_of_another_shape_mid_stream_refuses_its_producer_for_good() -> None:
    """The docs' example: the refused producer is told why, its earlier samples (in the same
    frame) stay and are trained on, ``wait_all_done`` does not wait for it, it stays refused."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    names = ["sim-0", "sim-1"]

    def good(index: int, seq: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(index), float(seq), 0.0, 0.0]), "y": torch.tensor(1)}

    with anyio.fail_after(20):
        async with SampleReceiver(buffer, token=token, expected_producers=names) as receiver:
            async with AsyncProducer(receiver.address, name="sim-0", token=token) as first:
                for seq in range(10):
                    await first.send(good(0, seq))
                await first.done()
            with pytest.raises(StreamingError) as refused:  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim-1", token=token) as bad:
                    await bad.send_many([good(1, seq) for seq in range(7)])  # one frame
                    await bad.send({"x": torch.zeros(6), "y": torch.tensor(1)})
                    for seq in range(8, 12):
                        await bad.send(good(1, seq))
                    await bad.done()
            host, port = receiver.address
            assert str(refused.value).startswith(
                f"producer 'sim-1' refused by the receiver at {host}:{port}: sample seq 7 does "
                "not match the stream's samples: tensor 'x' has shape [6] (float32), not [4] "
                "(float32) (as in its first sample, seq 0 of producer 'sim-0')"
            )
            assert set(receiver.producers_refused) == {"sim-1"}
            assert "seq 7" in receiver.producers_refused["sim-1"]
            assert receiver.refusals == 1
            await receiver.wait_all_done()  # sim-0 done, sim-1 refused
            # refused for good: the same name, now with good samples, is not taken
            with pytest.raises(LamploopError, match="refused"):  # noqa: PT012
                async with AsyncProducer(receiver.address, name="sim-1", token=token, start_seq=7) as back:
                    await back.send(good(1, 7))
                    await back.done()
            assert receiver.acknowledged == {"sim-0": 9, "sim-1": 6}
            buffer.close()
            trained: list[tuple[int, int]] = []

            class Recording(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.linear = torch.nn.Linear(4, 2)

                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    trained.extend((int(a), int(b)) for a, b in x[:, :2].tolist())
                    return self.linear(x)

            state = await lamploop.fit_async(
                model=lamploop.SupervisedModel(Recording(), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=buffer_batches(buffer, batch_size=5, batches_per_epoch=2),
                max_epochs=100,
                reporters=[],
                device="cpu",
            )
    expected = [(0, seq) for seq in range(10)] + [(1, seq) for seq in range(7)]
    assert trained == expected  # FIFO: in arrival order, each once
    assert state is not None
    assert state.epoch == 2


@pytest.mark.timeout(20)
async def test_a_sample_over_the_producers_frame_limit_is_refused_and_costs_no_seq() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            async with AsyncProducer(
                receiver.address, name="sim", token=token, max_frame_bytes=70_000
            ) as producer:
                assert await producer.send(_sample(0, 0)) == 0
                with pytest.raises(FrameError, match=r"70000"):
                    await producer.send({"x": torch.zeros(40_000)})  # 160,000 bytes
                assert producer.next_seq == 1
                assert await producer.send(_sample(0, 1)) == 1
                await producer.done()
            await receiver.wait_all_done()
            assert receiver.refusals == 0
            buffer.close()
            assert [_ids(s) for s in await _drain(buffer)] == [(0, 0), (0, 1)]


@pytest.mark.timeout(20)
async def test_a_sample_over_the_receivers_frame_limit_fails_the_producer_naming_it() -> None:
    """The receiver announces its ``max_frame_bytes``; a sample that cannot fit fails the
    producer at once (an error naming the sample and the limit), not after a timeout."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(
            buffer, token=token, max_frame_bytes=65_536, uniform_samples=False
        ) as receiver:
            started = time.monotonic()
            with pytest.raises(LamploopError) as failed:  # noqa: PT012
                async with AsyncProducer(
                    receiver.address, name="sim", token=token, reconnect_timeout=30
                ) as producer:
                    await producer.send(_sample(0, 0))
                    await _until(lambda: producer.acknowledged_seq == 0)
                    await producer.send({"x": torch.zeros(40_000)})
                    await producer.done()
            assert time.monotonic() - started < 5
            assert isinstance(failed.value, (StreamingError, FrameError))
            assert "65536" in str(failed.value)
            assert "1" in str(failed.value)
            assert buffer.fill == 1  # the sample before it was taken


@pytest.mark.timeout(20)
async def test_a_sample_after_the_buffer_closed_refuses_its_producer_and_the_run_goes_on() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    with anyio.fail_after(15):
        async with SampleReceiver(buffer, token=token) as receiver:
            buffer.close()
            with pytest.raises(StreamingError, match="arrived after the trainer closed its buffer"):  # noqa: PT012
                async with AsyncProducer(receiver.address, name="late", token=token) as producer:
                    await producer.send(_sample(0, 0))
                    await producer.done()
            assert receiver.refusals == 1
        # leaving the receiver raised nothing: the run was not ended by the late sample


# --- the receiver on its own thread --------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("own_thread", [False, True])
async def test_reservoir_via_receiver_evicts_exactly_the_overflow(own_thread: bool) -> None:
    """A reservoir never makes producers wait: N samples into capacity C evict exactly N - C
    (on the receiver's thread with ``own_thread``); the drain reads the C left once each."""
    token = _token()
    n, capacity = 200, 16
    evictions: list[tuple[Any, int, int]] = []
    buffer = ReservoirBuffer(
        capacity=capacity,
        watermark=1,
        seed=3,
        on_evict=lambda key, seen: evictions.append((key, seen, threading.get_ident())),
    )
    with anyio.fail_after(15):
        async with SampleReceiver(
            buffer, token=token, expected_producers=["sim"], own_thread=own_thread
        ) as receiver:
            async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                for seq in range(n):
                    await producer.send(_sample(0, seq))
                await producer.done()
            await receiver.wait_all_done()
            buffer.close()
            drained = [s.key for s in await _drain(buffer)]
    assert len(evictions) == n - capacity
    assert all(seen == 0 for _, seen, _ in evictions)
    assert len(drained) == capacity
    assert collections.Counter([k for k, _, _ in evictions] + drained) == {
        ("sim", seq): 1 for seq in range(n)
    }
    threads = {ident for _, _, ident in evictions}
    if own_thread:
        assert threading.get_ident() not in threads
    else:
        assert threads == {threading.get_ident()}


@pytest.mark.timeout(10)
async def test_own_thread_receiver_on_a_taken_port_names_it_and_leaves_no_thread() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = _user_threads()
        with pytest.raises(StreamingError, match=str(port)):
            async with SampleReceiver(
                FifoBuffer(capacity=4, watermark=1), token=_token(), port=port, own_thread=True
            ):
                pass
        assert _user_threads() == before


@pytest.mark.timeout(20)
@pytest.mark.parametrize("body", ["sleeps", "waits_all_done"])
@pytest.mark.parametrize("own_thread", [False, True])
async def test_a_failing_put_cancels_the_block_and_raises_streaming_error(
    own_thread: bool, body: str
) -> None:
    """The buffer already holds seqs 0..2 of 'sim' (the receiver was not told): its put of the
    producer's seq 0 raises DuplicateSampleError, which cancels the block's body and is raised
    on leaving as a StreamingError caused by it; no thread is left."""
    from lamploop.errors import DuplicateSampleError

    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    for seq in range(3):
        buffer.try_put(Sample("sim", seq, {"x": torch.zeros(3)}))
    before = _user_threads()
    body_finished = False
    started = time.monotonic()
    with anyio.fail_after(15):
        with pytest.raises(StreamingError) as failed:  # noqa: PT012
            async with SampleReceiver(  # noqa: SIM117
                buffer, token=token, own_thread=own_thread, expected_producers=["sim"]
            ) as receiver:
                async with AsyncProducer(
                    receiver.address, name="sim", token=token, reconnect_timeout=5
                ) as producer:
                    await producer.send(_sample(0, 0))
                    if body == "sleeps":
                        await anyio.sleep(10)
                    else:
                        await receiver.wait_all_done()
                    body_finished = True
    assert not body_finished
    assert time.monotonic() - started < 5
    assert isinstance(failed.value.__cause__, DuplicateSampleError)
    assert _user_threads() == before


# --- training on the stream ----------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("own_thread", [False, True])
async def test_training_on_a_firo_stream_equals_plain_torch_on_the_documented_draws(
    own_thread: bool,
) -> None:
    """The trainer waits for a producer that starts late (no failure), then trains; with the
    watermark at the stream's length the FIRO draws are the documented ones, so the model
    equals plain torch SGD on those batches; 60 samples read twice in batches of 10, 4 an
    epoch: 3 epochs, then the stream ends the run."""
    n, batch, per_epoch, seed, lr = 60, 10, 4, 5, 0.1
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(n, 4, generator=generator)
    labels = (features[:, 0] + features[:, 1] > 0).long()
    torch.manual_seed(1)
    module = torch.nn.Linear(4, 2)
    reference_module = copy.deepcopy(module)
    token = _token()
    buffer = FiroBuffer(capacity=64, watermark=n, seed=seed, max_reads=2)
    started = time.monotonic()
    with anyio.fail_after(20):
        async with SampleReceiver(
            buffer, token=token, expected_producers=["sim"], own_thread=own_thread
        ) as receiver:

            async def produce() -> None:
                await anyio.sleep(1.0)  # a simulation that starts late
                async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                    for i in range(n):
                        await producer.send({"x": features[i], "y": labels[i]})
                await receiver.wait_all_done()
                buffer.close()

            async with anyio.create_task_group() as group:
                group.start_soon(produce)
                state = await lamploop.fit_async(
                    model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=lr),
                    train_batches=buffer_batches(buffer, batch_size=batch, batches_per_epoch=per_epoch),
                    max_epochs=1000,
                    reporters=[],
                    device="cpu",
                )
    assert time.monotonic() - started >= 1.0
    assert state is not None
    assert state.epoch == 3
    assert [entry.epoch for entry in state.learning_curve] == [0, 1, 2]  # not the empty 4th
    reference = _ReferenceBuffer("firo", capacity=64, watermark=n, seed=seed, max_reads=2)
    for i in range(n):
        reference.try_put(i)
    reference.closed = True
    order: list[int] = []
    while (key := reference.try_get()) is not ENDED:
        order.append(key)
    assert collections.Counter(order) == dict.fromkeys(range(n), 2)
    optimizer = torch.optim.SGD(reference_module.parameters(), lr=lr)
    for start in range(0, len(order), batch):
        index = torch.tensor(order[start : start + batch])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference_module(features[index]), labels[index]).backward()
        optimizer.step()
    for name, value in reference_module.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
async def test_a_stop_request_ends_the_drivers_wait_for_samples() -> None:
    """docs/streaming.md: with the drivers, wrap the factory in ``stop_aware_batches`` and pass
    the same StopRequest as ``stop=``: a trainer waiting for samples (3 held, batches of 8)
    stops at the start of the epoch, at once, having taken no sample."""
    from lamploop.errors import TrainingInterrupted
    from lamploop.loop.stop_aware import stop_aware_batches
    from lamploop.loop.stop_request import StopRequest

    buffer = FifoBuffer(capacity=16, watermark=1)
    for seq in range(3):
        buffer.try_put(Sample("sim", seq, {"x": torch.zeros(3), "y": torch.tensor(0)}))
    stop = StopRequest()
    inner = buffer_batches(buffer, batch_size=8, batches_per_epoch=2)
    waiting = anyio.Event()

    def factory(context: Any) -> Any:
        waiting.set()
        return inner(context)

    requested_at = 0.0

    async def request_later() -> None:
        nonlocal requested_at
        await waiting.wait()
        await anyio.sleep(0.5)  # waits, as long as it takes: no failure meanwhile
        requested_at = time.monotonic()
        stop.request("test")

    outcome: list[BaseException] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(request_later)
            try:
                await lamploop.drive_distributed_training(
                    nranks=1,
                    device="cpu",
                    control=None,
                    model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), lamploop.cross_entropy_loss),
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                    train_batches=stop_aware_batches(factory, stop),
                    validation_batches=None,
                    max_epochs=100,
                    stop=stop,
                )
            except TrainingInterrupted as error:
                outcome.append(error)
            stopped_after = time.monotonic() - requested_at
    assert len(outcome) == 1, "no TrainingInterrupted"
    assert stopped_after < 0.5, stopped_after
    error = outcome[0]
    assert isinstance(error, TrainingInterrupted)
    assert (error.epoch, error.steps_done, error.reason) == (0, 0, "test")
    assert buffer.fill == 3
    assert buffer.read_total == 0


def test_stop_request_is_where_the_stop_aware_docstring_says() -> None:
    import lamploop.distributed

    assert hasattr(lamploop.distributed, "StopRequest")


# --- processes: stops, trainers gone, resume -------------------------------------------------


@pytest.mark.timeout(40)
async def test_sigterm_stops_a_trainer_that_waits_for_samples(tmp_path: Path, workers: Any) -> None:
    """A trainer with fewer samples than a batch waits (it does not fail); SIGTERM ends the
    wait at the start of the epoch (about 0.15 s, documented), with a checkpoint written and
    no sample taken out of the buffer."""
    ckpt = tmp_path / "ckpt"
    trainer = workers().run("sigterm", str(ckpt), _token())
    await trainer.wait_line("WAITING", 60)
    await anyio.sleep(1.0)
    assert trainer.popen.poll() is None, trainer.stderr()  # still waiting, no failure
    sent = time.time()
    trainer.popen.send_signal(signal.SIGTERM)
    info = json.loads(await trainer.wait_line("INTERRUPTED", 10))
    assert await trainer.wait_exit(10) == 0
    latency = info["t"] - sent
    assert latency < 1.0, f"SIGTERM to TrainingInterrupted took {latency:.2f} s"
    assert info["reason"] == "SIGTERM"
    assert info["steps_done"] == 0
    assert info["epoch"] == 0
    assert info["fill"] == 3
    assert info["read_total"] == 0
    assert info["checkpoint_files"], "no checkpoint written"


@pytest.mark.timeout(45)
async def test_producers_whose_trainer_is_frozen_or_killed_fail_within_their_bounds(
    workers: Any,
) -> None:
    """One trainer process (a FIFO of 8 nobody reads), two producers:

    - an AsyncProducer (``ack_timeout`` 0.5 s, ``reconnect_timeout`` 1 s,
      ``handshake_timeout`` 0.5 s): the trainer frozen by SIGSTOP keeps its connections open;
      the producer notices after ``ack_timeout`` and fails once ``reconnect_timeout`` passed;
    - a BlockingProducer process (``reconnect_timeout`` 1.5 s) whose ``send`` waits for room in
      its window: the trainer then SIGKILLed, it fails ``reconnect_timeout`` seconds later
      and its process exits.
    """
    token = _token()
    ack_timeout, reconnect_timeout, handshake_timeout = 0.5, 1.0, 0.5
    blocking_reconnect_timeout = 1.5
    trainer = workers().run("hold", "8", token)
    blocking = workers()
    port = await trainer.wait_line("PORT", 60)
    frozen_at = 0.0
    with anyio.fail_after(30):
        with pytest.raises(StreamingError) as failed:  # noqa: PT012
            async with AsyncProducer(
                ("127.0.0.1", int(port)),
                name="sim-async",
                token=token,
                resend_window=4,
                ack_timeout=ack_timeout,
                reconnect_timeout=reconnect_timeout,
                handshake_timeout=handshake_timeout,
            ) as producer:
                for seq in range(5):
                    await producer.send(_sample(0, seq))
                await _until(lambda: producer.acknowledged_seq == 4)
                blocking.run("bproducer", port, token, str(blocking_reconnect_timeout))
                await blocking.wait_line("STARTED", 60)
                await anyio.sleep(1.0)  # 8 in the buffer, 4 in its window, 256 ahead: waits
                assert blocking.popen.poll() is None, blocking.stderr()
                trainer.popen.send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
                for seq in range(5, 10_000):
                    await producer.send(_sample(0, seq))
                await producer.done()
    frozen_for = time.monotonic() - frozen_at
    assert "could not reach" in str(failed.value) or "receiver" in str(failed.value)
    assert frozen_for <= ack_timeout + reconnect_timeout + handshake_timeout + 2.0, frozen_for
    assert blocking.popen.poll() is None  # default ack_timeout (300 s): still waiting
    killed = time.time()
    trainer.popen.kill()
    status = await blocking.wait_exit(blocking_reconnect_timeout + 10)
    exited = time.time()
    report = json.loads(await blocking.wait_line("FAILED", 1))
    assert status == 3, blocking.stderr()
    assert report["type"] == "StreamingError", report
    failed_after = report["t"] - killed
    assert blocking_reconnect_timeout * 0.75 <= failed_after <= blocking_reconnect_timeout + 3.0
    assert exited - killed <= blocking_reconnect_timeout + 4.0


@pytest.mark.timeout(60)
async def test_a_trainer_sigkilled_mid_epoch_resumes_without_losing_or_repeating_a_read(
    tmp_path: Path, workers: Any
) -> None:
    """FIRO, ``max_reads=2``: the reads of the killed run up to its last checkpoint, plus
    the resumed run's, read every sample of both producers exactly twice, in 10 epochs."""
    token = _token()
    n, names = 60, ["sim-0", "sim-1"]
    port = free_port()
    ckpt, log = tmp_path / "ckpt", tmp_path / "batches.log"
    finished = anyio.Event()
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(2, n, 2, generator=generator)

    async def produce(index: int) -> None:
        async with AsyncProducer(
            ("127.0.0.1", port),
            name=names[index],
            token=token,
            keep_acknowledged=10 * n,
            reconnect_timeout=40,
        ) as producer:
            for seq in range(n):
                x = torch.cat([torch.tensor([float(1000 * index + seq)]), noise[index, seq]])
                await producer.send({"x": x, "y": (x[1] > 0).long()})
            await producer.done()
            await finished.wait()  # alive until the trainer ends (the docs' advice)

    def log_lines() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    with anyio.fail_after(55):
        args = [str(port), str(ckpt), token, str(log), "2"]
        first = workers().run("resume", *args, "0.03")
        second = workers()  # loaded, waiting for its job
        await first.wait_line("READY", 60)
        async with anyio.create_task_group() as group:
            group.start_soon(produce, 0)
            group.start_soon(produce, 1)
            while True:  # kill inside epoch 2 (0-based), after the checkpoint of epoch 1
                lines = log_lines()
                if "E 2" in lines and lines[-1].startswith("B") and lines.index("E 2") < len(lines) - 1:
                    break
                assert first.popen.poll() is None, first.stderr()
                await anyio.sleep(0.005)
            first.popen.kill()
            first.popen.wait(timeout=10)
            run1 = log_lines()
            assert not any(line.startswith("DONE") for line in first.lines())
            second.run("resume", *args, "0")
            done = json.loads(await second.wait_line("DONE", 40))
            finished.set()
        assert await second.wait_exit(10) == 0
    run2 = log_lines()[len(run1) :]
    assert run2[0].startswith("START")
    assert json.loads(run2[0][6:]) != {}
    epochs2 = [int(line[2:]) for line in run2 if line.startswith("E ")]
    resumed_from = epochs2[0] - 1
    assert resumed_from >= 2
    assert epochs2 == list(range(resumed_from + 1, 11))
    kept = run1[: run1.index(f"E {resumed_from}")]
    reads = [int(v) for line in kept + run2 if line.startswith("B ") for v in line[2:].split()]
    expected = {1000 * index + seq: 2 for index in range(2) for seq in range(n)}
    assert collections.Counter(reads) == expected
    assert done == {"epoch": 10, "fill": 0}
    # the checkpoint holds the stream as extra-stream.safetensors, listed with its sha256
    latest = max(ckpt.glob("epoch-*"))
    extra = latest / "extra-stream.safetensors"
    assert extra.is_file()
    digest = hashlib.sha256(extra.read_bytes()).hexdigest()
    assert digest in (latest / "checkpoint.json").read_text()
    # and is restored only into a buffer it fits
    from lamploop.errors import CheckpointError

    for misfit in (
        FifoBuffer(capacity=16, watermark=8),
        FiroBuffer(capacity=32, watermark=8, seed=0, max_reads=2),
        FiroBuffer(capacity=16, watermark=8, seed=0, max_reads=3),
    ):
        with pytest.raises(CheckpointError):
            StreamState(misfit).restore(ckpt)
    fits = FiroBuffer(capacity=16, watermark=8, seed=0, max_reads=2)
    assert StreamState(fits).restore(ckpt) == {"sim-0": n - 1, "sim-1": n - 1}
    assert fits.ended or fits.fill == 0
