"""The TCP control channel: a root that listens, followers that connect (anyio).

Every connection starts with a versioned, mutually authenticated handshake::

    root                                            follower (rank r)
     | -- Challenge(protocol_version, root nonce) --> |
     | <-- Hello(version, rank, nranks, model spec,   |
     |           follower nonce, proof) ------------- |   proof = HMAC(token, root nonce + hello)
     | -- Welcome(proof) or Refuse(reason) ---------> |   proof = HMAC(token, both nonces + hello)
     | <========== Heartbeat, both ways ===========>  |
     | -- Rendezvous --> ... Train / Valid ... -- Stop --> |   then both sides close

The root checks the follower's proof first; a peer without it (a stranger, a wrong
token, garbage, an oversized frame, silence) is refused, logged on the
``"lamploop.control"`` logger and remembered in :attr:`TcpControlRoot.recent_refusals`,
and nothing else happens.  A peer with the proof that does not fit the run (protocol
version, world size, rank, a rank already joined, model spec) is refused *and* fails
the root with a :class:`HandshakeError` naming the mismatch, since the job cannot
succeed.  Once joined, a peer that is silent past the heartbeat timeout, disconnects or
aborts before :class:`Stop` fails its counterpart with :class:`PeerLostError`; a side
that leaves early first sends ``Abort(reason)``, so that the other side's error says why.

Failures surface where the owner is waiting: from :meth:`TcpControlRoot.on_rendezvous_ready`,
:meth:`~TcpControlRoot.broadcast`, :meth:`TcpControlFollower.join` or the commands
iterator if one of them is running; otherwise the body of the ``async with`` block is
cancelled (it may be stuck in a collective that will never complete) and the error is
raised when the block exits.  Heartbeats run on the event loop: do blocking work (a
synchronous collective, a long CPU step) in a worker thread, or they stop.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType

import anyio
import anyio.abc
import attrs
from anyio.abc import SocketAttribute, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lamploop.control.commands import Command, Rendezvous, Stop, Train, Valid
from lamploop.control.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Challenge,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    Refuse,
    Welcome,
    encode_frame,
    follower_proof,
    is_nonce,
    new_nonce,
    proof_matches,
    root_proof,
)
from lamploop.errors import ConfigurationError, ControlChannelError, HandshakeError, PeerLostError
from lamploop.modelspec import ModelSpec, describe_mismatch

__all__ = ["MAX_UNREAD_COMMANDS", "TcpControlFollower", "TcpControlRoot"]

logger = logging.getLogger("lamploop.control")

MAX_UNREAD_COMMANDS = 1024
"""A follower this many commands behind fails with :class:`ControlChannelError`."""

_RECEIVE_BYTES = 65536
_RECENT_REFUSALS = 16
_GOODBYE_TIMEOUT = 2.0  # for the last words: an Abort, or waiting for the peer's EOF after Stop
_MIN_FRAME_BYTES = 1024


# --- argument checks ---------------------------------------------------------------------------


def _token_bytes(token: bytes | str) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    if not isinstance(raw, bytes) or not raw:
        msg = f"token must be a non-empty str or bytes, got {type(token).__name__}"
        raise ConfigurationError(msg)
    return raw


def _check_seconds(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            msg = f"{name} must be a positive number of seconds, got {value!r}"
            raise ConfigurationError(msg)


def _check_int(name: str, value: int, low: int, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        msg = f"{name} must be an integer in [{low}, {high}], got {value!r}"
        raise ConfigurationError(msg)


def _check_common(
    *,
    nranks: int,
    model_spec: ModelSpec,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    max_frame_bytes: int,
    **timeouts: float,
) -> None:
    _check_int("nranks", nranks, 1)
    if not isinstance(model_spec, ModelSpec):
        msg = f"model_spec must be a ModelSpec (from lamploop.model_spec), got {type(model_spec).__name__}"
        raise ConfigurationError(msg)
    _check_seconds(heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout, **timeouts)
    if heartbeat_timeout <= heartbeat_interval:
        msg = f"heartbeat_timeout={heartbeat_timeout!r} must exceed heartbeat_interval={heartbeat_interval!r}"
        raise ConfigurationError(msg)
    _check_int("max_frame_bytes", max_frame_bytes, _MIN_FRAME_BYTES)


def _describe_exit(exc: BaseException | None, failure: BaseException | None, who: str) -> str:
    if failure is not None:
        return str(failure)[:1000]
    if exc is None:
        return f"the {who} closed the channel before Stop"
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return f"the {who} was cancelled"
    return f"the {who} failed: {type(exc).__name__}: {exc}"[:1000]


def _explain(exc: BaseException) -> str:
    """``Type: message`` of a transport error, or of its cause when it has none (BrokenResourceError)."""
    if not str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _remote(stream: anyio.abc.SocketStream) -> str:
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except (anyio.TypedAttributeLookupError, OSError):
        return "an unknown peer"
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


# --- one framed connection ----------------------------------------------------------------------


class _Connection:
    """A socket stream that sends and receives whole messages; transport errors become ControlChannelError."""

    def __init__(
        self, stream: anyio.abc.SocketStream, *, peer: str, max_frame_bytes: int, send_timeout: float
    ):
        self.stream = stream
        self.peer = peer
        self.rank: int | None = None
        self.finished = False  # Stop went through, or this side is leaving: the peer's EOF is expected
        self._max_frame_bytes = max_frame_bytes
        self._send_timeout = send_timeout
        self._decoder = FrameDecoder(max_frame_bytes=max_frame_bytes)
        self._pending: deque[Message] = deque()
        self._send_lock = anyio.Lock()
        self._write_closed = False

    def encode(self, message: Message) -> bytes:
        return encode_frame(message, max_frame_bytes=self._max_frame_bytes)

    async def send(self, message: Message | bytes, *, unless_closed: bool = False) -> bool:
        """Send a message (or an already encoded frame); raises ControlChannelError.

        Once this side has closed for sending, raises too, or with ``unless_closed`` returns
        ``False`` instead.
        """
        data = message if isinstance(message, bytes) else self.encode(message)
        try:
            with anyio.fail_after(self._send_timeout):
                async with self._send_lock:
                    if self._write_closed:
                        if unless_closed:
                            return False
                        msg = f"cannot send to {self.peer}: this side has closed the connection for sending"
                        raise ControlChannelError(msg)
                    await self.stream.send(data)
        except TimeoutError as exc:
            msg = f"sending to {self.peer} took over {self._send_timeout:g} s: is it still reading?"
            raise ControlChannelError(msg) from exc
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            msg = f"sending to {self.peer} failed: {_explain(exc)}"
            raise ControlChannelError(msg) from exc
        return True

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words (Refuse, Abort) within a short bound, even in a cancelled scope."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_GOODBYE_TIMEOUT):
            try:
                await self.send(message)
            except ControlChannelError as exc:
                logger.debug("could not tell %s %r: %s", self.peer, message, exc)

    async def send_eof(self) -> None:
        """Close the sending direction after what was sent; heartbeats stop."""
        async with self._send_lock:
            self._write_closed = True
            with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self.stream.send_eof()  # only fails if the connection is already gone

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream; raises ControlChannelError / FrameError."""
        while not self._pending:
            try:
                data = await self.stream.receive(_RECEIVE_BYTES)
            except anyio.EndOfStream:
                if self._decoder.buffered:
                    msg = f"{self.peer} closed the connection in the middle of a frame"
                    raise ControlChannelError(msg) from None
                return None
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                msg = f"receiving from {self.peer} failed: {_explain(exc)}"
                raise ControlChannelError(msg) from exc
            self._pending.extend(self._decoder.feed(data))
        return self._pending.popleft()

    async def heartbeat_forever(
        self, interval: float, on_error: Callable[[ControlChannelError], None]
    ) -> None:
        """Send a heartbeat every ``interval`` seconds until closed for sending or failing."""
        while True:
            await anyio.sleep(interval)
            try:
                if not await self.send(Heartbeat(), unless_closed=True):
                    return
            except ControlChannelError as exc:
                on_error(exc)
                return

    async def aclose(self) -> None:
        await anyio.aclose_forcefully(self.stream)


