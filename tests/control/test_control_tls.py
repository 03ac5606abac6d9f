"""The TCP control channel over TLS (``ssl_context=``), with certificates made for the test (trustme).

Real sockets on 127.0.0.1: a run's commands arrive in order and the run ends at once
after ``Stop`` (TLS cannot half-close; an ``EndOfMessages`` frame stands in); a follower
that does not trust the root's certificate, or speaks plain TCP to a TLS root, is refused
with a message saying so; strangers do not disturb a TLS run; wrong contexts are refused
before anything starts.
"""

from __future__ import annotations

import ssl
import time

import anyio
import anyio.abc
import pytest
import trustme

from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot, Train, Valid
from lamploop.errors import ConfigurationError, ControlChannelError, HandshakeError
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = b"the shared secret"
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"),))
RENDEZVOUS = Rendezvous("127.0.0.1", 29500)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


@pytest.fixture(scope="module")
def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


GOODBYE_S = 30.0


async def _follow(
    port: int, rank: int, nranks: int, context: ssl.SSLContext | None, got: list[object]
) -> None:
    async with TcpControlFollower(
        host="127.0.0.1",
        port=port,
        rank=rank,
        nranks=nranks,
        token=TOKEN,
        model_spec=SPEC,
        ssl_context=context,
        connect_timeout=5.0,
        handshake_timeout=3.0,
    ) as follower:
        rendezvous, commands = await follower.join()
        got.append(rendezvous)
        async for command in commands:
            got.append(command)


async def test_a_run_over_tls_delivers_every_command_and_ends_at_once(
    server_context: ssl.SSLContext, client_context: ssl.SSLContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The goodbye waits 30 s here, not 2: the end's bound (10 s) then tells a missing stand-in
    # for the half-close from a loaded machine (1 s against 2 s could not, under CI's load).
    for module in ("lamploop.control.tcp_root", "lamploop.control.tcp_follower"):
        monkeypatch.setattr(f"{module}.GOODBYE_TIMEOUT", GOODBYE_S)
    commands = [Train(epoch=e, lr_factor=1.0) for e in range(5)] + [Valid(epoch=4), Stop("done")]
    got: dict[int, list[object]] = {1: [], 2: []}
    with anyio.fail_after(GOODBYE_S + 15):
        async with anyio.create_task_group() as tg:
            async with TcpControlRoot(
                nranks=3, token=TOKEN, model_spec=SPEC, ssl_context=server_context
            ) as root:
                for rank in (1, 2):
                    tg.start_soon(_follow, root.address[1], rank, 3, client_context, got[rank])
                await root.on_rendezvous_ready(RENDEZVOUS)
                for command in commands:
                    await root.broadcast(command)
                stopped = time.monotonic()
            closed_after = time.monotonic() - stopped
    for rank in (1, 2):
        assert got[rank] == [RENDEZVOUS, *commands]
    # Without a stand-in for the half-close, both sides would wait out the goodbye timeout.
    assert closed_after < GOODBYE_S / 3, closed_after


async def test_a_follower_that_does_not_trust_the_root_is_told_why(server_context: ssl.SSLContext) -> None:
    untrusting = ssl.create_default_context()  # the system's CAs only: not the test's CA
    with anyio.fail_after(20):
        async with TcpControlRoot(
            nranks=2, token=TOKEN, model_spec=SPEC, ssl_context=server_context, join_timeout=5.0
        ) as root:
            with pytest.raises(HandshakeError) as caught:
                await _follow(root.address[1], 1, 2, untrusting, [])
    message = str(caught.value)
    assert "rank 1: the TLS handshake with" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message or "certificate verify failed" in message
    assert "is its certificate trusted?" in message


async def test_a_plain_follower_cannot_join_a_tls_root(server_context: ssl.SSLContext) -> None:
    """The root waits for a TLS hello and the follower for a challenge: the root gives up and says so."""
    with anyio.fail_after(20):
        async with TcpControlRoot(
            nranks=2, token=TOKEN, model_spec=SPEC, ssl_context=server_context, handshake_timeout=0.5
        ) as root:
            with pytest.raises(ControlChannelError, match="instead of a challenge"):
                await _follow(root.address[1], 1, 2, None, [])
            refusals = root.recent_refusals
    assert any("no valid hello within 0.5 s" in r for r in refusals), refusals


async def _read_until_closed(stream: anyio.abc.SocketStream) -> None:
    while True:
        await stream.receive()


async def test_strangers_do_not_disturb_a_tls_run(
    server_context: ssl.SSLContext, client_context: ssl.SSLContext
) -> None:
    got: list[object] = []
    with anyio.fail_after(20):
        async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC, ssl_context=server_context) as root:
            port = root.address[1]
            for data in (b"\x00\x00\x00\x08garbage!", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\xff\xff"):
                async with await anyio.connect_tcp("127.0.0.1", port) as stranger:
                    await stranger.send(data)
                    with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError, OSError)):
                        await _read_until_closed(stranger)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follow, port, 1, 2, client_context, got)
                await root.on_rendezvous_ready(RENDEZVOUS)
                await root.broadcast(Train(epoch=0, lr_factor=1.0))
                await root.broadcast(Stop("done"))
            refusals = root.recent_refusals
    assert got == [RENDEZVOUS, Train(epoch=0, lr_factor=1.0), Stop("done")]
    assert len(refusals) == 3, refusals
    assert all("TLS handshake" in r for r in refusals), refusals


def test_contexts_for_the_wrong_side_or_of_the_wrong_type_are_refused_up_front(
    server_context: ssl.SSLContext, client_context: ssl.SSLContext
) -> None:
    with pytest.raises(
        ConfigurationError, match=r"ssl_context must be a server context \(ssl.PROTOCOL_TLS_SERVER\)"
    ):
        TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC, ssl_context=client_context)
    with pytest.raises(
        ConfigurationError, match=r"ssl_context must be a client context \(ssl.PROTOCOL_TLS_CLIENT\)"
    ):
        TcpControlFollower(
            host="127.0.0.1",
            port=1,
            rank=1,
            nranks=2,
            token=TOKEN,
            model_spec=SPEC,
            ssl_context=server_context,
        )
    with pytest.raises(ConfigurationError, match=r"ssl_context must be an ssl\.SSLContext or None, not str"):
        TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC, ssl_context="cert.pem")  # type: ignore[arg-type]
