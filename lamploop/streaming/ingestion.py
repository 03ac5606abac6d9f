"""``report_ingestion``: a streamed run's intake, sampled for the reporters.

Run it as a task beside the training (on the event loop of the receiver and the buffer)::

    async with anyio.create_task_group() as tg:
        tg.start_soon(report_ingestion, receiver, buffer, reporters)
        state = await lamploop.fit_async(..., reporters=reporters)
        tg.cancel_scope.cancel()

Every ``interval`` seconds it hands the reporters an
:class:`~lamploop.reporting.events.IngestionSampled`: samples and bytes per second, the
mean wait of a put (back-pressure), the buffer's fill and seen-count histogram, duplicates
and refusals.  TensorBoard and Prometheus reporters show them; the others ignore them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from lamploop.reporting.events import IngestionSampled
from lamploop.reporting.reporter import Reporter, report_all
from lamploop.streaming.buffers import StreamBuffer
from lamploop.streaming.receiver import SampleReceiver

__all__ = ["DEFAULT_INGESTION_INTERVAL_S", "report_ingestion"]

DEFAULT_INGESTION_INTERVAL_S = 1.0


class _Window:
    """The receiver's counters at the previous sample."""

    def __init__(self, receiver: SampleReceiver) -> None:
        stats = receiver.stats
        self.at = time.monotonic()
        self.samples, self.bytes, self.put_seconds = stats.samples, stats.bytes, stats.put_seconds


def _sample(
    receiver: SampleReceiver, buffer: StreamBuffer, since: _Window, *, rank: int = 0
) -> tuple[IngestionSampled, _Window]:
    """The event for the window since ``since``, and the window it starts."""
    now = _Window(receiver)
    seconds = max(now.at - since.at, 1e-9)
    stats, buffered = receiver.stats, buffer.stats()
    arrived = now.samples - since.samples
    event = IngestionSampled(
        rank=rank,
        samples=stats.samples,
        samples_per_second=arrived / seconds,
        bytes_per_second=(now.bytes - since.bytes) / seconds,
        put_seconds_mean=(now.put_seconds - since.put_seconds) / arrived if arrived else 0.0,
        fill=buffered.fill,
        capacity=buffered.capacity,
        reads=buffered.read_total,
        evicted=buffered.evicted,
        duplicates=stats.duplicates,
        refusals=stats.refusals,
        seen_histogram=buffer.seen_histogram(),
        closed=buffered.closed,
    )
    return event, now


async def report_ingestion(
    receiver: SampleReceiver,
    buffer: StreamBuffer,
    reporters: Sequence[Reporter],
    *,
    interval: float = DEFAULT_INGESTION_INTERVAL_S,
    rank: int = 0,
) -> None:
    """Report an :class:`IngestionSampled` every ``interval`` seconds until cancelled, and a
    last one when the buffer is closed and drained (then return)."""
    window = _Window(receiver)
    while True:
        await anyio.sleep(interval)
        event, window = _sample(receiver, buffer, window, rank=rank)
        report_all(reporters, event)
        if buffer.ended:
            return
