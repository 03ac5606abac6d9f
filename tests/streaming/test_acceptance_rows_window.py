"""Acceptance tests, written from the documentation only, for received samples as rows and the
producers' default resend window.

What they hold the code to (docs/streaming.md, "The transport" and the sixth round of
"Throughput"; CHANGELOG, "Changed"):

- A received sample's tensors are a ``SampleRow``: a read-only ``Mapping[str, Tensor]``.
  ``stack_samples``, the collate of ``buffer_batches``, gives a batch equal bitwise to
  ``torch.stack`` of the samples' tensors, and a copy: changing it in place changes no sample
  that a buffer still holds.  (Checked for samples that share a frame and for samples that
  travel alone in theirs, a slow simulation's.)
- The producers' default ``resend_window=None`` keeps up to 256 unacknowledged samples that
  hold at most 4 MiB together, and 64 whatever their size; ``resend_window=N`` keeps exactly N; a
  producer's ``send`` waits while its window is full (a receiver whose sink takes nothing).
  ``BlockingProducer.send`` waits once, beyond the window, ``BLOCKING_AHEAD`` (256) samples
  (or 4 MiB) are not taken by the loop.

Every sample's tensors are made from its seq by a seeded generator (float64 and int64, 2-D),
so the tests know exactly what each batch must be.  Not written from lamploop's source.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import torch
from support import ROOT

from lamploop.errors import StreamEnded
from lamploop.streaming import FifoBuffer, FiroBuffer, Sample, StreamBuffer, stack_samples
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.sample_rows import SampleRow

pytestmark = pytest.mark.anyio

TOKEN = secrets.token_hex(16)

# The samples, shared (as source) by the test and the producer processes it starts.
SAMPLE_SOURCE = '''
import torch

SHAPES = {"small": ((3, 5), (2, 3)), "large": ((48, 96), (4, 8))}


def make_sample(seq, kind):
    """Sample ``seq``: ``x`` float64 and ``y`` int64, both 2-D, drawn from a generator seeded by seq."""
    x_shape, y_shape = SHAPES[kind]
    generator = torch.Generator().manual_seed(1000 + seq)
    x = torch.randn(x_shape, generator=generator, dtype=torch.float64)
    y = torch.randint(-(2**40), 2**40, y_shape, generator=generator, dtype=torch.int64)
    return {"x": x, "y": y}
'''
_namespace: dict[str, Any] = {}
exec(SAMPLE_SOURCE, _namespace)
make_sample = _namespace["make_sample"]

ASYNC_PRODUCER_SCRIPT = (
    SAMPLE_SOURCE
    + """
import os
import sys

import anyio

from lamploop.streaming.producer import AsyncProducer


async def main():
    port, name, count, kind = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    pause = float(sys.argv[5])  # seconds between two sends (0: as fast as it goes)
    token = os.environ["ACCEPTANCE_ROWS_TOKEN"]
    async with AsyncProducer(("127.0.0.1", port), name=name, token=token, reconnect_timeout=15.0) as p:
        for seq in range(count):
            assert await p.send(make_sample(seq, kind)) == seq
            if pause:
                await anyio.sleep(pause)
        await p.done()


anyio.run(main)
"""
)

BLOCKING_PRODUCER_SCRIPT = (
    SAMPLE_SOURCE
    + """
import os
import sys

from lamploop.streaming.producer import BlockingProducer

port, name, count, kind = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]  # argv[5]: unused
token = os.environ["ACCEPTANCE_ROWS_TOKEN"]
with BlockingProducer(("127.0.0.1", port), name=name, token=token, reconnect_timeout=15.0) as p:
    for seq in range(count):
        assert p.send(make_sample(seq, kind)) == seq
    p.done()
"""
)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (float64 as int64), for a bitwise comparison."""
    return tensor.view(torch.int64) if tensor.dtype == torch.float64 else tensor


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _check_sample(sample: Sample, kind: str, what: str) -> None:
    expected = make_sample(sample.seq, kind)
    assert set(sample.tensors) == {"x", "y"}, what
    for name in ("x", "y"):
        got = sample.tensors[name]
        assert _bitwise_equal(got, expected[name]), (
            f"{what}: sample seq {sample.seq}'s {name!r} is not what its producer sent"
        )


