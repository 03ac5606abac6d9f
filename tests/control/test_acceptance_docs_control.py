"""Acceptance tests of the control channel, written from its documentation alone.

Sources: docs/control-channel.md, docs/concepts/control-channels.md, docs/transport.md,
docs/shared DESIGN.md section 5 and the public docstrings of ``lamploop.control`` and
``lamploop.errors``. Every rank is an async task of this process; the TCP channel runs on
real sockets on 127.0.0.1 (a small in-process TCP proxy freezes or cuts one follower's
connection); no mocks. Settings are scaled down (heartbeats every 0.1 s, lost after 0.8 s)
so that the module stays short.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from support import free_port

import lamploop.control as control
from lamploop.control import (
    PROTOCOL_VERSION,
    Rendezvous,
    Stop,
    TcpControlFollower,
    TcpControlRoot,
    Train,
    Valid,
    local_control,
)
from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    HandshakeError,
    LamploopError,
    PeerLostError,
    TransportError,
)
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = pytest.mark.anyio

SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))
OTHER_SPEC = ModelSpec((TensorSpec("fc.weight", (10, 5), "float32"), TensorSpec("fc.bias", (10,), "float32")))
TOKEN = "a secret shared by every rank"
RDV = Rendezvous(host="127.0.0.1", port=29500)
HB_INTERVAL = 0.1
HB_TIMEOUT = 0.8
FAST = {"heartbeat_interval": HB_INTERVAL, "heartbeat_timeout": HB_TIMEOUT}
KINDS = ["local", "tcp"]

Drive = Callable[[Any], Awaitable[Any]]


# ---------------------------------------------------------------------------------------------
# helpers


async def follow(follower: Any, seen: list[Any]) -> None:
    """The docs' follower: the rendezvous, then every command; an error ends the list."""
    try:
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            async for command in commands:
                seen.append(command)
    except Exception as error:
        seen.append(error)


def tcp_follower(address: tuple[str, int], rank: int, nranks: int, **kw: Any) -> TcpControlFollower:
    args: dict[str, Any] = {
        "host": address[0],
        "port": address[1],
        "rank": rank,
        "nranks": nranks,
        "token": TOKEN,
        "model_spec": SPEC,
        "connect_timeout": 5.0,
        "handshake_timeout": 3.0,
        **FAST,
    }
    args.update(kw)
    return TcpControlFollower(**args)


def tcp_root(nranks: int, **kw: Any) -> TcpControlRoot:
    args: dict[str, Any] = {
        "nranks": nranks,
        "token": TOKEN,
        "model_spec": SPEC,
        "join_timeout": 5.0,
        "handshake_timeout": 3.0,
        **FAST,
    }
    args.update(kw)
    return TcpControlRoot(**args)


async def run_world(
    kind: str,
    nranks: int,
    drive: Drive,
    *,
    follow_fn: Callable[[Any, list[Any]], Awaitable[None]] = follow,
    root_kw: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[int, list[Any]]]:
    """Root and followers as tasks; the root's result or error, and what each follower saw."""
    seen: dict[int, list[Any]] = {rank: [] for rank in range(1, nranks)}
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as tasks:
        if kind == "local":
            root, followers = local_control(nranks, **(root_kw or {}))
            for follower in followers:
                tasks.start_soon(follow_fn, follower, seen[follower.rank])
        else:
            root = tcp_root(nranks, **(root_kw or {}))
        try:
            async with root:
                if kind == "tcp":
                    for rank in range(1, nranks):
                        tasks.start_soon(follow_fn, tcp_follower(root.address, rank, nranks), seen[rank])
                outcome["value"] = await drive(root)
        except Exception as error:
            outcome["error"] = error
    return outcome, seen


async def read_frame(reader: BufferedByteReceiveStream) -> dict[str, Any]:
    header = await reader.receive_exactly(4)
    body = await reader.receive_exactly(int.from_bytes(header, "big"))
    return json.loads(body)


async def drain(stream: SocketStream) -> bytes:
    """Everything the peer sends until it closes (an error counts as closed)."""
    data = bytearray()
    with suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        while True:
            data += await stream.receive()
    return bytes(data)


def frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "big") + body


