"""Hostile inputs to streaming: producers, receivers, buffers and ``buffer_batches`` as a user meets them.

Written from docs/streaming.md, the ``lamploop.streaming`` reference (its docstrings),
docs/contract-changes.md and DESIGN.md section 8 ("Nothing waits forever") alone.  Every case
is a call, the lamploop error it must raise (or a documented builtin one) and a pattern its
message must match (case-insensitive), within a time bound.  The cases go past the earlier
streaming tests (tests/streaming/test_stream_transport.py, test_stream_buffers.py,
test_acceptance_docs_streaming_r2.py): wrong types of every keyword, samples that change their
names, dtypes or ranks mid-stream, non-tensor values, garbage on the receiver's port, a producer
SIGKILLed in the middle of its frames, a receiver that leaves under a waiting producer, double
closes and use after close, and exact counts (ids inside the tensors) through every policy.
Written from the docs alone; the 9 defects it found (14 cases: a bare AttributeError from
``try_put``, an empty sample taken, unnamed bad tensors at ``send``, a reserved tensor name
that killed the stream, unchecked ``producers`` and ``StreamState(name=)``...) are fixed and
their cases pass (CHANGELOG).  Tiny CPU tensors; real sockets on
127.0.0.1, real processes; every wait bounded.
"""

from __future__ import annotations

import collections
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import lamploop
from lamploop.errors import (
    BufferClosedError,
    CheckpointError,
    ConfigurationError,
    DuplicateSampleError,
    LamploopError,
    StreamEnded,
    StreamingError,
)
from lamploop.streaming import (
    FifoBuffer,
    FifoPolicy,
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
BOUND_S = 20.0  # generous: a loaded 2-core machine
NAN = math.nan


# ----------------------------------------------------------------------------- helpers


def _token() -> str:
    return secrets.token_hex(16)


def _x(producer: int, seq: int, width: int = 3) -> torch.Tensor:
    """A sample tensor that carries its own id: ``[producer, seq, seq, ...]``."""
    x = torch.full((width,), float(seq))
    x[0] = float(producer)
    return x


def _sample(producer: int, seq: int) -> dict[str, torch.Tensor]:
    return {"x": _x(producer, seq), "y": torch.tensor(seq % 2)}


def _ids(sample: Sample) -> tuple[int, int]:
    x = sample.tensors["x"]
    return int(x[0]), int(x[1])


def _put(buffer: StreamBuffer, producer: str, seq: int, pid: int = 0) -> bool:
    return buffer.try_put(Sample(producer, seq, _sample(pid, seq)))


@dataclass
class Case:
    """A call, the error it must raise, and a pattern its message must match."""

    id: str
    call: Callable[[], Any]
    error: type[BaseException] | tuple[type[BaseException], ...]
    pattern: str
    marks: tuple[Any, ...] = field(default_factory=tuple)


def case(
    id: str,
    call: Callable[[], Any],
    error: type[BaseException] | tuple[type[BaseException], ...],
    pattern: str,
) -> Any:
    return pytest.param(Case(id, call, error, pattern), id=id)


def _invoke(call: Callable[[], Any]) -> None:
    """Call; await what it returns if it is awaitable, on a fresh event loop, within the bound."""
    result = call()
    if hasattr(result, "__await__"):

        async def main() -> Any:
            with anyio.fail_after(BOUND_S):
                return await result

        anyio.run(main)


def _check(c: Case) -> None:
    started = time.monotonic()
    with pytest.raises(c.error) as info:
        _invoke(c.call)
    assert re.search(c.pattern, str(info.value), re.IGNORECASE | re.DOTALL), str(info.value)
    assert time.monotonic() - started < BOUND_S


# ----------------------------------------------------------------------------- buffer constructors

DOC_ERR = ConfigurationError


def _fifo(**kw: Any) -> Any:
    return lambda: FifoBuffer(**{"capacity": 4, "watermark": 1, **kw})


def _firo(**kw: Any) -> Any:
    return lambda: FiroBuffer(**{"capacity": 4, "watermark": 1, "seed": 0, **kw})


def _reservoir(**kw: Any) -> Any:
    return lambda: ReservoirBuffer(**{"capacity": 4, "watermark": 1, "seed": 0, **kw})


BUFFER_ARGUMENTS = [
    case("capacity-negative", _fifo(capacity=-3), DOC_ERR, r"capacity"),
    case("capacity-str", _fifo(capacity="4"), DOC_ERR, r"capacity.*'4'|capacity.*str"),
    case("capacity-none", _firo(capacity=None), DOC_ERR, r"capacity"),
    case("capacity-bool", _fifo(capacity=True), DOC_ERR, r"capacity"),
    case("capacity-nan", _reservoir(capacity=NAN), DOC_ERR, r"capacity"),
    case("watermark-str", _fifo(watermark="1"), DOC_ERR, r"watermark"),
    case("watermark-float", _firo(watermark=1.0), DOC_ERR, r"watermark"),
    case("watermark-negative", _reservoir(watermark=-1), DOC_ERR, r"watermark"),
    case("watermark-none", _fifo(watermark=None), DOC_ERR, r"watermark"),
    case("seed-str", _firo(seed="0"), DOC_ERR, r"seed"),
    case("seed-float", _reservoir(seed=0.5), DOC_ERR, r"seed"),
    case("seed-missing-firo", lambda: FiroBuffer(capacity=4, watermark=1), DOC_ERR, r"seed"),
    case("seed-missing-reservoir", lambda: ReservoirBuffer(capacity=4, watermark=1), DOC_ERR, r"seed"),
    case("max_reads-negative", _firo(max_reads=-2), DOC_ERR, r"max_reads"),
    case("max_reads-float", _fifo(max_reads=1.5), DOC_ERR, r"max_reads"),
    case("max_reads-str", _reservoir(max_reads="2"), DOC_ERR, r"max_reads"),
    case("max_reads-bool", _fifo(max_reads=True), DOC_ERR, r"max_reads"),
    case("policy-str", _fifo(policy="fifo"), DOC_ERR, r"policy"),
    case("policy-class", _fifo(policy=FifoPolicy), DOC_ERR, r"policy"),
    case("policy-missing", lambda: StreamBuffer(capacity=4, watermark=1), DOC_ERR, r"policy"),
    case("on_read-not-callable", _fifo(on_read="print"), DOC_ERR, r"on_read"),
    case("on_evict-not-callable", _reservoir(on_evict=3), DOC_ERR, r"on_evict"),
    case("unknown-keyword", _fifo(capacty=4), (TypeError, LamploopError), r"capacty"),
]


@pytest.mark.parametrize("c", BUFFER_ARGUMENTS)
def test_bad_buffer_arguments_are_named(c: Case) -> None:
    _check(c)


# ----------------------------------------------------------------------------- buffer operations


def _buf() -> FifoBuffer:
    return FifoBuffer(capacity=4, watermark=1)


def _closed() -> FifoBuffer:
    buffer = _buf()
    buffer.close()
    return buffer


def _with_seq(seq: int) -> FifoBuffer:
    buffer = _buf()
    _put(buffer, "sim", seq)
    return buffer


BUFFER_OPERATIONS = [
    case("get_batch-zero", lambda: _buf().get_batch(0), DOC_ERR, r"\bn\b.*0|1\.\.4|capacity"),
    case("get_batch-over-capacity", lambda: _buf().get_batch(5), DOC_ERR, r"5"),
    case("get_batch-str", lambda: _buf().get_batch("2"), DOC_ERR, r"'2'|str"),
    case("get_batch-float", lambda: _buf().get_batch(2.0), DOC_ERR, r"2\.0|float"),
    case("get-closed-empty", lambda: _closed().get(), StreamEnded, r"."),
    case("get_batch-closed-empty", lambda: _closed().get_batch(2), StreamEnded, r"."),
    case("try_get-closed-empty", lambda: _closed().try_get(), StreamEnded, r"."),
    case(
        "put-closed",
        lambda: _closed().put(Sample("sim", 0, _sample(0, 0))),
        BufferClosedError,
        r"clos",
    ),
    case(
        "try_put-closed",
        lambda: _closed().try_put(Sample("sim", 0, _sample(0, 0))),
        BufferClosedError,
        r"clos",
    ),
    case(
        "try_put_many-closed",
        lambda: _closed().try_put_many([Sample("sim", 0, _sample(0, 0))]),
        BufferClosedError,
        r"clos",
    ),
    case(
        "try_put-duplicate",
        lambda: _with_seq(3).try_put(Sample("sim", 3, _sample(0, 3))),
        DuplicateSampleError,
        r"sim.*3|3.*sim",
    ),
    case(
        "try_put-older",
        lambda: _with_seq(3).try_put(Sample("sim", 1, _sample(0, 1))),
        DuplicateSampleError,
        r"sim.*1|1.*sim",
    ),
    case(
        "try_put-not-a-sample",
        lambda: _buf().try_put({"x": torch.zeros(3)}),  # type: ignore[arg-type]
        (LamploopError, TypeError),
        r"Sample",
    ),
    case(
        "try_put-seq-str",
        lambda: _buf().try_put(Sample("sim", "0", _sample(0, 0))),  # type: ignore[arg-type]
        (LamploopError, TypeError),
        r"seq",
    ),
    case(
        "try_put-seq-negative",
        lambda: _buf().try_put(Sample("sim", -1, _sample(0, 0))),
        (LamploopError, ValueError),
        r"seq",
    ),
    case(
        "try_put-producer-int",
        lambda: _buf().try_put(Sample(3, 0, _sample(0, 0))),  # type: ignore[arg-type]
        (LamploopError, TypeError),
        r"producer",
    ),
    case(
        "try_put-empty-tensors",
        lambda: _buf().try_put(Sample("sim", 0, {})),
        (LamploopError, ValueError),
        r"tensor|empty",
    ),
    case(
        "try_put-list-value",
        lambda: _buf().try_put(Sample("sim", 0, {"x": [1.0, 2.0]})),  # type: ignore[dict-item]
        (LamploopError, TypeError),
        r"'x'",
    ),
    case(
        "try_put-tensors-none",
        lambda: _buf().try_put(Sample("sim", 0, None)),  # type: ignore[arg-type]
        (LamploopError, TypeError),
        r"tensors",
    ),
    case(
        "try_put_many-duplicate-inside",
        lambda: _buf().try_put_many([Sample("sim", 0, _sample(0, 0)), Sample("sim", 0, _sample(0, 0))]),
        DuplicateSampleError,
        r"sim",
    ),
]


@pytest.mark.parametrize("c", BUFFER_OPERATIONS)
def test_bad_buffer_operations_are_refused(c: Case) -> None:
    _check(c)


def test_a_refused_put_changes_nothing_and_the_buffer_goes_on() -> None:
    buffer = FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2)
    assert _put(buffer, "sim", 0)
    before = buffer.state_dict()[1]
    with pytest.raises(DuplicateSampleError):
        buffer.try_put_many([Sample("sim", 1, _sample(0, 1)), Sample("sim", 1, _sample(0, 1))])
    with pytest.raises(DuplicateSampleError):
        _put(buffer, "sim", 0)
    assert buffer.state_dict()[1] == before  # the same counters, seqs and generator
    assert buffer.try_put_many([Sample("sim", 1, _sample(0, 1)), Sample("other", 0, _sample(1, 0))]) == 2
    buffer.close()
    buffer.close()  # idempotent
    assert buffer.closed
    assert buffer.try_put_many([]) == 0  # nothing to refuse
    reads = collections.Counter()
    while True:
        try:
            sample = buffer.try_get()
        except StreamEnded:
            break
        assert sample is not None
        reads[_ids(sample)] += 1
    assert reads == {(0, 0): 2, (0, 1): 2, (1, 0): 2}


