"""``fit``: the common case in one call.

It wires :func:`drive_distributed_training` (which runs :func:`lamploop.epochs` and
:func:`lamploop.one_epoch`), checkpoints with ``keep_last``, and resuming from the latest
checkpoint, so that a restarted job carries on by itself.

>>> import torch, lamploop
>>> x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
>>> module = torch.nn.Linear(3, 2)
>>> state = lamploop.fit(
...     model=lamploop.SupervisedModel(module),
...     optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
...     train_batches=lamploop.tensor_batches(x, y, batch_size=16),
...     max_epochs=2,
... )
>>> state.epoch
2
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lamploop.arguments import (
    check_batch_factory,
    check_checkpointing,
    check_early_stopping,
    check_fit_keywords,
    check_model,
    check_optimizer_factory,
    check_reporters,
    check_selection_needs_validation,
    check_sharded_strategy,
    check_stateful_strategy,
)
from lamploop.averaging import Averaging, check_averaging_starts
from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint.extras import CheckpointExtra
from lamploop.checkpoint.resume import resume_root
from lamploop.checkpoint.save import check_keep_last
from lamploop.distributed.drive import OptimizerFactory
from lamploop.distributed.launch import LaunchEnv, default_launch_command, noting_failure_for_the_root
from lamploop.distributed.placement import AUTO_DEVICE, place
from lamploop.distributed.rank_extras import SYNC_EXTRA
from lamploop.fit.ranks import Heartbeat, Job, default_reporter, follow, lead, resumed_epoch
from lamploop.loop.epoch_driver import ALL_EPOCHS
from lamploop.loop.non_finite import NonFiniteLossPolicy
from lamploop.loop.precision import Precision
from lamploop.loop.profiler import Profile
from lamploop.loop.selection import SelectionMode, check_selection_metric
from lamploop.loop.stop_aware import stop_aware_batches
from lamploop.model import SupervisedModel
from lamploop.modelspec import model_spec
from lamploop.reporting.reporter import Reporter, close_all, start_all
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.schedules.step import StepSchedule
from lamploop.schedules.torch_scheduler import LrSchedulerFactory, SchedulerInterval
from lamploop.settings import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    TrainingSettings,
)
from lamploop.state import LoopState
from lamploop.stopping import (
    blocking,
    stop_if_requested_before_training,
    stop_on_signals,
    stop_request,
    stopped_at_once,
)

__all__ = ["AUTO_DEVICE", "fit", "fit_async"]

logger = logging.getLogger("lamploop")

_SERVED_RUNS: set[str] = set()
"""The runs (their control addresses) that ``fit`` in this process, a follower that ``fit``
itself started, has served: the process was started for one run."""


def _run_served(env: LaunchEnv | None) -> str | None:
    """The run a follower that ``fit(world_size=n)`` started was started for; ``None`` for other launchers."""
    if env is None or env.launcher != "lamploop":
        return None
    return f"{env.root_host}:{env.control_port}"


@noting_failure_for_the_root
async def fit_async(
    *,
    model: SupervisedModel,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchStreamFactory,
    max_epochs: int,
    validation_batches: BatchStreamFactory | None = None,
    checkpoint_dir: str | Path | None = None,
    keep_last: int | None = 3,
    resume: bool = True,
    learning_rate_schedule: LearningRateSchedule[Any] = noop(),
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] = ALL_EPOCHS,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    accumulate_gradient_over_n_batches: int = 1,
    device: torch.device | str = AUTO_DEVICE,
    on_epoch: Callable[[LoopState], object] | None = None,
    world_size: int | None = None,
    strategy: str = "auto",
    launch_command: Sequence[str] | None = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    reporters: Sequence[Reporter] | None = None,
    checkpoint_every_n_steps: int | None = None,
    checkpoint_every_seconds: float | None = None,
    on_non_finite_loss: NonFiniteLossPolicy = "raise",
    max_gradient_norm: float | None = None,
    precision: Precision = "32",
    step_schedule: StepSchedule | None = None,
    lr_scheduler: LrSchedulerFactory | None = None,
    lr_scheduler_interval: SchedulerInterval = "epoch",
    averaging: Averaging | None = None,
    model_selection_metric: str | None = None,
    model_selection_mode: SelectionMode = "min",
    early_stopping_patience: int | None = None,
    profile: Profile | None = None,
    checkpoint_extras: Mapping[str, CheckpointExtra] | None = None,
) -> LoopState | None:
    """Train ``model``, checkpointing and resuming; the final state (``None`` on followers).

    With ``world_size=n`` and no launcher, this process becomes rank 0 and runs the same
    command line again for ranks ``1..n-1`` (see :mod:`lamploop.distributed.launch`);
    such a rank serves one run, and a later call in it returns ``None`` at once (the root's
    next call starts ranks of its own).  Under ``torchrun`` or Slurm the launcher's variables
    decide the rank.  Only rank 0 checkpoints, reports and returns the state.

    Args:
        model: the :class:`SupervisedModel` to train; ends holding the best model when an
            eligible epoch validated, else the last one.
        optimizer_factory: ``params -> torch.optim.Optimizer``.
        train_batches: the training :data:`BatchStreamFactory`.
        max_epochs: the number of epochs in all (a resumed run counts those already done).
        validation_batches: the validation stream factory, or ``None``.
        checkpoint_dir: write a checkpoint after every epoch there, and resume from its
            latest checkpoint when ``resume`` is true.
        keep_last: how many checkpoints to keep (``None``: all).
        learning_rate_schedule, validation_frequency, return_min_validation_loss_model
            (default: every epoch), validation_loss_exponential_smoothing_factor,
            accumulate_gradient_over_n_batches: as in :func:`lamploop.epochs` and
            :func:`lamploop.one_epoch`.
        device: where to train; ``"auto"`` (the default) is ``cuda:LOCAL_RANK`` where torch has
            CUDA (NCCL between ranks), else MPS for one rank where torch has it, else the CPU
            (Gloo).
        on_epoch: called with the :class:`LoopState` after every epoch (rank 0).
        world_size: the number of ranks (default: the launcher's, else 1).
        strategy, bucket_cap_mb, collective_timeout: as in :func:`drive_distributed_training`
            (``"auto"`` is ``all_reduce`` here: every rank has the optimizer factory).
        launch_command: the command that starts ranks ``1..n-1`` when lamploop launches
            them itself (default: this process's command line).
        heartbeat_interval, heartbeat_timeout: the control channel's; a rank silent for
            ``heartbeat_timeout`` seconds (dead, frozen or cut off) ends the run everywhere.
        reporters: who hears about the run (default: live progress bars, a
            :class:`~lamploop.reporting.ProgressReporter` on stderr, when stderr is a terminal
            and rich is installed; else a :class:`LoggingReporter`, a line per epoch).
        checkpoint_every_n_steps, checkpoint_every_seconds: also checkpoint inside epochs,
            at the step boundary after every N steps or T seconds (needs ``checkpoint_dir``).
        on_non_finite_loss: ``"raise"`` (default) stops at the step whose loss is NaN or
            infinite on any rank, naming the epoch, step and rank; ``"skip_step"`` skips that
            step on every rank and goes on (see :mod:`lamploop.loop.non_finite`).
        max_gradient_norm: clip each step's gradient (summed over the ranks) to this global
            L2 norm, as ``torch.nn.utils.clip_grad_norm_`` (``None``: no clipping).
        precision: ``"32"`` (default), ``"bf16"`` or ``"fp16"``: forward passes under autocast,
            fp16 with a dynamic loss scale (see :mod:`lamploop.loop.precision`).
        step_schedule: a per-step learning-rate factor (warm-up, cosine or linear decay),
            multiplied with ``learning_rate_schedule``'s (see :mod:`lamploop.schedules.step`).
        lr_scheduler, lr_scheduler_interval: a factory ``optimizer -> torch.optim.lr_scheduler``
            scheduler, stepped after every ``"step"`` or every ``"epoch"`` (default), written to
            checkpoints; it owns the rates: given with ``learning_rate_schedule`` or
            ``step_schedule`` it is a ConfigurationError before anything starts (see
            :mod:`lamploop.schedules.torch_scheduler`).
        averaging: ``lamploop.averaging.ema(decay)`` or ``swa(start_epoch)``: the weight
            average is checkpointed, and the model ends holding it (instead of the best
            validation epoch's model).
        model_selection_metric, model_selection_mode: pick the best model by the smoothed
            validation metric of that name (``"min"`` or ``"max"``), not the validation loss;
            the model's ``metrics`` must have it (see :mod:`lamploop.metrics`).
        early_stopping_patience: stop once this many validations in a row bring no new
            best model (judged as ``model_selection_*`` says); ``None``: never.
        profile: ``lamploop.Profile(out_dir, wait=, warmup=, active=)``: torch.profiler over
            that window of optimizer steps on every rank, one Chrome/TensorBoard trace per
            rank in ``out_dir`` (see docs/observability.md); ``None`` (default): no profiler.
        checkpoint_extras: named state saved with every checkpoint beside the model and
            restored from it on resume before training starts (rank 0; see
            :mod:`lamploop.checkpoint.extras`), such as a stream's buffer
            (:class:`lamploop.streaming.StreamState`).  Checkpoints are then written at
            epoch ends only: ``checkpoint_every_*`` is refused, and a stop by a signal inside
            an epoch writes none (the next run resumes from the last epoch's end and does
            that epoch's work again), because an extra's state at a step boundary would not
            match the resumed pass, which replays the epoch's first batches.

    SIGTERM or SIGINT (on the main thread; on any rank) stops every rank after the step in
    progress (one rank whose steps are under 20 ms: within 20 ms of the signal, see
    docs/loop.md); with ``checkpoint_dir`` a checkpoint of that step boundary is written, from
    which the next run resumes exactly there.  During a validation pass the run stops at the
    epoch's end, after its checkpoint (a validation stream that waits for samples ends on the
    request, and the validation cut short is discarded: the epoch is not finished).  Before
    training starts (checking the arguments, restoring the checkpoint) the run stops once the
    checkpoint is restored, writing nothing.  A second signal stops at once.

    Raises:
        lamploop.errors.LamploopError: any of its subclasses, see the parts above; a lost
            rank is a :class:`~lamploop.errors.PeerLostError` naming it.
        lamploop.errors.TrainingInterrupted: stopped by a signal (``reason`` names it).
    """
    # SIGTERM and SIGINT are stop requests from the first line on: one handler for the whole
    # call (a second stop_on_signals inside would set their actions back to the defaults on
    # leaving).  Until training starts a request is looked at once the checkpoint is restored.
    stop = stop_request()
    state: LoopState | None = None
    follower = False
    async with stop_on_signals(stop) as at_once:
        # Check: every argument, before anything starts.
        check_model("fit", model)
        check_optimizer_factory("fit", optimizer_factory)
        check_batch_factory("fit", "train_batches", train_batches)
        check_batch_factory("fit", "validation_batches", validation_batches, optional=True)
        check_reporters("fit", reporters)
        check_fit_keywords(
            "fit",
            on_epoch=on_epoch,
            checkpoint_dir=checkpoint_dir,
            resume=resume,
            launch_command=launch_command,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        )
        check_early_stopping("fit", early_stopping_patience, validation_batches)
        settings = TrainingSettings.from_arguments(locals())
        check_selection_metric("fit", settings.model_selection_metric, model)
        check_selection_needs_validation("fit", settings, validation_batches)
        check_averaging_starts("fit", settings.averaging, settings.max_epochs)
        check_sharded_strategy("fit", settings)  # before any rank starts
        extras = check_checkpointing("fit", settings, checkpoint_dir, checkpoint_extras)
        check_keep_last(keep_last, "fit")  # before any reporter starts (the checkpointer checks too late)
        # Place: this process's rank and device.
        placement = place(world_size, device)
        if placement.nranks > 1:  # one rank syncs nothing: its strategy keeps no state
            check_stateful_strategy("fit", settings, extras)
        if placement.env is None and placement.nranks > 1 and launch_command is None:
            launch_command = default_launch_command(placement.nranks)
        job = Job(
            model=model,
            optimizer_factory=optimizer_factory,
            train_batches=stop_aware_batches(train_batches, stop),
            validation_batches=(
                stop_aware_batches(validation_batches, stop) if validation_batches is not None else None
            ),
            settings=settings,
            placement=placement,
            spec=model_spec(model.module),
            heartbeat=Heartbeat(heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout),
            stop=stop,
            extras=extras,
            checkpoint_dir=checkpoint_dir,
            resume=resume,
        )
        # Follow (a rank the launcher started) or resume (the root), then run.
        if placement.rank > 0:
            follower = True
            served = _run_served(placement.env)
            try:
                if served is not None and served in _SERVED_RUNS:
                    # The script calls fit again (getting-started's resume pattern): the root's
                    # next call starts followers of its own, from the script's first line.
                    logger.info("rank %d: this process served its run already; fit returns", placement.rank)
                    return None
                if served is not None:
                    _SERVED_RUNS.add(served)
                await follow(job)
            finally:
                close_all(reporters or ())  # the same script's reporters: a follower reports nothing
        else:
            resumed = resume_root(
                checkpoint_dir,
                resume,
                settings.learning_rate_schedule,
                model.module,
                extras,
                reserved=SYNC_EXTRA,
                nranks=placement.nranks,  # a sharded run's checkpoint reshards to any number
                leave_shards=settings.strategy == "fsdp" and placement.nranks > 1,  # each rank reads its rows
            )
            await stop_if_requested_before_training(stop, resumed_epoch(resumed))
            listeners = list(reporters) if reporters is not None else [default_reporter()]
            try:
                start_all(listeners)
                state = await lead(job, resumed, listeners, keep_last, on_epoch, launch_command, at_once)
            finally:
                close_all(listeners)
    # A second request: cancelled here, or raised in a plain iterable that held the loop.
    if (at_once.cancelled_caught or stop.at_once()) and not follower:  # a follower ends quietly
        raise stopped_at_once(stop)
    return state


fit = blocking(fit_async)