class Proxy:
    """A TCP relay between one follower and the root, that can freeze or cut the connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.frozen = False
        self.port = 0
        self.root_to_follower = bytearray()
        self._streams: list[SocketStream] = []

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started()
        async with listener:
            await listener.serve(self._relay)

    async def _relay(self, client: SocketStream) -> None:
        async with client, await anyio.connect_tcp(*self.target) as upstream:
            self._streams += [client, upstream]
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._pump, upstream, client, self.root_to_follower)
                tasks.start_soon(self._pump, client, upstream, None)

    async def _pump(self, src: SocketStream, dst: SocketStream, record: bytearray | None) -> None:
        with suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for chunk in src:
                if self.frozen:
                    await anyio.sleep_forever()
                if record is not None:
                    record += chunk
                await dst.send(chunk)

    async def cut(self) -> None:
        for stream in self._streams:
            with suppress(Exception):
                await stream.aclose()


# ---------------------------------------------------------------------------------------------
# commands reach every follower, in order; local and TCP alike


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_commands_reach_every_follower_in_order(kind: str) -> None:
    """control-channel.md, The interface: broadcast goes 'to every follower, in call order'."""
    commands = [
        *(c for e in range(15) for c in (Train(epoch=e, lr_factor=1.0 / (e + 1)), Valid(epoch=e))),
        Stop(reason="max_epochs reached"),
    ]

    async def drive(root: Any) -> tuple[int, ...]:
        await root.on_rendezvous_ready(RDV)
        peers = root.peers()
        for command in commands:
            await root.broadcast(command)
        return peers

    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 4, drive)
    assert outcome == {"value": (1, 2, 3)}
    for rank in (1, 2, 3):
        assert seen[rank] == [RDV, *commands], rank


@pytest.mark.timeout(20)
async def test_local_and_tcp_are_interchangeable_on_the_docs_example() -> None:
    """control-channel.md, Example: the same program gives the same result on both channels."""
    commands = [Train(epoch=0, lr_factor=1.0), Valid(epoch=0), Stop(reason="done")]

    async def drive(root: Any) -> None:
        await root.on_rendezvous_ready(RDV)
        assert root.peers() == (1, 2)
        for command in commands:
            await root.broadcast(command)

    with anyio.fail_after(10):
        local = await run_world("local", 3, drive)
        tcp = await run_world("tcp", 3, drive)
    assert local == tcp == ({"value": None}, {1: [RDV, *commands], 2: [RDV, *commands]})


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_root_leaving_without_stop_aborts_followers_with_the_reason(kind: str) -> None:
    """control-channel.md, The interface: leaving the root's block without Stop (an exception)
    'tells every follower that the run was aborted, and why: their command iterators raise
    PeerLostError with the reason'."""

    async def drive(root: Any) -> None:
        await root.on_rendezvous_ready(RDV)
        await root.broadcast(Train(epoch=0, lr_factor=1.0))
        raise RuntimeError("the disk is full")

    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 3, drive)
    assert isinstance(outcome["error"], RuntimeError)
    for rank in (1, 2):
        assert seen[rank][:2] == [RDV, Train(epoch=0, lr_factor=1.0)], rank
        assert len(seen[rank]) == 3, seen[rank]
        error = seen[rank][2]
        assert isinstance(error, PeerLostError), repr(error)
        assert "the disk is full" in str(error), str(error)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_root_leaving_quietly_without_stop_aborts_followers(kind: str) -> None:
    """concepts/control-channels.md: 'Without Stop, leaving the root's block aborts the
    followers' (the example: PeerLostError)."""

    async def drive(root: Any) -> None:
        await root.on_rendezvous_ready(RDV)
        await root.broadcast(Valid(epoch=3))

    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 3, drive)
    assert outcome == {"value": None}
    for rank in (1, 2):
        assert seen[rank][:2] == [RDV, Valid(epoch=3)]
        assert isinstance(seen[rank][-1], PeerLostError), seen[rank]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_follower_leaving_before_stop_fails_the_root_naming_it(kind: str) -> None:
    """control-channel.md, The interface: 'a follower that leaves its block before Stop fails
    the root with PeerLostError naming its rank'; over TCP the other followers raise
    PeerLostError(rank=r) too (Heartbeats and timeouts: lost_rank)."""
    left = anyio.Event()

    async def follow_or_leave(follower: Any, seen: list[Any]) -> None:
        if follower.rank != 2:
            await follow(follower, seen)
            return
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            async for command in commands:
                seen.append(command)
                break  # leaves after the first command, before Stop
        left.set()

    async def drive(root: Any) -> None:
        await root.on_rendezvous_ready(RDV)
        await root.broadcast(Train(epoch=0, lr_factor=1.0))
        await left.wait()
        while True:  # the root learns it at its next broadcast, or its body is cancelled
            await root.broadcast(Valid(epoch=0))
            await anyio.sleep(0.05)

    start = time.monotonic()
    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 3, drive, follow_fn=follow_or_leave)
    elapsed = time.monotonic() - start
    error = outcome["error"]
    assert isinstance(error, PeerLostError), repr(error)
    assert error.rank == 2, (error.rank, str(error))
    assert "rank 2" in str(error), str(error)
    assert error.how in {"closed", "aborted", "died"}, error.how
    assert isinstance(seen[1][-1], PeerLostError), seen[1]
    if kind == "tcp":
        assert seen[1][-1].rank == 2, (seen[1][-1].rank, str(seen[1][-1]))
        # a departure is noticed by its Abort or the disconnection, not by a heartbeat timeout
        assert elapsed < 3.0, elapsed


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_misuse_of_the_root_is_a_control_channel_error(kind: str) -> None:
    """ControlRoot.broadcast: ControlChannelError 'called before on_rendezvous_ready or after
    Stop'; on_rendezvous_ready: ControlChannelError 'called twice'."""

    async def drive(root: Any) -> list[BaseException]:
        errors = []
        for attempt in (
            lambda: root.broadcast(Train(epoch=0, lr_factor=1.0)),
            lambda: None,
            lambda: root.on_rendezvous_ready(RDV),
            lambda: root.broadcast(Stop(reason="done")),
            lambda: root.broadcast(Train(epoch=1, lr_factor=1.0)),
        ):
            try:
                awaitable = attempt()
                if awaitable is None:
                    await root.on_rendezvous_ready(RDV)
                else:
                    await awaitable
            except Exception as error:
                errors.append(error)
        return errors

    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 2, drive)
    errors = outcome["value"]
    assert len(errors) == 3, errors
    for error in errors:
        assert isinstance(error, ControlChannelError), repr(error)
        assert isinstance(error, TransportError)
    assert seen[1] == [RDV, Stop(reason="done")]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_join_twice_is_a_control_channel_error(kind: str) -> None:
    """LocalControlFollower.join / TcpControlFollower.join: ControlChannelError when called twice."""
    second: list[BaseException] = []

    async def follow_twice(follower: Any, seen: list[Any]) -> None:
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            try:
                await follower.join()
            except Exception as error:
                second.append(error)
            async for command in commands:
                seen.append(command)

    async def drive(root: Any) -> None:
        await root.on_rendezvous_ready(RDV)
        await root.broadcast(Stop(reason="done"))

    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 2, drive, follow_fn=follow_twice)
    assert outcome == {"value": None}
    assert seen[1] == [RDV, Stop(reason="done")]
    assert len(second) == 1, second
    assert isinstance(second[0], ControlChannelError), second


@pytest.mark.timeout(20)
async def test_tcp_join_outside_async_with_is_a_control_channel_error() -> None:
    """TcpControlFollower.join: ControlChannelError 'also when called ... outside async with'."""
    follower = tcp_follower(("127.0.0.1", 9), 1, 2, connect_timeout=0.2)
    with anyio.fail_after(3), pytest.raises(ControlChannelError):
        await follower.join()


@pytest.mark.timeout(20)
async def test_tcp_broadcast_of_a_non_command_is_a_type_error() -> None:
    """TcpControlRoot.broadcast: 'TypeError: command is not a Train, Valid or Stop'."""

    async def drive(root: Any) -> None:
        await root.on_rendezvous_ready(RDV)
        with pytest.raises(TypeError):
            await root.broadcast({"type": "train", "epoch": 0, "lr_factor": 1.0})
        await root.broadcast(Stop(reason="done"))

    with anyio.fail_after(10):
        outcome, seen = await run_world("tcp", 2, drive)
    assert outcome == {"value": None}
    assert seen[1] == [RDV, Stop(reason="done")]