async def test_close_wakes_a_waiting_put_and_a_waiting_get_within_the_bound() -> None:
    full = FifoBuffer(capacity=1, watermark=1)
    assert _put(full, "sim", 0)
    empty = FifoBuffer(capacity=2, watermark=2)
    outcome: dict[str, BaseException] = {}

    async def put() -> None:
        try:
            await full.put(Sample("sim", 1, _sample(0, 1)))
        except BaseException as error:
            outcome["put"] = error

    async def get() -> None:
        try:
            await empty.get_batch(2)
        except BaseException as error:
            outcome["get"] = error

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(put)
            tg.start_soon(get)
            await anyio.sleep(0.2)
            assert outcome == {}  # both wait
            full.close()
            empty.close()
    assert isinstance(outcome["put"], BufferClosedError)
    assert isinstance(outcome["get"], StreamEnded)
    assert full.fill == 1  # the refused put took nothing
    assert _ids(full.try_get()) == (0, 0)


# ----------------------------------------------------------------------------- checkpointed state


def _meta_with(change: Callable[[dict[str, Any]], None]) -> Callable[[], Any]:
    def call() -> Any:
        buffer = FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2)
        _put(buffer, "sim", 0)
        _put(buffer, "sim", 1)
        tensors, meta = buffer.state_dict()
        meta = __import__("json").loads(__import__("json").dumps(meta))
        change(meta)
        target = FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2)
        target.load_state_dict(tensors, meta)

    return call


def _tensors_with(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[], Any]:
    def call() -> Any:
        buffer = FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2)
        _put(buffer, "sim", 0)
        tensors, meta = buffer.state_dict()
        tensors = dict(tensors)
        change(tensors)
        FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2).load_state_dict(tensors, meta)

    return call


def _other_buffer(**kw: Any) -> Callable[[], Any]:
    def call() -> Any:
        buffer = FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2)
        _put(buffer, "sim", 0)
        FiroBuffer(**{"capacity": 4, "watermark": 1, "seed": 0, "max_reads": 2, **kw}).load_state_dict(
            *buffer.state_dict()
        )

    return call


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(meta: dict[str, Any]) -> None:
        keys = path.split(".")
        target: Any = meta
        for key in keys[:-1]:
            target = target[int(key)] if key.isdigit() else target[key]
        target[keys[-1]] = value

    return change


STATE_CASES = [
    case("other-capacity", _other_buffer(capacity=8), CheckpointError, r"capacity"),
    case("other-max_reads", _other_buffer(max_reads=3), CheckpointError, r"max_reads"),
    case("other-watermark", _other_buffer(watermark=2), CheckpointError, r"watermark"),
    case(
        "other-policy",
        lambda: FifoBuffer(capacity=4, watermark=1, max_reads=2).load_state_dict(
            *FiroBuffer(capacity=4, watermark=1, seed=0, max_reads=2).state_dict()
        ),
        CheckpointError,
        r"polic|firo|fifo",
    ),
    case(
        "seen-str", _meta_with(lambda m: m["samples"][0].__setitem__("seen", "1")), CheckpointError, r"seen"
    ),
    case(
        "producer-int",
        _meta_with(lambda m: m["samples"][1].__setitem__("producer", 7)),
        CheckpointError,
        r"producer",
    ),
    case("meta-not-dict", _meta_with(lambda m: m.clear()), CheckpointError, r"missing|format|field"),
    case(
        "tensor-missing",
        _tensors_with(lambda t: t.pop(next(iter(t)))),
        CheckpointError,
        r"s0\.",
    ),
    case(
        "tensor-not-tensor",
        _tensors_with(lambda t: t.__setitem__(next(iter(t)), [1.0, 2.0])),
        CheckpointError,
        r"s0\.",
    ),
    case(
        "tensor-extra",
        _tensors_with(lambda t: t.__setitem__("s9.x", torch.zeros(3))),
        CheckpointError,
        r"s9",
    ),
    case(
        "state-not-a-pair",
        lambda: FifoBuffer(capacity=4, watermark=1).load_state_dict("junk", "junk"),  # type: ignore[arg-type]
        CheckpointError,
        r"state",
    ),
]


