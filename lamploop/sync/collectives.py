"""Collectives over one process group, every wait bounded and abortable.

A Gloo wait cannot be interrupted from outside (``abort()`` does not wake a thread
already inside ``wait()``), so :meth:`Collectives.wait` never blocks for long: it waits
in slices of :data:`POLL_S` and between slices checks an :class:`AbortSignal`.  The
training drivers set that signal when the control channel finds a rank dead, frozen or cut
off; the waiting thread then raises :class:`WaitAborted` within a slice instead of hanging
until the collective timeout.  On NCCL the communicator is also aborted, which unblocks
the device side.

Everything here runs on the thread that trains (a worker thread in a multi-rank run).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import torch
import torch.distributed as dist

from lamploop.errors import DistributedError, mark_detected_by_every_rank
from lamploop.sync.abandon import abandon

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_GIVE_UP_AFTER_S",
    "POLL_S",
    "AbortSignal",
    "Collectives",
    "Group",
    "WaitAborted",
    "Work",
]

DEFAULT_COLLECTIVE_TIMEOUT_S: Final = 1800.0
"""The backstop for a collective whose peers are all alive (heartbeats flow) but never arrive,
such as ranks that disagree on what to run.  A dead, frozen or cut-off rank is found by the
control channel's heartbeats within seconds, long before this; a slow step (a minute and
more) must not trip it, hence its length."""

Group: TypeAlias = Any
"""A process-group backend object (``ProcessGroupGloo`` or ``ProcessGroupNCCL``): their
common base is private and the CPU build of torch lacks the NCCL class."""
Work: TypeAlias = Any
"""A collective in flight (``torch.distributed.Work``)."""

POLL_S: Final = 0.1
"""The slice of a wait between two looks at the abort signal."""

DEFAULT_GIVE_UP_AFTER_S: Final = 2.0
"""How long after its abort signal a rank waits for its training thread, by default (see
:class:`AbortSignal`).  A thread in one of lamploop's waits ends within :data:`POLL_S`; this
bounds the user's code: a follower whose batch source blocked for minutes outlived its killed
root by as long, silently.  Long enough for a sliced wait to end on a loaded machine."""
_SLICE: Final = datetime.timedelta(seconds=POLL_S)
_KEPT_AFTER_WAIT: Final = 2
"""How many waited-for works (with their tensors) a :class:`Collectives` keeps referenced.

