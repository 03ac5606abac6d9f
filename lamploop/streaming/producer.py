"""The producers' end of the streaming transport: send samples to a trainer, resend what it did not take.

:class:`AsyncProducer` numbers the samples it is given (seq 0, 1, 2, ... from
``start_seq``), keeps each until the receiver acknowledges it, and holds the caller back
(``send`` waits) when its resend window is full: ``resend_window`` samples unacknowledged,
or by default up to 256 that hold at most 4 MiB together, and 64 whatever their size.
When the connection drops it reconnects with backoff, and the receiver's Welcome says which
seq it holds up to: everything after it is resent, in order.  :class:`BlockingProducer` is
the same for plain (synchronous) simulation codes: it runs an event loop on a thread of its
own (:func:`anyio.from_thread.start_blocking_portal`), to which the caller's thread hands its
samples a chunk at a time.  Samples sent in a row leave in batches (one ``"samples"`` frame,
cut once it holds 256 KiB and 32 samples, or 2 MiB, within the receiver's frame limit).

A producer knows one address.  When the trainer has several ranks, the receiver there may
answer with a :class:`~lamploop.streaming.wire.Redirect` to the rank's receiver assigned to
this producer: the producer connects there and goes on (and comes back to the first address
whenever the assigned one cannot be reached).

A producer whose process was killed and restarted may simply start again from 0: the
receiver drops every sample at or below what it already holds, by seq (the producer learns
that number in the Welcome and does not even send those).  This assumes the restarted
producer makes the same samples in the same order, as a deterministic simulation does.  Or
it may be given ``start_seq=``: the first seq the receiver had not acknowledged (say a saved
:attr:`AsyncProducer.acknowledged_seq` + 1); a later one would leave a gap, which the
receiver refuses, and the producer fails saying which seqs are missing.

The two live in :mod:`lamploop.streaming.async_producer` and
:mod:`lamploop.streaming.blocking_producer`; their numbering and resend window is the
sans-IO :class:`~lamploop.streaming.outbox.Outbox`, their side of the handshake
:mod:`lamploop.streaming.producer_handshake`.  This module names them all.

.. versionadded:: 0.2
"""

from lamploop.streaming.async_producer import HANDOVER_BYTES, HANDOVER_SAMPLES, AsyncProducer, ProducerStats
from lamploop.streaming.blocking_producer import (
    BLOCKING_AHEAD,
    BLOCKING_AHEAD_BYTES,
    HANDOVER_DELAY_S,
    BlockingProducer,
)

__all__ = [
    "BLOCKING_AHEAD",
    "BLOCKING_AHEAD_BYTES",
    "HANDOVER_BYTES",
    "HANDOVER_DELAY_S",
    "HANDOVER_SAMPLES",
    "AsyncProducer",
    "BlockingProducer",
    "ProducerStats",
]