@pytest.mark.parametrize("c", STATE_CASES)
def test_a_bad_checkpointed_buffer_state_is_refused_naming_it(c: Case) -> None:
    _check(c)


def test_stream_state_refuses_a_late_restore_and_a_second_receiver(tmp_path: Path) -> None:
    buffer = FifoBuffer(capacity=4, watermark=1)
    stream = StreamState(buffer)
    state = StreamState(FifoBuffer(capacity=4, watermark=1)).state_dict()
    _put(buffer, "sim", 0)
    with pytest.raises(CheckpointError, match=r"took|already|acknowledged|samples"):
        stream.load_state_dict(*state)
    stream.open_receiver(token=_token(), producers=["sim"])
    with pytest.raises(ConfigurationError, match=r"already|opened|receiver"):
        stream.open_receiver(token=_token(), producers=["sim"])
    with pytest.raises(CheckpointError, match=r"checkpoint"):
        StreamState(FifoBuffer(capacity=4, watermark=1)).restore(_a_checkpoint_without_stream(tmp_path))


def _a_checkpoint_without_stream(tmp: Path) -> Path:
    torch.manual_seed(0)
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(torch.randn(8, 3), torch.randint(0, 2, (8,)), batch_size=4),
        max_epochs=1,
        reporters=[],
        device="cpu",
        checkpoint_dir=tmp,
    )
    return tmp


# ----------------------------------------------------------------------------- buffer_batches


def _in_loop(make: Callable[[], Any]) -> Callable[[], Any]:
    async def run() -> Any:
        return make()

    return run


def _bb(**kw: Any) -> Callable[[], Any]:
    return _in_loop(
        lambda: buffer_batches(**{"buffer": _buf(), "batch_size": 2, "batches_per_epoch": 1, **kw})
    )


BATCHES_CASES = [
    case("buffer-list", _bb(buffer=[]), DOC_ERR, r"buffer"),
    case("buffer-stream-state", _bb(buffer=StreamState(_buf())), DOC_ERR, r"buffer"),
    case("batch_size-str", _bb(batch_size="2"), DOC_ERR, r"batch_size"),
    case("batch_size-float", _bb(batch_size=2.0), DOC_ERR, r"batch_size"),
    case("batch_size-negative", _bb(batch_size=-1), DOC_ERR, r"batch_size"),
    case("batch_size-none", _bb(batch_size=None), DOC_ERR, r"batch_size"),
    case("batch_size-bool", _bb(batch_size=True), DOC_ERR, r"batch_size"),
    case("batches_per_epoch-str", _bb(batches_per_epoch="1"), DOC_ERR, r"batches_per_epoch"),
    case("batches_per_epoch-float", _bb(batches_per_epoch=1.5), DOC_ERR, r"batches_per_epoch"),
    case("batches_per_epoch-negative", _bb(batches_per_epoch=-1), DOC_ERR, r"batches_per_epoch"),
    case("collate-str", _bb(collate="stack"), DOC_ERR, r"collate"),
    case(
        "no-event-loop",
        lambda: buffer_batches(_buf(), batch_size=2, batches_per_epoch=1),
        DOC_ERR,
        r"event loop",
    ),
]


@pytest.mark.parametrize("c", BATCHES_CASES)
def test_bad_buffer_batches_arguments_are_named(c: Case) -> None:
    _check(c)


def _fit_on(buffer: StreamBuffer, **kw: Any) -> Any:
    async def main() -> Any:
        with anyio.fail_after(BOUND_S):
            return await lamploop.fit_async(
                model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=buffer_batches(buffer, batch_size=4, batches_per_epoch=2, **kw),
                max_epochs=100,
                reporters=[],
                device="cpu",
            )

    return anyio.run(main)


def test_a_sample_without_its_target_mid_stream_names_the_tensor_and_the_sample() -> None:
    buffer = FifoBuffer(capacity=16, watermark=1)
    for seq in range(5):
        _put(buffer, "sim-2", seq)
    buffer.try_put(Sample("sim-2", 5, {"x": _x(0, 5)}))  # no "y"
    for seq in range(6, 8):
        _put(buffer, "sim-2", seq)
    buffer.close()
    with pytest.raises(LamploopError) as info:
        _fit_on(buffer)
    message = str(info.value)
    assert re.search(r"'y'|\by\b", message), message
    assert "sim-2" in message, message
    assert re.search(r"\b5\b", message), message


def test_a_collate_that_raises_comes_out_as_itself() -> None:
    class Boom(Exception):
        pass

    def collate(samples: list[Sample]) -> Any:
        raise Boom("collate failed")

    buffer = FifoBuffer(capacity=8, watermark=1)
    for seq in range(4):
        _put(buffer, "sim", seq)
    buffer.close()
    with pytest.raises(Boom, match="collate failed"):
        _fit_on(buffer, collate=collate)


# ----------------------------------------------------------------------------- producer arguments


ADDRESS = ("127.0.0.1", 9)


def _producer(kind: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        arguments = {"address": ADDRESS, "name": "sim", "token": "t" * 32, **kw}
        address = arguments.pop("address")
        cls = AsyncProducer if kind == "async" else BlockingProducer
        return cls(address, **arguments)

    return make


PRODUCER_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"reconnect_timeout": 0}, r"reconnect_timeout"),
    ({"reconnect_timeout": -1.0}, r"reconnect_timeout"),
    ({"reconnect_timeout": NAN}, r"reconnect_timeout"),
    ({"reconnect_timeout": "5"}, r"reconnect_timeout"),
    ({"handshake_timeout": 0}, r"handshake_timeout"),
    ({"handshake_timeout": NAN}, r"handshake_timeout"),
    ({"ack_timeout": NAN}, r"ack_timeout"),
    ({"ack_timeout": "1"}, r"ack_timeout"),
    ({"keep_acknowledged": -1}, r"keep_acknowledged"),
    ({"keep_acknowledged": 1.5}, r"keep_acknowledged"),
    ({"max_frame_bytes": 0}, r"max_frame_bytes"),
    ({"max_frame_bytes": "1000"}, r"max_frame_bytes"),
    ({"resend_window": 1.5}, r"resend_window"),
    ({"resend_window": "8"}, r"resend_window"),
    ({"resend_window": -1}, r"resend_window"),
    ({"start_seq": 1.5}, r"start_seq"),
    ({"start_seq": "0"}, r"start_seq"),
    ({"ssl_context": "yes"}, r"ssl_context"),
    ({"token": 123}, r"token"),
    ({"token": None}, r"token"),
    ({"name": 5}, r"name"),
    ({"name": None}, r"name"),
    ({"address": ("127.0.0.1",)}, r"address"),
    ({"address": ("127.0.0.1", "80")}, r"address|port"),
    ({"address": ("127.0.0.1", 70000)}, r"address|port"),
    ({"address": ("127.0.0.1", -1)}, r"address|port"),
    ({"address": None}, r"address"),
    ({"resend_windw": 8}, r"resend_windw"),
]


