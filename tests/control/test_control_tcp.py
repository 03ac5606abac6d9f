"""The TCP control channel over real sockets on 127.0.0.1: handshake, refusals, noise, lost peers."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
from support import free_port

from lamploop.control import Command, Rendezvous, Stop, TcpControlFollower, TcpControlRoot, Train, Valid
from lamploop.control.wire import (
    PROTOCOL_VERSION,
    Challenge,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    Refuse,
    Welcome,
    encode_frame,
    follower_proof,
    new_nonce,
    root_proof,
)
from lamploop.errors import ConfigurationError, ControlChannelError, HandshakeError, PeerLostError
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = b"the shared secret"
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))
RENDEZVOUS = Rendezvous(host="127.0.0.1", port=29500)
FAST = {"heartbeat_interval": 0.1, "heartbeat_timeout": 0.6}  # keeps the lost-peer tests short


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class LogWatch(logging.Handler):
    """Collects the "lamploop.control" records; lets a test wait for one instead of sleeping."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self._waiters: list[tuple[re.Pattern[str], anyio.Event]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        for pattern, event in self._waiters:
            if pattern.search(message):
                event.set()

    async def wait_for(self, pattern: str, *, count: int = 1) -> None:
        """Wait until ``count`` records match ``pattern`` (callers bound the wait)."""
        regex = re.compile(pattern)
        while sum(bool(regex.search(m)) for m in self.messages) < count:
            event = anyio.Event()
            self._waiters.append((regex, event))
            await event.wait()
            self._waiters.remove((regex, event))


@pytest.fixture
def log_watch() -> Iterator[LogWatch]:
    logger = logging.getLogger("lamploop.control")
    watch = LogWatch()
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(old_level)


def root(nranks: int, **kwargs: Any) -> TcpControlRoot:
    options: dict[str, Any] = {"token": TOKEN, "model_spec": SPEC, "join_timeout": 5.0, **FAST}
    options.update(kwargs)
    return TcpControlRoot(nranks=nranks, **options)


def follower(address: tuple[str, int], rank: int, nranks: int, **kwargs: Any) -> TcpControlFollower:
    options: dict[str, Any] = {"token": TOKEN, "model_spec": SPEC, "connect_timeout": 5.0, **FAST}
    options.update(kwargs)
    host, port = address
    return TcpControlFollower(host=host, port=port, rank=rank, nranks=nranks, **options)


class Outcome:
    """What one follower task saw: the rendezvous, the commands, and the error that ended it."""

    def __init__(self) -> None:
        self.log: list[object] = []
        self.error: BaseException | None = None
        self.done = anyio.Event()


async def follow(end: TcpControlFollower, outcome: Outcome) -> None:
    try:
        async with end:
            rendezvous, commands = await end.join()
            outcome.log.append(rendezvous)
            async for command in commands:
                outcome.log.append(command)
    except ControlChannelError as exc:
        outcome.error = exc
    finally:
        outcome.done.set()


async def join_alone(end: TcpControlFollower) -> None:
    async with end:
        await end.join()


def start(tg: anyio.abc.TaskGroup, end: TcpControlFollower) -> Outcome:
    outcome = Outcome()
    tg.start_soon(follow, end, outcome)
    return outcome


