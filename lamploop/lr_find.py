"""The learning-rate range test (Leslie Smith's; Lightning's ``Tuner.lr_find``, Ignite's ``FastaiLRFinder``).

:func:`lr_find` trains a deep copy of the model for up to ``num_steps`` optimizer steps,
the learning rate growing exponentially from ``min_lr`` to ``max_lr`` (step ``i`` of ``n``
at ``min_lr * (max_lr / min_lr) ** (i / (n - 1))``, every parameter group alike), and
records each step's mean training loss and its exponentially smoothed value
(``smoothing * previous + (1 - smoothing) * loss``, bias-corrected, as fastai and Lightning
do; ``smoothing=0.9`` by default, a window of about 10 steps, where their 0.98 lags the
loss by tens of steps).  It stops early once the smoothed loss exceeds
``divergence_threshold`` (4) times the best one so far, or the loss is NaN or infinite.

The suggestion is fastai's original rule, Smith's "an order of magnitude below the
minimum": the learning rate at the lowest smoothed loss, divided by 10
(:func:`min_loss_suggestion`).  Lightning's rule, the steepest descent of the smoothed loss
(:func:`steepest_descent`), is there to compare; it is not the default because, measured on
the digits in 8 configurations (an MLP with SGD, SGD with momentum and Adam, batch sizes
16 to 64, each against a sweep of 3-epoch runs at learning rates half a decade apart), it
landed 3.4x to 100x above the sweep's best rate in 6 of them with Lightning's smoothing of
0.98 (the lagging smoothed loss falls fastest where the loss is at its lowest or already
diverging), where "minimum / 10" stayed within 3x in 7 of 8 (0.44x to 1.4x; the eighth
4.3x below, where the sweep's two best rates were nearly tied).  ``tests/test_lr_find.py``
checks two of those configurations.  The suggestion is a starting point for a constant
learning rate or the start of a decaying schedule; a one-cycle schedule's maximum is nearer
the minimum itself.

The steps run through :func:`lamploop.one_epoch` on the copy, with the same gradient
accumulation, precision and clipping as a run's: a step is an optimizer step, of
``accumulate_gradient_over_n_batches`` batches.  The model passed in (its parameters,
buffers, gradients and train/eval mode), any optimizer of it, and the global random number
generators (torch's CPU one, and the CUDA device's where the copy trains) are left as they
were, bit for bit: the copy and its optimizer are dropped at the end.  The copy needs memory
for a second model and its optimizer state.

.. versionadded:: 0.3
"""

from __future__ import annotations

import copy
import io
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import torch

from lamploop.arguments import check_batch_factory, check_model, check_optimizer_factory
from lamploop.batches import Batch, BatchContext, BatchStream, BatchStreamFactory
from lamploop.checks import check_int, check_positive
from lamploop.distributed.drive import OptimizerFactory
from lamploop.errors import ConfigurationError, MissingDependencyError, NonFiniteLossError
from lamploop.loop.epoch_pass import one_epoch
from lamploop.loop.forward import device_of
from lamploop.loop.precision import LossScale, Precision, check_precision
from lamploop.model import SupervisedModel
from lamploop.stopping import blocking
from lamploop.strict_json import write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LrFindResult", "lr_find", "lr_find_async", "min_loss_suggestion", "steepest_descent"]

SKIP_BEGIN: Final = 10
"""Steps left out at the start when suggesting (the smoothed loss is still settling there)."""

SKIP_END: Final = 1
"""Steps left out at the end when suggesting (the step that diverged)."""

_INSTALL: Final = 'pip install "lamploop[plot]"'