@pytest.mark.parametrize("kind", ["async", "blocking"])
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    PRODUCER_ARGUMENTS,
    ids=[
        next(iter(kw)) + "=" + repr(v)[:12] for kw, _ in PRODUCER_ARGUMENTS for v in [next(iter(kw.values()))]
    ],
)
def test_bad_producer_arguments_are_named_at_construction(
    kind: str, kwargs: dict[str, Any], pattern: str
) -> None:
    _check(Case("x", _producer(kind, **kwargs), (LamploopError, TypeError), pattern))


# ----------------------------------------------------------------------------- receiver arguments


def _receiver(**kw: Any) -> Callable[[], Any]:
    async def enter() -> None:
        arguments = {"sink": FifoBuffer(capacity=4, watermark=1), "token": _token(), **kw}
        sink = arguments.pop("sink")
        async with SampleReceiver(sink, **arguments):
            pass

    return enter


def _opened(**kw: Any) -> Callable[[], Any]:
    async def enter() -> None:
        stream = StreamState(FifoBuffer(capacity=4, watermark=1))
        async with stream.open_receiver(**{"token": _token(), "producers": ["sim"], **kw}):
            pass

    return enter


RECEIVER_ARGUMENTS = [
    case("token-empty", _receiver(token=""), DOC_ERR, r"token"),
    case("token-int", _receiver(token=5), DOC_ERR, r"token"),
    case("port-negative", _receiver(port=-1), DOC_ERR, r"port"),
    case("port-too-large", _receiver(port=70000), DOC_ERR, r"port"),
    case("port-str", _receiver(port="0"), DOC_ERR, r"port"),
    case("host-int", _receiver(host=5), LamploopError, r"host|5:0"),
    case("ack_every-zero", _receiver(ack_every=0), DOC_ERR, r"ack_every"),
    case("ack_every-float", _receiver(ack_every=2.5), DOC_ERR, r"ack_every"),
    case("max_frame_bytes-zero", _receiver(max_frame_bytes=0), DOC_ERR, r"max_frame_bytes"),
    case("handshake_timeout-negative", _receiver(handshake_timeout=-1), DOC_ERR, r"handshake_timeout"),
    case("handshake_timeout-nan", _receiver(handshake_timeout=NAN), DOC_ERR, r"handshake_timeout"),
    case("idle_timeout-zero", _receiver(idle_timeout=0), DOC_ERR, r"idle_timeout"),
    case(
        "max_pending_handshakes-zero", _receiver(max_pending_handshakes=0), DOC_ERR, r"max_pending_handshakes"
    ),
    case("acknowledged-str-seq", _receiver(acknowledged={"sim": "3"}), DOC_ERR, r"acknowledged"),
    case("acknowledged-list", _receiver(acknowledged=[("sim", 3)]), DOC_ERR, r"acknowledged"),
    case("expected_producers-str", _receiver(expected_producers="sim"), DOC_ERR, r"expected_producers"),
    case("allowed_producers-str", _receiver(allowed_producers="sim"), DOC_ERR, r"allowed_producers"),
    case(
        "allowed_producers-int-names", _receiver(allowed_producers=[1, 2]), DOC_ERR, r"allowed_producers|name"
    ),
    case("producers_done-str", _receiver(producers_done="sim"), DOC_ERR, r"producers_done"),
    case("uniform_samples-str", _receiver(uniform_samples="no"), DOC_ERR, r"uniform_samples"),
    case("own_thread-str", _receiver(own_thread="yes"), DOC_ERR, r"own_thread"),
    case("ssl_context-str", _receiver(ssl_context="tls"), DOC_ERR, r"ssl_context"),
    case("sink-none", _receiver(sink=None), DOC_ERR, r"sink"),
    case("unknown-keyword", _receiver(ack_evry=3), (TypeError, LamploopError), r"ack_evry"),
    case("open-producers-str", _opened(producers="sim"), DOC_ERR, r"producers"),
    case(
        "open-producers-empty",
        _opened(producers=[]),
        DOC_ERR,
        r"producers",
    ),
    case(
        "open-producers-duplicate",
        _opened(producers=["a", "a"]),
        DOC_ERR,
        r"'a'|duplicate|twice",
    ),
    case("open-producers-int", _opened(producers=[1]), DOC_ERR, r"producer|name"),
    case("open-nranks-zero", _opened(nranks=0), DOC_ERR, r"nranks"),
    case("open-rank-out-of-range", _opened(nranks=2, rank=2), DOC_ERR, r"rank"),
    case("open-rank-negative", _opened(rank=-1), DOC_ERR, r"rank"),
    case("open-token-empty", _opened(token=b""), DOC_ERR, r"token"),
    case("open-unknown-option", _opened(portt=0), (TypeError, LamploopError), r"portt"),
]


@pytest.mark.parametrize("c", RECEIVER_ARGUMENTS)
def test_bad_receiver_arguments_are_named(c: Case) -> None:
    _check(c)


# ----------------------------------------------------------------------------- bad samples at send


def _good(i: int) -> dict[str, torch.Tensor]:
    return _sample(0, i)


