"""Who gets in: the TCP control root's handshake with each connection, and its refusals.

:class:`FollowerAdmission` runs the root's end of the handshake
(:func:`~lamploop.control.handshake.authenticate_follower`, under TLS when the root has a
context) within ``handshake_timeout``, at most ``max_pending_handshakes`` connections at once
(past it the oldest is dropped), in the transport's order of checks
(:mod:`lamploop.transport.handshake`): the token's proof, the protocol version, then whether
the follower fits the run (:func:`~lamploop.control.handshake.mismatch`).  A stranger is
refused and logged in the root's refusal log, and nothing else happens; a follower that
proved the token but does not fit the run is refused and fails the root, since the run
cannot succeed.  What a welcomed follower then does is :class:`~lamploop.control.TcpControlRoot`'s.

.. versionadded:: 0.1
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Mapping

import anyio
import anyio.abc

from lamploop.control.connection import Connection
from lamploop.control.handshake import authenticate_follower, mismatch
from lamploop.control.settings import Run
from lamploop.control.wire import Hello, Refuse, Welcome
from lamploop.errors import ControlChannelError, HandshakeError
from lamploop.transport import tls
from lamploop.transport.handshake import Refusal
from lamploop.transport.strangers import PendingHandshakes, RefusalLog
from lamploop.transport.supervisor import Supervisor

__all__ = ["RUN_FINISHED", "FollowerAdmission"]

RUN_FINISHED = "this root's run is finished (Stop was sent); the next run's root does not listen yet"
"""The refusal of a follower that proved the token to a root whose run is over: a follower
that ran the same script's next ``fit`` sooner than its root, which a follower retries (within
its ``connect_timeout``) until the next run's root listens."""

logger = logging.getLogger("lamploop.control")


class FollowerAdmission:
    """The root's door: authenticates each connection, refuses strangers and followers that do not fit.

    Args:
        run: what every rank of the run must agree on (the token among it).
        sup: the root's supervisor, failed when a follower with the token does not fit.
        refusals: the root's log of refused strangers.
        context: the root's TLS server context, or ``None``.
        handshake_timeout: a connection must complete the handshake within this many seconds.
        max_pending_handshakes: connections handshaking at once; one more drops the oldest.
        finished: whether the run is over (Stop was sent): a follower is then turned away with
            :data:`RUN_FINISHED`, and the root does not fail for it.
    """

    def __init__(
        self,
        *,
        run: Run,
        sup: Supervisor,
        refusals: RefusalLog,
        context: ssl.SSLContext | None,
        handshake_timeout: float,
        max_pending_handshakes: int,
        finished: Callable[[], bool] = lambda: False,
    ) -> None:
        self._finished = finished
        self._run = run
        self._sup = sup
        self._refusals = refusals
        self._tls = context
        self._handshake_timeout = handshake_timeout
        self._handshakes = PendingHandshakes(max_pending_handshakes)

    async def admit(self, conn: Connection, joined: Mapping[int, Connection]) -> tuple[int, Welcome] | None:
        """Run the handshake on ``conn``; the follower's rank and the welcome to send it, ``None`` if refused.

        ``joined`` holds the followers admitted so far (a rank may join once).  Nothing is
        awaited between checking ``joined`` and returning, so the caller takes the rank before
        another connection can claim it.
        """
        try:
            with anyio.fail_after(self._handshake_timeout), self._handshakes.slot() as slot:
                if self._tls is not None:
                    conn.stream = await self._secure(conn.stream, self._tls)
                hello, welcome = await authenticate_follower(conn, self._run.token)
            if slot.cancelled_caught:
                await self._refuse_stranger(conn, "dropped: the oldest of too many connections handshaking")
                return None
        except TimeoutError:
            await self._refuse_stranger(conn, f"no valid hello within {self._handshake_timeout:g} s")
            return None
        except Refusal as exc:
            if isinstance(exc.hello, Hello):
                await self._refuse_follower(conn, exc.hello.rank, exc.reason)
            elif exc.reply:
                await self._refuse_stranger(conn, exc.reason)
            else:  # garbage or a hang-up: no reply, the least work for a flood of strangers
                self._refusals.refused(conn.peer, exc.reason)
            return None
        if self._finished():
            logger.info("control root: rank %d (%s) came after the run; turned away", hello.rank, conn.peer)
            await conn.send_best_effort(Refuse(RUN_FINISHED))
            return None
        reason = mismatch(hello, self._run, joined)
        if reason is not None:
            await self._refuse_follower(conn, hello.rank, reason)
            return None
        return hello.rank, welcome

    @staticmethod
    async def _secure(stream: anyio.abc.ByteStream, context: ssl.SSLContext) -> anyio.abc.ByteStream:
        try:
            return await tls.wrap(stream, context, server_side=True)
        except ControlChannelError as exc:
            raise Refusal(str(exc)) from exc

    async def _refuse_follower(self, conn: Connection, rank: int, reason: str) -> None:
        """Refuse a peer that proved the token but does not fit the run, and fail the root for it."""
        logger.warning("control root refused rank %d (%s): %s", rank, conn.peer, reason)
        await conn.send_best_effort(Refuse(reason))
        self._sup.fail(HandshakeError(f"refused rank {rank} ({conn.peer}): {reason}"))

    async def _refuse_stranger(self, conn: Connection, reason: str) -> None:
        self._refusals.refused(conn.peer, reason)
        await conn.send_best_effort(Refuse(reason))