# ---------------------------------------------------------------------------------------------
# stop requests


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_a_followers_stop_request_reaches_every_rank_first_one_wins(kind: str) -> None:
    """control-channel.md, Stop requests / request_stop docstrings: a request on one rank
    reaches every rank; 'only the first request (from any rank) counts'; it 'returns at once,
    raises nothing'."""
    reasons: dict[int, str] = {}
    asked = anyio.Event()

    async def follow_and_listen(follower: Any, seen: list[Any]) -> None:
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            if follower.rank == 2:
                with anyio.fail_after(0.5):
                    await follower.request_stop("SIGTERM")
                asked.set()
            else:
                await asked.wait()
                await anyio.sleep(0.2)
                await follower.request_stop("SIGINT")  # later: does nothing
            with anyio.fail_after(5):
                reasons[follower.rank] = await follower.wait_for_stop_request()
            async for command in commands:
                seen.append(command)

    async def drive(root: Any) -> str:
        await root.on_rendezvous_ready(RDV)
        with anyio.fail_after(5):
            reason = await root.wait_for_stop_request()
        await anyio.sleep(0.4)  # the later request from rank 1 had time to arrive
        await root.request_stop("the root's own, later")
        reason_after = await root.wait_for_stop_request()
        await root.broadcast(Stop(reason="stopped: " + reason))
        assert reason_after == reason
        return reason

    with anyio.fail_after(15):
        outcome, seen = await run_world(kind, 4, drive, follow_fn=follow_and_listen)
    assert outcome == {"value": "SIGTERM"}
    assert reasons == {1: "SIGTERM", 2: "SIGTERM", 3: "SIGTERM"}
    for rank in (1, 2, 3):
        assert seen[rank] == [RDV, Stop(reason="stopped: SIGTERM")], seen[rank]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_the_roots_stop_request_reaches_every_follower(kind: str) -> None:
    """ControlRoot.request_stop: 'Every follower learns it from wait_for_stop_request'."""
    reasons: dict[int, str] = {}
    all_heard = anyio.Event()

    async def follow_and_listen(follower: Any, seen: list[Any]) -> None:
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            with anyio.fail_after(5):
                reasons[follower.rank] = await follower.wait_for_stop_request()
            if len(reasons) == 2:
                all_heard.set()
            async for command in commands:
                seen.append(command)

    async def drive(root: Any) -> str:
        await root.on_rendezvous_ready(RDV)
        with anyio.fail_after(0.5):
            await root.request_stop("SIGTERM")
        with anyio.fail_after(1):
            reason = await root.wait_for_stop_request()
        await all_heard.wait()
        await root.broadcast(Stop(reason="stopped"))
        return reason

    with anyio.fail_after(15):
        outcome, _seen = await run_world(kind, 3, drive, follow_fn=follow_and_listen)
    assert outcome == {"value": "SIGTERM"}
    assert reasons == {1: "SIGTERM", 2: "SIGTERM"}


@pytest.mark.timeout(20)
async def test_tcp_stop_request_reaches_a_follower_that_joins_later() -> None:
    """control-channel.md, Stop requests: the root passes a request on 'to every other
    follower, also to one that joins later'."""
    reasons: dict[int, str] = {}
    all_heard = anyio.Event()

    async def follower_side(follower: TcpControlFollower, seen: list[Any], delay: float) -> None:
        await anyio.sleep(delay)
        async with follower:
            if follower.rank == 1:
                await follower.request_stop("SIGTERM")  # before joining: sent once joined
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            with anyio.fail_after(5):
                reasons[follower.rank] = await follower.wait_for_stop_request()
            if len(reasons) == 2:
                all_heard.set()
            async for command in commands:
                seen.append(command)

    seen: dict[int, list[Any]] = {1: [], 2: []}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks, tcp_root(3) as root:
            tasks.start_soon(follower_side, tcp_follower(root.address, 1, 3), seen[1], 0.0)
            tasks.start_soon(follower_side, tcp_follower(root.address, 2, 3), seen[2], 0.5)
            with anyio.fail_after(5):
                assert await root.wait_for_stop_request() == "SIGTERM"
            assert root.peers() == (1,)  # the request came before rank 2 joined
            await root.on_rendezvous_ready(RDV)
            await all_heard.wait()
            await root.broadcast(Stop(reason="stopped"))
    assert reasons == {1: "SIGTERM", 2: "SIGTERM"}
    assert seen == {1: [RDV, Stop(reason="stopped")], 2: [RDV, Stop(reason="stopped")]}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
async def test_request_stop_raises_nothing_even_before_entering(kind: str) -> None:
    """The interface: request_stop 'returns at once, raises nothing'."""
    if kind == "local":
        root, followers = local_control(2)
        follower: Any = followers[0]
    else:
        root = tcp_root(2)
        follower = tcp_follower(("127.0.0.1", 9), 1, 2)
    with anyio.fail_after(0.5):
        await follower.request_stop("SIGTERM")
        await root.request_stop("SIGTERM")
    if kind == "local":  # its memory streams
        await follower.aclose()
        await root.aclose()


# ---------------------------------------------------------------------------------------------
# liveness over TCP: a follower that freezes, is cut off, or never joins


async def run_through_proxy(
    action: str, hb_timeout: float
) -> tuple[dict[str, Any], dict[int, list[Any]], float]:
    """nranks=3; rank 1 talks to the root through a proxy, which then freezes or cuts."""
    seen: dict[int, list[Any]] = {1: [], 2: []}
    outcome: dict[str, Any] = {}
    fault_at = 0.0
    kw = {"heartbeat_interval": HB_INTERVAL, "heartbeat_timeout": hb_timeout}
    async with anyio.create_task_group() as tasks:
        try:
            async with tcp_root(3, **kw) as root:
                proxy = Proxy(root.address)
                await tasks.start(proxy.serve)
                tasks.start_soon(follow, tcp_follower(("127.0.0.1", proxy.port), 1, 3, **kw), seen[1])
                tasks.start_soon(follow, tcp_follower(root.address, 2, 3, **kw), seen[2])
                await root.on_rendezvous_ready(RDV)
                await root.broadcast(Train(epoch=0, lr_factor=1.0))
                await anyio.sleep(3 * HB_INTERVAL)  # heartbeats flow
                fault_at = time.monotonic()
                if action == "freeze":
                    proxy.frozen = True
                else:
                    await proxy.cut()
                while True:
                    await anyio.sleep(0.05)
                    await root.broadcast(Valid(epoch=0))
        except Exception as error:
            outcome["error"] = error
            outcome["after"] = time.monotonic() - fault_at
        tasks.cancel_scope.cancel()
    return outcome, seen, fault_at