# --- failure bookkeeping shared by root and follower ---------------------------------------------


class _Supervisor:
    """A task group whose tasks report failures here instead of raising them.

    The first failure wins.  If the owner is waiting in one of the channel's methods
    (inside :meth:`waiting`) that method raises it; otherwise the owner's ``async with``
    body -- and only the body: the background tasks still have last words to say -- is
    cancelled, and :meth:`close` raises the failure.
    """

    def __init__(self) -> None:
        self.failure: ControlChannelError | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._body: anyio.CancelScope | None = None
        self._waiting = 0
        self.on_failure: Callable[[], None] = lambda: None

    @property
    def tg(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            msg = "use the control channel inside `async with`"
            raise ControlChannelError(msg)
        return self._tg

    async def enter(self) -> None:
        """Start the task group, then a cancel scope around the owner's body (left in :meth:`leave_body`)."""
        if self._tg is not None:
            msg = "a control channel can be entered only once"
            raise ControlChannelError(msg)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._body = anyio.CancelScope()
        self._body.__enter__()

    def fail(self, error: ControlChannelError) -> None:
        if self.failure is not None:
            logger.debug("after the first failure, also: %s", error)
            return
        self.failure = error
        self.on_failure()
        if self._waiting == 0 and self._body is not None:
            self._body.cancel()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark the owner as waiting in a channel method, which raises failures itself."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def leave_body(self, exc: BaseException | None) -> BaseException | None:
        """Leave the body's scope; the exception still in flight (``None`` if it was our cancellation)."""
        if self._body is None:
            msg = "the control channel was not entered"
            raise ControlChannelError(msg)
        if self._body.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None):
            return None
        return exc

    async def close(self, exc: BaseException | None, *, swallowed: bool) -> bool:
        """Stop every task; raise the recorded failure unless the body's own exception explains more.

        ``exc`` is what :meth:`leave_body` returned; ``swallowed`` says whether it swallowed
        the body's cancellation (then this returns ``True`` or raises the failure).
        """
        tg = self.tg
        tg.cancel_scope.cancel()
        if exc is not None and isinstance(exc, anyio.get_cancelled_exc_class()):
            # An outer cancellation: the task group re-raises it.
            await tg.__aexit__(type(exc), exc, exc.__traceback__)
        else:
            # The tasks never raise, so the group ends cleanly and the body's exception propagates unwrapped.
            await tg.__aexit__(None, None, None)
        if self.failure is not None and exc is not self.failure:
            if exc is None:
                raise self.failure
            logger.warning("control channel failure while the block ended with an error: %s", self.failure)
        return swallowed and exc is None


