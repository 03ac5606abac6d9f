"""A receiver's connections served on a thread of their own, with their own event loop.

``SampleReceiver(buffer, ..., own_thread=True)``: the sockets' reads, the frames' decoding, the
puts into the buffer and the acknowledgements run on this thread, so that the trainer's thread
only draws batches from the buffer (a :class:`~lamploop.streaming.buffers.StreamBuffer`, whose
puts and reads may come from two threads: :mod:`lamploop.streaming.buffer_wakes`).  Python
holds one lock for both threads, but the trainer's heavy work (torch's kernels) lets it go,
so the receiving runs while the trainer computes, on another core.

The thread is structured: the receiver's ``async with`` starts it and waits until it listens,
and leaving the block stops its tasks and joins it.  What the receiver's owner awaits or reads
(``wait_all_done``, ``acknowledged``, ``stats``, ...) is the same as without the thread; a
failure of the thread's tasks (the buffer's put raised) cancels the owner's block, or raises in
``wait_all_done``, and is raised when the block is left, as on one loop.

.. versionadded:: 0.3
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.to_thread

from lamploop.errors import StreamingError
from lamploop.transport.supervisor import Supervisor

__all__ = ["ServingThread"]

_Serve = Callable[..., Coroutine[Any, Any, Any]]


class ServingThread:
    """Runs ``serve`` (a receiver's ``_serve``) in ``sup`` on a thread of its own until :meth:`stop`.

    Args:
        sup: the receiver's supervisor; entered and closed on the thread.
        serve: started in the supervisor's task group (``task_status``: the address).
        on_end: called on the owner's loop when the thread's tasks ended by themselves (a failure).
    """

    def __init__(self, sup: Supervisor, serve: _Serve, on_end: Callable[[], None]) -> None:
        self._sup = sup
        self._serve = serve
        self._on_end = on_end
        self._ready = threading.Event()
        self._address: tuple[str, int] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop: anyio.Event | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's
        # Callbacks asked for before the thread's loop runs (set_directory while starting):
        # run by the thread once its loop is up, not dropped.
        self._early: list[Callable[[], object]] | None = []
        self._early_lock = threading.Lock()
        self._owner: asyncio.AbstractEventLoop | None = None  # the owner's

    async def start(self, name: str) -> tuple[str, int]:
        """Start the thread; its address once it listens.

        Raises:
            OSError: it cannot listen.
        """
        self._owner = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        with anyio.CancelScope(shield=True):  # not left running unjoined: it listens (or fails) at once
            await anyio.to_thread.run_sync(self._ready.wait)
        if self._address is None:
            self._thread.join()
            error = self._error
            if error is None:  # pragma: no cover - _main always sets one or the other
                error = StreamingError("the receiver's thread ended before it listened")
            raise error
        return self._address

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the thread's loop (or now, from that thread; nothing once it ended)."""
        if threading.current_thread() is self._thread:
            callback()
            return
        with self._early_lock:
            if self._early is not None:  # the thread's loop is not up yet
                self._early.append(callback)
                return
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended
                self._loop.call_soon_threadsafe(callback)

    def call_soon_owner(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the owner's loop, from whichever thread."""
        if self._owner is None or threading.current_thread() is not self._thread:
            callback()
            return
        with contextlib.suppress(RuntimeError):  # the owner's loop has ended
            self._owner.call_soon_threadsafe(callback)

    async def stop(self) -> BaseException | None:
        """Stop the thread's tasks and join it; the error its supervisor's close raised (a failure)."""
        self._stopping = True
        if self._stop is not None:
            self.call_soon(self._stop.set)
        if self._thread is not None:
            with anyio.CancelScope(shield=True):  # joined even when the owner is cancelled
                await anyio.to_thread.run_sync(self._thread.join)  # bounded: closing cancels every task
        return self._error

    def _run(self) -> None:
        try:
            anyio.run(self._main)
        except BaseException as exc:  # reported to the owner by stop(), start()
            self._error = self._error or exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = anyio.Event()
        with self._early_lock:
            early, self._early = self._early or [], None
        for callback in early:
            callback()
        sup = self._sup
        await sup.enter()
        try:
            self._address = await sup.tg.start(self._serve)
        except OSError as exc:
            self._error = exc
            sup.leave_body(None)
            await sup.close(None, swallowed=False)
            return
        self._ready.set()
        body: BaseException | None = None
        try:
            await self._stop.wait()  # in the supervisor's body: a failure cancels it
        except BaseException as exc:  # handed to the supervisor, as `async with` would
            body = exc
        remaining = sup.leave_body(body)
        try:
            await sup.close(remaining, swallowed=body is not None and remaining is None)
        except BaseException as exc:  # the failure: raised on the owner's side
            self._error = exc
        if not self._stopping:
            self.call_soon_owner(self._on_end)