@pytest.mark.timeout(20)
async def test_a_frozen_follower_is_detected_within_the_heartbeat_timeout_and_named() -> None:
    """control-channel.md, Heartbeats and timeouts: 'A joined peer that is silent past
    heartbeat_timeout ... fails its counterpart with PeerLostError naming it'; how="silent";
    the root's Abort carries lost_rank so 'every survivor raises PeerLostError(rank=r)'; a
    frozen rank ends every survivor's run within timeout + about one interval (5 s with 4 s)."""
    with anyio.fail_after(10):
        outcome, seen, _ = await run_through_proxy("freeze", HB_TIMEOUT)
    error = outcome["error"]
    assert isinstance(error, PeerLostError), repr(error)
    assert (error.rank, error.how) == (1, "silent"), (error.rank, error.how, str(error))
    assert "rank 1" in str(error), str(error)
    # silent for the timeout since its last heartbeat (at most one interval before the freeze):
    # not before that (a slow rank is not a lost one), not much after it
    assert HB_TIMEOUT - HB_INTERVAL - 0.05 <= outcome["after"] <= HB_TIMEOUT + 1.0, outcome["after"]
    survivor = seen[2][-1]
    assert isinstance(survivor, PeerLostError), seen[2]
    assert survivor.rank == 1, (survivor.rank, str(survivor))
    # the frozen rank itself stops too (it hears nothing from the root)
    assert isinstance(seen[1][-1], PeerLostError), seen[1]


@pytest.mark.timeout(20)
async def test_a_disconnected_follower_is_detected_at_once_and_named() -> None:
    """control-channel.md: a lost rank is noticed 'by heartbeats, disconnection or its Abort';
    a peer that 'disconnects ... before Stop fails its counterpart with PeerLostError naming
    it'. With a 3 s heartbeat timeout, a cut connection must be noticed well before it."""
    with anyio.fail_after(10):
        outcome, seen, _ = await run_through_proxy("cut", 3.0)
    error = outcome["error"]
    assert isinstance(error, PeerLostError), repr(error)
    assert error.rank == 1, (error.rank, error.how, str(error))
    assert error.how in {"died", "closed"}, (error.rank, error.how, str(error))
    assert outcome["after"] < 1.5, outcome["after"]
    assert isinstance(seen[2][-1], PeerLostError), seen[2]
    assert seen[2][-1].rank == 1, seen[2]


@pytest.mark.timeout(20)
async def test_join_timeout_names_the_missing_rank_and_quotes_refusals() -> None:
    """Heartbeats and timeouts table: on_rendezvous_ready 'waits this long for every follower,
    then raises HandshakeError naming the missing ranks'; Handshake: 'the join-timeout error
    quotes them [recent refusals], which is what you need when a rank was started with the
    wrong token'; TcpControlFollower.join: the root aborts the run after its join timeout."""
    seen: dict[int, list[Any]] = {1: [], 2: []}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks, tcp_root(3, join_timeout=1.0) as root:
            tasks.start_soon(follow, tcp_follower(root.address, 1, 3), seen[1])
            tasks.start_soon(follow, tcp_follower(root.address, 2, 3, token="not the token"), seen[2])
            start = time.monotonic()
            with pytest.raises(HandshakeError) as caught:
                await root.on_rendezvous_ready(RDV)
            elapsed = time.monotonic() - start
    message = str(caught.value)
    assert "2" in message, message
    assert "wrong token" in message, message
    assert 0.9 <= elapsed <= 2.5, elapsed
    assert isinstance(seen[2][-1], HandshakeError), seen[2]
    assert len(seen[1]) == 1, seen[1]
    assert isinstance(seen[1][0], PeerLostError), seen[1]


@pytest.mark.timeout(20)
async def test_local_join_timeout_names_the_missing_rank() -> None:
    """local_control: on_rendezvous_ready raises HandshakeError 'not every follower joined
    within the join timeout (names the missing ranks)'."""
    root, followers = local_control(3, join_timeout=0.3)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            seen: list[Any] = []
            tasks.start_soon(follow, followers[0], seen)
            async with root:
                with pytest.raises(HandshakeError) as caught:
                    await root.on_rendezvous_ready(RDV)
    assert "2" in str(caught.value), str(caught.value)


@pytest.mark.timeout(20)
async def test_follower_gives_up_after_connect_timeout_with_a_clear_error() -> None:
    """Heartbeats table: connect_timeout 'keep retrying to connect'; join raises
    ControlChannelError 'the root was not reachable within connect_timeout'."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    follower = tcp_follower(("127.0.0.1", port), 1, 2, connect_timeout=0.5)
    start = time.monotonic()
    with anyio.fail_after(5), pytest.raises(ControlChannelError) as caught:
        async with follower:
            await follower.join()
    elapsed = time.monotonic() - start
    assert 0.4 <= elapsed <= 2.0, elapsed
    assert str(port) in str(caught.value), str(caught.value)


@pytest.mark.timeout(20)
async def test_followers_may_start_before_the_root_listens() -> None:
    """Handshake: 'TCP connect (retried with backoff until connect_timeout)', 'so followers may
    start first'."""
    port = free_port()  # the root listens there later: below the range outgoing connections take
    seen: list[Any] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(follow, tcp_follower(("127.0.0.1", port), 1, 2), seen)
            await anyio.sleep(0.6)
            async with tcp_root(2, port=port) as root:
                await root.on_rendezvous_ready(RDV)
                await root.broadcast(Stop(reason="done"))
    assert seen == [RDV, Stop(reason="done")]


# ---------------------------------------------------------------------------------------------
# authentication and strangers


