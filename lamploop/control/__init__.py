"""The control channel: the root's per-epoch commands to its followers.

Two implementations of one interface (:class:`ControlRoot` / :class:`ControlFollower`):

- :func:`local_control` -- every rank is a task in one process (anyio memory streams);
- :class:`TcpControlRoot` / :class:`TcpControlFollower` -- one process per rank, over TCP,
  with an authenticated handshake and heartbeats.

See ``docs/control-channel.md``.

.. versionadded:: 0.1
"""

from lamploop.control.commands import Command, ControlFollower, ControlRoot, Rendezvous, Stop, Train, Valid
from lamploop.control.local import LocalControlFollower, LocalControlRoot, local_control
from lamploop.control.settings import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S
from lamploop.control.tcp import TcpControlFollower, TcpControlRoot
from lamploop.control.wire import PROTOCOL_VERSION

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "PROTOCOL_VERSION",
    "Command",
    "ControlFollower",
    "ControlRoot",
    "LocalControlFollower",
    "LocalControlRoot",
    "Rendezvous",
    "Stop",
    "TcpControlFollower",
    "TcpControlRoot",
    "Train",
    "Valid",
    "local_control",
]
