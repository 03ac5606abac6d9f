"""The forward-only pass of :func:`~lamploop.loop.epoch_pass.one_epoch` (validation).

A sharded model's ranks run every forward together, so its validation stream is padded
(:func:`padded`): a rank whose stream ended runs a stand-in batch while others still have one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import torch

from lamploop.batches import BatchStream
from lamploop.errors import BatchError, mark_detected_by_every_rank
from lamploop.loop.batch_checks import check_finite, prepare
from lamploop.loop.boundary import StepBoundary
from lamploop.loop.forward import Forward
from lamploop.loop.metric_sums import MetricSums
from lamploop.loop.pass_totals import Yielder, pass_totals
from lamploop.loop.stop_aware import ended_by_request, watching
from lamploop.sync.channel import TensorChannel
from lamploop.sync.fsdp import is_sharded

__all__ = ["forward_pass", "padded"]

_STREAM = "validation"  # a forward-only pass's batches, as its errors name them


async def forward_pass(
    forward: Forward,
    batches: BatchStream,
    channel: TensorChannel,
    device: torch.device | None,
    epoch: int | None,
    metrics: MetricSums,
    boundary: StepBoundary | None,
) -> tuple[float, float, list[float], bool | None]:
    """The pass's totals over all ranks; last, ``None`` when no stop was requested, else
    whether some rank's stream was cut short by the request."""
    async with watching(batches):  # one task ends a stop-aware stream's waits on a stop request
        return await _forward_pass(forward, batches, channel, device, epoch, metrics, boundary)


async def _forward_pass(
    forward: Forward,
    batches: BatchStream,
    channel: TensorChannel,
    device: torch.device | None,
    epoch: int | None,
    metrics: MetricSums,
    boundary: StepBoundary | None,
) -> tuple[float, float, list[float], bool | None]:
    """The pass of :func:`forward_pass`."""
    forward.model.module.eval()
    rank = channel.rank
    losses: list[torch.Tensor] = []
    count = 0
    yield_now = Yielder()
    items: AsyncIterator[Any] = aiter(batches)
    if channel.nranks > 1 and is_sharded(forward.model.module):
        items = padded(items, forward, channel, device, epoch)
    async for item in items:
        index = len(losses)
        # Gradient mode is per thread: switched off around the forward only, never across an
        # await, where another task of this event loop (a second model training) may run.
        with torch.no_grad():
            batch = prepare(item, device, epoch, index, rank, _STREAM)
            loss_sum, n, values = forward(batch, epoch, index, rank, _STREAM)
        if metrics:
            metrics.add(values)
        losses.append(loss_sum.detach())
        count += n
        await yield_now()
    local = float(torch.stack(losses).sum()) if losses else 0.0
    # Asked once, here: a request during the pass (or before it) is seen by every rank in the sum.
    requested = boundary is not None and boundary.requests(0)[1]
    cut_short = ended_by_request(batches)
    total, global_count, metric_totals, (stops, cuts) = await pass_totals(
        channel, [local, count], metrics, [float(requested or cut_short), float(cut_short)]
    )
    if cuts > 0:  # the pass's loss is discarded: no check of it
        return total, global_count, metric_totals, True
    check_finite(losses, total, epoch, rank, stream=_STREAM)
    return total, global_count, metric_totals, False if stops > 0 else None


async def padded(
    items: AsyncIterator[Any],
    forward: Forward,
    channel: TensorChannel,
    device: torch.device | None,
    epoch: int | None,
) -> AsyncIterator[Any]:
    """A sharded model's validation stream: every rank runs a forward while any rank has a batch.

    Each forward all-gathers parameters, a collective: before each batch the ranks sum who
    has one (one small all-reduce per batch), and a rank whose stream ended runs its first
    batch again without counting it (``no_grad``; its loss is dropped).
    """
    stand_in: Any = None
    while True:
        item = await anext(items, None)
        lacking = item is None and stand_in is None
        having, stuck = channel.all_reduce_sum([float(item is not None), float(lacking)])
        if having == 0:
            return
        if stuck:
            place = "" if epoch is None else f"epoch {epoch}: "
            msg = (
                f"{place}{int(stuck)} rank(s) have no validation batch while others have: a sharded "
                "model (strategy 'fsdp') runs every forward on every rank, so each rank's stream "
                "needs at least one batch"
            )
            raise mark_detected_by_every_rank(BatchError(msg))
        if item is None:
            with torch.no_grad():
                forward(stand_in, epoch, 0, channel.rank)
            continue
        if stand_in is None:
            stand_in = prepare(item, device, epoch, 0, channel.rank, _STREAM)
        yield item
