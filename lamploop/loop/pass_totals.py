"""What a training and a validation pass share: turns for the event loop, and the end-of-pass sum."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio.lowlevel
import anyio.to_thread

from lamploop.loop.metric_sums import MetricSums
from lamploop.loop.stop_request import SIGNAL_TURNS
from lamploop.sync.channel import TensorChannel

__all__ = ["Yielder", "epoch_totals", "pass_totals"]

_YIELD_EVERY_S = 0.02
"""Heavy compute runs on the event loop's thread; give other tasks (heartbeats)
a turn at least this often."""


class Yielder:
    """Awaited after each batch: lets other tasks run at least every ``_YIELD_EVERY_S``.

    Each time it yields it gives the loop :data:`SIGNAL_TURNS` turns, so that a SIGTERM or
    SIGINT that came meanwhile has set the stop request when the pass next looks at it: a
    pass that never waits (batches in memory, one rank) gives the loop no other turn, and
    the request would otherwise wait for the end of the epoch.  About 60 µs every 20 ms.
    """

    def __init__(self) -> None:
        self._last = time.monotonic()

    async def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= _YIELD_EVERY_S:
            self._last = now
            for _ in range(SIGNAL_TURNS):
                await anyio.lowlevel.checkpoint()


async def epoch_totals(
    channel: TensorChannel, values: list[float], metrics: MetricSums
) -> tuple[float, float, list[float]]:
    """The loss sum, example count and metric totals over all ranks, in one all-reduce."""
    total, global_count, metric_totals, _ = await pass_totals(channel, values, metrics)
    return total, global_count, metric_totals


async def pass_totals(
    channel: TensorChannel, values: list[float], metrics: MetricSums, flags: Sequence[float] = ()
) -> tuple[float, float, list[float], list[float]]:
    """:func:`epoch_totals`, and ``flags`` summed over all ranks in the same all-reduce.

    A validation pass carries its stop request there (and whether its stream was cut short
    by one), as a training step carries it in the step's sum: every rank learns the same.
    """
    summed = values + metrics.totals() + list(flags)
    if channel.nranks == 1:
        totals = channel.all_reduce_sum(summed)
    else:
        # This waits for the slowest rank's whole epoch: keep the event loop (heartbeats) free.
        totals = await anyio.to_thread.run_sync(channel.all_reduce_sum, summed)
    cut = len(totals) - len(flags)
    total, global_count, *metric_totals = totals[:cut]
    return total, global_count, metric_totals, list(totals[cut:])
