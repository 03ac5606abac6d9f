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

from collections.abc import Callable

import torch

from lamploop.batches import BatchStream, source_ended
from lamploop.checks import check_bool, check_callable, check_device, check_int, check_positive
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    StreamExhausted,
    mark_detected_by_every_rank,
)
from lamploop.loop.batch_checks import check_stream
from lamploop.loop.boundary import EpochStart, StepBoundary
from lamploop.loop.forward import Forward, device_of
from lamploop.loop.forward_pass import forward_pass
from lamploop.loop.metric_sums import MetricSums
from lamploop.loop.non_finite import NonFiniteLossPolicy, check_policy
from lamploop.loop.precision import LossScale, Precision, check_precision
from lamploop.loop.profiler import StepProfiler
from lamploop.loop.step_timing import StepTimes
from lamploop.loop.training_pass import StepExtras, TrainingPass
from lamploop.metrics import PassResult
from lamploop.model import SupervisedModel, check_model
from lamploop.sync.channel import SingleProcessChannel, TensorChannel

__all__ = ["ValidationStopped", "one_epoch"]


class ValidationStopped(Exception):
    """A forward-only pass during which a stop was requested on some rank (every rank raises it).

    Attributes:
        result: the pass's mean loss (a :class:`~lamploop.metrics.PassResult` with metrics)
            when every rank's stream ran to its end; ``None`` when a request cut some rank's
            stream short (:mod:`lamploop.loop.stop_aware`): the pass saw only part of its
            batches, and its loss is discarded.
    """

    def __init__(self, result: float | None) -> None:
        super().__init__("validation cut short by a stop request" if result is None else "stop requested")
        self.result = result


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
    start: EpochStart | None = None,
    boundary: StepBoundary | None = None,
    on_non_finite_loss: NonFiniteLossPolicy = "raise",
    max_gradient_norm: float | None = None,
    precision: Precision = "32",
    loss_scale: LossScale | None = None,
    before_step: Callable[[int], object] | None = None,
    after_step: Callable[[int, float | torch.Tensor], object] | None = None,
    step_times: StepTimes | None = None,
    profiler: StepProfiler | None = None,
) -> float:
    """Run one pass over ``batches`` and return the mean loss over every example of every rank.

    Args:
        model: the module and its summed loss.
        batches: this rank's stream of ``(features, target)`` batches.
        channel: the ranks that train together (default: this process alone).
        step_optimizer: called once per step after the gradients are complete,
            for example ``optimizer.step``; required unless ``forward_only``.  With a
            strategy that steps on the root alone (``steps_on_every_rank`` false:
            ``reduce_to_root``), called on rank 0 only: the others receive its parameters.
        forward_only: no gradients, no steps, module in eval mode (validation).
        accumulate_gradient_over_n_batches: batches per optimizer step on each
            rank; an epoch that ends mid-group still steps with what it has.
        device: move each batch there (non-blocking) before the forward pass.
        epoch: only used to say where an error happened.
        start: resume a training pass at a step boundary (see :mod:`lamploop.loop.boundary`).
        boundary: asked at every step boundary whether to checkpoint or stop; a forward-only
            pass asks it once, at its end, whether to stop (the ranks agree in the pass's sum).
        on_non_finite_loss: what a training step with a NaN or infinite loss on any rank
            does: ``"raise"`` (before the optimizer step) or ``"skip_step"`` (every rank
            drops that step; see :mod:`lamploop.loop.non_finite`).  Validation always raises.
        max_gradient_norm: clip the step's gradient to this global L2 norm, after the
            ranks' gradients are summed (so every rank clips the same gradient alike).
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``: forward passes under autocast (see
            :mod:`lamploop.loop.precision`).
        loss_scale: fp16's loss scale, to keep across epochs (default: a new one).
        before_step: called with the step's index in the epoch right before each optimizer
            step (e.g. to set a per-step learning rate; see :mod:`lamploop.schedules.step`).
        after_step: called after each step (also a skipped one) with the step's example
            count and loss sum over every rank; on a single rank the loss sum may be a
            tensor on the device, not yet read (reading it waits for the device: a progress
            reporter reads it now and then, see :mod:`lamploop.reporting.sampler`).
        step_times: add each training step's breakdown (data wait, forward+backward,
            communication wait, optimizer, checkpoint) to these sums (see
            :mod:`lamploop.loop.step_timing`); ``None``: no clock is read.
        profiler: started at the first training step and stepped after every optimizer
            step (see :mod:`lamploop.loop.profiler`); ignored by a forward-only pass.

    Raises:
        ConfigurationError: bad arguments.
        BatchError: an empty or malformed batch (says which epoch, batch and
            rank), or no rank had any batch.
        StreamExhausted: (a BatchError) no rank had a batch to train on because every
            rank's stream of samples ended (see :class:`~lamploop.batches.EndingBatchStream`).
        NonFiniteLossError: a loss was NaN or infinite (says which epoch, step, batch and
            rank), or every step of the pass was skipped for one.
        EpochStopped: the ranks stopped at a step boundary on request.
        ValidationStopped: (forward-only, with a ``boundary``) a stop was requested on some
            rank during the pass; it carries the pass's result, or ``None`` when a request cut
            a stream short.
    """
    k = accumulate_gradient_over_n_batches
    if not isinstance(k, int) or k < 1:
        msg = f"one_epoch: accumulate_gradient_over_n_batches must be an int >= 1, got {k!r}"
        raise ConfigurationError(msg)
    check_stream(batches)
    _check_arguments(model, step_optimizer, forward_only, before_step, after_step)
    _check_channel_and_epoch(channel, epoch)
    policy = check_policy(on_non_finite_loss)
    check_precision(precision)
    if max_gradient_norm is not None:
        check_positive("max_gradient_norm", max_gradient_norm)
    channel = channel if channel is not None else SingleProcessChannel()
    target_device = check_device("one_epoch", device) if device is not None else None
    metrics = MetricSums(list(model.metrics), () if start is None or forward_only else start.metric_sums)
    forward_of = Forward(model, precision, target_device or device_of(model.module))
    if forward_only:
        total, count, metric_totals, stopped = await forward_pass(
            forward_of, batches, channel, target_device, epoch, metrics, boundary
        )
        if stopped is not None:
            if stopped or count == 0:  # cut short: a part of the batches is no validation
                raise ValidationStopped(None)
            raise ValidationStopped(_result(total, count, metrics, metric_totals))
    elif step_optimizer is None:
        msg = "one_epoch: step_optimizer is required when training (forward_only=False)"
        raise ConfigurationError(msg)
    else:
        extras = StepExtras(
            policy=policy,
            forward=forward_of,
            metrics=metrics,
            max_gradient_norm=max_gradient_norm,
            loss_scale=(loss_scale or LossScale()) if precision == "fp16" else None,
            before_step=before_step,
            after_step=after_step,
            step_times=step_times,
            profiler=profiler,
        )
        training = TrainingPass(
            model, channel, step_optimizer, k, target_device, epoch, start or EpochStart(), boundary, extras
        )
        total, count, metric_totals = await training.run(batches)
    if count == 0:
        place = "" if epoch is None else f"epoch {epoch}: "
        if not forward_only and source_ended(batches):
            msg = f"{place}the streams of samples of all {channel.nranks} rank(s) ended: nothing left"
            raise StreamExhausted(msg)
        msg = f"{place}the batch streams of all {channel.nranks} rank(s) were empty"
        raise mark_detected_by_every_rank(BatchError(msg))  # every rank sums the same zero
    return _result(total, count, metrics, metric_totals)


