"""The arguments both ends of the TCP control channel take: checked once, then held as small frozen values.

:class:`Run` is what every rank of one run must agree on (the handshake compares it),
:class:`Link` how every connection behaves.  Every check names the argument and the bad
value and raises :class:`~lamploop.errors.ConfigurationError` (the transport's checks,
:mod:`lamploop.transport.settings`).
"""

from __future__ import annotations

from typing import Final

import attrs

from lamploop.errors import ConfigurationError
from lamploop.modelspec import ModelSpec
from lamploop.transport.proofs import check_token
from lamploop.transport.settings import check_int_in, check_seconds_each

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "Link",
    "Run",
]

_MIN_FRAME_BYTES = 1024

DEFAULT_HEARTBEAT_INTERVAL_S: Final = 0.5
"""Seconds between two heartbeats on a joined connection, both ways."""

DEFAULT_HEARTBEAT_TIMEOUT_S: Final = 4.0
"""Seconds of silence after which a joined peer is lost.

A dead, frozen or cut-off rank ends every survivor's run about this long after its last
heartbeat: within 5 s of the fault (docs/reliability.md).  The heartbeats run on the event
loop, apart from compute, so only a loop starved for 3.5 s (eight heartbeats missed) is
taken for lost: a step that computes for a minute is not.  What does starve it is a thread
that holds the GIL for long (a checkpoint serializing gigabytes, a first optimizer step
importing ``torch._dynamo``) on an overloaded machine: up to 1.3 s was measured with 2 busy
processes per core (``benchmarks/stress_liveness.py``)."""


@attrs.frozen
class Run:
    """What every rank of one run shares; a follower that does not match is refused.

    Attributes:
        nranks: the world size, root included.
        token: the shared secret, as bytes.
        model_spec: this rank's model spec.
    """

    nranks: int
    token: bytes
    model_spec: ModelSpec

    @classmethod
    def checked(cls, nranks: int, token: bytes | str, model_spec: ModelSpec) -> Run:
        """Check ``nranks``, ``model_spec`` and ``token``, in that order.

        Raises:
            ConfigurationError: an argument is out of range (names it).
        """
        check_int_in("nranks", nranks, 1)
        if not isinstance(model_spec, ModelSpec):
            msg = (
                f"model_spec must be a ModelSpec (from lamploop.model_spec), got {type(model_spec).__name__}"
            )
            raise ConfigurationError(msg)
        return cls(nranks, check_token(token), model_spec)


@attrs.frozen
class Link:
    """How a connection behaves; the same for every connection of a channel.

    Attributes:
        heartbeat_interval: seconds between heartbeats.
        heartbeat_timeout: a peer silent this long is lost, and a send may take this long.
        max_frame_bytes: the largest frame body sent or accepted.
    """

    heartbeat_interval: float
    heartbeat_timeout: float
    max_frame_bytes: int

    @classmethod
    def checked(cls, heartbeat_interval: float, heartbeat_timeout: float, max_frame_bytes: int) -> Link:
        """Check the heartbeat's seconds (the timeout must exceed the interval), then ``max_frame_bytes``.

        Raises:
            ConfigurationError: an argument is out of range (names it).
        """
        check_seconds_each(heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout)
        if heartbeat_timeout <= heartbeat_interval:
            msg = (
                f"heartbeat_timeout={heartbeat_timeout!r} must exceed "
                f"heartbeat_interval={heartbeat_interval!r}"
            )
            raise ConfigurationError(msg)
        check_int_in("max_frame_bytes", max_frame_bytes, _MIN_FRAME_BYTES)
        return cls(heartbeat_interval, heartbeat_timeout, max_frame_bytes)
