"""One hostile-peer suite for the three protocols of lamploop.transport: the same cases, the same verdicts.

Each case runs against the real listener of the control root (:class:`TcpControlRoot`), of a
sample receiver (:class:`SampleReceiver`) and of the federated aggregator (:func:`run_aggregator`),
on 127.0.0.1, with raw sockets speaking each protocol's frames: bytes before the challenge,
garbage, a frame whose header announces more than the pre-authentication limit (refused at the
header: no body is ever sent), a wrong token, another protocol version (with and without the
token: the proof is checked first, then the version), a silent peer (closed at the handshake
timeout while a good peer joins meanwhile), and two frames in one read before the token is
proved (the hello is judged alone).  After each case a well-behaved peer of the protocol, its
real client, must still be served.  Then: the pre-authentication limit is one constant, and a
change to it takes effect in all three.  docs/transport.md lists the differences on purpose.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import pytest
import torch

from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot
from lamploop.control import wire as control_wire
from lamploop.errors import HandshakeError
from lamploop.federated import AggregatorSettings, mlp, run_aggregator
from lamploop.federated import wire as federated_wire
from lamploop.federated.link import Link, join_aggregator
from lamploop.modelspec import ModelSpec, TensorSpec
from lamploop.streaming import wire as stream_wire
from lamploop.streaming.producer import AsyncProducer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.sample import Sample
from lamploop.transport import frames
from lamploop.transport.handshake import WRONG_TOKEN
from tests.workers.federated_harness import MODEL_OPTIONS, make_plan

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = b"conformance-token"
OTHER_TOKEN = b"another-token"
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))
HANDSHAKE_TIMEOUT = 5.0  # 2 s let a loaded machine time out a good peer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Refusals(logging.Handler):
    """The refusal log's lines ("... refused host:port: why"), as every server writes them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if " refused " in line:
            self.lines.append(line)


@pytest.fixture
def refusals() -> Iterator[Refusals]:
    handler = Refusals()
    logger = logging.getLogger("lamploop.control")  # the refusal log's (transport.strangers)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


# -- the three protocols, as a raw client and a real server see them --


@attrs.frozen
class Protocol:
    """One protocol: how to speak its handshake by hand, serve it, and be a good client of it."""

    name: str
    version: int
    challenge: type[Any]
    welcome: type[Any]
    refuse: type[Any]
    decoder: Callable[[], frames.FrameDecoder[Any]]  # a client's decoder of the server's frames
    hello: Callable[[str, bytes, int], bytes]  # (server nonce, token, version) -> hello frame
    serve: Callable[[], Any]  # an async context manager yielding (port, good peer coroutine function)
    fails_on_proved_mismatch: bool  # the control root fails its run for a follower that does not fit


def _messages(decoder: Any, data: bytes) -> list[Any]:
    return [item[0] if isinstance(item, tuple) else item for item in decoder.feed(data)]


def _control_hello(nonce: str, token: bytes, version: int) -> bytes:
    hello = control_wire.Hello(version, 1, 2, SPEC, control_wire.new_nonce(), "")
    proof = control_wire.follower_proof(token, root_nonce=nonce, hello=hello)
    return control_wire.encode_frame(attrs.evolve(hello, proof=proof))


def _stream_hello(nonce: str, token: bytes, version: int) -> bytes:
    hello = stream_wire.Hello(version, "hostile", control_wire.new_nonce(), "")
    proof = stream_wire.producer_proof(token, receiver_nonce=nonce, hello=hello)
    return stream_wire.encode_frame(attrs.evolve(hello, proof=proof))


def _federated_hello(nonce: str, token: bytes, version: int) -> bytes:
    hello = federated_wire.Hello(version, "hostile", control_wire.new_nonce(), "")
    proof = federated_wire.node_proof(token, aggregator_nonce=nonce, hello=hello)
    return federated_wire.encode_frame(attrs.evolve(hello, proof=proof))


