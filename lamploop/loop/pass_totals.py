"""What a training and a validation pass share: turns for the event loop, and the end-of-pass sum."""

from __future__ import annotations

import time

import anyio.lowlevel
import anyio.to_thread

from lamploop.loop.metric_sums import MetricSums
from lamploop.sync.channel import TensorChannel

__all__ = ["Yielder", "epoch_totals"]

_YIELD_EVERY_S = 0.02
"""Heavy compute runs on the event loop's thread; give other tasks (heartbeats)
a turn at least this often."""


class Yielder:
    """Awaited after each batch: lets other tasks run at least every ``_YIELD_EVERY_S``."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    async def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= _YIELD_EVERY_S:
            self._last = now
            await anyio.lowlevel.checkpoint()


async def epoch_totals(
    channel: TensorChannel, values: list[float], metrics: MetricSums
) -> tuple[float, float, list[float]]:
    """The loss sum, example count and metric totals over all ranks, in one all-reduce."""
    values = values + metrics.totals()
    if channel.nranks == 1:
        total, global_count, *metric_totals = channel.all_reduce_sum(values)
    else:
        # This waits for the slowest rank's whole epoch: keep the event loop (heartbeats) free.
        total, global_count, *metric_totals = await anyio.to_thread.run_sync(channel.all_reduce_sum, values)
    return total, global_count, metric_totals
