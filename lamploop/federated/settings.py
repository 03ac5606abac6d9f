"""The settings of both ends of a federated run: the aggregator's and a node's, checked once.

:class:`AggregatorSettings` says how many rounds, how many nodes and how long every wait of
the aggregator may last; :class:`NodeSettings` how a node reaches the aggregator and how long
it waits.  Both are frozen; every check names the field and the bad value and raises
:class:`~lamploop.errors.ConfigurationError` (the checks of :mod:`lamploop.checks`).

.. versionadded:: 0.3
"""

from __future__ import annotations

from pathlib import Path

import attrs

from lamploop.checks import check_int, check_path, int_at_least, seconds
from lamploop.federated.wire import DEFAULT_MAX_FRAME_BYTES


def _optional_path(value: object) -> Path | None:
    return None if value is None else check_path("AggregatorSettings: checkpoint_dir", value)


__all__ = ["AggregatorSettings", "NodeSettings"]


@attrs.frozen(kw_only=True)
class AggregatorSettings:
    """How many rounds, how many nodes, and how long every wait may last.

    Attributes:
        rounds: rounds in all (a resumed run counts the rounds done already).
        min_nodes: a round needs at least this many answers.
        expected_nodes: before the first round, wait for this many nodes (default ``min_nodes``).
        join_timeout: the longest wait for those nodes before a round.
        round_timeout: the longest wait for a round's answers.
        round_attempts: how many times a round is sent before too few answers fail the run.
        handshake_timeout: a connection must prove the token within this.
        max_pending_handshakes: connections handshaking at once; past it the oldest is dropped.
        max_frame_bytes: the largest frame accepted from a node that proved the token.
        checkpoint_dir: checkpoint after every round there, and resume from there (``None``: no).
        keep_last: round checkpoints kept.
    """

    rounds: int = attrs.field(validator=int_at_least(None, 0))
    min_nodes: int = attrs.field(default=1, validator=int_at_least(None, 1))
    expected_nodes: int | None = None
    join_timeout: float = attrs.field(default=60.0, validator=seconds)
    round_timeout: float = attrs.field(default=600.0, validator=seconds)
    round_attempts: int = attrs.field(default=1, validator=int_at_least(None, 1))
    handshake_timeout: float = attrs.field(default=10.0, validator=seconds)
    max_pending_handshakes: int = attrs.field(default=64, validator=int_at_least(None, 1))
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_FRAME_BYTES, validator=int_at_least(None, 1))
    checkpoint_dir: Path | None = attrs.field(default=None, converter=_optional_path)
    keep_last: int = attrs.field(default=3, validator=int_at_least(None, 1))

    def __attrs_post_init__(self) -> None:
        if self.expected_nodes is not None:
            check_int("expected_nodes", self.expected_nodes, self.min_nodes)


@attrs.frozen(kw_only=True)
class NodeSettings:
    """How a node reaches the aggregator and how long it waits.

    Attributes:
        connect_timeout: keep trying to reach the aggregator this long (at the start, and
            after a lost connection) before giving up.
        retry_interval: seconds between connection attempts.
        handshake_timeout: the TLS and token handshake must finish within this.
        idle_timeout: once joined, the longest wait for the aggregator's next message.
        max_frame_bytes: the largest frame accepted from the aggregator.
    """

    connect_timeout: float = attrs.field(default=60.0, validator=seconds)
    retry_interval: float = attrs.field(default=0.2, validator=seconds)
    handshake_timeout: float = attrs.field(default=10.0, validator=seconds)
    idle_timeout: float = attrs.field(default=3600.0, validator=seconds)
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_FRAME_BYTES)

    def __attrs_post_init__(self) -> None:
        check_int("max_frame_bytes", self.max_frame_bytes, 1)
