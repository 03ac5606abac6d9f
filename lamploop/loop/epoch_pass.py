"""``one_epoch``: one pass over a batch stream, training or forward-only.

The same function runs on every rank; everything that crosses ranks goes
through the :class:`~lamploop.sync.channel.TensorChannel`.  A training step, on
every rank::

    for each of up to k batches (k = accumulate_gradient_over_n_batches):
        loss_sum, n = model(batch); (loss_sum / expected).backward()
    global_n = sum of n over ranks           # also tells when every rank is done
    gradients = reduced sum * expected / global_n   # the strategy's GradientSync.reduce
    step_optimizer(); clear gradients

A rank whose stream is exhausted keeps taking part with zero examples until the
sum over ranks is zero, so uneven streams neither hang nor drop examples.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.lowlevel
import anyio.to_thread
import torch

from lamploop.batches import BatchStream
from lamploop.errors import BatchError, ConfigurationError
from lamploop.loop.batch_checks import check_finite, prepare
from lamploop.model import SupervisedModel
from lamploop.sync.channel import PendingSum, SingleProcessChannel, TensorChannel

__all__ = ["one_epoch"]

_YIELD_EVERY_S = 0.02
"""Heavy compute runs on the event loop's thread; give other tasks (heartbeats)
a turn at least this often."""


class _Yielder:
    def __init__(self) -> None:
        self._last = time.monotonic()

    async def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= _YIELD_EVERY_S:
            self._last = now
            await anyio.lowlevel.checkpoint()


async def _epoch_totals(
    channel: TensorChannel, losses: list[torch.Tensor], count: int
) -> tuple[float, float]:
    """The loss sum and example count over all ranks."""
    values = [_local_sum(losses), count]
    if channel.nranks == 1:
        total, global_count = channel.all_reduce_sum(values)
    else:
        # This waits for the slowest rank's whole epoch: keep the event loop (heartbeats) free.
        total, global_count = await anyio.to_thread.run_sync(channel.all_reduce_sum, values)
    return total, global_count


def _local_sum(losses: list[torch.Tensor]) -> float:
    return float(torch.stack(losses).sum()) if losses else 0.0


class _Scales:
    """``1 / expected`` as a 0-dim tensor like the loss, made once per distinct value."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, expected: int, like: torch.Tensor) -> torch.Tensor:
        key = (expected, like.dtype, like.device)
        scale = self._cache.get(key)
        if scale is None:
            scale = torch.ones((), dtype=like.dtype, device=like.device).div(expected)
            self._cache[key] = scale
        return scale


async def one_epoch(
    *,
    model: SupervisedModel,
    batches: BatchStream,
    channel: TensorChannel | None = None,
    step_optimizer: Callable[[], object] | None = None,
    forward_only: bool = False,
    accumulate_gradient_over_n_batches: int = 1,
    device: torch.device | str | None = None,
    epoch: int | None = None,
) -> float:
    """Run one pass over ``batches`` and return the mean loss over every example of every rank.

    Args:
        model: the module and its summed loss.
        batches: this rank's stream of ``(features, target)`` batches.
        channel: the ranks that train together (default: this process alone).
        step_optimizer: called once per step after the gradients are complete,
            for example ``optimizer.step``; required unless ``forward_only``.
        forward_only: no gradients, no steps, module in eval mode (validation).
        accumulate_gradient_over_n_batches: batches per optimizer step on each
            rank; an epoch that ends mid-group still steps with what it has.
        device: move each batch there (non-blocking) before the forward pass.
        epoch: only used to say where an error happened.

    Raises:
        ConfigurationError: bad arguments.
        BatchError: an empty or malformed batch (says which epoch, batch and
            rank), or no rank had any batch.
        NonFiniteLossError: a loss was NaN or infinite (says which batch).
    """
    k = accumulate_gradient_over_n_batches
    if not isinstance(k, int) or k < 1:
        msg = f"one_epoch: accumulate_gradient_over_n_batches must be an int >= 1, got {k!r}"
        raise ConfigurationError(msg)
    channel = channel if channel is not None else SingleProcessChannel()
    target_device = torch.device(device) if device is not None else None
    if forward_only:
        total, count = await _forward_pass(model, batches, channel, target_device, epoch)
    elif step_optimizer is None:
        msg = "one_epoch: step_optimizer is required when training (forward_only=False)"
        raise ConfigurationError(msg)
    else:
        total, count = await _training_pass(model, batches, channel, step_optimizer, k, target_device, epoch)
    if count == 0:
        place = "" if epoch is None else f"epoch {epoch}: "
        msg = f"{place}the batch streams of all {channel.nranks} rank(s) were empty"
        raise BatchError(msg)
    return total / count


