"""The aggregator's listener: admits the nodes that prove the token, and turns what they send into events.

:class:`NodeListener` listens (the transport's listener), runs the aggregator's end of the
handshake on every connection (within ``handshake_timeout``, at most
``max_pending_handshakes`` at once: past it the oldest is dropped), refuses and logs strangers,
and for every node that joined reads its messages until the connection ends.  What happens
reaches the round loop (:mod:`lamploop.federated.round_loop`) as one stream of events:
:class:`NodeJoined`, :class:`NodeAnswered` (a round's reply or refusal), :class:`NodeLost`
(with why).  The listener never touches a round; the round loop never touches a socket.

.. versionadded:: 0.3
"""

from __future__ import annotations

import ssl
from typing import Any

import anyio
import anyio.abc
import attrs
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from lamploop.errors import TransportError
from lamploop.federated.link import Link, accept_node
from lamploop.federated.settings import AggregatorSettings
from lamploop.federated.wire import RoundRefused, RoundReply
from lamploop.transport.connection import remote
from lamploop.transport.listen import serve_tcp
from lamploop.transport.strangers import PendingHandshakes, RefusalLog
from lamploop.transport.tls import wrap

__all__ = ["NodeAnswered", "NodeEvent", "NodeJoined", "NodeListener", "NodeLost"]


@attrs.frozen
class NodeJoined:
    """A node proved the token: ``link`` is its connection from now on."""

    name: str
    link: Link


@attrs.frozen
class NodeAnswered:
    """A node answered a round, over ``link``: its reply, or its refusal."""

    name: str
    link: Link
    message: RoundReply | RoundRefused


@attrs.frozen
class NodeLost:
    """A node's connection ``link`` ended, and ``why``."""

    name: str
    link: Link
    why: str


NodeEvent = NodeJoined | NodeAnswered | NodeLost
"""What the listener tells the round loop."""


class NodeListener:
    """Accepts connections: refuses strangers, hands joined nodes and their answers to the round loop."""

    def __init__(
        self,
        token: bytes,
        settings: AggregatorSettings,
        context: ssl.SSLContext | None,
        events: MemoryObjectSendStream[NodeEvent],
    ) -> None:
        self.token, self.settings, self.context, self.events = token, settings, context, events
        self.pending = PendingHandshakes(settings.max_pending_handshakes)
        self.refusals = RefusalLog(who="federated aggregator")

    async def serve(self, host: str, port: int, *, task_status: TaskStatus[tuple[str, int]]) -> None:
        """Listen on ``host:port`` (the transport's listener) and handle each connection in a task.

        Raises:
            OSError: the address cannot be listened on (as itself, not in an exception group).
        """
        failure: OSError | None = None
        async with anyio.create_task_group() as tg:
            try:
                await serve_tcp(
                    host,
                    port,
                    on_connection=lambda stream: tg.start_soon(self.handle, stream),
                    refusals=self.refusals,
                    who="aggregator",
                    checks_first_bytes=self.context is None,  # under TLS the client speaks first
                    task_status=task_status,
                )
            except OSError as exc:  # before listening: no connection task runs yet
                failure = exc
        if failure is not None:
            raise failure

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        """One connection: the handshake, then the node's messages as events until it ends."""
        name, link = await self._handshake(stream, remote(stream))
        if name is None or link is None:
            return
        await self.events.send(NodeJoined(name, link))
        await self._read(name, link)

    async def _handshake(self, stream: Any, peer: str) -> tuple[str | None, Link | None]:
        link: Link | None = None
        closed = False
        with self.pending.slot() as slot:
            try:
                with anyio.fail_after(self.settings.handshake_timeout):
                    if self.context is not None:
                        stream = await wrap(stream, self.context, server_side=True)
                    link = Link(stream, max_frame_bytes=self.settings.max_frame_bytes, peer=peer)
                    return await accept_node(link, self.token), link
            except TimeoutError:
                why = f"no handshake within {self.settings.handshake_timeout:g} s"
            except TransportError as exc:  # HandshakeError, FrameError, a broken connection
                why = str(exc)
            except BaseException:  # cancelled (too many handshakes, or the run is over): closed now,
                with anyio.CancelScope(shield=True):  # not left open for the garbage collector
                    await anyio.aclose_forcefully(stream)
                closed = True
                raise
        if slot.cancelled_caught:
            why = "dropped: too many connections handshaking at once"
        self.refusals.refused(peer, why)
        if closed:
            return None, None
        if link is not None:
            await link.aclose()
        else:
            await anyio.aclose_forcefully(stream)
        return None, None

    async def _read(self, name: str, link: Link) -> None:
        try:
            while True:
                message = await link.receive()
                if message is None:
                    await self.events.send(NodeLost(name, link, "it closed the connection"))
                    return
                if not isinstance(message, (RoundReply, RoundRefused)):
                    why = f"it sent a {type(message).__name__}, which nodes do not send"
                    await self.events.send(NodeLost(name, link, why))
                    return
                await self.events.send(NodeAnswered(name, link, message))
        except TransportError as exc:
            await self.events.send(NodeLost(name, link, f"its connection failed: {exc}"))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the round loop is gone: the run is over
        finally:
            await link.aclose()
