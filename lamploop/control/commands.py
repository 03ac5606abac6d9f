"""What the control channel carries, and the two interfaces every channel implements.

The root (rank 0) drives training; each follower (ranks ``1..nranks-1``) obeys.
Before the first epoch the root hands every follower the :class:`Rendezvous`, the
address of the ``torch.distributed`` store through which the tensor channel is set up.
Then, about once per epoch, the root broadcasts one :data:`Command`:

- :class:`Train` -- run one training epoch with this learning-rate factor;
- :class:`Valid` -- run one forward-only validation epoch;
- :class:`Stop` -- training is over; the follower's command iterator ends after it.

Beside the commands, any rank may ask every rank to stop after the step in progress (a
SIGTERM reached it): :meth:`ControlRoot.request_stop` / :meth:`ControlFollower.request_stop`,
heard everywhere through ``wait_for_stop_request`` (see :func:`lamploop.stopping.share_stop_requests`).

:class:`ControlRoot` and :class:`ControlFollower` are the whole interface (after lamp's
``DistributedCommunicationRoot`` / ``NonRoot``); :mod:`lamploop.control.local` and
:mod:`lamploop.control.tcp` implement them, and one conformance test runs against both.

.. versionadded:: 0.1
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeAlias, runtime_checkable

import attrs

from lamploop.checks import check_finite
from lamploop.errors import ConfigurationError

__all__ = [
    "Command",
    "ControlFollower",
    "ControlRoot",
    "Rendezvous",
    "Stop",
    "Train",
    "Valid",
    "check_command",
]


_Validator: TypeAlias = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _bad(command: object, attribute: attrs.Attribute[Any], value: object, wanted: str) -> ConfigurationError:
    return ConfigurationError(
        f"{type(command).__name__}.{attribute.name} must be {wanted}, got {value!r:.60}"
    )


def _int_in(low: int, high: float = math.inf) -> _Validator:
    """An int (not a bool) in ``[low, high]``: a command's fields are checked as it is made."""

    def check(command: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _bad(command, attribute, value, f"an int in [{low}, {high}]")

    return check


def _finite(command: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A finite real number: NaN crosses no JSON frame, so neither channel may carry one."""
    check_finite(f"{type(command).__name__}.{attribute.name}", value)


def _text(command: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(command, attribute, value, "a str")


def check_command(command: object) -> None:
    """Raise TypeError unless ``command`` is a :data:`Command` (what either root may broadcast)."""
    if not isinstance(command, (Train, Valid, Stop)):
        msg = f"a command is Train, Valid or Stop, got {type(command).__name__}"
        raise TypeError(msg)


@attrs.frozen
class Train:
    """Run training epoch ``epoch`` with every param group's base lr multiplied by ``lr_factor``."""

    epoch: int = attrs.field(validator=_int_in(0))
    lr_factor: float = attrs.field(validator=_finite)


@attrs.frozen
class Valid:
    """Run a forward-only validation pass after training epoch ``epoch``."""

    epoch: int = attrs.field(validator=_int_in(0))


@attrs.frozen
class Stop:
    """Training is over (``reason`` says why, for logs); nothing follows it."""

    reason: str = attrs.field(validator=_text)


Command: TypeAlias = Train | Valid | Stop
"""One instruction from the root to every follower."""


@attrs.frozen
class Rendezvous:
    """Where the root's ``torch.distributed.TCPStore`` listens; followers join the tensor channel there."""

    host: str = attrs.field(validator=_text)
    port: int = attrs.field(validator=_int_in(0, 65535))


@runtime_checkable
class ControlRoot(Protocol):
    """The root's end of a control channel (rank 0).

    Implementations are async context managers: entering starts whatever runs in the
    background (listening, heartbeats), leaving stops it and closes the followers'
    connections.  Leave after broadcasting :class:`Stop` for a clean end; leaving
    without it tells every follower that the run was aborted.
    """

    async def on_rendezvous_ready(self, rendezvous: Rendezvous) -> None:
        """Wait until all ``nranks - 1`` followers have joined, then send each the rendezvous.

        Raises:
            HandshakeError: not every follower joined within the channel's join timeout
                (the message names the missing ranks and recent refused peers), or a peer
                that proved the shared token does not fit this run (another world size,
                protocol version or model, a rank out of range or taken twice).
            PeerLostError: a follower that had joined went silent or disconnected.
            ControlChannelError: any other failure of the channel.
        """
        ...

    def peers(self) -> tuple[int, ...]:
        """The ranks of the followers that have joined so far, sorted."""
        ...

    async def broadcast(self, command: Command) -> None:
        """Send ``command`` to every follower, in the order of the calls.

        Raises:
            PeerLostError: a follower is gone (the message names its rank).
            ControlChannelError: called before :meth:`on_rendezvous_ready` or after
                :class:`Stop`, or the channel failed otherwise.
        """
        ...

    async def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the step in progress (``reason``: what asked, ``"SIGTERM"``).

        Every follower learns it from :meth:`ControlFollower.wait_for_stop_request`, also one
        that waits for data.  Only the first request (from any rank) counts; later ones and
        those after :class:`Stop` do nothing.  It does not wait for the followers and raises
        nothing: a follower that is gone is reported as usual.
        """
        ...

    async def wait_for_stop_request(self) -> str:
        """Wait until a rank (this one or a follower) asked every rank to stop; its reason."""
        ...


@runtime_checkable
class ControlFollower(Protocol):
    """A follower's end of a control channel (ranks ``1..nranks-1``).

    Implementations are async context managers, like :class:`ControlRoot`.
    """

    async def join(self) -> tuple[Rendezvous, AsyncIterator[Command]]:
        """Join the root; return the rendezvous and the iterator of the root's commands.

        The iterator yields every broadcast command in order and ends right after
        yielding :class:`Stop`.  Iterating raises :class:`PeerLostError` if the root
        goes silent, disconnects or aborts the run before sending ``Stop``.

        Raises:
            HandshakeError: the root refused this follower; the message carries the
                root's reason (wrong token, other model, world size...).
            ControlChannelError: the root could not be reached before the deadline, or
                did not prove the shared token.
            PeerLostError: the root went away before sending the rendezvous.
        """
        ...

    async def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the step in progress (``reason``: what asked, ``"SIGTERM"``).

        The root and every other follower learn it (the root passes it on), as with
        :meth:`ControlRoot.request_stop`; it does not wait and raises nothing.
        """
        ...

    async def wait_for_stop_request(self) -> str:
        """Wait until a rank (this one, the root or another follower) asked every rank to stop; its reason."""
        ...