async def _forward_pass(
    model: SupervisedModel,
    batches: BatchStream,
    channel: TensorChannel,
    device: torch.device | None,
    epoch: int | None,
) -> tuple[float, float]:
    model.module.eval()
    rank = channel.rank
    losses: list[torch.Tensor] = []
    count = 0
    yield_now = _Yielder()
    with torch.no_grad():
        async for item in batches:
            index = len(losses)
            features, target = prepare(item, device, epoch, index, rank)
            loss_sum, n = model.loss_sum_and_count(features, target)
            losses.append(loss_sum.detach())
            count += n
            await yield_now()
    total, global_count = await _epoch_totals(channel, losses, count)
    check_finite(losses, total, epoch, rank)
    return total, global_count


async def _training_pass(
    model: SupervisedModel,
    batches: BatchStream,
    channel: TensorChannel,
    step_optimizer: Callable[[], object],
    k: int,
    device: torch.device | None,
    epoch: int | None,
) -> tuple[float, float]:
    module = model.module
    module.train()
    rank, single = channel.rank, channel.nranks == 1
    sync = channel.gradient_sync(module)
    sync.begin_pass()
    losses: list[torch.Tensor] = []
    count = 0
    yield_now = _Yielder()
    stream: AsyncIterator[Any] = aiter(batches)
    upcoming = await anext(stream, None)
    previous_global_count = 0
    scales = _Scales()
    while True:
        group_count = 0
        global_count = 0
        pending: PendingSum | None = None
        # Backprop loss / expected, expected being a guess of the step's global example
        # count that every rank makes alike (also a rank with no batch left): finish()
        # corrects by expected / actual, exactly 1 (no pass) when the guess holds.
        expected = previous_global_count or 1
        for position in range(k):
            if upcoming is None:
                break
            index = len(losses)
            features, target = prepare(upcoming, device, epoch, index, rank)
            upcoming = await anext(stream, None)
            loss_sum, n = model.loss_sum_and_count(features, target)
            if position == 0 and single:
                expected = k * n  # one rank knows its step's count up front
            losses.append(loss_sum.detach())
            group_count += n
            if position == k - 1 or upcoming is None:
                # Every rank starts the count before any gradient bucket, so the
                # collectives pair up in the same order on all ranks.
                pending = None if single else channel.begin_all_reduce_sum([group_count])
                sync.last_backward()
            if expected == 1:
                loss_sum.backward()
            else:
                # Seeding backward with 1/expected gives the gradients of loss_sum / expected
                # bit for bit, without a division node in the graph.
                loss_sum.backward(scales.get(expected, loss_sum))
        if single:
            global_count = group_count
        else:
            if pending is None:  # no batch left here: take part with zero examples
                pending = channel.begin_all_reduce_sum([group_count])
            global_count = int(pending.wait()[0])
        if global_count == 0:
            break
        count += group_count
        previous_global_count = global_count
        sync.reduce(expected / global_count)
        step_optimizer()
        sync.after_step()
        await yield_now()
    sync.end_pass()
    total, global_total = await _epoch_totals(channel, losses, count)
    check_finite(losses, total, epoch, rank)
    return total, global_total