class RawPeer:
    """A hand-driven socket speaking the wire format, to play a broken or hostile peer."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.pending: list[Message] = []

    async def send(self, message: Message) -> None:
        await self.stream.send(encode_frame(message))

    async def receive(self) -> Message | None:
        while not self.pending:
            try:
                data = await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return None
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    async def receive_until_closed(self) -> list[Message]:
        """Everything the other side sends until it closes the connection."""
        messages = []
        while (message := await self.receive()) is not None:
            messages.append(message)
        return messages


@asynccontextmanager
async def raw_connection(address: tuple[str, int]) -> AsyncIterator[RawPeer]:
    async with await anyio.connect_tcp(*address) as stream:
        yield RawPeer(stream)


async def raw_join(peer: RawPeer, *, rank: int, nranks: int, token: bytes = TOKEN) -> Welcome:
    """The follower's half of the handshake, by hand; returns the root's welcome."""
    challenge = await peer.receive()
    assert isinstance(challenge, Challenge)
    assert challenge.protocol_version == PROTOCOL_VERSION
    hello = Hello(PROTOCOL_VERSION, rank, nranks, SPEC, new_nonce(), proof="")
    await peer.send(attrs.evolve(hello, proof=follower_proof(token, root_nonce=challenge.nonce, hello=hello)))
    welcome = await peer.receive()
    assert isinstance(welcome, Welcome), welcome
    return welcome


# --- joining -----------------------------------------------------------------------------------


async def test_root_reports_the_port_it_listens_on() -> None:
    async with root(2) as r:
        host, port = r.address
        assert host == "127.0.0.1"
        assert port > 0
        async with raw_connection(r.address) as peer:  # it really listens there
            assert isinstance(await peer.receive(), Challenge)


async def test_a_follower_started_before_the_root_retries_until_it_listens(log_watch: LogWatch) -> None:
    port = free_port()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            outcome = start(tg, follower(("127.0.0.1", port), 1, 2))
            await log_watch.wait_for(r"not reachable yet.*retrying", count=2)  # it did fail, twice
            async with root(2, port=port) as r:
                await r.on_rendezvous_ready(RENDEZVOUS)
                await r.broadcast(Stop(reason="done"))
    assert outcome.error is None
    assert outcome.log == [RENDEZVOUS, Stop(reason="done")]


async def test_a_follower_gives_up_when_no_root_listens() -> None:
    end = follower(("127.0.0.1", free_port()), 1, 2, connect_timeout=0.4)
    started = anyio.current_time()
    with pytest.raises(
        ControlChannelError, match=r"could not reach the root at 127\.0\.0\.1:\d+ within 0\.4 s"
    ):
        await join_alone(end)
    assert anyio.current_time() - started < 2.0


async def test_wrong_token_is_refused_on_both_sides_and_the_root_keeps_admitting(log_watch: LogWatch) -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, root(2) as r:
            intruder = follower(r.address, 1, 2, token=b"not the secret")
            with pytest.raises(
                HandshakeError, match="refused by root: the proof of the shared token did not match"
            ):
                await join_alone(intruder)
            await log_watch.wait_for("refused 127.0.0.1:.*proof of the shared token did not match")
            assert any("did not match" in refusal for refusal in r.recent_refusals)
            assert r.peers() == ()
            outcome = start(tg, follower(r.address, 1, 2))
            await r.on_rendezvous_ready(RENDEZVOUS)
            await r.broadcast(Train(epoch=0, lr_factor=1.0))
            await r.broadcast(Stop(reason="done"))
    assert outcome.error is None
    assert outcome.log == [RENDEZVOUS, Train(epoch=0, lr_factor=1.0), Stop(reason="done")]


async def test_join_timeout_names_missing_ranks_and_recent_refusals() -> None:
    async def run(tg: anyio.abc.TaskGroup) -> None:
        async with root(3, join_timeout=0.5) as r:
            start(tg, follower(r.address, 1, 3))
            with pytest.raises(HandshakeError):
                await join_alone(follower(r.address, 2, 3, token="guess"))
            await r.on_rendezvous_ready(RENDEZVOUS)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            with pytest.raises(HandshakeError) as caught:
                await run(tg)
    message = str(caught.value)
    assert "only ranks [1] of 1..2 joined within 0.5 s; missing ranks [2]" in message
    assert "recently refused: 127.0.0.1:" in message
    assert "proof of the shared token did not match" in message


@asynccontextmanager
async def fake_root(behaviour: str) -> AsyncIterator[tuple[str, int]]:
    """A hand-made root: ``impostor`` does not know the token; ``vanish`` and ``silent`` welcome
    the follower, send the rendezvous and one command, then close the socket or go quiet."""

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await play(RawPeer(stream))

    async def play(peer: RawPeer) -> None:
        nonce = new_nonce()
        await peer.send(Challenge(PROTOCOL_VERSION, nonce))
        hello = await peer.receive()
        assert isinstance(hello, Hello)
        if behaviour == "impostor":
            await peer.send(Welcome(proof="00" * 32))
            await peer.receive_until_closed()
            return
        await peer.send(Welcome(root_proof(TOKEN, root_nonce=nonce, hello=hello)))
        await peer.send(RENDEZVOUS)
        await peer.send(Train(epoch=0, lr_factor=1.0))
        if behaviour == "vanish":
            await peer.stream.aclose()
        else:
            await anyio.sleep_forever()

    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(listener.serve, serve)
        yield "127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.cancel_scope.cancel()


async def test_the_follower_authenticates_the_root_too() -> None:
    async with fake_root("impostor") as address:
        with anyio.fail_after(5), pytest.raises(HandshakeError, match="did not prove the shared token"):
            await join_alone(follower(address, 1, 2))


# --- a follower that proved the token but does not fit fails the run on both sides ---------------


def spec_with(**changes: Any) -> ModelSpec:
    first, second = SPEC.tensors
    return ModelSpec((attrs.evolve(first, **changes), second))


MISMATCHES: dict[str, tuple[dict[str, Any], str]] = {
    "tensor name": (
        {"model_spec": spec_with(name="fc.kernel")},
        r"rank 1's model differs: rank 1 lacks tensors \['fc.weight'\]; "
        r"rank 1 has unexpected tensors \['fc.kernel'\]",
    ),
    "shape": (
        {"model_spec": spec_with(shape=(10, 5))},
        r"rank 1's model differs: tensor 'fc.weight': root shape \(10, 4\), rank 1 shape \(10, 5\)",
    ),
    "dtype": (
        {"model_spec": spec_with(dtype="float16")},
        r"rank 1's model differs: tensor 'fc.weight': root dtype float32, rank 1 dtype float16",
    ),
    "world size": ({"nranks": 3}, r"rank 1 was started with nranks=3, the root with nranks=2"),
    "protocol version": (
        {"_protocol_version": 0},
        rf"rank 1 speaks control protocol version 0, the root speaks version {PROTOCOL_VERSION}",
    ),
}


@pytest.mark.parametrize("mismatch", list(MISMATCHES), ids=list(MISMATCHES))
async def test_a_mismatch_is_named_on_both_sides(mismatch: str) -> None:
    overrides, expected = MISMATCHES[mismatch]
    overrides = dict(overrides)
    nranks = overrides.pop("nranks", 2)
    outcomes: list[Outcome] = []

    async def run(tg: anyio.abc.TaskGroup) -> None:
        async with root(2) as r:
            outcomes.append(start(tg, follower(r.address, 1, nranks, **overrides)))
            await r.on_rendezvous_ready(RENDEZVOUS)

    started = anyio.current_time()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(HandshakeError, match=rf"refused rank 1 \(127.0.0.1:\d+\): {expected}"):
                await run(tg)
    [outcome] = outcomes
    assert isinstance(outcome.error, HandshakeError)
    assert re.search(f"rank 1 refused by root: {expected}", str(outcome.error)), outcome.error
    assert anyio.current_time() - started < 3.0


async def test_a_duplicate_rank_is_named_on_both_sides(log_watch: LogWatch) -> None:
    outcomes: list[Outcome] = []

    async def run(tg: anyio.abc.TaskGroup) -> None:
        async with root(3) as r:
            outcomes.append(start(tg, follower(r.address, 1, 3)))
            await log_watch.wait_for("rank 1 joined from")
            outcomes.append(start(tg, follower(r.address, 1, 3)))
            await r.on_rendezvous_ready(RENDEZVOUS)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(HandshakeError, match=r"rank 1 has already joined from 127.0.0.1:\d+"):
                await run(tg)
    first, second = outcomes
    assert isinstance(second.error, HandshakeError)
    assert "refused by root: rank 1 has already joined from 127.0.0.1:" in str(second.error)
    assert "is rank 1 started twice?" in str(second.error)
    # the rank 1 that had joined is told why the run ended
    assert isinstance(first.error, PeerLostError)
    assert "rank 1 has already joined" in str(first.error)


async def test_a_rank_out_of_range_is_refused_and_fails_the_root() -> None:
    replies: list[Message | None] = []

    async def rank_5(address: tuple[str, int]) -> None:
        async with raw_connection(address) as peer:
            challenge = await peer.receive()
            assert isinstance(challenge, Challenge)
            hello = Hello(PROTOCOL_VERSION, 5, 2, SPEC, new_nonce(), proof="")
            proof = follower_proof(TOKEN, root_nonce=challenge.nonce, hello=hello)
            await peer.send(attrs.evolve(hello, proof=proof))
            replies.append(await peer.receive())

    async def run(tg: anyio.abc.TaskGroup) -> None:
        async with root(2) as r:
            tg.start_soon(rank_5, r.address)
            await r.on_rendezvous_ready(RENDEZVOUS)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(HandshakeError, match=r"rank 5 is out of range: with nranks=2"):
                await run(tg)
    [reply] = replies
    assert isinstance(reply, Refuse)
    assert "rank 5 is out of range" in reply.reason


# --- noise on the root's port does not disturb a run ---------------------------------------------


async def test_garbage_oversized_frames_and_silence_leave_a_run_unaffected(log_watch: LogWatch) -> None:
    commands: list[Command] = [Train(epoch=e, lr_factor=1.0) for e in range(20)]
    commands += [Valid(epoch=19), Stop(reason="done")]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, root(3, handshake_timeout=0.5) as r:
            outcomes = [start(tg, follower(r.address, rank, 3)) for rank in (1, 2)]
            await r.on_rendezvous_ready(RENDEZVOUS)
            async with (
                raw_connection(r.address) as garbage,
                raw_connection(r.address) as oversized,
                raw_connection(r.address) as silent,
                raw_connection(r.address) as stranger,
            ):
                for i, command in enumerate(commands[:-1]):
                    await r.broadcast(command)
                    if i == 2:
                        await garbage.stream.send(b"\x00\x00\x00\x0cnot { json }")
                    if i == 5:  # an HTTP request reads as a header of 1195725856 bytes
                        await oversized.stream.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    if i == 8:
                        await stranger.send(Heartbeat())  # well-formed, but not a hello
                # Each is refused and closed by the root.  Garbage gets no reply (the least work
                # for the root); the silent one is told why after the handshake timeout.
                for peer in (garbage, oversized, stranger):
                    messages = await peer.receive_until_closed()
                    assert [type(m) for m in messages] == [Challenge]
                told = await silent.receive_until_closed()
                assert [type(m) for m in told] == [Challenge, Refuse]
            await log_watch.wait_for("control root refused 127.0.0.1", count=4)
            assert r.peers() == (1, 2)
            await r.broadcast(commands[-1])
    for outcome in outcomes:
        assert outcome.error is None
        assert outcome.log == [RENDEZVOUS, *commands]
    refusals = "\n".join(r.recent_refusals)
    assert "not UTF-8 JSON" in refusals
    assert "over the limit" in refusals
    assert "sent a Heartbeat message instead of a hello" in refusals
    assert "no valid hello within 0.5 s" in refusals


# --- lost peers --------------------------------------------------------------------------------


async def test_a_silent_follower_fails_the_root_within_the_heartbeat_timeout() -> None:
    joined: list[float] = []

    async def run() -> None:
        async with root(2) as r, raw_connection(r.address) as peer:
            await raw_join(peer, rank=1, nranks=2)  # and never sends a heartbeat
            await r.on_rendezvous_ready(RENDEZVOUS)
            joined.append(anyio.current_time())
            await anyio.sleep_forever()  # the root cancels this block when it gives up on rank 1

    with anyio.fail_after(5), pytest.raises(PeerLostError) as caught:
        await run()
    assert anyio.current_time() - joined[0] < 0.6 + 0.5
    assert re.search(
        r"rank 1 \(127.0.0.1:\d+\) sent nothing for 0.6 s \(heartbeat timeout\)", str(caught.value)
    )


async def test_a_follower_whose_connection_drops_fails_the_root_at_once() -> None:
    async def run() -> None:
        async with root(2, heartbeat_timeout=10.0) as r:
            async with raw_connection(r.address) as peer:
                await raw_join(peer, rank=1, nranks=2)
                await r.on_rendezvous_ready(RENDEZVOUS)
            # the raw follower's socket is now closed, without Stop or Abort
            await anyio.sleep_forever()

    # Closing with the root's heartbeats unread resets the connection, or it reads as an end of stream.
    lost = r"rank 1 \(127.0.0.1:\d+\) (closed the connection before Stop|is gone: .*Connection reset)"
    with anyio.fail_after(5), pytest.raises(PeerLostError, match=lost):
        await run()


async def test_a_failing_follower_tells_the_root_why() -> None:
    async def fail_at_first_command(end: TcpControlFollower) -> None:
        async with end:
            _, commands = await end.join()
            async for _ in commands:
                msg = "loss is NaN"
                raise RuntimeError(msg)

    async def failing(end: TcpControlFollower) -> None:
        with pytest.raises(RuntimeError, match="loss is NaN"):
            await fail_at_first_command(end)

    async def run(tg: anyio.abc.TaskGroup) -> None:
        async with root(2, heartbeat_timeout=10.0) as r:
            tg.start_soon(failing, follower(r.address, 1, 2, heartbeat_timeout=10.0))
            await r.on_rendezvous_ready(RENDEZVOUS)
            await r.broadcast(Train(epoch=0, lr_factor=1.0))
            await anyio.sleep_forever()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(PeerLostError) as caught:
                await run(tg)
    assert "rank 1 (127.0.0.1:" in str(caught.value)
    assert "aborted the run: the follower of rank 1 failed: RuntimeError: loss is NaN" in str(caught.value)


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        ("vanish", "closed the connection before Stop"),
        ("silent", r"sent nothing for 0.6 s \(heartbeat timeout\)"),
    ],
)
async def test_a_vanished_or_silent_root_fails_the_follower_promptly(behaviour: str, expected: str) -> None:
    seen: list[object] = []

    async def run(end: TcpControlFollower) -> None:
        async with end:
            _, commands = await end.join()
            async for command in commands:
                seen.append(command)

    async with fake_root(behaviour) as address:
        with (
            anyio.fail_after(3),
            pytest.raises(PeerLostError, match=rf"rank 1: the root at 127.0.0.1:\d+ {expected}"),
        ):
            await run(follower(address, 1, 2))
    assert seen == [Train(epoch=0, lr_factor=1.0)]


async def test_a_follower_busy_outside_the_iterator_is_cancelled_and_raises_on_exit() -> None:
    async def run(end: TcpControlFollower) -> None:
        async with end:
            await end.join()
            await anyio.sleep_forever()  # e.g. stuck in a collective: the channel cancels it

    async with fake_root("vanish") as address:
        with anyio.fail_after(3), pytest.raises(PeerLostError, match="closed the connection before Stop"):
            await run(follower(address, 1, 2))


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nranks": 0}, "nranks must be an integer"),
        ({"token": b""}, "token must be a non-empty"),
        ({"heartbeat_interval": 1.0, "heartbeat_timeout": 1.0}, "must exceed heartbeat_interval"),
        ({"join_timeout": -1}, "join_timeout must be a positive number"),
        ({"model_spec": {"fc.weight": (1,)}}, "model_spec must be a ModelSpec"),
        ({"port": 70000}, "port must be an integer"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    options: dict[str, Any] = {"nranks": 2, "token": TOKEN, "model_spec": SPEC, **kwargs}
    with pytest.raises(ConfigurationError, match=match):
        TcpControlRoot(**options)


def test_a_follower_rank_must_be_a_follower_rank() -> None:
    with pytest.raises(ConfigurationError, match=r"rank must be an integer in \[1, 1\], got 0"):
        follower(("127.0.0.1", 1234), 0, 2)


async def test_a_second_join_while_the_first_is_still_greeting_is_refused() -> None:
    """join() twice is a ControlChannelError, also when the second call comes while the first
    one still connects (it once was refused only after the first had joined)."""
    with anyio.fail_after(10):
        async with root(2) as the_root, anyio.create_task_group() as tg:
            end = follower(the_root.address, 1, 2)
            async with end:
                joined = anyio.Event()

                async def first() -> None:
                    await end.join()
                    joined.set()

                tg.start_soon(first)
                await anyio.lowlevel.checkpoint()  # the first join() is at its first wait now
                assert not joined.is_set()
                with pytest.raises(ControlChannelError, match=r"rank 1 already called join\(\)"):
                    await end.join()
                await the_root.on_rendezvous_ready(RENDEZVOUS)
                await joined.wait()
                await the_root.broadcast(Stop(reason="done"))