@asynccontextmanager
async def _control_server() -> AsyncIterator[tuple[int, Callable[[], Any]]]:
    async with TcpControlRoot(
        nranks=2, token=TOKEN, model_spec=SPEC, handshake_timeout=HANDSHAKE_TIMEOUT
    ) as root:

        async def good_peer() -> None:
            """A real follower joins, gets the rendezvous and the commands up to Stop."""
            async with anyio.create_task_group() as tg:

                async def lead() -> None:
                    await root.on_rendezvous_ready(Rendezvous("127.0.0.1", 1))
                    await root.broadcast(Stop("done"))

                tg.start_soon(lead)
                follower = TcpControlFollower(
                    host="127.0.0.1", port=root.address[1], rank=1, nranks=2, token=TOKEN, model_spec=SPEC
                )
                async with follower:
                    rendezvous, commands = await follower.join()
                    assert rendezvous == Rendezvous("127.0.0.1", 1)
                    assert [command async for command in commands] == [Stop("done")]

        yield root.address[1], good_peer


class _ListSink:
    def __init__(self) -> None:
        self.samples: list[Sample] = []

    async def put(self, sample: Sample) -> None:
        self.samples.append(sample)


@asynccontextmanager
async def _stream_server() -> AsyncIterator[tuple[int, Callable[[], Any]]]:
    sink = _ListSink()
    async with SampleReceiver(sink, token=TOKEN, handshake_timeout=HANDSHAKE_TIMEOUT) as receiver:

        async def good_peer() -> None:
            """A real producer delivers a sample and its Done."""
            async with AsyncProducer(receiver.address, name="good", token=TOKEN) as producer:
                await producer.send({"x": torch.ones(3)})
                await producer.done()
            assert [sample.key for sample in sink.samples] == [("good", 0)]

        yield receiver.address[1], good_peer


@asynccontextmanager
async def _federated_server() -> AsyncIterator[tuple[int, Callable[[], Any]]]:
    listening: list[int] = []
    started = anyio.Event()
    plan = make_plan()
    settings = AggregatorSettings(
        rounds=1,
        min_nodes=1,
        join_timeout=30.0,
        round_timeout=30.0,
        round_attempts=1000,  # the good peer leaves after its task: the round is sent again
        handshake_timeout=HANDSHAKE_TIMEOUT,
    )

    def on_listening(port: int) -> None:
        listening.append(port)
        started.set()

    async with anyio.create_task_group() as tg:
        initial = mlp(MODEL_OPTIONS)
        tg.start_soon(
            lambda: run_aggregator(
                plan=plan, initial_model=initial, token=TOKEN, settings=settings, on_listening=on_listening
            )
        )
        await started.wait()
        port = listening[0]

        async def good_peer() -> None:
            """A node joins with the real handshake and is sent the round."""
            link = Link(await anyio.connect_tcp("127.0.0.1", port), max_frame_bytes=1 << 24)
            try:
                await join_aggregator(link, TOKEN, "good")
                task = await link.receive()
                assert isinstance(task, federated_wire.RoundTask), task
            finally:
                await link.aclose()

        yield port, good_peer
        tg.cancel_scope.cancel()


PROTOCOLS = {
    "control": Protocol(
        "control",
        control_wire.PROTOCOL_VERSION,
        control_wire.Challenge,
        control_wire.Welcome,
        control_wire.Refuse,
        lambda: control_wire.FrameDecoder(),
        _control_hello,
        _control_server,
        fails_on_proved_mismatch=True,
    ),
    "streaming": Protocol(
        "streaming",
        stream_wire.PROTOCOL_VERSION,
        stream_wire.Challenge,
        stream_wire.Welcome,
        stream_wire.Refuse,
        lambda: stream_wire.FrameDecoder(),
        _stream_hello,
        _stream_server,
        fails_on_proved_mismatch=False,
    ),
    "federated": Protocol(
        "federated",
        federated_wire.PROTOCOL_VERSION,
        federated_wire.Challenge,
        federated_wire.Welcome,
        federated_wire.Refuse,
        lambda: federated_wire.FrameDecoder(max_frame_bytes=1 << 24),
        _federated_hello,
        _federated_server,
        fails_on_proved_mismatch=False,
    ),
}


# -- a raw client --


class Raw:
    """A connection to a server, spoken to by hand."""

    def __init__(self, protocol: Protocol, stream: anyio.abc.SocketStream) -> None:
        self.protocol = protocol
        self.stream = stream
        self.decoder = protocol.decoder()
        self.nonce = ""

    @classmethod
    async def connect(cls, protocol: Protocol, port: int) -> Raw:
        """Connect and read the server's challenge."""
        raw = cls(protocol, await anyio.connect_tcp("127.0.0.1", port))
        got: list[Any] = []
        while not got:
            got = _messages(raw.decoder, await raw.stream.receive())
        assert isinstance(got[0], protocol.challenge), got
        assert got[0].protocol_version == protocol.version
        raw.nonce = got[0].nonce
        return raw

    async def replies_until_closed(self, within: float = 5.0) -> list[Any]:
        """What the server sends until it closes the connection (bounded)."""
        got: list[Any] = []
        with anyio.fail_after(within):
            try:
                while True:
                    got.extend(_messages(self.decoder, await self.stream.receive()))
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                pass
        await self.stream.aclose()
        return got