SEND_CASES: list[Any] = [
    ("send-empty", "send", {}, (LamploopError, ValueError, TypeError), r"empty|at least one tensor"),
    ("send-list-value", "send", {"x": [1.0, 2.0]}, (LamploopError, TypeError, ValueError), r"list"),
    ("send-float-value", "send", {"x": 1.5}, (LamploopError, TypeError, ValueError), r"float"),
    ("send-numpy-value", "send", {"x": np.zeros(3)}, (LamploopError, TypeError, ValueError), r"ndarray"),
    ("send-int-name", "send", {1: torch.zeros(3)}, (LamploopError, TypeError, ValueError), r"name|str|\b1\b"),
    ("send-not-mapping", "send", "x", (LamploopError, TypeError, ValueError), r"mapping|str"),
    ("send-none", "send", None, (LamploopError, TypeError, ValueError), r"mapping|None"),
    pytest.param(
        "send-one-bad-value",
        "send",
        {"x": torch.zeros(3), "y": "label"},
        (LamploopError, TypeError, ValueError),
        r"'y'",
        id="send-one-bad-value",
    ),
    pytest.param(
        "rows-one-bad-column",
        "send_rows",
        {"x": torch.zeros(2, 3), "y": [0, 1]},
        (LamploopError, TypeError, ValueError),
        r"'y'",
        id="rows-one-bad-column",
    ),
    (
        "send-sparse",
        "send",
        {"x": torch.zeros(3).to_sparse()},
        (LamploopError, TypeError, ValueError),
        r"'x'.*sparse|sparse.*'x'",
    ),
    (
        "send-meta-device",
        "send",
        {"x": torch.zeros(3, device="meta")},
        (LamploopError, TypeError, ValueError),
        r"'x'.*meta",
    ),
    pytest.param(
        "send-reserved-name",
        "send",
        {"__metadata__": torch.zeros(3)},
        (LamploopError, TypeError, ValueError),
        r"__metadata__",
        id="send-reserved-name",
    ),
    ("rows-empty", "send_rows", {}, (LamploopError, TypeError, ValueError), r"empty|at least one"),
    (
        "rows-uneven",
        "send_rows",
        {"x": torch.zeros(4, 3), "y": torch.zeros(5)},
        (LamploopError, TypeError, ValueError),
        r"4.*5|5.*4|rows",
    ),
    (
        "rows-0d",
        "send_rows",
        {"x": torch.tensor(1.0)},
        (LamploopError, TypeError, ValueError),
        r"'x'|0-d|dimension",
    ),
    ("rows-list", "send_rows", {"x": [[1.0, 2.0]]}, (LamploopError, TypeError, ValueError), r"list"),
    (
        "rows-not-mapping",
        "send_rows",
        torch.zeros(4, 3),
        (LamploopError, TypeError, ValueError),
        r"mapping|Tensor",
    ),
    ("many-not-iterable", "send_many", 5, (LamploopError, TypeError, ValueError), r"int|iterable"),
    ("many-bad-second", "send_many", [_good(0), {}], (LamploopError, TypeError, ValueError), r"at least one"),
]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["async", "blocking"])
@pytest.mark.parametrize(
    ("label", "method", "value", "error", "pattern"),
    SEND_CASES,
    ids=[c.id if hasattr(c, "marks") else c[0] for c in SEND_CASES],
)
async def test_a_bad_sample_is_refused_at_send_and_costs_no_seq_nor_the_stream(
    kind: str, label: str, method: str, value: Any, error: Any, pattern: str
) -> None:
    """The bad call raises, naming the problem; what was kept before it stays (send_many keeps the
    samples before the one it stopped at); the producer then goes on and the receiver holds every
    good sample once, with seqs without gaps."""
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    kept_before = 1 if label == "many-bad-second" else 0
    caught: list[BaseException] = []

    def blocking(address: tuple[str, int]) -> list[int]:
        with BlockingProducer(address, name="sim", token=token, reconnect_timeout=5) as producer:
            producer.send(_good(100))
            try:
                getattr(producer, method)(value)
            except BaseException as raised:
                caught.append(raised)
            after = producer.next_seq
            producer.send(_good(101))
            producer.send_rows({"x": torch.stack([_x(0, 102), _x(0, 103)]), "y": torch.tensor([0, 1])})
        return [after]

    async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
        with anyio.fail_after(BOUND_S):
            if kind == "async":
                async with AsyncProducer(
                    receiver.address, name="sim", token=token, reconnect_timeout=5
                ) as producer:
                    await producer.send(_good(100))
                    try:
                        await getattr(producer, method)(value)
                    except BaseException as raised:
                        caught.append(raised)
                    after = producer.next_seq
                    await producer.send(_good(101))
                    await producer.send_rows(
                        {"x": torch.stack([_x(0, 102), _x(0, 103)]), "y": torch.tensor([0, 1])}
                    )
            else:
                [after] = await anyio.to_thread.run_sync(blocking, receiver.address)
            await receiver.wait_all_done()
    assert len(caught) == 1, "the bad call did not raise"
    assert isinstance(caught[0], error), repr(caught[0])
    assert re.search(pattern, str(caught[0]), re.IGNORECASE), str(caught[0])
    assert after == 1 + kept_before  # the refused sample took no seq
    buffer.close()
    got = [(sample.seq, _ids(sample)[1]) async for sample in buffer]
    expected_ids = [100] + ([0] if kept_before else []) + [101, 102, 103]
    assert got == list(enumerate(expected_ids))
    assert receiver.refusals == 0


# ----------------------------------------------------------------------------- samples that change mid-stream

MISMATCHES = {
    "dtype": ({"x": torch.zeros(3, dtype=torch.float64), "y": torch.tensor(0)}, r"'x'.*float64|float64.*'x'"),
    "rank": ({"x": torch.zeros(1, 3), "y": torch.tensor(0)}, r"'x'.*\[1, 3\]|\[1, 3\].*'x'"),
    "extra-name": ({"x": torch.zeros(3), "y": torch.tensor(0), "z": torch.zeros(1)}, r"'z'"),
    "missing-name": ({"x": torch.zeros(3)}, r"'y'"),
    "renamed": ({"x": torch.zeros(3), "label": torch.tensor(0)}, r"'label'|'y'"),
    "target-dtype": ({"x": torch.zeros(3), "y": torch.tensor(0.5)}, r"'y'"),
}


@pytest.mark.timeout(40)
@pytest.mark.parametrize("how", sorted(MISMATCHES))
async def test_a_sample_that_changes_mid_stream_refuses_its_producer_and_the_others_go_on(how: str) -> None:
    """Producer 'bad' sends 3 good samples, then one of another kind: it is refused for good, told
    why (naming seq 3 and the tensor), its 3 samples stay; producer 'good' delivers all 20."""
    token = _token()
    bad_value, pattern = MISMATCHES[how]
    buffer = FifoBuffer(capacity=64, watermark=1)
    caught: list[BaseException] = []
    async with SampleReceiver(buffer, token=token, expected_producers=["bad", "good"]) as receiver:
        with anyio.fail_after(BOUND_S):
            async with AsyncProducer(receiver.address, name="good", token=token) as good:
                await good.send(_sample(1, 0))
                while receiver.acknowledged.get("good", -1) < 0:  # noqa: ASYNC110 (the receiver's state)
                    await anyio.sleep(0.01)
                try:
                    async with AsyncProducer(
                        receiver.address, name="bad", token=token, reconnect_timeout=5
                    ) as bad:
                        for seq in range(3):
                            await bad.send(_sample(0, seq))
                        await bad.send(bad_value)
                        await bad.done()
                except StreamingError as error:
                    caught.append(error)
                for seq in range(1, 20):
                    await good.send(_sample(1, seq))
            await receiver.wait_all_done()
    assert len(caught) == 1, "the bad producer was not told"
    message = str(caught[0])
    assert re.search(r"seq 3", message), message
    assert re.search(pattern, message), message
    assert "bad" in receiver.producers_refused
    assert re.search(pattern, str(receiver.producers_refused["bad"])), receiver.producers_refused
    buffer.close()
    got = collections.Counter([_ids(sample) async for sample in buffer])
    assert got == collections.Counter([(0, s) for s in range(3)] + [(1, s) for s in range(20)])


# ----------------------------------------------------------------------------- strangers on the port

GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "random": bytes(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8)),
    "huge-length": b"\xff" * 16,
    "zeros": b"\x00" * 4096,
    "json": b'{"type":"hello","producer":"sim","version":2}\n' * 4,
}


def _garbage_client(address: tuple[str, int], payload: bytes, bound: float) -> bytes:
    """Send ``payload`` and read until the receiver closes the connection (or ``bound`` passes)."""
    with socket.create_connection(address, timeout=bound) as sock:
        try:
            sock.sendall(payload)
        except OSError:
            return b""
        received = b""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return received
            if not chunk:
                return received
            received += chunk
        raise AssertionError(f"the receiver kept a garbage connection open for {bound} s")


@pytest.mark.timeout(40)
@pytest.mark.parametrize("own_thread", [False, True])
async def test_garbage_on_the_receivers_port_is_refused_counted_and_closed_while_producers_go_on(
    own_thread: bool,
) -> None:
    token = _token()
    buffer = FifoBuffer(capacity=256, watermark=1)
    async with SampleReceiver(
        buffer, token=token, expected_producers=["sim"], handshake_timeout=1.0, own_thread=own_thread
    ) as receiver:
        with anyio.fail_after(BOUND_S):
            async with anyio.create_task_group() as tg:
                for payload in GARBAGE.values():
                    tg.start_soon(anyio.to_thread.run_sync, _garbage_client, receiver.address, payload, 8.0)
                tg.start_soon(
                    anyio.to_thread.run_sync, _garbage_client, receiver.address, b"", 8.0
                )  # silence
                async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                    for seq in range(100):
                        await producer.send(_sample(0, seq))
                        if seq % 10 == 0:
                            await anyio.sleep(0.01)
            await receiver.wait_all_done()
            refusals = receiver.refusals
    assert refusals >= len(GARBAGE) + 1, receiver.recent_refusals
    buffer.close()
    assert [_ids(sample) async for sample in buffer] == [(0, s) for s in range(100)]