def min_loss_suggestion(
    lrs: tuple[float, ...] | list[float], losses: tuple[float, ...] | list[float], *, divisor: float = 10.0
) -> float | None:
    """The learning rate of ``lrs`` at the lowest finite loss of ``losses``, divided by ``divisor``.

    ``None`` when fewer than 2 finite losses were recorded.

    >>> min_loss_suggestion([0.01, 0.1, 1.0, 10.0], [2.0, 1.9, 1.0, 3.5])
    0.1
    """
    finite = [(loss, i) for i, loss in enumerate(losses) if math.isfinite(loss)]
    if len(finite) < 2:
        return None
    return lrs[min(finite)[1]] / divisor


def steepest_descent(
    lrs: tuple[float, ...] | list[float],
    losses: tuple[float, ...] | list[float],
    *,
    skip_begin: int = SKIP_BEGIN,
    skip_end: int = SKIP_END,
) -> float | None:
    """The learning rate of ``lrs`` where ``losses`` fall fastest against ``log(lr)`` (Lightning's rule).

    The first ``skip_begin`` and last ``skip_end`` points are left out; the slope at each
    point is a central difference (one-sided at the ends), as ``numpy.gradient``'s.  ``None``
    when fewer than 2 finite points are left.

    >>> steepest_descent([0.01, 0.1, 1.0, 10.0], [2.0, 1.9, 1.0, 0.95], skip_begin=0, skip_end=0)
    0.1
    """
    points = [
        (math.log(lrs[i]), losses[i], i)
        for i in range(skip_begin, len(lrs) - skip_end)
        if math.isfinite(losses[i])
    ]
    if len(points) < 2:
        return None
    steepest, at = math.inf, points[0][2]
    for j, (_, _, index) in enumerate(points):
        before, after = points[max(j - 1, 0)], points[min(j + 1, len(points) - 1)]
        slope = (after[1] - before[1]) / (after[0] - before[0])
        if slope < steepest:
            steepest, at = slope, index
    return lrs[at]


@attrs.frozen
class LrFindResult:
    """What :func:`lr_find` measured, one entry per optimizer step taken.

    Attributes:
        lrs: the learning rate of each step.
        losses: the smoothed training loss after each step (what the suggestion and the
            divergence test look at).
        raw_losses: each step's mean training loss per example.
        suggestion: the suggested learning rate (:func:`min_loss_suggestion` of ``losses``:
            the rate at the lowest smoothed loss / 10), ``None`` when too few steps were taken.
        diverged: whether the test stopped early because the loss diverged (else it took
            every step up to ``max_lr``).
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    raw_losses: tuple[float, ...]
    suggestion: float | None
    diverged: bool

    def plot(
        self,
        path: str | os.PathLike[str],
        *,
        title: str = "learning-rate range test",
        figsize: tuple[float, float] = (8.0, 5.0),
        dpi: float = 120,
    ) -> Path:
        """Draw the losses against the learning rate (log scale) and the suggestion into a PNG; its path.

        The file is written atomically (a temporary sibling renamed over it).

        Raises:
            lamploop.errors.MissingDependencyError: matplotlib is not installed (the message
                says ``pip install "lamploop[plot]"``).
        """
        figure = _new_figure(figsize, dpi)
        axes = figure.add_subplot()
        axes.set_title(title)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("training loss")
        axes.grid(True, alpha=0.3)
        axes.plot(self.lrs, self.raw_losses, color="#bbbbbb", linewidth=1, label="loss")
        axes.plot(self.lrs, self.losses, color="#1f77b4", linewidth=2, label="smoothed loss")
        if self.suggestion is not None:
            lowest = min(range(len(self.losses)), key=lambda i: self.losses[i])
            axes.plot(
                [self.lrs[lowest]],
                [self.losses[lowest]],
                marker="o",
                color="#7f7f7f",
                linestyle="none",
                label=f"lowest smoothed loss, at {self.lrs[lowest]:.3g}",
            )
            axes.axvline(
                self.suggestion,
                color="#d62728",
                linestyle="--",
                linewidth=1.5,
                label=f"suggestion {self.suggestion:.3g} (that / 10)",
            )
        finite = [v for v in (*self.losses, *self.raw_losses) if math.isfinite(v)]
        if finite:  # down to the lowest loss, up to the smoothed curve's top (a raw spike is cut off)
            low, high = min(finite), max(v for v in self.losses if math.isfinite(v))
            margin = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
            axes.set_ylim(low - margin, high + 2 * margin)
        axes.legend(loc="best")
        figure.tight_layout()
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=dpi)
        target = Path(path)
        write_atomically(target, png.getvalue())
        return target


def _new_figure(figsize: tuple[float, float], dpi: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        msg = f"plotting needs matplotlib, which is not installed ({e}); install it with: {_INSTALL}"
        raise MissingDependencyError(msg) from e
    figure = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(figure)
    return figure


def _check_rate(name: str, value: object) -> float:
    return check_positive(f"lr_find: {name}", value)


@attrs.define
class _Recorder:
    """The steps' learning rates and losses so far; says when the test is done."""

    schedule: list[float]
    smoothing: float
    threshold: float | None
    raw: list[float] = attrs.Factory(list)
    smoothed: list[float] = attrs.Factory(list)
    average: float = 0.0
    best: float = math.inf
    diverged: bool = False

    @property
    def done(self) -> bool:
        return self.diverged or len(self.raw) >= len(self.schedule)

    @property
    def rate(self) -> float:
        """The learning rate of the step about to be taken."""
        return self.schedule[min(len(self.raw), len(self.schedule) - 1)]

    def record(self, count: int, loss_sum: float | torch.Tensor) -> None:
        if self.done:  # a step begun before the test ended (its first batch was read ahead)
            return
        loss = float(loss_sum) / count if count else math.nan
        if not math.isfinite(loss):
            self.diverged = True
            return
        self.average = self.smoothing * self.average + (1 - self.smoothing) * loss
        smoothed = self.average / (1 - self.smoothing ** (len(self.raw) + 1))
        self.raw.append(loss)
        self.smoothed.append(smoothed)
        if self.threshold is not None and len(self.raw) > 1 and smoothed > self.threshold * self.best:
            self.diverged = True
        self.best = min(self.best, smoothed)


