"""The one transport of lamploop's three TCP protocols: the control channel, streaming, federated.

Each protocol (:mod:`lamploop.control`, :mod:`lamploop.streaming`, :mod:`lamploop.federated`)
keeps only its own messages and its state machine; what they share is here, once, so that a
fix (a security fix above all) is made once and the differences that remain are meant:

- :mod:`~lamploop.transport.frames` -- the frame decoder: the length checked at the header,
  the pre-authentication limit (:data:`~lamploop.transport.frames.PREAUTH_FRAME_BYTES`) and
  one frame at a time until the peer proved the token;
- :mod:`~lamploop.transport.envelope` -- messages as tagged JSON through a strict converter;
- :mod:`~lamploop.transport.proofs` -- the token, nonces, HMAC proofs;
- :mod:`~lamploop.transport.handshake` -- challenge, hello, welcome or refuse, and the one
  order in which a server checks a hello: token proof, then protocol version, then the
  protocol's own fields;
- :mod:`~lamploop.transport.connection` -- the framed connection (the control channel adds
  heartbeats on top);
- :mod:`~lamploop.transport.listen`, :mod:`~lamploop.transport.strangers`,
  :mod:`~lamploop.transport.tls` -- the listener, the admission of strangers and the log of
  refusals, TLS;
- :mod:`~lamploop.transport.supervisor` -- where a background failure surfaces;
- :mod:`~lamploop.transport.settings` -- the checks of ports, limits and timeouts.

Every failure is a :class:`~lamploop.errors.TransportError`.  See docs/transport.md.

.. versionadded:: 0.3
"""
