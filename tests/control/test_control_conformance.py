"""One conformance suite for every control channel: in-process and TCP (after lamp's communication test)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from lamploop.control import (
    Command,
    ControlFollower,
    ControlRoot,
    Rendezvous,
    Stop,
    TcpControlFollower,
    TcpControlRoot,
    Train,
    Valid,
    local_control,
)
from lamploop.errors import ControlChannelError, HandshakeError, PeerLostError
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = "conformance-token"
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))
RENDEZVOUS = Rendezvous(host="127.0.0.1", port=29500)
COMMANDS: list[Command] = [
    Train(epoch=0, lr_factor=1.0),
    Valid(epoch=0),
    Train(epoch=1, lr_factor=0.5),
    Train(epoch=2, lr_factor=0.25),
    Valid(epoch=2),
    Stop(reason="finished after epoch 2"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Channel = Callable[..., Any]


@asynccontextmanager
async def local_channel(
    nranks: int, join_timeout: float = 5.0
) -> AsyncIterator[tuple[ControlRoot, list[ControlFollower]]]:
    root, followers = local_control(nranks, join_timeout=join_timeout)
    async with root:
        yield root, list(followers)


@asynccontextmanager
async def tcp_channel(
    nranks: int, join_timeout: float = 5.0
) -> AsyncIterator[tuple[ControlRoot, list[ControlFollower]]]:
    timing: dict[str, Any] = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}
    async with TcpControlRoot(
        nranks=nranks, token=TOKEN, model_spec=SPEC, join_timeout=join_timeout, **timing
    ) as root:
        host, port = root.address
        followers: list[ControlFollower] = [
            TcpControlFollower(
                host=host,
                port=port,
                rank=rank,
                nranks=nranks,
                token=TOKEN,
                model_spec=SPEC,
                connect_timeout=5.0,
                **timing,
            )
            for rank in range(1, nranks)
        ]
        yield root, followers


@pytest.fixture(params=[local_channel, tcp_channel], ids=["local", "tcp"])
def channel(request: pytest.FixtureRequest) -> Channel:
    return request.param  # type: ignore[no-any-return]


class Followers:
    """Runs followers as tasks (of a task group outside the root's block) and records what they saw."""

    def __init__(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg
        self.logs: dict[int, list[object]] = {}
        self.errors: dict[int, BaseException] = {}

    def start(self, follower: Any, *, leave_after: int | None = None) -> None:
        self.logs[follower.rank] = []
        self._tg.start_soon(self._follow, follower, leave_after)

    async def _follow(self, follower: Any, leave_after: int | None) -> None:
        log = self.logs[follower.rank]
        try:
            async with follower:
                rendezvous, commands = await follower.join()
                log.append(rendezvous)
                async for command in commands:
                    log.append(command)
                    if len(log) - 1 == leave_after:
                        return
                log.append("ended")
                with pytest.raises(StopAsyncIteration):
                    await commands.__anext__()
        except ControlChannelError as exc:
            self.errors[follower.rank] = exc


@pytest.mark.parametrize("nfollowers", [0, 1, 3])
async def test_rendezvous_and_commands_reach_every_follower_in_order(
    channel: Channel, nfollowers: int
) -> None:
    nranks = nfollowers + 1
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            followers = Followers(tg)
            async with channel(nranks) as (root, ends):
                assert [end.rank for end in ends] == list(range(1, nranks))
                for end in ends:
                    followers.start(end)
                await root.on_rendezvous_ready(RENDEZVOUS)
                assert root.peers() == tuple(range(1, nranks))
                for command in COMMANDS:
                    await root.broadcast(command)
    assert followers.errors == {}
    assert followers.logs == {rank: [RENDEZVOUS, *COMMANDS, "ended"] for rank in range(1, nranks)}


async def test_broadcast_is_refused_before_rendezvous_and_after_stop(channel: Channel) -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            followers = Followers(tg)
            async with channel(2) as (root, [end]):
                with pytest.raises(ControlChannelError, match="before on_rendezvous_ready"):
                    await root.broadcast(Train(epoch=0, lr_factor=1.0))
                followers.start(end)
                await root.on_rendezvous_ready(RENDEZVOUS)
                await root.broadcast(Stop(reason="at once"))
                with pytest.raises(ControlChannelError, match="after Stop"):
                    await root.broadcast(Valid(epoch=1))
    assert followers.errors == {}
    assert followers.logs == {1: [RENDEZVOUS, Stop(reason="at once"), "ended"]}


async def test_root_times_out_naming_the_missing_ranks(channel: Channel) -> None:
    async def run(followers: Followers) -> None:
        async with channel(4, join_timeout=3.0) as (root, ends):  # rank 1 joins well within it
            followers.start(ends[0])  # rank 1 joins, ranks 2 and 3 never do
            try:
                await root.on_rendezvous_ready(RENDEZVOUS)
            finally:
                assert root.peers() == (1,)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            followers = Followers(tg)
            with pytest.raises(HandshakeError, match=r"only ranks \[1\] .* missing ranks \[2, 3\]"):
                await run(followers)
    # The root's failure ends the follower that had joined, with the reason.
    assert followers.logs == {1: []}
    assert isinstance(followers.errors[1], PeerLostError)
    assert "missing ranks [2, 3]" in str(followers.errors[1])


async def test_root_leaving_without_stop_fails_the_followers(channel: Channel) -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            followers = Followers(tg)
            async with channel(3) as (root, ends):
                for end in ends:
                    followers.start(end)
                await root.on_rendezvous_ready(RENDEZVOUS)
                await root.broadcast(Train(epoch=0, lr_factor=1.0))
            # the root's block ends without Stop
    assert followers.logs == {rank: [RENDEZVOUS, Train(epoch=0, lr_factor=1.0)] for rank in (1, 2)}
    for rank in (1, 2):
        assert isinstance(followers.errors[rank], PeerLostError)
        assert "the root closed the channel before Stop" in str(followers.errors[rank])


async def test_a_follower_leaving_before_stop_fails_the_root_naming_it(channel: Channel) -> None:
    failures: list[PeerLostError] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            followers = Followers(tg)
            try:
                async with channel(3) as (root, ends):
                    followers.start(ends[0])
                    followers.start(ends[1], leave_after=1)  # rank 2 leaves after the first command
                    await root.on_rendezvous_ready(RENDEZVOUS)
                    await root.broadcast(Train(epoch=0, lr_factor=1.0))
                    # The local root notices at its next broadcast; the TCP root as soon as rank 2
                    # leaves (it cancels this block and raises when the block ends).
                    while True:
                        await anyio.sleep(0.02)
                        await root.broadcast(Valid(epoch=0))
            except PeerLostError as exc:
                failures.append(exc)
    assert len(failures) == 1
    assert "rank 2" in str(failures[0])
    assert followers.logs[2] == [RENDEZVOUS, Train(epoch=0, lr_factor=1.0)]
    # rank 1 is told that the run was aborted because of rank 2
    assert isinstance(followers.errors[1], PeerLostError)
    assert "rank 2" in str(followers.errors[1])