async def complete_run_after(root: TcpControlRoot, hostile: Callable[[], Awaitable[None]]) -> list[Any]:
    """Let ``hostile`` do its worst, then a real follower joins and the run completes."""
    seen: list[Any] = []
    await hostile()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(follow, tcp_follower(root.address, 1, 2), seen)
        with anyio.fail_after(2):
            await root.on_rendezvous_ready(RDV)
        await root.broadcast(Train(epoch=0, lr_factor=1.0))
        await root.broadcast(Stop(reason="done"))
    return seen


@pytest.mark.timeout(20)
async def test_wrong_token_is_refused_logged_and_does_not_disturb_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Handshake: a wrong token is 'only refused: the root logs a warning on the
    lamploop.control logger, keeps the last 16 in root.recent_refusals ... and goes on';
    a well-formed hello with a wrong proof is told why ('the proof of the shared token did
    not match (wrong token?)'); the follower raises HandshakeError."""
    caplog.set_level(logging.WARNING, logger="lamploop.control")
    errors: list[Any] = []

    async def wrong_token() -> None:
        await follow(tcp_follower(root.address, 1, 2, token="the wrong token"), errors)

    with anyio.fail_after(10):
        async with tcp_root(2) as root:
            seen = await complete_run_after(root, wrong_token)
            refusals = root.recent_refusals
    assert len(errors) == 1, errors
    assert isinstance(errors[0], HandshakeError), errors
    assert "wrong token" in str(errors[0]), str(errors[0])
    assert "rank 1" in str(errors[0]), str(errors[0])
    assert "the wrong token" not in str(errors[0])
    assert seen == [RDV, Train(epoch=0, lr_factor=1.0), Stop(reason="done")]
    assert len(refusals) == 1, refusals
    assert "wrong token" in refusals[0], refusals
    assert refusals[0].startswith("127.0.0.1:"), refusals
    warnings = [
        r for r in caplog.records if r.name.startswith("lamploop.control") and r.levelno == logging.WARNING
    ]
    assert warnings, caplog.records


@pytest.mark.timeout(20)
async def test_garbage_after_the_challenge_gets_no_reply_and_is_remembered() -> None:
    """Framing + Handshake: the root speaks first with a challenge (a 4-byte big-endian length,
    then UTF-8 JSON with a "type"); 'garbage gets no reply'; refused, remembered; run goes on."""
    challenges: list[dict[str, Any]] = []
    replies: list[bytes] = []

    async def garbage() -> None:
        for payload in (
            frame({"type": "nonsense"}),
            b"\x00\x00\x00\x05hello",
            frame({"type": "hello", "rank": "one"}),
            b"\x00\x00\x00\x03[1]",
        ):
            async with await anyio.connect_tcp(*root.address) as stream:
                reader = BufferedByteReceiveStream(stream)
                challenges.append(await read_frame(reader))
                await stream.send(payload)
                with anyio.fail_after(2):
                    replies.append(bytes(reader.buffer) + await drain(stream))

    with anyio.fail_after(10):
        async with tcp_root(2) as root:
            seen = await complete_run_after(root, garbage)
            refusals = root.recent_refusals
    assert seen == [RDV, Train(epoch=0, lr_factor=1.0), Stop(reason="done")]
    for challenge in challenges:
        assert challenge["type"] == "challenge", challenge
        assert challenge["protocol_version"] == PROTOCOL_VERSION, challenge
    assert replies == [b""] * 4, replies
    assert len(refusals) == 4, refusals


@pytest.mark.timeout(20)
@pytest.mark.parametrize("announced", [1 << 20, 64 << 20, 0x47455420])
async def test_oversized_frames_are_refused_at_the_header(announced: int) -> None:
    """Handshake: 'frames before authentication are limited to twice the size of a hello ...
    (at least 16 KiB, at most max_frame_bytes): a stranger's 4 MB hello is refused at its
    4-byte header, nothing buffered'. 1 MiB < max_frame_bytes (4 MiB), 64 MiB > it, and
    0x47455420 is 'GET ' (an HTTP request)."""
    closed_after: list[float] = []

    async def oversized() -> None:
        async with await anyio.connect_tcp(*root.address) as stream:
            reader = BufferedByteReceiveStream(stream)
            await read_frame(reader)
            start = time.monotonic()
            await stream.send(announced.to_bytes(4, "big") + b"{" * 100)  # never the whole body
            with anyio.fail_after(2.5):
                rest = await drain(stream)
            closed_after.append(time.monotonic() - start)
            assert rest == b"", rest

    with anyio.fail_after(10):
        async with tcp_root(2, handshake_timeout=3.0) as root:
            seen = await complete_run_after(root, oversized)
            refusals = root.recent_refusals
    assert seen == [RDV, Train(epoch=0, lr_factor=1.0), Stop(reason="done")]
    assert closed_after[0] < 1.0, closed_after  # at the header, not at the handshake timeout
    assert len(refusals) == 1, refusals


@pytest.mark.timeout(20)
async def test_a_peer_that_speaks_first_is_closed_without_a_handshake() -> None:
    """Handshake, 'speaking first': an HTTP request sent at connect gets no handshake (at most
    the challenge, if it was accepted before its bytes arrived) and is remembered."""
    replies: list[bytes] = []

    async def speaks_first() -> None:
        for _ in range(3):
            async with await anyio.connect_tcp(*root.address) as stream:
                await stream.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                with anyio.fail_after(2.5):
                    replies.append(await drain(stream))

    with anyio.fail_after(10):
        async with tcp_root(2) as root:
            seen = await complete_run_after(root, speaks_first)
            refusals = root.recent_refusals
    assert seen == [RDV, Train(epoch=0, lr_factor=1.0), Stop(reason="done")]
    for reply in replies:
        if reply:
            message = json.loads(reply[4 : 4 + int.from_bytes(reply[:4], "big")])
            assert message["type"] == "challenge", reply
            assert len(reply) == 4 + int.from_bytes(reply[:4], "big"), reply
    assert len(refusals) == 3, refusals


@pytest.mark.timeout(20)
async def test_a_silent_peer_is_refused_with_a_reason_at_the_handshake_timeout() -> None:
    """Handshake: 'silent for handshake_timeout: Refuse(reason), close; logged, remembered';
    a real follower joins meanwhile."""
    received: list[Any] = []
    seen: list[Any] = []
    with anyio.fail_after(10):
        async with tcp_root(2, handshake_timeout=0.6) as root, anyio.create_task_group() as tasks:
            async with await anyio.connect_tcp(*root.address) as stream:
                reader = BufferedByteReceiveStream(stream)
                received.append(await read_frame(reader))
                start = time.monotonic()
                tasks.start_soon(follow, tcp_follower(root.address, 1, 2), seen)
                await root.on_rendezvous_ready(RDV)
                joined_after = time.monotonic() - start
                with anyio.fail_after(3):
                    received.append(await read_frame(reader))
                    elapsed = time.monotonic() - start
                    rest = bytes(reader.buffer) + await drain(stream)
            await root.broadcast(Stop(reason="done"))
            refusals = root.recent_refusals
    assert joined_after < 0.5, joined_after
    assert received[1]["type"] == "refuse", received
    assert received[1].get("reason"), received
    assert 0.5 <= elapsed <= 1.6, elapsed
    assert rest == b""
    assert len(refusals) == 1, refusals
    assert seen == [RDV, Stop(reason="done")]


@pytest.mark.timeout(20)
async def test_too_many_pending_handshakes_drop_the_oldest_and_a_follower_still_joins() -> None:
    """Handshake: 'at most max_pending_handshakes at once; one more drops the oldest', so silent
    connections cannot keep a real follower from joining 'in well under a second', 'nor hold
    more file descriptors than that'."""
    limit, opened = 3, 10
    streams: list[SocketStream] = []
    seen: list[Any] = []
    with anyio.fail_after(10):
        async with tcp_root(2, handshake_timeout=5.0, max_pending_handshakes=limit) as root:
            for _ in range(opened):
                stream = await anyio.connect_tcp(*root.address)
                streams.append(stream)
                reader = BufferedByteReceiveStream(stream)
                with anyio.fail_after(2):
                    assert (await read_frame(reader))["type"] == "challenge"
            async with anyio.create_task_group() as tasks:
                start = time.monotonic()
                tasks.start_soon(follow, tcp_follower(root.address, 1, 2), seen)
                await root.on_rendezvous_ready(RDV)
                joined_after = time.monotonic() - start
                await root.broadcast(Stop(reason="done"))
            still_open = 0
            for stream in streams:
                with anyio.move_on_after(0.05) as scope:
                    await drain(stream)
                if scope.cancelled_caught:
                    still_open += 1
                await stream.aclose()
    assert joined_after < 1.0, joined_after
    assert seen == [RDV, Stop(reason="done")]
    assert still_open <= limit, still_open


@pytest.mark.timeout(20)
async def test_recent_refusals_keeps_the_last_16_and_the_log_is_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Handshake: 'keeps the last 16 in root.recent_refusals'; 'the log: at most 10 refusal lines
    per 10 s, then one line with the count of the others'."""
    caplog.set_level(logging.WARNING, logger="lamploop.control")

    async def flood() -> None:
        for _ in range(25):
            async with await anyio.connect_tcp(*root.address) as stream:
                reader = BufferedByteReceiveStream(stream)
                await read_frame(reader)
                await stream.send(b"\x00\x00\x00\x02{}")
                with anyio.fail_after(2):
                    await drain(stream)

    with anyio.fail_after(10):
        async with tcp_root(2) as root:
            seen = await complete_run_after(root, flood)
            refusals = root.recent_refusals
    assert seen == [RDV, Train(epoch=0, lr_factor=1.0), Stop(reason="done")]
    assert len(refusals) == 16, refusals
    lines = [
        r for r in caplog.records if r.name.startswith("lamploop.control") and r.levelno >= logging.WARNING
    ]
    assert 1 <= len(lines) <= 11, [r.getMessage() for r in lines]


@pytest.mark.timeout(20)
async def test_a_follower_refuses_a_root_that_does_not_prove_the_token() -> None:
    """Security model: 'followers only accept a root that knows it'; the proof 'cannot be
    replayed'; transport.md: an unproven welcome is a HandshakeError for the follower. A fake
    root replays a real root's welcome (recorded through a proxy) to a new challenge."""
    # 1. record a real welcome
    seen: list[Any] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            async with tcp_root(2) as root:
                proxy = Proxy(root.address)
                await tasks.start(proxy.serve)
                tasks.start_soon(follow, tcp_follower(("127.0.0.1", proxy.port), 1, 2), seen)
                await root.on_rendezvous_ready(RDV)
                await root.broadcast(Stop(reason="done"))
            tasks.cancel_scope.cancel()
    assert seen == [RDV, Stop(reason="done")]
    recorded = bytes(proxy.root_to_follower)
    frames = []
    while recorded:
        size = int.from_bytes(recorded[:4], "big")
        frames.append(json.loads(recorded[4 : 4 + size]))
        recorded = recorded[4 + size :]
    challenge, welcome = frames[0], frames[1]
    assert challenge["type"] == "challenge"

    # 2. a fake root: a fresh challenge, then the recorded welcome
    async def fake_root(stream: SocketStream) -> None:
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            await stream.send(frame({**challenge, "nonce": "ab" * 32}))
            hello = await read_frame(reader)
            assert hello["type"] == "hello"
            await stream.send(frame(welcome))
            with anyio.move_on_after(3):
                await drain(stream)

    errors: list[Any] = []
    with anyio.fail_after(10):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(listener.serve, fake_root)
            await follow(tcp_follower(("127.0.0.1", port), 1, 2), errors)
            tasks.cancel_scope.cancel()
        await listener.aclose()
    assert len(errors) == 1, errors
    assert isinstance(errors[0], HandshakeError), errors


@pytest.mark.timeout(20)
async def test_a_follower_facing_a_non_lamploop_server_gets_a_transport_error() -> None:
    """join: ControlChannelError if the root 'does not speak this protocol'; never a raw error."""

    async def http_server(stream: SocketStream) -> None:
        async with stream:
            await stream.send(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    errors: list[Any] = []
    with anyio.fail_after(10):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(listener.serve, http_server)
            await follow(tcp_follower(("127.0.0.1", port), 1, 2, connect_timeout=1.0), errors)
            tasks.cancel_scope.cancel()
        await listener.aclose()
    assert len(errors) == 1, errors
    assert isinstance(errors[0], ControlChannelError), errors


# ---------------------------------------------------------------------------------------------
# peers that prove the token but do not fit the run: the root fails too


async def mismatch(
    root_nranks: int, followers: list[dict[str, Any]]
) -> tuple[BaseException, list[list[Any]]]:
    seen: list[list[Any]] = [[] for _ in followers]
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tasks:
        try:
            async with tcp_root(root_nranks) as root:
                for kw, into in zip(followers, seen, strict=True):
                    delay = kw.pop("delay", 0.0)
                    await anyio.sleep(delay)
                    tasks.start_soon(follow, tcp_follower(root.address, **kw), into)
                try:
                    await root.on_rendezvous_ready(RDV)
                except Exception as error:
                    errors.append(error)
        except Exception as error:
            errors.append(error)
    assert errors, errors
    assert all(isinstance(e, HandshakeError) for e in errors), errors
    return errors[0], seen


@pytest.mark.timeout(20)
async def test_world_size_mismatch_fails_both_sides_with_the_documented_message() -> None:
    """Handshake: 'rank 1 was started with nranks=3, the root with nranks=2'; the follower
    raises HandshakeError('rank 1 refused by root: <reason>') and the root
    HandshakeError('refused rank 1 (host:port): <reason>')."""
    with anyio.fail_after(10):
        root_error, seen = await mismatch(2, [{"rank": 1, "nranks": 3}])
    reason = "rank 1 was started with nranks=3, the root with nranks=2"
    assert "refused rank 1 (127.0.0.1:" in str(root_error), str(root_error)
    assert reason in str(root_error), str(root_error)
    assert isinstance(seen[0][-1], HandshakeError), seen
    assert str(seen[0][-1]).startswith("rank 1 refused by root: ")
    assert reason in str(seen[0][-1])


@pytest.mark.timeout(20)
async def test_model_mismatch_names_the_tensor_and_both_shapes() -> None:
    """Handshake: "rank 1's model differs: tensor 'fc.weight': root shape (10, 4), rank 1 shape
    (10, 5)"."""
    with anyio.fail_after(10):
        root_error, seen = await mismatch(2, [{"rank": 1, "nranks": 2, "model_spec": OTHER_SPEC}])
    reason = "rank 1's model differs: tensor 'fc.weight': root shape (10, 4), rank 1 shape (10, 5)"
    assert reason in str(root_error), str(root_error)
    assert isinstance(seen[0][-1], HandshakeError), seen
    assert reason in str(seen[0][-1]), seen


@pytest.mark.timeout(20)
async def test_a_rank_started_twice_is_refused_naming_the_first() -> None:
    """Handshake: 'rank 1 has already joined from 10.0.0.7:51234: is rank 1 started twice?'."""
    with anyio.fail_after(10):
        root_error, seen = await mismatch(
            3, [{"rank": 1, "nranks": 3}, {"rank": 1, "nranks": 3, "delay": 0.5}]
        )
    message = str(root_error)
    assert "rank 1 has already joined from 127.0.0.1:" in message, message
    assert "is rank 1 started twice?" in message, message
    assert isinstance(seen[1][-1], HandshakeError), seen


# ---------------------------------------------------------------------------------------------
# bad arguments: ConfigurationError naming the argument


def root_args(**kw: Any) -> dict[str, Any]:
    return {"nranks": 2, "token": TOKEN, "model_spec": SPEC, **kw}


def follower_args(**kw: Any) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "port": 29511,
        "rank": 1,
        "nranks": 2,
        "token": TOKEN,
        "model_spec": SPEC,
        **kw,
    }


BAD_ROOT = [
    ({"port": -1}, "port"),
    ({"port": 65536}, "port"),
    ({"port": "29500"}, "port"),
    ({"port": 1.5}, "port"),
    ({"nranks": 0}, "nranks"),
    ({"nranks": 2.0}, "nranks"),
    ({"nranks": True}, "nranks"),
    ({"token": ""}, "token"),
    ({"token": b""}, "token"),
    ({"token": 1234}, "token"),
    ({"token": None}, "token"),
    ({"model_spec": None}, "model_spec"),
    ({"join_timeout": 0}, "join_timeout"),
    ({"join_timeout": -1.0}, "join_timeout"),
    ({"join_timeout": float("nan")}, "join_timeout"),
    ({"handshake_timeout": 0}, "handshake_timeout"),
    ({"handshake_timeout": "5"}, "handshake_timeout"),
    ({"heartbeat_interval": 0}, "heartbeat_interval"),
    ({"heartbeat_timeout": -4.0}, "heartbeat_timeout"),
    ({"heartbeat_timeout": float("inf")}, "heartbeat_timeout"),
    ({"heartbeat_interval": 1.0, "heartbeat_timeout": 0.5}, "heartbeat_timeout"),
    ({"max_frame_bytes": 0}, "max_frame_bytes"),
    ({"max_pending_handshakes": 0}, "max_pending_handshakes"),
    ({"ssl_context": "tls please"}, "ssl_context"),
]

BAD_FOLLOWER = [
    ({"port": 0}, "port"),
    ({"port": 70000}, "port"),
    ({"port": None}, "port"),
    ({"rank": 0}, "rank"),
    ({"rank": 2}, "rank"),
    ({"rank": -1}, "rank"),
    ({"rank": "1"}, "rank"),
    ({"rank": 1.0}, "rank"),
    ({"nranks": 1}, "rank"),
    ({"nranks": 0}, "nranks"),
    ({"token": ""}, "token"),
    ({"token": 42}, "token"),
    ({"model_spec": {"fc.weight": (10, 4)}}, "model_spec"),
    ({"connect_timeout": 0}, "connect_timeout"),
    ({"connect_timeout": float("nan")}, "connect_timeout"),
    ({"handshake_timeout": -1}, "handshake_timeout"),
    ({"heartbeat_interval": -0.5}, "heartbeat_interval"),
    ({"heartbeat_timeout": 0}, "heartbeat_timeout"),
    ({"max_frame_bytes": -1}, "max_frame_bytes"),
    ({"ssl_context": object()}, "ssl_context"),
]


def check_configuration_error(error: BaseException, name: str) -> None:
    assert isinstance(error, ConfigurationError), repr(error)
    assert isinstance(error, ValueError)
    assert isinstance(error, LamploopError)
    assert name in str(error), str(error)


@pytest.mark.timeout(20)
def _case_id(bad: dict[str, Any]) -> str:
    """A test id that is the same in every process (an object()'s repr holds its address)."""
    return ",".join(f"{k}={'object()' if type(v) is object else repr(v)}" for k, v in bad.items())


@pytest.mark.parametrize(("bad", "name"), BAD_ROOT, ids=[_case_id(b) for b, _ in BAD_ROOT])
def test_bad_root_arguments_are_configuration_errors(bad: dict[str, Any], name: str) -> None:
    """TcpControlRoot: 'ConfigurationError: an argument is out of range'; errors.py: 'Each
    message names the offending value'."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        TcpControlRoot(**root_args(**bad))
    check_configuration_error(caught.value, name)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("bad", "name"), BAD_FOLLOWER, ids=[_case_id(b) for b, _ in BAD_FOLLOWER])
def test_bad_follower_arguments_are_configuration_errors(bad: dict[str, Any], name: str) -> None:
    """TcpControlFollower: 'ConfigurationError: an argument is out of range' (rank in 1..nranks-1)."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        TcpControlFollower(**follower_args(**bad))
    check_configuration_error(caught.value, name)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        ((0,), {}, "nranks"),
        (("3",), {}, "nranks"),
        ((2.5,), {}, "nranks"),
        ((3,), {"join_timeout": 0}, "join_timeout"),
        ((3,), {"join_timeout": -2}, "join_timeout"),
    ],
)
def test_bad_local_control_arguments_are_configuration_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> None:
    """local_control: 'ConfigurationError: nranks < 1 or join_timeout not positive'."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        local_control(*args, **kwargs)
    check_configuration_error(caught.value, name)


@pytest.mark.timeout(20)
def test_tls_context_for_the_wrong_side_is_a_configuration_error() -> None:
    """TLS: 'Passing a context for the wrong side, or something else than an ssl.SSLContext,
    raises ConfigurationError at once'."""
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    client_side = ssl.create_default_context()
    with pytest.raises(Exception) as caught:  # noqa: PT011
        TcpControlFollower(**follower_args(ssl_context=server_side))
    check_configuration_error(caught.value, "ssl_context")
    with pytest.raises(Exception) as caught:  # noqa: PT011
        TcpControlRoot(**root_args(ssl_context=client_side))
    check_configuration_error(caught.value, "ssl_context")