# -- the hostile cases --


async def _spoke_first(p: Protocol, port: int) -> tuple[list[Any], str]:
    # Blocking calls on purpose: the server (on this event loop) accepts only once the bytes
    # are there, as with a stranger that does not wait for the challenge.
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")

    def read_all() -> bytes:
        with s:
            chunks = []
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(4096):
                    chunks.append(chunk)
            return b"".join(chunks)

    assert await anyio.to_thread.run_sync(read_all) == b""  # not even a challenge
    return [], "spoke before"


async def _garbage(p: Protocol, port: int) -> tuple[list[Any], str]:
    raw = await Raw.connect(p, port)
    await raw.stream.send((16).to_bytes(4, "big") + b"\x00\x0e{{{{{{{{{{{{{{")
    return await raw.replies_until_closed(), "JSON"


async def _oversized(p: Protocol, port: int) -> tuple[list[Any], str]:
    raw = await Raw.connect(p, port)
    started = time.monotonic()
    await raw.stream.send((2**31).to_bytes(4, "big"))  # the header alone: no body ever follows
    replies = await raw.replies_until_closed()
    assert time.monotonic() - started < HANDSHAKE_TIMEOUT / 2, "refused at the header, not at a timeout"
    return replies, "over the limit of"


async def _wrong_token(p: Protocol, port: int) -> tuple[list[Any], str]:
    raw = await Raw.connect(p, port)
    await raw.stream.send(p.hello(raw.nonce, OTHER_TOKEN, p.version))
    replies = await raw.replies_until_closed()
    assert replies == [p.refuse(WRONG_TOKEN)], replies
    return replies, "wrong token"


async def _other_version_wrong_token(p: Protocol, port: int) -> tuple[list[Any], str]:
    """The proof is checked before the version: a stranger learns nothing about the run."""
    raw = await Raw.connect(p, port)
    await raw.stream.send(p.hello(raw.nonce, OTHER_TOKEN, p.version + 1))
    replies = await raw.replies_until_closed()
    assert replies == [p.refuse(WRONG_TOKEN)], replies
    return replies, "wrong token"


async def _silent(p: Protocol, port: int, good_peer: Callable[[], Any]) -> tuple[list[Any], str]:
    started = time.monotonic()  # before the connection: the server's timer starts after it
    raw = await Raw.connect(p, port)
    await good_peer()  # served while the silent peer holds its connection
    assert time.monotonic() - started < HANDSHAKE_TIMEOUT, "the good peer waited for the silent one"
    replies = await raw.replies_until_closed(within=HANDSHAKE_TIMEOUT + 5)
    assert time.monotonic() - started >= HANDSHAKE_TIMEOUT
    return replies, "within"


async def _two_frames_in_one_read(p: Protocol, port: int) -> tuple[list[Any], str]:
    """A hello and an oversized frame in one write: the hello is judged alone, the frame never."""
    raw = await Raw.connect(p, port)
    await raw.stream.send(p.hello(raw.nonce, OTHER_TOKEN, p.version) + (2**31).to_bytes(4, "big"))
    replies = await raw.replies_until_closed()
    assert replies == [p.refuse(WRONG_TOKEN)], replies
    return replies, "wrong token"


