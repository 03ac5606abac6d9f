"""The root's end of the TCP control channel: listen, admit followers, send them the rendezvous and commands.

:class:`TcpControlRoot` accepts connections, has
:class:`~lamploop.control.root_admission.FollowerAdmission` run the handshake of
:mod:`lamploop.control.handshake` on each (refusing strangers, and failing the run for a
follower that proves the token but does not fit), keeps a heartbeat with every follower
that joined, and broadcasts.  How its failures surface is :mod:`lamploop.transport.supervisor`'s
business; the protocol as a whole is described in :mod:`lamploop.control.tcp`.

.. versionadded:: 0.1
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from types import TracebackType

import anyio
import anyio.abc
from anyio.abc import TaskStatus

from lamploop.control.commands import Command, Rendezvous, Stop, check_command
from lamploop.control.connection import Connection, Gone, abort_message
from lamploop.control.root_admission import FollowerAdmission
from lamploop.control.settings import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S, Link, Run
from lamploop.control.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Abort,
    Heartbeat,
    Interrupt,
    encode_frame,
    preauth_frame_limit,
)
from lamploop.errors import ControlChannelError, HandshakeError, PeerLostError
from lamploop.modelspec import ModelSpec
from lamploop.transport import tls
from lamploop.transport.connection import GOODBYE_TIMEOUT
from lamploop.transport.listen import serve_tcp
from lamploop.transport.settings import check_int_in, check_seconds_each
from lamploop.transport.strangers import RefusalLog
from lamploop.transport.supervisor import Supervisor

__all__ = ["TcpControlRoot"]

logger = logging.getLogger("lamploop.control")

_RECENT_REFUSALS = 16


class TcpControlRoot:
    """The root's end of the TCP control channel; implements :class:`~lamploop.control.ControlRoot`.

    ``async with TcpControlRoot(...) as root:`` listens on ``host:port`` (``port=0`` picks a
    free port: read :attr:`address`) and admits followers as they connect.

    Args:
        host, port: where to listen.  Listening on all interfaces (``"0.0.0.0"``) is for
            trusted networks only; see the security notes in ``docs/control-channel.md``.
        nranks: the world size, root included.
        token: the secret every rank shares; peers prove they know it.
        model_spec: this rank's :func:`~lamploop.modelspec.model_spec`; followers must match it.
        join_timeout: seconds :meth:`on_rendezvous_ready` waits for every follower to join.
        heartbeat_interval, heartbeat_timeout: send a heartbeat every interval; a joined
            follower silent for longer than the timeout is lost.
        handshake_timeout: a connection must complete the handshake within this many seconds.
        max_frame_bytes: the largest frame body sent or accepted.
        max_pending_handshakes: connections handshaking at once; a new one past this drops
            the oldest (strangers cannot hold the port, or file descriptors, and a real
            follower, which answers at once, is never kept waiting behind them).
        ssl_context: TLS for every connection: a server context with the root's certificate
            (``ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)`` then
            ``load_cert_chain(...)``; require client certificates there if you want them).
            ``None`` (default): no TLS, the token's proofs alone authenticate the peers.

    Raises:
        ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        nranks: int,
        token: bytes | str,
        model_spec: ModelSpec,
        join_timeout: float = 60.0,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        handshake_timeout: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_pending_handshakes: int = 64,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._run = Run.checked(nranks, token, model_spec)
        self._link = Link.checked(heartbeat_interval, heartbeat_timeout, max_frame_bytes)
        check_seconds_each(join_timeout=join_timeout, handshake_timeout=handshake_timeout)
        check_int_in("port", port, 0, 65535)
        check_int_in("max_pending_handshakes", max_pending_handshakes, 1)
        self._host = host
        self._port = port
        self._join_timeout = join_timeout
        self._tls = tls.check_context("ssl_context", ssl_context, server_side=True)
        self._sup = Supervisor(on_failure=self._wake_up)
        self._address: tuple[str, int] | None = None
        self._peers: dict[int, Connection] = {}
        self._refusals = RefusalLog(remember=_RECENT_REFUSALS)
        self._admission = FollowerAdmission(
            run=self._run,
            sup=self._sup,
            refusals=self._refusals,
            context=self._tls,
            handshake_timeout=handshake_timeout,
            max_pending_handshakes=max_pending_handshakes,
            finished=lambda: self._stop_sent,
        )
        self._joined_or_failed = anyio.Event()
        self._serving = 0
        self._all_served = anyio.Event()
        self._rendezvous_sent = False
        self._stop_sent = False
        self._aborted = False  # the Abort went out (abort_run, or leaving before Stop)
        self._abort_error: BaseException | None = None  # abort_run's, for followers joining after it
        self._said_goodbye = False  # __aexit__ said its last words (an Abort unless Stop went out)
        self._welcomed: set[int] = set()  # those whose Welcome went out: Interrupts may follow it
        self._stop_reason: str | None = None  # the first rank's request to stop every rank
        self._stop_requested = anyio.Event()

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the root listens on (the real port when ``port=0``)."""
        if self._address is None:
            msg = "the root is not listening yet: use `async with TcpControlRoot(...) as root`"
            raise ControlChannelError(msg)
        return self._address

    @property
    def nranks(self) -> int:
        """The world size this channel was made for, root included."""
        return self._run.nranks

    @property
    def recent_refusals(self) -> tuple[str, ...]:
        """The last few peers refused for not proving the token, oldest first: ``"host:port: why"``."""
        return tuple(self._refusals.recent)

    def peers(self) -> tuple[int, ...]:
        """The ranks of the followers that have joined so far, sorted."""
        return tuple(sorted(self._peers))

    async def __aenter__(self) -> TcpControlRoot:
        await self._sup.enter()
        try:
            self._address = await self._sup.tg.start(self._serve)
        except OSError as exc:
            self._sup.leave_body(None)
            await self._sup.close(None, swallowed=False)
            msg = f"the control root cannot listen on {self._host}:{self._port}: {exc}"
            raise ControlChannelError(msg) from exc
        logger.info("control root listening on %s:%d for %d followers", *self._address, self._run.nranks - 1)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        remaining = self._sup.leave_body(exc)
        self._refusals.flush()
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            if not self._stop_sent:
                # Those abort_run told are told nothing more; one that joined since hears its reason.
                await self._say_abort(self._abort_error if self._aborted else remaining)
            # Read each follower until it closes too, so that nothing we sent is lost to a reset.
            if self._serving:
                await self._all_served.wait()
        self._said_goodbye = True
        for conn in list(self._peers.values()):  # those a cancellation left open for the Abort
            await conn.aclose()
        return await self._sup.close(remaining, swallowed=exc is not None and remaining is None)

    async def abort_run(self, error: BaseException) -> None:
        """Tell every follower now that the run failed with ``error``, as leaving the channel with it would.

        A run that failed on the root leaves its followers waiting in a collective until the
        root leaves the channel; :func:`~lamploop.drive_distributed_training` calls this at
        once instead, so that a root that stays in the channel after the failure (one process
        holding every rank, a caller that catches the error) holds nobody.  Leaving later
        tells only a follower that joins after this call (the same reason).  Does nothing after
        :class:`Stop` or a first call.
        """
        if self._stop_sent or self._aborted:
            return
        self._abort_error = error
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            await self._say_abort(error)

    async def _say_abort(self, error: BaseException | None) -> None:
        """Tell every follower not told yet why the run ends, then close our side to it."""
        self._aborted = True
        abort = abort_message(self._sup, error, "root", own_rank=0)
        for conn in list(self._peers.values()):
            if conn.finished:  # told already (abort_run)
                continue
            conn.finished = True  # their closing is expected now
            await conn.send_best_effort(abort)
            await conn.send_eof()

    def _wake_up(self) -> None:
        self._joined_or_failed.set()

    def _preauth_frame_bytes(self) -> int:
        """The frame limit until a peer proves the token (read at each connection)."""
        return preauth_frame_limit(self._run.nranks, self._run.model_spec, self._link.max_frame_bytes)

    async def on_rendezvous_ready(self, rendezvous: Rendezvous) -> None:
        """Wait until all ``nranks - 1`` followers have joined, then send each the rendezvous.

        Raises:
            HandshakeError: not every follower joined within ``join_timeout`` (names the
                missing ranks and recent refusals), or a follower with the right token does
                not fit the run (names the mismatch).
            PeerLostError: a joined follower went silent, disconnected or aborted (names it).
            ControlChannelError: called twice or outside ``async with``.
        """
        self._sup.raise_failure()
        if self._address is None or self._rendezvous_sent:
            msg = "on_rendezvous_ready() must be called once, inside `async with`"
            raise ControlChannelError(msg)
        with self._sup.waiting():
            if len(self._peers) < self._run.nranks - 1:
                with anyio.move_on_after(self._join_timeout):
                    await self._joined_or_failed.wait()
            self._sup.raise_failure()
            if len(self._peers) < self._run.nranks - 1:
                raise HandshakeError(self._join_timeout_message())
            data = encode_frame(rendezvous, max_frame_bytes=self._link.max_frame_bytes)
            for rank in sorted(self._peers):
                await self._send_to(rank, data)
        self._rendezvous_sent = True
        logger.info("rendezvous %s:%d sent to ranks %s", rendezvous.host, rendezvous.port, self.peers())

    def _join_timeout_message(self) -> str:
        missing = sorted(set(range(1, self._run.nranks)) - set(self._peers))
        msg = (
            f"only ranks {sorted(self._peers)} of 1..{self._run.nranks - 1} joined within "
            f"{self._join_timeout:g} s; missing ranks {missing}"
        )
        if self._refusals.recent:
            msg += f"; recently refused: {'; '.join(self._refusals.recent)}"
        return msg

    async def broadcast(self, command: Command) -> None:
        """Send ``command`` to every follower, in the order of the calls.

        Raises:
            PeerLostError: a follower is gone (names its rank).
            ControlChannelError: called before :meth:`on_rendezvous_ready` or after
                :class:`Stop`, or the channel failed otherwise.
            TypeError: ``command`` is not a Train, Valid or Stop.
        """
        check_command(command)
        self._sup.raise_failure()
        if not self._rendezvous_sent or self._stop_sent:
            state = "after Stop" if self._stop_sent else "before on_rendezvous_ready()"
            msg = f"broadcast({command!r}) {state}"
            raise ControlChannelError(msg)
        data = encode_frame(command, max_frame_bytes=self._link.max_frame_bytes)
        stop = isinstance(command, Stop)
        if stop:
            self._stop_sent = True
        with self._sup.waiting():
            for rank in sorted(self._peers):
                conn = self._peers[rank]
                if stop:
                    conn.finished = True  # from now on the follower closing is the expected answer
                await self._send_to(rank, data)
                if stop:
                    await conn.send_eof()
        self._sup.raise_failure()

    async def request_stop(self, reason: str) -> None:
        """Ask every follower to stop after the step in progress (see :meth:`ControlRoot.request_stop`).

        Only the first request counts (this one, or a follower's that the root passed on);
        the sends run in the background: this returns at once and raises nothing.
        """
        self._share_stop_request(reason, source=0)
        await anyio.lowlevel.checkpoint()

    async def wait_for_stop_request(self) -> str:
        """Wait until a rank (the root or a follower) asked every rank to stop; its reason."""
        if not self._stop_requested.is_set():  # outside the block no request could ever come
            self._sup.require_inside("wait_for_stop_request()")
        await self._stop_requested.wait()
        return self._stop_reason or ""

    def _share_stop_request(self, reason: str, *, source: int) -> None:
        """Record the first request to stop, and send it to every follower but ``source``."""
        if self._stop_reason is not None or self._stop_sent:
            return
        self._stop_reason = reason
        self._stop_requested.set()
        logger.info("rank %d asked every rank to stop (%s); telling the followers", source, reason)
        for rank in sorted(self._welcomed - {source}):
            self._sup.tg.start_soon(self._send_interrupt, self._peers[rank], reason)

    async def _send_interrupt(self, conn: Connection, reason: str) -> None:
        try:
            await conn.send(Interrupt(reason), unless_closed=True)
        except ControlChannelError as exc:  # the follower is gone: its connection reports that
            logger.debug("could not pass the stop request to rank %s: %s", conn.rank, exc)

    async def _send_to(self, rank: int, data: bytes) -> None:
        conn = self._peers[rank]
        try:
            await conn.send(data)
        except ControlChannelError as exc:
            self._sup.fail(PeerLostError(f"rank {rank} ({conn.peer}) is gone: {exc}", rank=rank, how="died"))
            self._sup.raise_failure()

    # -- background tasks --

    async def _serve(self, *, task_status: TaskStatus[tuple[str, int]]) -> None:
        await serve_tcp(
            self._host,
            self._port,
            on_connection=lambda stream: self._sup.tg.start_soon(self._handle, stream),
            refusals=self._refusals,
            who="root",
            checks_first_bytes=self._tls is None,  # under TLS the client speaks first
            task_status=task_status,
        )

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        conn = Connection(stream, link=self._link, preauth_frame_bytes=self._preauth_frame_bytes())
        left_open = False
        try:
            rank = await self._admit(conn)
            if rank is not None and self._aborted and not self._stop_sent and not conn.finished:
                # Joined after abort_run: told at once (no rendezvous will come), read until it closes.
                await self._say_abort(self._abort_error)
            if rank is not None:
                await self._serve_peer(conn, rank)
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside before the root said goodbye: leaving its block, the root
            # tells this follower why (an Abort), and only then closes the connection (__aexit__).
            left_open = conn.rank is not None and not self._said_goodbye
            raise
        finally:
            if not left_open:
                await conn.aclose()

    async def _admit(self, conn: Connection) -> int | None:
        """Admit ``conn`` and welcome it; the follower's rank, ``None`` if refused.

        The handshake and the refusals are :class:`~lamploop.control.root_admission.FollowerAdmission`'s.
        """
        admitted = await self._admission.admit(conn, self._peers)
        if admitted is None:
            return None
        rank, welcome = admitted
        conn.joined()
        # Take the rank before the first await, so that a duplicate cannot slip in meanwhile.
        conn.rank = rank
        self._peers[rank] = conn
        self._serving += 1
        try:
            await conn.send(welcome)
        except ControlChannelError as exc:
            self._lost(conn, f"is gone: {exc}", "died")
            return rank
        logger.info("control root: rank %d joined from %s", rank, conn.peer)
        self._welcomed.add(rank)
        if self._stop_reason is not None:  # a stop was requested before it joined
            self._sup.tg.start_soon(self._send_interrupt, conn, self._stop_reason)
        if len(self._peers) == self._run.nranks - 1:
            self._joined_or_failed.set()  # after the welcome, so the rendezvous cannot overtake it
        return rank

    async def _serve_peer(self, conn: Connection, rank: int) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(conn.heartbeat_forever, self._on_heartbeat_error(conn))
                await self._read_from(conn)
                tg.cancel_scope.cancel()
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._all_served.set()

    def _on_heartbeat_error(self, conn: Connection) -> Callable[[ControlChannelError], None]:
        return lambda exc: self._lost(conn, f"is gone: {exc}", "died")

    def _lost(self, conn: Connection, what: str, how: str, *, alike: bool = False) -> None:
        if conn.finished:
            logger.debug("rank %s (%s) after Stop: %s", conn.rank, conn.peer, what)
            return
        error = PeerLostError(f"rank {conn.rank} ({conn.peer}) {what}", rank=conn.rank, how=how)
        self._sup.fail(error, alike=alike)

    def fail_peer(self, rank: int, how: str, detail: str) -> None:
        """Record that rank ``rank`` was lost (found out by other means); the first failure wins."""
        self._sup.fail(PeerLostError(f"rank {rank} {detail}", rank=rank, how=how))

    async def _read_from(self, conn: Connection) -> None:
        """Read a joined follower until it closes after Stop, or report how it was lost."""
        while True:
            message = await conn.receive_live()
            if isinstance(message, Gone):
                self._lost(conn, message.what, message.how)
                return
            if isinstance(message, Abort):
                self._lost_by_abort(conn, message)
                return
            if isinstance(message, Interrupt):
                if not conn.finished and conn.rank is not None:
                    self._share_stop_request(message.reason, source=conn.rank)
                continue
            if not isinstance(message, Heartbeat):
                self._lost(
                    conn, f"broke the protocol: it sent a {type(message).__name__} message", "protocol"
                )
                return

    def _lost_by_abort(self, conn: Connection, abort: Abort) -> None:
        """A follower aborted: it failed itself, or it lost another rank (which it names).

        When it failed with an error that every rank detects itself (the Abort says so), this
        side's own verdict is awaited first (see :mod:`lamploop.transport.supervisor`).
        """
        alike = abort.detected_by_every_rank
        if abort.lost_rank is not None and abort.lost_rank != conn.rank and abort.lost_rank != 0:
            if conn.finished:
                return
            what = f"rank {abort.lost_rank}, reported by rank {conn.rank} ({conn.peer}): {abort.reason}"
            self._sup.fail(PeerLostError(what, rank=abort.lost_rank, how=abort.how), alike=alike)
            return
        self._lost(conn, f"aborted the run: {abort.reason}", "aborted", alike=alike)