@pytest.mark.timeout(20)
async def test_a_port_in_use_is_a_transport_error_naming_it() -> None:
    """Errors: 'transport errors (OSError ...) are wrapped with what happened and which peer'."""
    with anyio.fail_after(5):
        async with tcp_root(2) as first:
            port = first.address[1]
            with pytest.raises(TransportError) as caught:
                async with tcp_root(2, port=port):
                    pass
    assert str(port) in str(caught.value), str(caught.value)


def test_documented_defaults_and_constants() -> None:
    """Heartbeats table: interval 0.5 s, timeout 4 s, 'also in lamploop.settings'; the error
    hierarchy: ControlChannelError catches the same as TransportError."""
    import lamploop.settings as settings

    assert control.DEFAULT_HEARTBEAT_INTERVAL_S == 0.5
    assert control.DEFAULT_HEARTBEAT_TIMEOUT_S == 4.0
    assert settings.DEFAULT_HEARTBEAT_INTERVAL_S == 0.5
    assert settings.DEFAULT_HEARTBEAT_TIMEOUT_S == 4.0
    assert PROTOCOL_VERSION >= 3
    for cls in (HandshakeError, PeerLostError):
        assert issubclass(cls, ControlChannelError)
        assert issubclass(cls, TransportError)
    error = PeerLostError("rank 2 (127.0.0.1:1) sent nothing for 4 s", rank=2, how="silent")
    assert (error.rank, error.how) == (2, "silent")