CASES: dict[str, Callable[..., Any]] = {
    "bytes before the challenge": _spoke_first,
    "garbage": _garbage,
    "an oversized frame": _oversized,
    "a wrong token": _wrong_token,
    "another version and a wrong token": _other_version_wrong_token,
    "a silent peer": _silent,
    "two frames in one read": _two_frames_in_one_read,
}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("case", list(CASES))
async def test_a_hostile_peer_is_refused_and_a_good_peer_is_served_after_it(
    protocol: str, case: str, refusals: Refusals
) -> None:
    p = PROTOCOLS[protocol]
    with anyio.fail_after(20):
        async with p.serve() as (port, good_peer):
            hostile = CASES[case]
            args = (p, port, good_peer) if hostile is _silent else (p, port)
            replies, why = await hostile(*args)
            assert not any(isinstance(reply, p.welcome) for reply in replies), replies
            assert any(why in line for line in refusals.lines), (why, refusals.lines)
            if hostile is not _silent:
                await good_peer()


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_a_peer_of_another_version_with_the_token_is_told_both_versions(
    protocol: str, refusals: Refusals
) -> None:
    """The token is proved, so the refusal names both versions; the control root also fails
    its run for it (a rank that does not fit: the run cannot succeed), the others serve on."""
    p = PROTOCOLS[protocol]
    theirs = p.version + 1
    expected = f"speaks {p.name} protocol version {theirs}, the "
    replies: list[Any] = []

    async def refused() -> None:
        async with p.serve() as (port, good_peer):
            raw = await Raw.connect(p, port)
            await raw.stream.send(p.hello(raw.nonce, TOKEN, theirs))
            with anyio.CancelScope(shield=True):  # the control root's failure cancels this body
                replies.extend(await raw.replies_until_closed())
            if p.fails_on_proved_mismatch:
                await anyio.sleep(10)  # cancelled by the root's failure
            await good_peer()

    with anyio.fail_after(20):
        if p.fails_on_proved_mismatch:
            with pytest.raises(HandshakeError, match=expected):
                await refused()
        else:
            await refused()
    (refuse,) = replies
    assert isinstance(refuse, p.refuse)
    assert expected in refuse.reason
    assert f"speaks version {p.version}" in refuse.reason


# -- one pre-authentication limit --


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_the_pre_authentication_limit_is_one_constant_for_all_three(
    protocol: str, refusals: Refusals, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changing ``lamploop.transport.frames.PREAUTH_FRAME_BYTES`` changes what every server takes
    before the token is proved (the control root's floor is 4 times it: its hello carries a model spec)."""
    p = PROTOCOLS[protocol]
    limits = {}
    for value in (frames.PREAUTH_FRAME_BYTES, 2048):
        monkeypatch.setattr(frames, "PREAUTH_FRAME_BYTES", value)
        limit = value * (control_wire.PREAUTH_FLOOR_FACTOR if protocol == "control" else 1)
        refusals.lines.clear()
        with anyio.fail_after(20):
            async with p.serve() as (port, good_peer):
                raw = await Raw.connect(p, port)
                await raw.stream.send((limit + 1).to_bytes(4, "big"))
                assert await raw.replies_until_closed() == []
                assert any(f"over the limit of {limit} bytes" in line for line in refusals.lines), (
                    refusals.lines
                )
                await good_peer()
        limits[value] = limit
    assert len(set(limits.values())) == 2


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_one_frame_at_a_time_until_the_token_is_proved(protocol: str) -> None:
    """A hello and a frame over the pre-authentication limit in one read: the decoder hands out the
    hello alone and judges the next frame only under the limit the proof lifted it to."""
    p = PROTOCOLS[protocol]
    big = {
        "control": lambda: control_wire.encode_frame(control_wire.Abort("x" * 20_000)),
        "streaming": lambda: stream_wire.sample_frame(
            "hostile", 0, stream_wire.encode_tensors({"x": torch.ones(5000)})
        ),
        "federated": lambda: federated_wire.encode_frame(federated_wire.RoundRefused(0, "", "x" * 20_000)),
    }[protocol]()
    decoder: frames.FrameDecoder[Any] = p.decoder()
    decoder.max_frame_bytes, decoder.one_at_a_time = frames.PREAUTH_FRAME_BYTES, True
    assert len(big) > frames.PREAUTH_FRAME_BYTES * 4 + 4
    hello = p.hello(control_wire.new_nonce(), TOKEN, p.version)
    (first,) = _messages(decoder, hello + big)
    assert first.protocol_version == p.version
    assert decoder.buffered == len(big)
    decoder.authenticated(1 << 24)
    (second,) = _messages(decoder, b"")
    assert type(second).__name__ in ("Abort", "SamplesFrame", "RoundRefused")


def test_the_transport_never_unpickles() -> None:
    """What crosses a connection is JSON and safetensors bytes, in all three protocols."""
    import re
    from pathlib import Path

    import lamploop.transport

    for module in Path(lamploop.transport.__file__).parent.glob("*.py"):
        source = module.read_text()
        assert not re.search(r"^\s*(import|from)\s+(pickle|marshal|shelve)\b", source, re.MULTILINE), module
        assert "torch.load" not in source, module