# --- the root ----------------------------------------------------------------------------------


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
        max_pending_handshakes: connections handshaking at once; more wait their turn
            (within ``handshake_timeout``), which bounds the memory strangers can hold.

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
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        handshake_timeout: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_pending_handshakes: int = 64,
    ) -> None:
        _check_common(
            nranks=nranks,
            model_spec=model_spec,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            max_frame_bytes=max_frame_bytes,
            join_timeout=join_timeout,
            handshake_timeout=handshake_timeout,
        )
        _check_int("port", port, 0, 65535)
        _check_int("max_pending_handshakes", max_pending_handshakes, 1)
        self._host = host
        self._port = port
        self._nranks = nranks
        self._token = _token_bytes(token)
        self._spec = model_spec
        self._join_timeout = join_timeout
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._handshake_timeout = handshake_timeout
        self._max_frame_bytes = max_frame_bytes
        self._handshakes = anyio.CapacityLimiter(max_pending_handshakes)
        self._sup = _Supervisor()
        self._sup.on_failure = self._wake_up
        self._address: tuple[str, int] | None = None
        self._peers: dict[int, _Connection] = {}
        self._refusals: deque[str] = deque(maxlen=_RECENT_REFUSALS)
        self._joined_or_failed = anyio.Event()
        self._serving = 0
        self._all_served = anyio.Event()
        self._rendezvous_sent = False
        self._stop_sent = False

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the root listens on (the real port when ``port=0``)."""
        if self._address is None:
            msg = "the root is not listening yet: use `async with TcpControlRoot(...) as root`"
            raise ControlChannelError(msg)
        return self._address

    @property
    def recent_refusals(self) -> tuple[str, ...]:
        """The last few peers refused for not proving the token, oldest first: ``"host:port: why"``."""
        return tuple(self._refusals)

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
        logger.info("control root listening on %s:%d for %d followers", *self._address, self._nranks - 1)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        remaining = self._sup.leave_body(exc)
        with anyio.CancelScope(shield=True), anyio.move_on_after(_GOODBYE_TIMEOUT):
            if not self._stop_sent:
                # Tell every follower why the run ends, then close our side.
                reason = _describe_exit(remaining, self._sup.failure, "root")
                for conn in list(self._peers.values()):
                    conn.finished = True  # their closing is expected now
                    await conn.send_best_effort(Abort(reason))
                    await conn.send_eof()
            # Read each follower until it closes too, so that nothing we sent is lost to a reset.
            if self._serving:
                await self._all_served.wait()
        return await self._sup.close(remaining, swallowed=exc is not None and remaining is None)

    def _wake_up(self) -> None:
        self._joined_or_failed.set()

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
            if len(self._peers) < self._nranks - 1:
                with anyio.move_on_after(self._join_timeout):
                    await self._joined_or_failed.wait()
            self._sup.raise_failure()
            if len(self._peers) < self._nranks - 1:
                raise HandshakeError(self._join_timeout_message())
            data = encode_frame(rendezvous, max_frame_bytes=self._max_frame_bytes)
            for rank in sorted(self._peers):
                await self._send_to(rank, data)
        self._rendezvous_sent = True
        logger.info("rendezvous %s:%d sent to ranks %s", rendezvous.host, rendezvous.port, self.peers())

    def _join_timeout_message(self) -> str:
        missing = sorted(set(range(1, self._nranks)) - set(self._peers))
        msg = (
            f"only ranks {sorted(self._peers)} of 1..{self._nranks - 1} joined within "
            f"{self._join_timeout:g} s; missing ranks {missing}"
        )
        if self._refusals:
            msg += f"; recently refused: {'; '.join(self._refusals)}"
        return msg

    async def broadcast(self, command: Command) -> None:
        """Send ``command`` to every follower, in the order of the calls.

        Raises:
            PeerLostError: a follower is gone (names its rank).
            ControlChannelError: called before :meth:`on_rendezvous_ready` or after
                :class:`Stop`, or the channel failed otherwise.
            TypeError: ``command`` is not a Train, Valid or Stop.
        """
        if not isinstance(command, (Train, Valid, Stop)):
            msg = f"a command is Train, Valid or Stop, got {type(command).__name__}"
            raise TypeError(msg)
        self._sup.raise_failure()
        if not self._rendezvous_sent or self._stop_sent:
            state = "after Stop" if self._stop_sent else "before on_rendezvous_ready()"
            msg = f"broadcast({command!r}) {state}"
            raise ControlChannelError(msg)
        data = encode_frame(command, max_frame_bytes=self._max_frame_bytes)
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

    async def _send_to(self, rank: int, data: bytes) -> None:
        conn = self._peers[rank]
        try:
            await conn.send(data)
        except ControlChannelError as exc:
            self._sup.fail(PeerLostError(f"rank {rank} ({conn.peer}) is gone: {exc}"))
            self._sup.raise_failure()

    # -- background tasks --

    async def _serve(self, *, task_status: TaskStatus[tuple[str, int]]) -> None:
        listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
        # One socket listener per address family of the host (create_tcp_listener makes only those).
        sockets = [one for one in listener.listeners if isinstance(one, anyio.abc.SocketListener)]
        async with listener, anyio.create_task_group() as tg:
            for one in sockets:
                tg.start_soon(self._accept_forever, one)
            address = listener.extra(SocketAttribute.local_address)
            task_status.started((str(address[0]), int(address[1])))

    async def _accept_forever(self, listener: anyio.abc.SocketListener) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the joined peers
                logger.warning("control root: accepting a connection failed: %s", exc)
                await anyio.sleep(0.1)
                continue
            self._sup.tg.start_soon(self._handle, stream)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        conn = _Connection(
            stream,
            peer=_remote(stream),
            max_frame_bytes=self._max_frame_bytes,
            send_timeout=self._heartbeat_timeout,
        )
        try:
            rank = await self._admit(conn)
            if rank is not None:
                await self._serve_peer(conn, rank)
        finally:
            await conn.aclose()

    async def _admit(self, conn: _Connection) -> int | None:
        """Run the handshake; the follower's rank once welcomed, ``None`` if refused."""
        try:
            with anyio.fail_after(self._handshake_timeout):
                async with self._handshakes:
                    hello, root_nonce = await self._authenticate(conn)
        except TimeoutError:
            await self._refuse_stranger(conn, f"no valid hello within {self._handshake_timeout:g} s")
            return None
        except _Unauthenticated as exc:
            await self._refuse_stranger(conn, str(exc))
            return None
        rank = hello.rank
        reason = self._mismatch(hello)
        if reason is not None:
            logger.warning("control root refused rank %d (%s): %s", rank, conn.peer, reason)
            await conn.send_best_effort(Refuse(reason))
            self._sup.fail(HandshakeError(f"refused rank {rank} ({conn.peer}): {reason}"))
            return None
        # Take the rank before the first await, so that a duplicate cannot slip in meanwhile.
        conn.rank = rank
        self._peers[rank] = conn
        self._serving += 1
        try:
            await conn.send(Welcome(root_proof(self._token, root_nonce=root_nonce, hello=hello)))
        except ControlChannelError as exc:
            self._lost(conn, f"is gone: {exc}")
            return rank
        logger.info("control root: rank %d joined from %s", rank, conn.peer)
        if len(self._peers) == self._nranks - 1:
            self._joined_or_failed.set()  # after the welcome, so the rendezvous cannot overtake it
        return rank

    async def _authenticate(self, conn: _Connection) -> tuple[Hello, str]:
        root_nonce = new_nonce()
        try:
            await conn.send(Challenge(PROTOCOL_VERSION, root_nonce))
            hello = await conn.receive()
        except ControlChannelError as exc:
            raise _Unauthenticated(str(exc)) from exc
        if hello is None:
            msg = "closed the connection without a hello"
            raise _Unauthenticated(msg)
        if not isinstance(hello, Hello):
            msg = f"sent a {type(hello).__name__} message instead of a hello"
            raise _Unauthenticated(msg)
        if not is_nonce(hello.nonce):
            msg = "sent a malformed nonce"
            raise _Unauthenticated(msg)
        if not proof_matches(follower_proof(self._token, root_nonce=root_nonce, hello=hello), hello.proof):
            msg = "the proof of the shared token did not match (wrong token?)"
            raise _Unauthenticated(msg)
        return hello, root_nonce

    async def _refuse_stranger(self, conn: _Connection, reason: str) -> None:
        logger.warning("control root refused %s: %s", conn.peer, reason)
        self._refusals.append(f"{conn.peer}: {reason}")
        await conn.send_best_effort(Refuse(reason))

    def _mismatch(self, hello: Hello) -> str | None:
        """Why a follower that proved the token cannot take part, or ``None``."""
        rank, nranks = hello.rank, self._nranks
        if hello.protocol_version != PROTOCOL_VERSION:
            return (
                f"rank {rank} speaks control protocol version {hello.protocol_version}, "
                f"the root speaks version {PROTOCOL_VERSION}"
            )
        if hello.nranks != nranks:
            return f"rank {rank} was started with nranks={hello.nranks}, the root with nranks={nranks}"
        if not 1 <= rank < nranks:
            return (
                f"rank {rank} is out of range: with nranks={nranks} the followers are ranks 1..{nranks - 1}"
            )
        if rank in self._peers:
            return (
                f"rank {rank} has already joined from {self._peers[rank].peer}: is rank {rank} started twice?"
            )
        detail = describe_mismatch(
            self._spec, hello.model_spec, expected_label="root", actual_label=f"rank {rank}"
        )
        if detail is not None:
            return f"rank {rank}'s model differs: {detail}"
        return None

    async def _serve_peer(self, conn: _Connection, rank: int) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    conn.heartbeat_forever, self._heartbeat_interval, self._on_heartbeat_error(conn)
                )
                await self._read_from(conn)
                tg.cancel_scope.cancel()
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._all_served.set()

    def _on_heartbeat_error(self, conn: _Connection) -> Callable[[ControlChannelError], None]:
        return lambda exc: self._lost(conn, f"is gone: {exc}")

    def _lost(self, conn: _Connection, what: str) -> None:
        if conn.finished:
            logger.debug("rank %s (%s) after Stop: %s", conn.rank, conn.peer, what)
            return
        self._sup.fail(PeerLostError(f"rank {conn.rank} ({conn.peer}) {what}"))

    async def _read_from(self, conn: _Connection) -> None:
        """Read a joined follower until it closes after Stop, or report how it was lost."""
        while True:
            message: Message | None = None
            with anyio.move_on_after(self._heartbeat_timeout) as silence:
                try:
                    message = await conn.receive()
                except ControlChannelError as exc:
                    self._lost(conn, f"is gone: {exc}")
                    return
            if silence.cancelled_caught:
                self._lost(conn, f"sent nothing for {self._heartbeat_timeout:g} s (heartbeat timeout)")
                return
            if message is None:
                self._lost(conn, "closed the connection before Stop")
                return
            if isinstance(message, Abort):
                self._lost(conn, f"aborted the run: {message.reason}")
                return
            if not isinstance(message, Heartbeat):
                self._lost(conn, f"broke the protocol: it sent a {type(message).__name__} message")
                return