async def _batches_until_done(
    stream: BatchStream, recorder: _Recorder, budget: list[int]
) -> AsyncIterator[Batch]:
    """``stream``'s batches while the test goes on, ``budget[0]`` of them at most (counted down)."""
    iterator = aiter(stream)
    try:
        while budget[0] > 0 and not recorder.done:
            item = await anext(iterator, None)
            if item is None:
                return
            budget[0] -= 1
            yield item
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


def _learning_rates(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    ratio = max_lr / min_lr
    return [min_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]


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
    recorder = _Recorder(_learning_rates(low, high, steps), float(smoothing), threshold)
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

        budget = [steps * k]
        loss_scale = LossScale() if precision == "fp16" else None
        epoch = 0
        while not recorder.done and budget[0] > 0:
            stream = _batches_until_done(train_batches(BatchContext(epoch=epoch)), recorder, budget)
            try:
                await one_epoch(
                    model=work,
                    batches=stream,
                    step_optimizer=optimizer.step,
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
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"lr_find: device {device!r} is not a device torch knows ({exc})"
        raise ConfigurationError(msg) from None
    if target.type == "cuda" and not torch.cuda.is_available():
        msg = f"lr_find: device={str(device)!r}, but CUDA is not available here; pass device='cpu'"
        raise ConfigurationError(msg)
    return target


lr_find = blocking(lr_find_async)
lr_find.__name__ = lr_find.__qualname__ = "lr_find"
lr_find.__doc__ = (lr_find_async.__doc__ or "").replace(
    "Run the learning-rate range test",
    "Run the learning-rate range test (blocking: runs :func:`lr_find_async` in a new event loop, on a "
    "thread of its own when called inside one, as in a notebook)",
    1,
)