# ----------------------------------------------------------------------------- a producer SIGKILLed mid-frame

KILLED_PRODUCER = r"""
import os, sys, time
import torch
from lamploop.streaming.producer import BlockingProducer

port, count, width = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
with BlockingProducer(
    ("127.0.0.1", port), name="sim", token=os.environ["TOKEN"], reconnect_timeout=10, resend_window=32
) as producer:
    for seq in range(count):
        x = torch.full((width,), float(seq))
        x[0] = 0.0
        producer.send({"x": x, "y": torch.tensor(seq % 2)})
        if seq == 3:
            print("sending", flush=True)
"""


@pytest.mark.timeout(60)
async def test_a_producer_sigkilled_mid_frame_loses_and_repeats_nothing_once_restarted(
    tmp_path: Path,
) -> None:
    """Samples of 512 KiB, a window of 32 (16 MiB) in front of a slow reader: the socket's buffers
    are full of frames when the SIGKILL comes, so it lands in the middle of one. The
    receiver keeps every acknowledged sample whole, takes nothing torn, and a producer restarted
    from seq 0 completes the stream: every seq exactly once, each tensor intact."""
    token = _token()
    width = 128 * 1024  # float32: 512 KiB a sample
    count = 60
    buffer = FifoBuffer(capacity=8, watermark=1)
    seen: collections.Counter[int] = collections.Counter()
    torn: list[int] = []
    script = tmp_path / "producer.py"
    script.write_text(KILLED_PRODUCER)
    env = {**os.environ, "TOKEN": token, "PYTHONPATH": str(REPO)}

    async def drain() -> None:
        while True:
            try:
                sample = await buffer.get()
            except StreamEnded:
                return
            x = sample.tensors["x"]
            seq = int(x[1])
            if seq != sample.seq or not bool((x[1:] == seq).all()) or x.numel() != width:
                torn.append(sample.seq)
            seen[seq] += 1
            await anyio.sleep(0.002)  # a slow trainer: frames wait in the socket

    async with (
        SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(drain)
        port = str(receiver.address[1])
        with anyio.fail_after(40):
            async with await anyio.open_process(
                [sys.executable, str(script), port, str(10_000), str(width)],
                env=env,
                stdout=subprocess.DEVNULL,
            ) as first:
                try:
                    while receiver.acknowledged.get("sim", -1) < 12:
                        assert first.returncode is None, "the producer exited early"
                        await anyio.sleep(0.01)
                finally:
                    first.send_signal(signal.SIGKILL)
                    await first.wait()
            assert first.returncode == -signal.SIGKILL
            killed_at = receiver.acknowledged["sim"]
            second = await anyio.run_process(
                [sys.executable, str(script), port, str(killed_at + count), str(width)], env=env, check=False
            )
            assert second.returncode == 0, second.stderr
            await receiver.wait_all_done()
            buffer.close()
    assert torn == []
    assert seen == dict.fromkeys(range(killed_at + count), 1)
    assert receiver.producers_refused == {}


# ----------------------------------------------------------------------------- a receiver that goes away

RECONNECT_S = 1.5


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_producer_whose_receiver_left_fails_within_reconnect_timeout_naming_it(kind: str) -> None:
    """The receiver's buffer is full (nobody reads), the producer waits in its window; then the
    receiver leaves its block.  The producer must fail within ``reconnect_timeout`` (plus slack),
    with a StreamingError naming the receiver, from the send that waits or on leaving its block."""
    token = _token()
    buffer = FifoBuffer(capacity=2, watermark=1)
    outcome: dict[str, Any] = {}
    options = {"reconnect_timeout": RECONNECT_S, "ack_timeout": 1.0, "resend_window": 4}

    async def run_async(address: tuple[str, int]) -> None:
        try:
            async with AsyncProducer(address, name="sim", token=token, **options) as producer:
                for seq in range(1000):
                    await producer.send(_sample(0, seq))
        except BaseException as error:
            outcome["error"] = error
        outcome["ended"] = time.monotonic()

    def run_blocking(address: tuple[str, int]) -> None:
        try:
            with BlockingProducer(address, name="sim", token=token, **options) as producer:
                for seq in range(1000):
                    producer.send(_sample(0, seq))
        except BaseException as error:
            outcome["error"] = error
        outcome["ended"] = time.monotonic()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async with SampleReceiver(buffer, token=token) as receiver:
                if kind == "async":
                    tg.start_soon(run_async, receiver.address)
                else:
                    tg.start_soon(anyio.to_thread.run_sync, run_blocking, receiver.address)
                while receiver.acknowledged.get("sim", -1) < 1:  # noqa: ASYNC110 (the receiver's state)
                    await anyio.sleep(0.01)
                await anyio.sleep(0.3)  # the producer now waits for room
                address = receiver.address
            left = time.monotonic()
    error = outcome.get("error")
    assert isinstance(error, StreamingError), repr(error)
    took = outcome["ended"] - left
    assert took < RECONNECT_S + 6.0, f"{took:.1f} s after the receiver left"
    message = str(error)
    assert str(address[1]) in message, message
    assert re.search(r"reach|unreachable|gone|reconnect|timeout|seconds", message, re.IGNORECASE), message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("own_thread", [False, True])
async def test_a_receiver_without_producers_ends_promptly_when_cancelled(own_thread: bool) -> None:
    """No producer ever comes: wait_all_done, a get, a get_batch and a buffer_batches stream all
    wait; cancelling them (a stop) ends every wait within a second, takes nothing, and leaving the
    receiver's block (joining its thread) is prompt too."""
    buffer = FifoBuffer(capacity=8, watermark=2)
    stream = StreamState(buffer)
    factory = buffer_batches(buffer, batch_size=2, batches_per_epoch=1)
    started = time.monotonic()
    with anyio.fail_after(10):
        async with stream.open_receiver(token=_token(), producers=["sim"], own_thread=own_thread) as receiver:
            for wait in (receiver.wait_all_done, buffer.get, lambda: buffer.get_batch(2)):
                with anyio.move_on_after(0.3) as scope:
                    await wait()
                assert scope.cancelled_caught
            with anyio.move_on_after(0.3) as scope:
                async for _ in factory(lamploop.batches.BatchContext(epoch=0)):
                    raise AssertionError("a batch from nothing")
            assert scope.cancelled_caught
            cancelled = time.monotonic()
        assert time.monotonic() - cancelled < 2.0
    assert time.monotonic() - started < 4.0
    assert buffer.received == 0
    assert buffer.read_total == 0
    assert not buffer.closed


# ----------------------------------------------------------------------------- double close, use after close


@pytest.mark.timeout(30)
async def test_use_of_a_receiver_before_and_after_its_block_is_a_clear_error() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    receiver = SampleReceiver(buffer, token=token, expected_producers=["sim"])
    with anyio.fail_after(5), pytest.raises(StreamingError, match=r"listen|not .*(open|enter)|block"):
        await receiver.wait_all_done()
    async with receiver:
        address = receiver.address
        async with AsyncProducer(address, name="sim", token=token) as producer:
            await producer.send(_sample(0, 0))
        await receiver.wait_all_done()
    with anyio.fail_after(5), pytest.raises(StreamingError, match=r"listen|not .*(open|enter)|after|block"):
        await receiver.wait_all_done()
    # Nothing listens there any more: a new connection is refused by the OS.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=2).close()
    assert receiver.acknowledged == {"sim": 0}  # still readable for the checkpoint


@pytest.mark.timeout(30)
async def test_use_of_an_async_producer_outside_its_block_and_double_done() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
        producer = AsyncProducer(receiver.address, name="sim", token=token)
        with anyio.fail_after(5):
            for call in (
                lambda: producer.send(_good(0)),
                producer.done,
                lambda: producer.send_rows({"x": torch.zeros(2, 3)}),
            ):
                with pytest.raises(StreamingError, match=r"outside `async with`"):
                    await call()
        assert producer.next_seq == 0
        with anyio.fail_after(BOUND_S):
            async with producer:
                await producer.send(_good(0))
                await producer.done()
                await producer.done()  # again: nothing more to say, returns
                with pytest.raises(StreamingError, match=r"done"):
                    await producer.send(_good(1))
            await receiver.wait_all_done()
            with pytest.raises(StreamingError):
                await producer.send(_good(1))
    assert buffer.received == 1


@pytest.mark.timeout(30)
async def test_use_of_a_blocking_producer_outside_its_block_and_double_done() -> None:
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    errors: list[str] = []

    def simulate(address: tuple[str, int]) -> None:
        producer = BlockingProducer(address, name="sim", token=token, reconnect_timeout=5)
        for call in (lambda: producer.send(_good(0)), producer.flush, producer.done):
            try:
                call()
            except StreamingError as error:
                errors.append(str(error))
        with producer:
            producer.send(_good(0))
            producer.done()
            producer.done()
            try:
                producer.send(_good(1))
            except StreamingError as error:
                errors.append(str(error))
        try:
            producer.flush()
        except StreamingError as error:
            errors.append(str(error))

    async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
        with anyio.fail_after(BOUND_S):
            await anyio.to_thread.run_sync(simulate, receiver.address)
            await receiver.wait_all_done()
    assert len(errors) == 5, errors
    assert all(re.search(r"outside `with`|after done\(\)", e) for e in errors), errors
    assert buffer.received == 1


# ----------------------------------------------------------------------------- exact counts, every policy


def _mixed_producers(address: tuple[str, int], token: str, per: int) -> list[Callable[[], Any]]:
    """Three producers of three kinds and calls: AsyncProducer.send, AsyncProducer.send_rows,
    BlockingProducer.send_many, each ``per`` samples with their ids inside."""

    async def one_by_one() -> None:
        async with AsyncProducer(address, name="p0", token=token, resend_window=3) as producer:
            for seq in range(per):
                await producer.send(_sample(0, seq))

    async def rows() -> None:
        async with AsyncProducer(address, name="p1", token=token) as producer:
            for start in range(0, per, 7):
                stop = min(per, start + 7)
                await producer.send_rows(
                    {
                        "x": torch.stack([_x(1, s) for s in range(start, stop)]),
                        "y": torch.tensor([s % 2 for s in range(start, stop)]),
                    }
                )

    def many() -> None:
        with BlockingProducer(address, name="p2", token=token) as producer:
            for start in range(0, per, 11):
                producer.send_many([_sample(2, s) for s in range(start, min(per, start + 11))])

    async def blocking() -> None:
        await anyio.to_thread.run_sync(many)

    return [one_by_one, rows, blocking]


POLICIES = {
    "fifo-1": lambda: FifoBuffer(capacity=8, watermark=4),
    "fifo-3": lambda: FifoBuffer(capacity=8, watermark=4, max_reads=3),
    "firo-2": lambda: FiroBuffer(capacity=8, watermark=4, seed=5, max_reads=2),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_thread", [False, True])
@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_every_sample_is_read_exactly_max_reads_times_through_a_small_fifo_or_firo(
    policy: str, own_thread: bool
) -> None:
    """Capacity 8, three producers of 40 samples, a reader drawing batches of 3 while they send
    (back-pressure all the way): each id is read exactly max_reads times, none lost, none extra."""
    token = _token()
    buffer = POLICIES[policy]()
    reads: collections.Counter[tuple[int, int]] = collections.Counter()
    per = 40

    async def read() -> None:
        while True:
            try:
                batch = await buffer.get_batch(3)
            except StreamEnded:
                return
            for sample in batch:
                assert _ids(sample) == (int(sample.producer[1]), sample.seq)
                reads[_ids(sample)] += 1

    with anyio.fail_after(40):
        async with (
            SampleReceiver(
                buffer, token=token, expected_producers=["p0", "p1", "p2"], own_thread=own_thread
            ) as receiver,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(read)
            async with anyio.create_task_group() as producers:
                for producer in _mixed_producers(receiver.address, token, per):
                    producers.start_soon(producer)
            await receiver.wait_all_done()
            buffer.close()
    expected = buffer.max_reads
    assert reads == {(p, s): expected for p in range(3) for s in range(per)}
    assert buffer.received == 3 * per
    assert buffer.fill == 0
    assert receiver.refusals == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_reads", [None, 2])
async def test_a_reservoir_accounts_for_every_sample_read_or_evicted(max_reads: int | None) -> None:
    """A reservoir of 16 fed 120 samples by three producers, nobody reading until the end: exactly
    120 - 16 are evicted, and after close each of the 16 residents is read exactly once more and
    leaves; evicted and read are disjoint and together every sample sent."""
    token = _token()
    evicted: list[tuple[str, int]] = []
    buffer = ReservoirBuffer(
        capacity=16, watermark=1, seed=3, max_reads=max_reads, on_evict=lambda key, seen: evicted.append(key)
    )
    per = 40
    with anyio.fail_after(40):
        async with SampleReceiver(buffer, token=token, expected_producers=["p0", "p1", "p2"]) as receiver:
            async with anyio.create_task_group() as producers:
                for producer in _mixed_producers(receiver.address, token, per):
                    producers.start_soon(producer)
            await receiver.wait_all_done()
    buffer.close()
    read = [(sample.producer, sample.seq) async for sample in buffer]
    everyone = {(f"p{p}", s) for p in range(3) for s in range(per)}
    assert len(evicted) == 3 * per - 16 == buffer.evicted
    assert len(read) == 16 == len(set(read))
    assert set(read).isdisjoint(evicted)
    assert set(read) | set(evicted) == everyone


# ----------------------------------------------------------------------------- fit fed live


@pytest.mark.timeout(60)
async def test_fit_fed_live_trains_on_every_sample_exactly_max_reads_times_and_ends_with_the_stream() -> None:
    """fit_async over a FIRO buffer fed live by three producers (90 samples, max_reads=2): the
    collate sees every id exactly twice, 180 reads = 18 batches of 10 = 6 epochs of 3, then the
    stream ends the run (state.epoch == 6, not max_epochs)."""
    token = _token()
    buffer = FiroBuffer(capacity=16, watermark=8, seed=1, max_reads=2)
    stream = StreamState(buffer)
    trained: collections.Counter[tuple[int, int]] = collections.Counter()
    stack = lamploop.streaming.stack_samples()

    def collate(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        for sample in samples:
            trained[_ids(sample)] += 1
        return stack(samples)

    async def feed(address: tuple[str, int]) -> None:
        async with anyio.create_task_group() as producers:
            for producer in _mixed_producers(address, token, 30):
                producers.start_soon(producer)
        await receiver.wait_all_done()
        buffer.close()

    with anyio.fail_after(45):
        async with (
            stream.open_receiver(token=token, producers=["p0", "p1", "p2"]) as receiver,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(feed, receiver.address)
            try:
                state = await lamploop.fit_async(
                    model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), lamploop.cross_entropy_loss),
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
                    train_batches=buffer_batches(buffer, batch_size=10, batches_per_epoch=3, collate=collate),
                    max_epochs=1000,
                    reporters=[],
                    device="cpu",
                )
            finally:
                buffer.close()  # on a failure: refuses the producers, whose threads then end
    assert trained == {(p, s): 2 for p in range(3) for s in range(30)}
    assert state is not None
    assert state.epoch == 6


# ----------------------------------------------------------------------------- strangers with the protocol


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["async", "blocking"])
@pytest.mark.parametrize("stranger", ["wrong-token", "unlisted-name"])
async def test_a_refused_producer_is_told_why_within_the_bound_and_the_listed_one_goes_on(
    kind: str, stranger: str
) -> None:
    token = _token()
    buffer = FifoBuffer(capacity=64, watermark=1)
    stream = StreamState(buffer)
    name, its_token = ("sim-0", _token()) if stranger == "wrong-token" else ("sim-7", token)
    caught: list[BaseException] = []

    def blocking(address: tuple[str, int]) -> None:
        try:
            with BlockingProducer(address, name=name, token=its_token, reconnect_timeout=5) as producer:
                producer.send(_good(0))
        except LamploopError as error:
            caught.append(error)

    async def run_async(address: tuple[str, int]) -> None:
        try:
            async with AsyncProducer(address, name=name, token=its_token, reconnect_timeout=5) as producer:
                await producer.send(_good(0))
        except LamploopError as error:
            caught.append(error)

    started = time.monotonic()
    with anyio.fail_after(BOUND_S):
        async with stream.open_receiver(token=token, producers=["sim-0"]) as receiver:
            if kind == "async":
                await run_async(receiver.address)
            else:
                await anyio.to_thread.run_sync(blocking, receiver.address)
            took = time.monotonic() - started
            async with AsyncProducer(receiver.address, name="sim-0", token=token) as honest:
                for seq in range(5):
                    await honest.send(_sample(0, seq))
            await receiver.wait_all_done()
            refusals = receiver.refusals
    assert took < 5.0, f"the refusal took {took:.1f} s"
    assert len(caught) == 1, "the refused producer was not told"
    message = str(caught[0])
    assert str(receiver.address[1]) in message, message
    if stranger == "wrong-token":
        assert re.search(r"token|proof", message, re.IGNORECASE), message
    else:
        assert "'sim-7'" in message, message
        assert "not one of this run's producers" in message, message
    assert refusals >= 1
    buffer.close()
    assert [_ids(sample) async for sample in buffer] == [(0, s) for s in range(5)]


ODD_TENSORS = {
    "non-contiguous": lambda: torch.arange(12.0).reshape(3, 4).t(),
    "requires-grad": lambda: torch.ones(3, requires_grad=True),
    "bfloat16": lambda: torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
    "bool": lambda: torch.tensor([True, False, True]),
    "int64-scalar": lambda: torch.tensor(2**40),
    "zero-size": lambda: torch.zeros(0, 3),
    "expanded": lambda: torch.tensor([7.0]).expand(5),
    "nan-inf": lambda: torch.tensor([NAN, math.inf, -math.inf]),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", sorted(ODD_TENSORS))
async def test_odd_but_valid_tensors_arrive_with_their_values_shape_and_dtype(how: str) -> None:
    token = _token()
    buffer = FifoBuffer(capacity=8, watermark=1)
    value = ODD_TENSORS[how]()
    with anyio.fail_after(BOUND_S):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                await producer.send({"v": value})
                await producer.send_rows({"v": value.detach().unsqueeze(0).expand(2, *value.shape)})
            await receiver.wait_all_done()
    buffer.close()
    got = [sample.tensors["v"] async for sample in buffer]
    assert len(got) == 3
    for tensor in got:
        assert tensor.dtype == value.dtype
        assert tuple(tensor.shape) == tuple(value.shape)
        torch.testing.assert_close(tensor, value.detach(), rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- the stream's checkpoint


STREAM_STATE_ARGUMENTS = [
    case("buffer-str", lambda: StreamState("buffer"), DOC_ERR, r"buffer"),  # type: ignore[arg-type]
    case(
        "name-int",
        lambda: StreamState(_buf(), name=3),  # type: ignore[arg-type]
        DOC_ERR,
        r"name",
    ),
    case(
        "name-empty",
        lambda: StreamState(_buf(), name=""),
        DOC_ERR,
        r"name",
    ),
    case("restore-a-file", lambda: StreamState(_buf()).restore(__file__), LamploopError, r"file|director"),
    case("restore-int", lambda: StreamState(_buf()).restore(5), LamploopError, r"director|str|path"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("c", STREAM_STATE_ARGUMENTS)
def test_bad_stream_state_arguments_are_named(c: Case) -> None:
    _check(c)


def _stream_checkpoint(directory: Path) -> Path:
    """One epoch over a FIRO buffer (capacity 8, max_reads 2) holding seqs 0..7, never closed:
    8 reads of the 16 owed, then the checkpoint with the stream."""
    buffer = FiroBuffer(capacity=8, watermark=1, seed=0, max_reads=2)
    stream = StreamState(buffer)
    for seq in range(8):
        assert _put(buffer, "sim", seq)

    async def main() -> Any:
        with anyio.fail_after(BOUND_S):
            return await lamploop.fit_async(
                model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=buffer_batches(buffer, batch_size=4, batches_per_epoch=2),
                max_epochs=1,
                reporters=[],
                device="cpu",
                checkpoint_dir=directory,
                checkpoint_extras={"stream": stream},
            )

    anyio.run(main)
    return directory


@pytest.mark.timeout(30)
def test_a_stream_checkpoint_restores_only_into_its_own_buffer_and_then_exactly(tmp_path: Path) -> None:
    directory = _stream_checkpoint(tmp_path)
    for changes, name in [
        ({"capacity": 16}, "capacity"),
        ({"max_reads": 3}, "max_reads"),
        ({"watermark": 2}, "watermark"),
    ]:
        other = FiroBuffer(**{"capacity": 8, "watermark": 1, "seed": 0, "max_reads": 2, **changes})
        with pytest.raises(CheckpointError, match=name):
            StreamState(other).restore(directory)
        assert other.fill == 0  # a refused state changes nothing
        assert other.received == 0
    with pytest.raises(CheckpointError, match=r"'other'"):
        StreamState(FiroBuffer(capacity=8, watermark=1, seed=0, max_reads=2), name="other").restore(directory)
    buffer = FiroBuffer(capacity=8, watermark=1, seed=0, max_reads=2)
    assert StreamState(buffer).restore(directory) == {"sim": 7}
    # 8 puts owe 16 reads; the epoch did 8: the residents owe exactly the other 8.
    owed = sum(2 - seen for seen in buffer.seen_counts().values())
    assert owed == 8
    buffer.close()
    reads = collections.Counter()
    while True:
        try:
            sample = buffer.try_get()
        except StreamEnded:
            break
        reads[sample.seq] += 1
    assert sum(reads.values()) == 8
    assert all(buffer_seen <= 2 for buffer_seen in reads.values())