class _Unauthenticated(Exception):
    """A peer did not prove the token; the message says how (internal)."""


# --- the follower ------------------------------------------------------------------------------


class TcpControlFollower:
    """A follower's end of the TCP control channel; implements :class:`~lamploop.control.ControlFollower`.

    ``async with TcpControlFollower(...) as follower:`` then ``await follower.join()``
    connects to the root at ``host:port``, retrying with exponential backoff (0.05 s
    doubling to 1 s) for up to ``connect_timeout`` seconds, so followers may start
    before the root listens.

    Args:
        host, port: the root's :attr:`TcpControlRoot.address`.
        rank: this follower's rank, ``1..nranks-1``.
        nranks, token: as given to the root.
        model_spec: this rank's model spec; the root refuses it unless it equals its own.
        connect_timeout: seconds to keep trying to reach the root.
        heartbeat_interval, heartbeat_timeout: as for the root; the root is lost when silent
            past the timeout.
        handshake_timeout: seconds the root may take to answer, once connected.
        max_frame_bytes: the largest frame body sent or accepted.

    Raises:
        ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        nranks: int,
        token: bytes | str,
        model_spec: ModelSpec,
        connect_timeout: float = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        handshake_timeout: float = 10.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        _protocol_version: int = PROTOCOL_VERSION,
    ) -> None:
        _check_common(
            nranks=nranks,
            model_spec=model_spec,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            max_frame_bytes=max_frame_bytes,
            connect_timeout=connect_timeout,
            handshake_timeout=handshake_timeout,
        )
        _check_int("port", port, 1, 65535)
        _check_int("rank", rank, 1, nranks - 1)
        self.rank = rank
        self._host = host
        self._port = port
        self._root = f"the root at {host}:{port}"
        self._nranks = nranks
        self._token = _token_bytes(token)
        self._spec = model_spec
        self._connect_timeout = connect_timeout
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._handshake_timeout = handshake_timeout
        self._max_frame_bytes = max_frame_bytes
        self._protocol_version = _protocol_version
        self._sup = _Supervisor()
        self._sup.on_failure = self._wake_up
        self._conn: _Connection | None = None
        self._rendezvous: Rendezvous | None = None
        self._rendezvous_or_failed = anyio.Event()
        self._drained = anyio.Event()
        self._send_commands: MemoryObjectSendStream[Command]  # made on entering, closed on leaving
        self._commands: _TcpCommands

    async def __aenter__(self) -> TcpControlFollower:
        await self._sup.enter()
        self._send_commands, receive = anyio.create_memory_object_stream[Command](MAX_UNREAD_COMMANDS)
        self._commands = _TcpCommands(receive, self._sup)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        conn = self._conn
        remaining = self._sup.leave_body(exc)
        try:
            if conn is not None and conn.rank is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(_GOODBYE_TIMEOUT):
                    if not conn.finished:  # leaving before Stop: tell the root why
                        conn.finished = True
                        who = f"follower of rank {self.rank}"
                        await conn.send_best_effort(Abort(_describe_exit(remaining, self._sup.failure, who)))
                        await conn.send_eof()
                    await self._drained.wait()  # read until the root closes, so nothing is lost to a reset
            return await self._sup.close(remaining, swallowed=exc is not None and remaining is None)
        finally:
            self._send_commands.close()
            self._commands.close()
            if conn is not None:
                await conn.aclose()

    def _wake_up(self) -> None:
        self._rendezvous_or_failed.set()
        self._send_commands.close()

    async def join(self) -> tuple[Rendezvous, AsyncIterator[Command]]:
        """Connect, authenticate both ways, and wait for the root's rendezvous.

        Waiting for the rendezvous is bounded by the root's join timeout (after which the
        root aborts the run) and by the heartbeat timeout (if the root goes silent).

        Raises:
            HandshakeError: the root refused this follower (carries the root's reason), or the
                root did not prove the shared token.
            ControlChannelError: the root was not reachable within ``connect_timeout``, did
                not answer within ``handshake_timeout``, or does not speak this protocol;
                also when called twice or outside ``async with``.
            PeerLostError: the root went silent, disconnected or aborted before the rendezvous.
        """
        tg = self._sup.tg
        if self._conn is not None:
            msg = f"rank {self.rank} already called join()"
            raise ControlChannelError(msg)
        stream = await self._connect()
        conn = self._conn = _Connection(
            stream,
            peer=self._root,
            max_frame_bytes=self._max_frame_bytes,
            send_timeout=self._heartbeat_timeout,
        )
        try:
            with anyio.fail_after(self._handshake_timeout):
                await self._handshake(conn)
        except TimeoutError as exc:
            timeout = self._handshake_timeout
            msg = f"rank {self.rank}: {self._root} did not finish the handshake in {timeout:g} s"
            raise ControlChannelError(msg) from exc
        conn.rank = 0
        logger.info("rank %d joined %s", self.rank, self._root)
        tg.start_soon(conn.heartbeat_forever, self._heartbeat_interval, self._on_heartbeat_error)
        tg.start_soon(self._read_root, conn)
        with self._sup.waiting():
            await self._rendezvous_or_failed.wait()
        self._sup.raise_failure()
        if self._rendezvous is None:  # the event is set only by the rendezvous or a failure
            msg = f"rank {self.rank}: woken up without a rendezvous"
            raise ControlChannelError(msg)
        return self._rendezvous, self._commands

    async def _connect(self) -> anyio.abc.SocketStream:
        deadline = anyio.current_time() + self._connect_timeout
        delay = 0.05
        attempts = 0
        while True:
            attempts += 1
            try:
                with anyio.fail_after(max(deadline - anyio.current_time(), 0.001)):
                    return await anyio.connect_tcp(self._host, self._port)
            except OSError as exc:  # includes TimeoutError and refused connections
                error = exc
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                msg = (
                    f"rank {self.rank} could not reach {self._root} within {self._connect_timeout:g} s "
                    f"({attempts} attempts; last error: {type(error).__name__}: {error})"
                )
                raise ControlChannelError(msg) from error
            logger.debug("rank %d: %s not reachable yet (%s); retrying", self.rank, self._root, error)
            await anyio.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    async def _handshake(self, conn: _Connection) -> None:
        challenge = await conn.receive()
        if not isinstance(challenge, Challenge) or not is_nonce(challenge.nonce):
            what = "closed the connection" if challenge is None else f"sent {type(challenge).__name__}"
            msg = f"rank {self.rank}: {self._root} {what} instead of a challenge: is it a lamploop root?"
            raise ControlChannelError(msg)
        hello = Hello(self._protocol_version, self.rank, self._nranks, self._spec, new_nonce(), proof="")
        hello = attrs.evolve(
            hello, proof=follower_proof(self._token, root_nonce=challenge.nonce, hello=hello)
        )
        await conn.send(hello)
        reply = await conn.receive()
        if isinstance(reply, Refuse):
            msg = f"rank {self.rank} refused by root: {reply.reason}"
            raise HandshakeError(msg)
        if not isinstance(reply, Welcome):
            what = "closed the connection" if reply is None else f"sent {type(reply).__name__}"
            msg = f"rank {self.rank}: {self._root} {what} instead of answering the hello"
            raise ControlChannelError(msg)
        if not proof_matches(root_proof(self._token, root_nonce=challenge.nonce, hello=hello), reply.proof):
            msg = f"rank {self.rank}: {self._root} did not prove the shared token (another root or token)"
            raise HandshakeError(msg)

    def _on_heartbeat_error(self, exc: ControlChannelError) -> None:
        self._lost(f"is gone: {exc}")

    def _lost(self, what: str) -> None:
        conn = self._conn
        if conn is not None and conn.finished:
            logger.debug("rank %d: after Stop, %s %s", self.rank, self._root, what)
            return
        self._sup.fail(PeerLostError(f"rank {self.rank}: {self._root} {what}"))

    async def _read_root(self, conn: _Connection) -> None:
        try:
            await self._read_messages(conn)
        finally:
            self._drained.set()

    async def _read_messages(self, conn: _Connection) -> None:
        while True:
            message: Message | None = None
            with anyio.move_on_after(self._heartbeat_timeout) as silence:
                try:
                    message = await conn.receive()
                except ControlChannelError as exc:
                    self._lost(f"is gone: {exc}")
                    return
            if silence.cancelled_caught:
                self._lost(f"sent nothing for {self._heartbeat_timeout:g} s (heartbeat timeout)")
                return
            if message is None:
                self._lost("closed the connection before Stop")
                return
            if isinstance(message, Heartbeat) or conn.finished:
                continue
            if isinstance(message, Abort):
                self._lost(f"aborted the run: {message.reason}")
                return
            if isinstance(message, Rendezvous) and self._rendezvous is None:
                self._rendezvous = message
                self._rendezvous_or_failed.set()
            elif isinstance(message, (Train, Valid, Stop)) and self._rendezvous is not None:
                if not self._deliver(message):
                    return
                if isinstance(message, Stop):
                    conn.finished = True  # the root's EOF follows; answer with ours
                    self._send_commands.close()
                    await conn.send_eof()
            else:
                self._lost(f"broke the protocol: it sent a {type(message).__name__} message")
                return

    def _deliver(self, command: Command) -> bool:
        try:
            self._send_commands.send_nowait(command)
        except anyio.WouldBlock:
            msg = f"rank {self.rank} has {MAX_UNREAD_COMMANDS} unread commands: is it reading them?"
            self._sup.fail(ControlChannelError(msg))
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            logger.debug("rank %d: the commands are no longer read; dropping %r", self.rank, command)
        return True


class _TcpCommands(AsyncIterator[Command]):
    """The root's commands as received by one follower; ends after :class:`Stop`."""

    def __init__(self, receive: MemoryObjectReceiveStream[Command], sup: _Supervisor) -> None:
        self._receive = receive
        self._sup = sup
        self._stopped = False

    def close(self) -> None:
        self._receive.close()

    async def __anext__(self) -> Command:
        if self._stopped:
            raise StopAsyncIteration
        with self._sup.waiting():
            try:
                command = await self._receive.receive()
            except anyio.EndOfStream:
                self._sup.raise_failure()
                msg = "the command stream ended before Stop"
                raise ControlChannelError(msg) from None
            except anyio.ClosedResourceError as exc:
                msg = "commands read after the follower was closed"
                raise ControlChannelError(msg) from exc
        if isinstance(command, Stop):
            self._stopped = True
        return command