def _assignment_raises(sample: Sample) -> bool:
    """Whether ``sample.tensors`` refuses item assignment and deletion (``TypeError``).

    It assigns each tensor its own value, so a mapping that takes it is left as it was."""
    tensors: Any = sample.tensors
    for name in ("x", "y"):
        value = tensors[name]
        try:
            tensors[name] = value
        except TypeError:
            pass
        else:
            return False
    try:
        del tensors["missing"]
    except TypeError:
        return True
    except KeyError:
        return False
    return False


async def _run_producer(script: str, port: int, name: str, count: int, kind: str, pause: float = 0.0) -> None:
    """The producer, in a process of its own (``sys.executable -c``), to 127.0.0.1:port."""
    env = {**os.environ, "ACCEPTANCE_ROWS_TOKEN": TOKEN}
    argv = [sys.executable, "-c", script, str(port), name, str(count), kind, str(pause)]
    result = await anyio.run_process(argv, env=env, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr.decode()[-3000:]


async def _stream_and_check_batches(
    buffer: StreamBuffer, script: str, *, count: int, kind: str, batch_size: int, max_reads: int
) -> list[int]:
    """Stream ``count`` samples from a producer process into ``buffer``; draw batches with
    ``stack_samples()`` while they arrive, check each against ``torch.stack`` of what was sent,
    then scribble over it and check that the samples it holds (still in the buffer while read
    fewer than ``max_reads`` times) are untouched.  Returns the seqs in the order read."""
    collate = stack_samples()
    order: list[int] = []

    async def close_when_done(receiver: SampleReceiver) -> None:
        await receiver.wait_all_done()
        buffer.close()

    with anyio.fail_after(18):
        async with (
            SampleReceiver(buffer, token=TOKEN, expected_producers=["sim"]) as receiver,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(_run_producer, script, receiver.address[1], "sim", count, kind)
            tg.start_soon(close_when_done, receiver)
            while True:
                try:
                    samples = await buffer.get_batch(batch_size)
                except StreamEnded:
                    break
                assert all(s.producer == "sim" for s in samples)
                for sample in samples:
                    assert isinstance(sample.tensors, Mapping)
                    _check_sample(sample, kind, "a sample read from the buffer")
                seqs = [s.seq for s in samples]
                order += seqs
                x, y = collate(samples)
                expected = [make_sample(seq, kind) for seq in seqs]
                want_x = torch.stack([e["x"] for e in expected])
                want_y = torch.stack([e["y"] for e in expected])
                assert _bitwise_equal(x, want_x), f"batch x of seqs {seqs} differs from torch.stack"
                assert _bitwise_equal(y, want_y), f"batch y of seqs {seqs} differs from torch.stack"
                # The batch is a copy: changing it in place changes no sample the buffer holds.
                x.fill_(-1.0e300)
                y.fill_(-7)
                for sample in samples:
                    _check_sample(sample, kind, "after its batch was changed in place")
    counts = Counter(order)
    assert sorted(counts) == list(range(count)), "every sample sent was read"
    assert set(counts.values()) == {max_reads}, f"each sample read exactly {max_reads} times"
    return order


@pytest.mark.parametrize(
    ("kind", "count", "batch_size"),
    [("small", 600, 24), ("large", 160, 12)],
    ids=["small-168B", "large-36KiB"],
)
async def test_fifo_batches_from_async_producer_process_equal_torch_stack(
    kind: str, count: int, batch_size: int
) -> None:
    """AsyncProducer in another process -> TCP -> receiver -> FifoBuffer(max_reads=2): every
    batch of ``stack_samples()`` equals ``torch.stack`` of what was sent, bitwise, in the
    buffer's order; changing a batch in place leaves the samples re-queued at the tail intact."""
    buffer = FifoBuffer(capacity=64, watermark=16, seed=0, max_reads=2)
    order = await _stream_and_check_batches(
        buffer, ASYNC_PRODUCER_SCRIPT, count=count, kind=kind, batch_size=batch_size, max_reads=2
    )
    # one producer, first in first out: the first reads are in seq order
    first_reads = []
    seen: set[int] = set()
    for seq in order:
        if seq not in seen:
            seen.add(seq)
            first_reads.append(seq)
    assert first_reads == list(range(count))


async def test_firo_batches_from_blocking_producer_process_equal_torch_stack() -> None:
    """BlockingProducer in another process -> FiroBuffer(max_reads=2): each sample drawn at
    random twice; every batch equals ``torch.stack`` bitwise, and scribbling over a batch
    changes neither the samples it holds (read again later) nor any other."""
    buffer = FiroBuffer(capacity=96, watermark=48, seed=5, max_reads=2)
    order = await _stream_and_check_batches(
        buffer, BLOCKING_PRODUCER_SCRIPT, count=500, kind="small", batch_size=20, max_reads=2
    )
    assert order[: len(order) // 2] != sorted(order[: len(order) // 2]), "FIRO draws at random"


@pytest.mark.parametrize(
    ("count", "pause"),
    [(300, 0.0), (25, 0.04)],
    ids=["sent-in-a-burst", "sent-one-at-a-time"],
)
async def test_received_sample_tensors_are_read_only_sample_rows(count: int, pause: float) -> None:
    """CHANGELOG: a received sample's tensors are a ``SampleRow``, a read-only mapping: item
    assignment and deletion raise ``TypeError``.  Samples sent as fast as they go share frames;
    samples sent ``pause`` s apart (a slow simulation) each travel alone in a frame."""
    buffer = FifoBuffer(capacity=count, watermark=1, seed=0)
    with anyio.fail_after(18):
        async with SampleReceiver(buffer, token=TOKEN, expected_producers=["sim"]) as receiver:
            await _run_producer(ASYNC_PRODUCER_SCRIPT, receiver.address[1], "sim", count, "small", pause)
            await receiver.wait_all_done()
    buffer.close()
    samples = [sample async for sample in buffer]
    assert [s.seq for s in samples] == list(range(count))
    for sample in samples:
        _check_sample(sample, "small", "a received sample")
    not_rows = [(s.seq, type(s.tensors).__name__) for s in samples if not isinstance(s.tensors, SampleRow)]
    writable = [(s.seq, type(s.tensors).__name__) for s in samples if not _assignment_raises(s)]
    for sample in samples:  # the checks above changed nothing
        _check_sample(sample, "small", "a received sample, after the assignments were tried")
    assert writable == [], (
        f"{len(writable)} of {count} received samples' tensors took an item assignment "
        f"(seq, type of Sample.tensors): {writable[:10]}"
    )
    assert not_rows == [], (
        f"{len(not_rows)} of {count} received samples' tensors are not a SampleRow (seq, type): "
        f"{not_rows[:10]}"
    )


# --------------------------------------------------------------------------------------------
# the resend window


class HeldSink:
    """A ``SampleSink`` that takes nothing until the test releases it (every ``put`` waits)."""

    def __init__(self) -> None:
        self.released = anyio.Event()
        self.puts_started = 0
        self.samples: list[Sample] = []

    async def put(self, sample: Sample) -> None:
        self.puts_started += 1
        await self.released.wait()
        self.samples.append(sample)


def _payload(nbytes: int, seq: int) -> dict[str, torch.Tensor]:
    """A sample whose tensor bytes are exactly ``nbytes`` (one 2-D float64 tensor)."""
    assert nbytes % (8 * 64) == 0
    return {"x": torch.full((64, nbytes // (8 * 64)), float(seq), dtype=torch.float64)}


async def _wait_for(condition: Any, what: str, limit_s: float = 10.0) -> None:
    """Return once ``condition()`` is true; ``AssertionError`` naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        if condition():
            return
        assert time.monotonic() < deadline, f"{what}: not within {limit_s:g} s"
        await anyio.sleep(0.01)


BLOCKED_AFTER_S = 1.0  # a send that has not returned in this long waits for the window


async def _async_sends_before_block(nbytes: int, expected: int, **options: Any) -> None:
    sink = HeldSink()
    with anyio.fail_after(18):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["sim"]) as receiver:
            try:
                async with AsyncProducer(
                    receiver.address, name="sim", token=TOKEN, reconnect_timeout=15.0, **options
                ) as producer:
                    sent = 0
                    blocked = False
                    limit = expected + 2  # never more than this
                    while sent < limit:
                        with anyio.move_on_after(BLOCKED_AFTER_S) as scope:
                            await producer.send(_payload(nbytes, sent))
                        if scope.cancelled_caught:
                            blocked = True
                            break
                        sent += 1
                        assert producer.unacknowledged == sent
                    await _wait_for(lambda: sink.puts_started >= 1, "the receiver's first put")
                    assert sink.samples == [], "the sink took nothing yet"
                    assert blocked, f"send never waited: {sent} samples kept unacknowledged"
                    assert sent == expected, (
                        f"send waited after {sent} unacknowledged samples of {nbytes} tensor bytes "
                        f"(about {sent * (nbytes + 104)} encoded bytes, 4 MiB = {4 * 1024 * 1024}), "
                        f"not {expected}"
                    )
                    assert producer.unacknowledged == expected
                    assert producer.next_seq == expected, "the cancelled send took nothing"
                    assert producer.acknowledged_seq < 0
                    # release the sink: the waiting send goes through, and done() ends
                    sink.released.set()
                    assert await producer.send(_payload(nbytes, expected)) == expected
                    await producer.done()
                    assert producer.unacknowledged == 0
                await receiver.wait_all_done()
            finally:
                sink.released.set()
    assert [s.seq for s in sink.samples] == list(range(expected + 1))
    assert all(float(s.tensors["x"][0, 0]) == float(s.seq) for s in sink.samples)


# The window in bytes: samples of 32 KiB of tensor bytes (plus a safetensors header of about
# 100 bytes, padded to 8) hold at most 4 MiB 127 at a time: 127 * (32768 + h) < 4 MiB for every
# header h of 1 to 258 bytes, and 128 never do.
WINDOW_32K = max(n for n in range(1, 257) if n * (32 * 1024 + 104) < 4 * 1024 * 1024)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(1024, 256), (32 * 1024, WINDOW_32K), (1024 * 1024, 64)],
    ids=["1KiB-256", "32KiB-at-most-4MiB", "1MiB-64"],
)
async def test_async_producer_default_window(nbytes: int, expected: int) -> None:
    """Default ``resend_window``: ``send`` waits after exactly 256 unacknowledged samples of
    1 KiB, as many 32 KiB samples as hold at most 4 MiB (127), and 64 samples of 1 MiB."""
    assert WINDOW_32K == 127
    await _async_sends_before_block(nbytes, expected)


@pytest.mark.parametrize("window", [300, 10])
async def test_async_producer_explicit_window_is_exact(window: int) -> None:
    """``resend_window=N``: exactly N unacknowledged 1 KiB samples, even above the default 256."""
    await _async_sends_before_block(1024, window, resend_window=window)


@pytest.mark.parametrize(
    ("options", "expected"),
    [({}, 256 + 256), ({"resend_window": 10}, 10 + 256)],
    ids=["default-256+256", "window10+256"],
)
async def test_blocking_producer_send_waits_beyond_window(options: dict[str, Any], expected: int) -> None:
    """``BlockingProducer.send`` (1 KiB samples) returns for the window's samples plus
    ``BLOCKING_AHEAD`` (256) more not yet kept by the loop, then waits until the receiver takes."""
    sink = HeldSink()
    returned = 0
    failure: list[BaseException] = []

    def produce(address: tuple[str, int]) -> None:
        nonlocal returned
        try:
            with BlockingProducer(
                address, name="sim", token=TOKEN, reconnect_timeout=15.0, **options
            ) as producer:
                for seq in range(expected + 1):
                    assert producer.send(_payload(1024, seq)) == seq
                    returned += 1
                producer.done()
        except BaseException as exc:
            failure.append(exc)

    with anyio.fail_after(18):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["sim"]) as receiver:
            thread = threading.Thread(target=produce, args=(receiver.address,), daemon=True)
            thread.start()
            try:
                await _wait_for(lambda: sink.puts_started >= 1, "the receiver's first put")
                # wait until the count of returned sends stays put for BLOCKED_AFTER_S
                last, since = -1, time.monotonic()
                while time.monotonic() - since < BLOCKED_AFTER_S:
                    if returned != last:
                        last, since = returned, time.monotonic()
                    await anyio.sleep(0.02)
                    assert not failure, failure
                assert thread.is_alive()
                assert returned == expected, (
                    f"BlockingProducer.send waited after {returned} samples, not {expected}"
                )
                assert sink.samples == []
            finally:
                sink.released.set()
            await _wait_for(lambda: not thread.is_alive(), "the producer's thread ending", limit_s=12.0)
            assert not failure, failure
            await receiver.wait_all_done()
    assert returned == expected + 1
    assert [s.seq for s in sink.samples] == list(range(expected + 1))
