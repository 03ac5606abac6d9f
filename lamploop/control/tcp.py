"""The TCP control channel: a root that listens, followers that connect (anyio).

Every connection starts with a versioned, mutually authenticated handshake::

    root                                            follower (rank r)
     | -- Challenge(protocol_version, root nonce) --> |
     | <-- Hello(version, rank, nranks, model spec,   |
     |           follower nonce, proof) ------------- |   proof = HMAC(token, root nonce + hello)
     | -- Welcome(proof) or Refuse(reason) ---------> |   proof = HMAC(token, both nonces + hello)
     | <========== Heartbeat, both ways ===========>  |
     | -- Rendezvous --> ... Train / Valid ... -- Stop --> |   then both sides close

The root checks the follower's proof first, then its protocol version, then whether it
fits the run: the transport's one order of checks (:mod:`lamploop.transport.handshake`).
A peer without the proof (a stranger, a wrong
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

This module is the public entry point; the work is done in modules of one job each:

- :mod:`lamploop.control.tcp_root` -- :class:`TcpControlRoot`: listen, admit, broadcast;
- :mod:`lamploop.control.root_admission` -- who gets in: the root's handshake with each
  connection, strangers and followers that do not fit refused;
- :mod:`lamploop.control.tcp_follower` -- :class:`TcpControlFollower`: connect with backoff,
  join, the commands iterator;
- :mod:`lamploop.control.handshake` -- both sides of the handshake above, and what makes a
  follower fit the run;
- :mod:`lamploop.control.connection` -- the transport's framed connection with heartbeats and
  a half-close;
- :mod:`lamploop.control.settings` -- the arguments both ends share, checked.

The listener, TLS, the admission of strangers and the supervisor of background failures are
the transport's (:mod:`lamploop.transport`), shared with the streaming and federated protocols.

.. versionadded:: 0.1
"""

from lamploop.control.tcp_follower import MAX_UNREAD_COMMANDS, TcpControlFollower
from lamploop.control.tcp_root import TcpControlRoot

__all__ = ["MAX_UNREAD_COMMANDS", "TcpControlFollower", "TcpControlRoot"]