# ---------------------------------------------------------------------------------------------
# what the two channels do with commands they should not carry


async def broadcast_outcome(kind: str, command: Any) -> tuple[str, list[Any]]:
    async def drive(root: Any) -> str:
        await root.on_rendezvous_ready(RDV)
        try:
            await root.broadcast(command)
        except Exception as error:
            outcome = type(error).__name__
        else:
            outcome = "sent"
        await root.broadcast(Stop(reason="done"))
        return outcome

    with anyio.fail_after(10):
        outcome, seen = await run_world(kind, 2, drive)
    return outcome["value"], seen[1]


@pytest.mark.timeout(20)
async def test_both_channels_refuse_a_non_command() -> None:
    """control-channel.md, Choosing local or TCP: 'Nothing else in lamploop cares which one it
    gets'; TcpControlRoot.broadcast: TypeError for anything but Train, Valid or Stop."""
    tcp = await broadcast_outcome("tcp", "junk")
    local = await broadcast_outcome("local", "junk")
    assert tcp == ("TypeError", [RDV, Stop(reason="done")]), tcp
    assert local == tcp, local


@pytest.mark.timeout(20)
async def test_both_channels_treat_a_nan_lr_factor_alike() -> None:
    """Choosing local or TCP: interchangeable; Framing: NaN is a FrameError over TCP. The factor
    is refused where the command is made, so that neither channel carries one."""
    with pytest.raises(ConfigurationError, match="lr_factor must be a finite number"):
        Train(epoch=0, lr_factor=float("nan"))
    tcp = await broadcast_outcome("tcp", Train(epoch=0, lr_factor=0.5))
    local = await broadcast_outcome("local", Train(epoch=0, lr_factor=0.5))
    assert tcp == local, (tcp, local)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Train(epoch="3", lr_factor=1.0),
        lambda: Train(epoch=0, lr_factor="1"),
        lambda: Valid(epoch=None),
        lambda: Stop(reason=3),
        lambda: Rendezvous(host=1, port=29500),
    ],
    ids=["train-epoch-str", "train-lr-str", "valid-epoch-none", "stop-reason-int", "rendezvous-host-int"],
)
def test_bad_command_fields_are_configuration_errors(make: Callable[[], Any]) -> None:
    """errors.py: 'Every error lamploop raises on purpose derives from LamploopError ... Errors
    about bad arguments also derive from ValueError'."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        make()
    assert isinstance(caught.value, LamploopError), repr(caught.value)
    assert isinstance(caught.value, ValueError), repr(caught.value)