A Gloo thread lets go of a work just after completing it, so a wait can return first.  Had
the waiting thread dropped the work by then, the Gloo thread's release would be the last one,
and it frees the Python objects of the work's tensors, which needs the interpreter: while the
interpreter finalizes (a process exiting right after a collective) that ends the thread inside
C++ and aborts the process with status -6 ("terminate called without an active exception";
``tests/sync/test_exit_after_collectives.py`` saw it in 1 of 5 exits).  Kept until a later wait
(or the ``Collectives``, which goes with its group), a work is let go of last by Python.  Two,
not more: a sharded model's all-gather outputs are whole layers.
"""


class WaitAborted(DistributedError):
    """A wait was given up because the run failed elsewhere (see :class:`AbortSignal`)."""


class AbortSignal:
    """Set once, from any thread, when the run has failed and waits must end.

    Attributes:
        reason: why it was set (empty until it is).
        give_up_after: how long after the signal the rank waits for its training thread to
            end (see :func:`lamploop.distributed.worker.run_on_worker`); past it, the thread is
            given up on: the rank's run ends with its error while the thread stays where it is
            (a daemon thread: it does not hold the process's exit).  ``None`` (the default):
            :data:`DEFAULT_GIVE_UP_AFTER_S`.  Every wait of lamploop's own looks at the signal
            and ends within :data:`POLL_S`; the bound is for what does not: the user's code (a
            batch source that blocks on the network, a long forward) and a collective out of the
            signal's reach (a ``DTensor``'s, inside ``torch.nn.utils.clip_grad_norm_`` on a
            sharded model).  Set by :meth:`allow_giving_up`.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._setting = threading.Lock()  # two threads setting it at once: the first reason stays
        self.reason = ""
        self.give_up_after: float | None = None

    def allow_giving_up(self, after: float) -> None:
        """The training thread may block out of this signal's reach: give it up ``after`` s after it."""
        self.give_up_after = after if self.give_up_after is None else min(self.give_up_after, after)

    def set(self, reason: str) -> None:
        """Abort every wait that looks at this signal (the first reason is kept)."""
        with self._setting:
            if not self._event.is_set():
                self.reason = reason
                self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Block up to ``seconds`` for the signal; whether it is set."""
        return self._event.wait(seconds)


class Collectives:
    """The collectives lamploop uses, over one process group of ``nranks`` ranks.

    Args:
        group: the process group object.
        rank, nranks: this rank and the world size.
        device: where this rank trains; small statistics travel on it when it is a CUDA
            device (NCCL), else on the CPU.
        timeout: seconds after which a wait whose peers never arrive fails.
        abort: checked between slices of every wait.
    """

    def __init__(
        self,
        group: Group,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        timeout: float,
        abort: AbortSignal | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.nranks = nranks
        self.device = device
        self.timeout = timeout
        self.abort = abort if abort is not None else AbortSignal()
        self.stats_device = device if device.type == "cuda" else torch.device("cpu")
        # Seconds this rank spent blocked in wait(): the communication compute did not hide.
        self.wait_seconds = 0.0
        # Started and not yet waited for, with their tensors: what a failed run abandons.
        self._in_flight: dict[int, tuple[Work, list[torch.Tensor]]] = {}
        # The last few waited for, kept so that a Gloo thread is never the last to let go of
        # one: see _KEPT_AFTER_WAIT.
        self._waited: deque[tuple[Work, list[torch.Tensor]]] = deque(maxlen=_KEPT_AFTER_WAIT)

    def all_reduce(self, tensors: list[torch.Tensor]) -> Work:
        """Start summing ``tensors`` in place over all ranks."""
        return self._started(self.group.allreduce(tensors), tensors)

    def reduce_to_root(self, tensors: list[torch.Tensor]) -> Work:
        """Start summing ``tensors`` into rank 0's."""
        options = dist.ReduceOptions()  # the default reduction is a sum
        options.rootRank = 0
        return self._started(self.group.reduce(tensors, options), tensors)

    def broadcast_from_root(self, tensors: list[torch.Tensor]) -> Work:
        """Start overwriting ``tensors`` on every rank with rank 0's."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._started(self.group.broadcast(tensors, options), tensors)

    def track(self, work: Work, tensors: list[torch.Tensor]) -> Work:
        """Record ``work``, a collective another library started on this group (FSDP2's), with its tensors.

        Waited for with :meth:`wait`, it is forgotten; left pending by a failed run, it is
        abandoned with the group (:meth:`abandon`).
        """
        return self._started(work, tensors)

    def _started(self, work: Work, tensors: list[torch.Tensor]) -> Work:
        self._in_flight[id(work)] = (work, tensors)
        return work

    def abandon(self) -> None:
        """Leave the group and everything in flight on it behind (a failed run; see ``abandon``)."""
        pending = [obj for work, tensors in self._in_flight.values() for obj in (work, *tensors)]
        self._in_flight.clear()
        abandon(self.group, *pending)

    def wait(self, work: Work, what: str) -> None:
        """Wait for ``work``; bounded by the timeout and ended early by the abort signal.

        Raises:
            WaitAborted: the abort signal was set.
            DistributedError: the collective failed (a peer died) or outlasted the timeout.
        """
        began = time.perf_counter()
        try:
            self._wait(work, what)
        finally:
            self.wait_seconds += time.perf_counter() - began

    def _wait(self, work: Work, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.abort.is_set():
                self._abort_backend()
                msg = f"rank {self.rank}: gave up waiting for the {what}: {self.abort.reason}"
                raise WaitAborted(msg)
            if self._waited_one_slice(work, what):
                self._waited.append(self._in_flight.pop(id(work), (work, [])))
                return
            if time.monotonic() > deadline:
                msg = (
                    f"rank {self.rank}: the {what} did not complete within {self.timeout:g} s "
                    "(collective_timeout) although every rank is alive: do the ranks run the same steps?"
                )
                raise DistributedError(msg)

    def _waited_one_slice(self, work: Work, what: str) -> bool:
        """Wait up to one slice: whether ``work`` completed; raises if it failed.

        A slice that runs out raises ``RuntimeError("Operation timed out!")``, but the work
        can complete between the end of the slice and the look at it: the waiting thread
        takes the GIL back first, which takes up to the switch interval (5 ms) on a busy
        process.  Such a work is complete and succeeded; taking it for failed (as a look at
        ``is_completed()`` alone would) fails a healthy run.  So a complete work is asked
        once more: its ``wait`` then returns at once, or raises its own failure (a socket's
        "Connection timed out" included).
        """
        try:
            work.wait(_SLICE)
        except RuntimeError as exc:
            if "timed out" in str(exc) and not work.is_completed():
                return False  # the slice ran out: look at the abort signal, then wait again
            if "timed out" not in str(exc):
                raise self._failed(what, exc) from exc
            try:
                work.wait(_SLICE)  # complete: its own outcome, at once
            except RuntimeError as failure:
                raise self._failed(what, failure) from failure
        return True

    def _failed(self, what: str, exc: RuntimeError) -> DistributedError:
        return DistributedError(f"rank {self.rank}: the {what} failed (a peer died?): {exc}")

    def _abort_backend(self) -> None:
        """NCCL can abort its communicator (unblocking the device); Gloo has nothing to abort."""
        abort = getattr(self.group, "abort", None)
        if self.device.type == "cuda" and callable(abort):
            try:
                abort()
            except RuntimeError:  # already aborted or torn down: nothing left to unblock
                return

    def sum(self, values: Sequence[float], *, per_rank: float | torch.Tensor | None = None) -> Pending:
        """Start summing a small float vector over all ranks (float64).

        ``per_rank``: one more value from each rank, in its own slot after ``values``
        (zeros elsewhere), so that every rank learns every rank's value from the same sum.
        A tensor is copied on its device, without waiting for it to be computed.
        """
        head = [float(v) for v in values]
        if per_rank is None or isinstance(per_rank, (int, float)):
            slots = [0.0] * (self.nranks if per_rank is not None else 0)
            if per_rank is not None:
                slots[self.rank] = float(per_rank)
            tensor = torch.tensor(head + slots, dtype=torch.float64, device=self.stats_device)
        else:
            tensor = torch.zeros(len(head) + self.nranks, dtype=torch.float64, device=self.stats_device)
            tensor[: len(head)] = torch.tensor(head, dtype=torch.float64)
            tensor[len(head) + self.rank] = per_rank.detach().to(self.stats_device, torch.float64)
        return Pending(self, self.all_reduce([tensor]), tensor)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Overwrite ``tensors`` on every rank with rank 0's (same shapes everywhere), blocking."""
        for t in tensors:
            staging = t.detach().to(self.device).contiguous()
            self.wait(self.broadcast_from_root([staging]), what)
            with torch.no_grad():
                t.copy_(staging)

    def broadcast_json(self, value: Any, what: str) -> Any:
        """Rank 0's JSON-ready ``value`` on every rank (bytes over the group, no pickle)."""
        payload = json.dumps(value).encode() if self.rank == 0 else b""
        return json.loads(self.broadcast_bytes(payload, what).decode())

    def broadcast_bytes(self, payload: bytes, what: str) -> bytes:
        """Rank 0's ``payload`` on every rank (the others' ``payload`` is ignored); blocking."""
        length = torch.tensor(
            [len(payload) if self.rank == 0 else 0], dtype=torch.int64, device=self.stats_device
        )
        self.wait(self.broadcast_from_root([length]), f"length of the {what}")
        buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=self.stats_device)
        if self.rank == 0 and payload:
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if buffer.numel():
            self.wait(self.broadcast_from_root([buffer]), what)
        return buffer.cpu().numpy().tobytes()

    def gather_json(self, value: Any, what: str) -> list[Any]:
        """Every rank's JSON-ready ``value``, in rank order, on every rank (two all-reduces, no pickle)."""
        payload = json.dumps(value).encode()
        lengths = torch.zeros(self.nranks, dtype=torch.int64, device=self.stats_device)
        lengths[self.rank] = len(payload)
        self.wait(self.all_reduce([lengths]), f"lengths of the {what}")
        rows = torch.zeros(
            self.nranks, int(lengths.max().item()), dtype=torch.uint8, device=self.stats_device
        )
        rows[self.rank, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.wait(self.all_reduce([rows]), what)
        cpu = rows.cpu()
        return [json.loads(bytes(cpu[r, : int(lengths[r])].tolist()).decode()) for r in range(self.nranks)]

    def gather_bytes_to_root(self, payload: bytes, what: str) -> list[bytes] | None:
        """Every rank's ``payload`` on the root, in rank order (``None`` elsewhere); blocking, no pickle.

        The lengths travel first (one all-reduce), then every payload padded to the longest
        (one gather to rank 0): the followers send their bytes once, not to every rank.
        """
        lengths = torch.zeros(self.nranks, dtype=torch.int64)
        lengths[self.rank] = len(payload)
        self.wait(self.all_reduce([lengths]), f"lengths of the {what}")
        longest = max(1, int(lengths.max().item()))
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        options = dist.GatherOptions()
        options.rootRank = 0
        rows = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.nranks)] if self.rank == 0 else []
        outputs = [rows] if self.rank == 0 else []  # Gloo wants no output list at all off the root
        self.wait(self._started(self.group.gather(outputs, [mine], options), [mine, *rows]), what)
        if self.rank != 0:
            return None
        return [rows[r][: int(lengths[r])].numpy().tobytes() for r in range(self.nranks)]

    def check_agreement(self, label: str, value: str, *, shown: str | None = None) -> None:
        """Raise DistributedError on every rank if the ranks hold different ``value`` for ``label``.

        ``shown``: how the message names this rank's value (default: ``value`` itself).
        """
        root_value = self.broadcast_json([value], f"root's {label}")[0]
        agreeing = int(self.sum([float(value == root_value)]).wait()[0])
        if agreeing != self.nranks:
            # Only when they disagree: every rank's value to every rank, so that each names
            # the ranks that differ and what they hold (a gather is one collective more).
            pairs = self.gather_json([value, value if shown is None else shown], f"ranks' {label}")
            differing = [f"rank {rank} has {s!r}" for rank, (v, s) in enumerate(pairs) if v != root_value]
            msg = (
                f"the ranks disagree on {label}: {self.nranks - agreeing} of {self.nranks} differ "
                f"from rank 0's {pairs[0][1]!r}: {', '.join(differing[:8])}"
                f"{' ...' if len(differing) > 8 else ''}"
            )
            # Every rank holds the same values: every rank raises this, not the abort it causes.
            raise mark_detected_by_every_rank(DistributedError(msg))


class Pending:
    """A sum over ranks in flight; :meth:`wait` gives it."""

    def __init__(self, collectives: Collectives, work: Work, values: torch.Tensor) -> None:
        self._collectives = collectives
        self._work = work
        self._values = values
        self._sums: list[float] | None = None

    def wait(self) -> list[float]:
        """The sums (waited for once; later calls return them again)."""
        if self._sums is None:
            self._collectives.wait(self._work, "sum of losses and example counts")
            self._sums = [float(v) for v in self._values.tolist()]
        return self._sums
