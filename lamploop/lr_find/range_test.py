"""The learning-rate range test itself: :func:`lr_find_async` and the blocking :func:`lr_find`.

What it does, and why its suggestion is the rate at the lowest smoothed loss / 10, is in
:mod:`lamploop.lr_find`.  The arguments are all checked before anything runs; the steps run
through :func:`~lamploop.loop.epoch_pass.one_epoch` on a deep copy of the model, under
:func:`torch.random.fork_rng`, so the model passed in and the global generators are left as
they were.

.. versionadded:: 0.3
"""

from __future__ import annotations

import copy

import attrs
import torch

from lamploop.arguments import check_batch_factory, check_model, check_optimizer_factory
from lamploop.batches import BatchContext, BatchStreamFactory
from lamploop.checks import check_int, check_positive
from lamploop.distributed.drive import OptimizerFactory
from lamploop.distributed.placement import checked_device
from lamploop.errors import ConfigurationError, NonFiniteLossError
from lamploop.loop.epoch_pass import one_epoch
from lamploop.loop.forward import device_of
from lamploop.loop.precision import LossScale, Precision, check_precision
from lamploop.lr_find.recorder import StepRecorder, batches_until_done, learning_rates
from lamploop.lr_find.result import LrFindResult
from lamploop.lr_find.suggestions import min_loss_suggestion
from lamploop.model import SupervisedModel
from lamploop.stopping import blocking

__all__ = ["lr_find", "lr_find_async"]


def _check_rate(name: str, value: object) -> float:
    return check_positive(f"lr_find: {name}", value)


async def lr_find_async(
    *,
    model: SupervisedModel,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchStreamFactory,
    min_lr: float = 1e-7,
    max_lr: float = 10.0,
    num_steps: int = 100,
    divergence_threshold: float | None = 4.0,
    smoothing: float = 0.9,
    accumulate_gradient_over_n_batches: int = 1,
    precision: Precision = "32",
    max_gradient_norm: float | None = None,
    device: torch.device | str | None = None,
) -> LrFindResult:
    """Run the learning-rate range test on a copy of ``model``; what it measured and suggests.

    Args:
        model: the :class:`~lamploop.SupervisedModel`; its module is deep-copied (and moved
            to ``device``), and the copy trained: ``model`` itself is not changed.
        optimizer_factory: ``params -> torch.optim.Optimizer``, as for :func:`lamploop.fit`;
            called once, on the copy's parameters.  Every parameter group's ``lr`` is set
            before each step (their own rates are overridden); the rest (momentum, weight
            decay, Adam's betas) is the factory's.
        train_batches: the training :data:`~lamploop.BatchStreamFactory`, asked for epoch
            0, 1, ... (rank 0 of 1) until ``num_steps`` steps are taken.
        min_lr, max_lr: the first and the last step's learning rate.
        num_steps: the optimizer steps at most (the test stops earlier when the loss diverges).
        divergence_threshold: stop once the smoothed loss exceeds this many times the best
            smoothed loss so far (``None``: never stop early, but on a NaN or infinite loss).
        smoothing: the exponential smoothing of the recorded loss, in ``[0, 1)`` (0: none).
        accumulate_gradient_over_n_batches, precision, max_gradient_norm: as in
            :func:`lamploop.fit` (a step is one optimizer step).
        device: where to train the copy (default: where the model's parameters are).

    Every argument is checked before anything runs.

    Raises:
        lamploop.errors.ConfigurationError: a bad argument (``min_lr >= max_lr``,
            ``num_steps < 2``...), or the model cannot be deep-copied.
        lamploop.errors.NonFiniteLossError: the loss was NaN or infinite at the very first step.
        lamploop.errors.BatchError: a malformed batch, or a stream with no batch.
    """
    check_model("lr_find", model)
    check_optimizer_factory("lr_find", optimizer_factory)
    check_batch_factory("lr_find", "train_batches", train_batches)
    low, high = _check_rate("min_lr", min_lr), _check_rate("max_lr", max_lr)
    if low >= high:
        msg = f"lr_find: min_lr must be below max_lr, got min_lr={min_lr!r} and max_lr={max_lr!r}"
        raise ConfigurationError(msg)
    steps = check_int("lr_find: num_steps", num_steps, 2)
    threshold = None
    if divergence_threshold is not None:
        threshold = check_positive("lr_find: divergence_threshold", divergence_threshold)
        if threshold <= 1:
            msg = f"lr_find: divergence_threshold must be > 1 (or None), got {divergence_threshold!r}"
            raise ConfigurationError(msg)
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing < 1:
        msg = f"lr_find: smoothing must be a number in [0, 1), got {smoothing!r}"
        raise ConfigurationError(msg)
    k = check_int("lr_find: accumulate_gradient_over_n_batches", accumulate_gradient_over_n_batches, 1)
    check_precision(precision)
    if max_gradient_norm is not None:
        check_positive("lr_find: max_gradient_norm", max_gradient_norm)
    target = _device(device, model.module)

    try:
        module = copy.deepcopy(model.module)
    except Exception as exc:
        msg = (
            f"lr_find: trains a deep copy of the model, and copy.deepcopy failed: {type(exc).__name__}: {exc}"
        )
        raise ConfigurationError(msg) from exc
    module.to(target)
    work = attrs.evolve(model, module=module, metrics={})  # metrics cost time and say nothing here
    recorder = StepRecorder(learning_rates(low, high, steps), float(smoothing), threshold)
    cuda = (
        [target.index if target.index is not None else torch.cuda.current_device()]
        if target.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=cuda):
        optimizer = optimizer_factory(module.parameters())

        def set_rate(_step: int) -> None:
            for group in optimizer.param_groups:
                group["lr"] = recorder.rate

        def step_while_testing() -> None:
            # The pass reads a batch ahead: a step begun before the loss diverged ends after;
            # it is not taken (the result has one entry per step taken).
            if not recorder.done:
                optimizer.step()

        budget = [steps * k]
        loss_scale = LossScale() if precision == "fp16" else None
        epoch = 0
        while not recorder.done and budget[0] > 0:
            stream = batches_until_done(train_batches(BatchContext(epoch=epoch)), recorder, budget)
            try:
                await one_epoch(
                    model=work,
                    batches=stream,
                    step_optimizer=step_while_testing,
                    accumulate_gradient_over_n_batches=k,
                    device=target,
                    epoch=epoch,
                    precision=precision,
                    loss_scale=loss_scale,
                    max_gradient_norm=max_gradient_norm,
                    before_step=set_rate,
                    after_step=recorder.record,
                )
            except NonFiniteLossError:
                if not recorder.raw:
                    raise
                recorder.diverged = True
            epoch += 1
    taken = len(recorder.raw)
    lrs = tuple(recorder.schedule[:taken])
    losses = tuple(recorder.smoothed)
    return LrFindResult(
        lrs=lrs,
        losses=losses,
        raw_losses=tuple(recorder.raw),
        suggestion=min_loss_suggestion(lrs, losses),
        diverged=recorder.diverged,
    )


def _device(device: torch.device | str | None, module: torch.nn.Module) -> torch.device:
    if device is None:
        return device_of(module)
    return checked_device(device, "lr_find")


lr_find = blocking(lr_find_async)