def _check_arguments(
    model: object, step_optimizer: object, forward_only: object, before_step: object, after_step: object
) -> None:
    """What would otherwise fail after the first batch's forward and backward, checked first."""
    check_model("one_epoch", model, trainable=False)  # a forward-only pass needs no parameters
    check_bool("one_epoch: forward_only", forward_only)
    if isinstance(step_optimizer, torch.optim.Optimizer):
        msg = "one_epoch: step_optimizer is an optimizer; pass its step method: step_optimizer=optimizer.step"
        raise ConfigurationError(msg)
    check_callable("one_epoch: step_optimizer", step_optimizer, optional=True)
    check_callable("one_epoch: before_step", before_step, optional=True)
    check_callable("one_epoch: after_step", after_step, optional=True)


def _check_channel_and_epoch(channel: object, epoch: object) -> None:
    if channel is not None and not all(
        hasattr(channel, name) for name in ("rank", "nranks", "gradient_sync", "all_reduce_sum")
    ):
        msg = (
            "one_epoch: channel must be None (one process) or a TensorChannel (rank, nranks, "
            f"gradient_sync, all_reduce_sum; see lamploop.sync.channel), got {type(channel).__name__}"
        )
        raise ConfigurationError(msg)
    if epoch is not None:
        check_int("one_epoch: epoch", epoch, 0)


def _result(total: float, count: float, metrics: MetricSums, metric_totals: list[float]) -> float:
    if metrics:
        return PassResult(total / count, metrics.means(metric_totals))
    return total / count
