"""A follower that meets the previous run's root closing tries again and joins the next one.

A process that runs ``fit`` again at once (a repeated job, an elastic restart) can connect while
the previous run's root is closing: the kernel had queued the connection on the old listener,
which then ends it before any challenge.  A CI run saw the follower give up on that at once
("closed the connection instead of a challenge") while the next root waited 60 s for it.  Real
sockets on 127.0.0.1: an old listener that ends one connection and closes, then a real root on
the same port.
"""

from __future__ import annotations

import anyio
import anyio.abc
import pytest
from support import free_port

from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot, Train
from lamploop.control.tcp_follower import HANGUPS_BEFORE_CHALLENGE_TRIED
from lamploop.errors import ControlChannelError
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = b"the shared secret"
SPEC = ModelSpec((TensorSpec("fc.weight", (2, 2), "float32"),))
RENDEZVOUS = Rendezvous(host="127.0.0.1", port=29500)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _old_root(port: int, times: int, hung_up: list[int]) -> None:
    """The previous run's root as the follower sees it: ``times`` connections ended unanswered."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    try:
        for _ in range(times):
            stream = await listener.listeners[0].accept()
            await stream.aclose()
            hung_up.append(1)
    finally:
        await listener.aclose()


async def _follow(port: int, got: list[object], *, connect_timeout: float = 20.0) -> None:
    async with TcpControlFollower(
        host="127.0.0.1",
        port=port,
        rank=1,
        nranks=2,
        token=TOKEN,
        model_spec=SPEC,
        connect_timeout=connect_timeout,
        handshake_timeout=5.0,
    ) as follower:
        rendezvous, commands = await follower.join()
        got.append(rendezvous)
        async for command in commands:
            got.append(command)


async def test_a_follower_hung_up_on_by_the_closing_root_joins_the_next_root_on_the_same_port() -> None:
    port = free_port()
    hung_up: list[int] = []
    got: list[object] = []
    commands = [Train(epoch=0, lr_factor=1.0), Stop("done")]
    with anyio.fail_after(40):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_follow, port, got)
            await _old_root(port, 1, hung_up)  # returns once it hung up on the follower, closed
            async with TcpControlRoot(
                host="127.0.0.1", port=port, nranks=2, token=TOKEN, model_spec=SPEC
            ) as root:
                await root.on_rendezvous_ready(RENDEZVOUS)
                for command in commands:
                    await root.broadcast(command)
    assert hung_up == [1]
    assert got == [RENDEZVOUS, *commands]


async def test_what_hangs_up_on_every_try_is_named_after_a_few() -> None:
    """Not a lamploop root at all (another service, a TLS root): named within seconds, not at the
    connect timeout."""
    port = free_port()
    hung_up: list[int] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_old_root, port, 100, hung_up)
            with pytest.raises(
                ControlChannelError, match="closed the connection instead of a challenge"
            ) as caught:
                await _follow(port, [], connect_timeout=25.0)
            tg.cancel_scope.cancel()
    assert "is it a lamploop root?" in str(caught.value)
    assert len(hung_up) == HANGUPS_BEFORE_CHALLENGE_TRIED
