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

import functools
import importlib.util
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypedDict, TypeVar

import anyio
import attrs
import torch

from lamploop.arguments import (
    check_batch_factory,
    check_early_stopping,
    check_model,
    check_optimizer_factory,
    check_reporters,
)
from lamploop.averaging import Averaging
from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from lamploop.checkpoint.extras import CheckpointExtra, check_extras, rank_extra_name
from lamploop.control.tcp import TcpControlRoot
from lamploop.distributed.boundaries import StopRequest
from lamploop.distributed.drive import OptimizerFactory, drive_distributed_training
from lamploop.distributed.follow import follow_distributed_training
from lamploop.distributed.launch import (
    LaunchEnv,
    default_launch_command,
    launch_env,
    open_follower_control,
    open_root_control,
    spawn_followers,
)
from lamploop.distributed.rank_extras import SYNC_EXTRA, RankExtras
from lamploop.errors import (
    CheckpointError,
    ConfigurationError,
    PeerLostError,
    TrainingInterrupted,
    error_detected_by_every_rank,
)
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.epoch_driver import ALL_EPOCHS
from lamploop.loop.non_finite import NonFiniteLossPolicy
from lamploop.loop.precision import Precision
from lamploop.loop.selection import SelectionMode
from lamploop.loop.stop_aware import stop_aware_batches
from lamploop.model import SupervisedModel
from lamploop.modelspec import model_spec
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.events import CheckpointWritten, PeerLost, RunFailed, RunStopped
from lamploop.reporting.logging_reporter import LoggingReporter
from lamploop.reporting.progress import ProgressReporter
from lamploop.reporting.reporter import Reporter, close_all, start_all
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.settings import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    TrainingSettings,
)
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.step_schedules import StepSchedule
from lamploop.stopping import blocking, share_stop_requests, stop_on_signals, stop_request
from lamploop.sync.strategy import AUTO, keeps_state, strategy_named
from lamploop.torch_schedulers import LrSchedulerFactory, SchedulerInterval

__all__ = ["fit", "fit_async"]

logger = logging.getLogger("lamploop")

P = ParamSpec("P")
R = TypeVar("R")

_LOCAL = "127.0.0.1"
_FOLLOWER_EXIT_TIMEOUT_S = 60.0
_OTHER_RANKS = re.compile(r"\.rank[0-9]+$")  # the followers' extras in the root's checkpoints
_SYNC_STATE = re.compile(re.escape(SYNC_EXTRA) + r"(\.rank[0-9]+)?")  # a stateful strategy's, every rank's


class _Heartbeat(TypedDict):
    heartbeat_interval: float
    heartbeat_timeout: float


@attrs.frozen
class _Place:
    env: LaunchEnv | None
    nranks: int
    rank: int
    device: torch.device


def _place(world_size: int | None, device: torch.device | str) -> _Place:
    env = launch_env()
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
    ):
        msg = f"fit: world_size must be None or an int >= 1, got {world_size!r}"
        raise ConfigurationError(msg)
    if env is not None and world_size is not None and world_size != env.world_size:
        msg = (
            f"fit: world_size={world_size}, but the launcher ({env.launcher}) started {env.world_size} ranks"
        )
        raise ConfigurationError(msg)
    nranks = env.world_size if env is not None else (world_size or 1)
    local_rank = env.local_rank if env is not None else 0
    torch_device = _auto_device(nranks, local_rank) if device == AUTO_DEVICE else _device(device)
    if torch_device.type == "cuda" and torch_device.index is None and nranks > 1:
        torch_device = torch.device("cuda", local_rank)
    if nranks > 1 and torch_device.type == "cpu":
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // min(nranks, cores)))
    return _Place(env, nranks, env.rank if env is not None else 0, torch_device)


AUTO_DEVICE = "auto"
"""``fit(device="auto")``: CUDA when torch has it (``cuda:LOCAL_RANK``, with NCCL), else MPS for
one rank where torch has it, else the CPU (with Gloo)."""


def _auto_device(nranks: int, local_rank: int) -> torch.device:
    """The device ``"auto"`` picks for this rank (see :data:`AUTO_DEVICE`)."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            msg = (
                f"fit: device='auto' picks CUDA, but this rank's local rank is {local_rank} and there "
                f"are {count} CUDA devices: start one rank per device, or pass device='cpu'"
            )
            raise ConfigurationError(msg)
        return torch.device("cuda", local_rank if nranks > 1 else torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if nranks == 1 and mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _default_reporter() -> Reporter:
    """Live progress bars when stderr is a terminal and rich is installed, else a line per epoch."""
    if sys.stderr.isatty() and importlib.util.find_spec("rich") is not None:
        return ProgressReporter(sys.stderr)
    return LoggingReporter()


def _device(device: torch.device | str) -> torch.device:
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"fit: device {device!r} is not a device torch knows ({exc})"
        raise ConfigurationError(msg) from None
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        msg = (
            f"fit: device={str(device)!r}, but CUDA is not available here (torch "
            f"{torch.__version__}, {torch.cuda.device_count()} CUDA devices); pass device='cpu'"
        )
        raise ConfigurationError(msg)
    return torch_device


def _resume(
    checkpoint_dir: str | Path | None,
    resume: bool,
    schedule: LearningRateSchedule[Any],
    module: torch.nn.Module,
    extras: Mapping[str, CheckpointExtra],
) -> dict[str, Any]:
    """The drive's keyword arguments that resume from the latest checkpoint (none without one).

    The checkpoint's extras are restored here, before training starts.
    """
    if checkpoint_dir is None or not resume or latest_checkpoint(checkpoint_dir) is None:
        return {}
    checkpoint = load_checkpoint(checkpoint_dir, schedule=schedule, model=module)
    _restore_extras(checkpoint.path, checkpoint.extras, extras, rank=0)
    checkpoint.rng.restore()
    where = f"epoch {checkpoint.state.loop_state.epoch}"
    if checkpoint.position is not None:
        where += f" after step {checkpoint.position.steps_done}"
    logger.info("resuming from %s at %s", checkpoint.path, where)
    return {
        "init_state": checkpoint.state,
        "learning_rate_schedule_init_state": checkpoint.schedule_state,
        "init_position": checkpoint.position,
        "init_rank_rngs": (checkpoint.rng, *checkpoint.rank_rngs),
        "extras_from": checkpoint.path.name if extras else None,
        "saved_sync": {n: state for n, state in checkpoint.extras.items() if _SYNC_STATE.fullmatch(n)},
    }


def _restore_extras(
    path: Path,
    saved: Mapping[str, tuple[dict[str, torch.Tensor], Any]],
    extras: Mapping[str, CheckpointExtra],
    *,
    rank: int,
) -> None:
    """Load this rank's state of every extra; one the checkpoint lacks is refused (it would start afresh)."""
    names = {rank_extra_name(name, rank): name for name in extras}
    missing = sorted(set(names) - set(saved))
    if missing:
        have = sorted(saved) or "none"
        msg = (
            f"{path}: has no state for the checkpoint extras {missing} (it has {have}); resuming would "
            "start them afresh while the model carries on; pass resume=False or another checkpoint_dir"
        )
        raise CheckpointError(msg)
    for saved_name, name in names.items():
        tensors, meta = saved[saved_name]
        extras[name].load_state_dict(tensors, meta)
    unused = sorted(
        n for n in set(saved) - set(names) if not _OTHER_RANKS.search(n) and not _SYNC_STATE.fullmatch(n)
    )
    if unused and rank == 0:
        logger.warning("%s: its checkpoint extras %s are not restored (not given)", path, unused)


def _resume_follower_extras(
    checkpoint_dir: str | Path | None, resume: bool, rank: int, extras: Mapping[str, CheckpointExtra]
) -> str | None:
    """A follower restores its own extras from the checkpoint the root resumes from (every rank reads it).

    Returns the checkpoint's name, which the ranks compare when they meet (``None``: nothing restored).
    """
    if not extras or checkpoint_dir is None or not resume or latest_checkpoint(checkpoint_dir) is None:
        return None
    checkpoint = load_checkpoint(checkpoint_dir)
    _restore_extras(checkpoint.path, checkpoint.extras, extras, rank=rank)
    return checkpoint.path.name


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
    checkpoint_extras: Mapping[str, CheckpointExtra] | None = None,
) -> LoopState | None:
    """Train ``model``, checkpointing and resuming; the final state (``None`` on followers).

    With ``world_size=n`` and no launcher, this process becomes rank 0 and runs the same
    command line again for ranks ``1..n-1`` (see :mod:`lamploop.distributed.launch`);
    under ``torchrun`` or Slurm the launcher's variables decide the rank.  Only rank 0
    checkpoints, reports and returns the state.

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
            multiplied with ``learning_rate_schedule``'s (see :mod:`lamploop.step_schedules`).
        lr_scheduler, lr_scheduler_interval: a factory ``optimizer -> torch.optim.lr_scheduler``
            scheduler, stepped after every ``"step"`` or every ``"epoch"`` (default), written to
            checkpoints; it replaces ``learning_rate_schedule`` and ``step_schedule`` (see
            :mod:`lamploop.torch_schedulers`).
        averaging: ``lamploop.averaging.ema(decay)`` or ``swa(start_epoch)``: the weight
            average is checkpointed, and the model ends holding it (instead of the best
            validation epoch's model).
        model_selection_metric, model_selection_mode: pick the best model by the smoothed
            validation metric of that name (``"min"`` or ``"max"``), not the validation loss;
            the model's ``metrics`` must have it (see :mod:`lamploop.metrics`).
        early_stopping_patience: stop once this many validations in a row bring no new
            best model (judged as ``model_selection_*`` says); ``None``: never.
        checkpoint_extras: named state saved with every checkpoint beside the model and
            restored from it on resume before training starts (rank 0; see
            :mod:`lamploop.checkpoint.extras`), such as a stream's buffer
            (:class:`lamploop.streaming.StreamState`).  Checkpoints are then written at
            epoch ends only: ``checkpoint_every_*`` is refused, and a stop by a signal inside
            an epoch writes none (the next run resumes from the last epoch's end and does
            that epoch's work again), because an extra's state at a step boundary would not
            match the resumed pass, which replays the epoch's first batches.

    SIGTERM or SIGINT (on the main thread; on any rank) stops every rank after the step in
    progress; with ``checkpoint_dir`` a checkpoint of that step boundary is written, from
    which the next run resumes exactly there.  A second signal stops at once.

    Raises:
        lamploop.errors.LamploopError: any of its subclasses, see the parts above; a lost
            rank is a :class:`~lamploop.errors.PeerLostError` naming it.
        lamploop.errors.TrainingInterrupted: stopped by a signal (``reason`` names it).
    """
    check_model("fit", model)
    check_optimizer_factory("fit", optimizer_factory)
    check_batch_factory("fit", "train_batches", train_batches)
    check_batch_factory("fit", "validation_batches", validation_batches, optional=True)
    check_reporters("fit", reporters)
    check_early_stopping("fit", early_stopping_patience, validation_batches)
    settings = TrainingSettings.from_arguments(locals())
    _check_step_checkpoints(checkpoint_dir, checkpoint_every_n_steps, checkpoint_every_seconds)
    extras = _check_checkpoint_extras(
        checkpoint_extras, checkpoint_dir, checkpoint_every_n_steps, checkpoint_every_seconds
    )
    place = _place(world_size, device)
    if place.nranks > 1:  # one rank syncs nothing: its strategy keeps no state
        _check_stateful_strategy(
            settings.strategy, extras, checkpoint_every_n_steps, checkpoint_every_seconds
        )
    if place.env is None and place.nranks > 1 and launch_command is None:
        launch_command = default_launch_command(place.nranks)
    spec = model_spec(model.module)
    heartbeat = _Heartbeat(heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout)
    rank_settings = settings.for_every_rank()
    stop = stop_request()
    if place.env is not None and place.rank > 0:
        restored_from = _resume_follower_extras(checkpoint_dir, resume, place.rank, extras)
        follow = functools.partial(
            follow_distributed_training,
            stop=stop,
            rank=place.rank,
            nranks=place.nranks,
            device=place.device,
            model=model,
            train_batches=stop_aware_batches(train_batches, stop),  # a stop ends a wait for samples
            validation_batches=validation_batches,
            optimizer_factory=optimizer_factory,
            checkpoint_extras=RankExtras(
                extras, rank=place.rank, nranks=place.nranks, resumed_from=restored_from
            ),
            **rank_settings,
        )
        try:
            async with (
                stop_on_signals(stop),
                open_follower_control(place.env, model_spec=spec, **heartbeat) as f,
                share_stop_requests(stop, f),
            ):
                await follow(control=f)
        finally:
            close_all(reporters or ())  # the same script's reporters: a follower reports nothing
        return None

    resumed = _resume(checkpoint_dir, resume, learning_rate_schedule, model.module, extras)
    run_extras = RankExtras(
        extras,
        rank=0,
        nranks=place.nranks,
        resumed_from=resumed.pop("extras_from", None),
        saved_sync=resumed.pop("saved_sync", None),
    )
    save = None
    if checkpoint_dir is not None:
        save = Checkpointer(checkpoint_dir, keep_last=keep_last, extras=run_extras)
    listeners = list(reporters) if reporters is not None else [_default_reporter()]
    emit = EventEmitter(listeners)

    async def after_epoch(data: LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        # The checkpoint itself is written through checkpoint_position, with every rank's RNG states.
        if on_epoch is not None:
            on_epoch(data.loop_state)

    async def save_position(
        data: LoopStateWithModelAndOptimizerData, schedule_state: Any, at: EpochPosition, rngs: Sequence[Any]
    ) -> bool:
        assert save is not None
        if run_extras.at_epoch_ends_only and at.steps_done > 0:  # a stop inside an epoch
            logger.warning(
                "stopped inside epoch %d after step %d: no checkpoint written there, since the "
                "checkpoint extras %s are consistent at epoch ends only; the next run resumes from "
                "the last epoch's end",
                at.epoch,
                at.steps_done,
                sorted(run_extras),
            )
            return False
        began = time.monotonic()
        await save.save_position(data, schedule_state, at, rngs)
        path = str(save.last_path) if save.last_path is not None else None
        emit(CheckpointWritten(at.epoch, at.steps_done, path, time.monotonic() - began))
        return True

    drive = functools.partial(
        drive_distributed_training,
        nranks=place.nranks,
        device=place.device,
        model=model,
        optimizer_factory=optimizer_factory,
        train_batches=stop_aware_batches(train_batches, stop),  # a stop ends a wait for samples
        validation_batches=validation_batches,
        checkpoint_state=after_epoch,
        checkpoint_position=save_position if save is not None else None,
        stop=stop,
        reporters=listeners,
        checkpoint_extras=run_extras,
        **resumed,
        **attrs.asdict(settings, recurse=False),
    )
    try:
        start_all(listeners)
        run = _drive_with_followers(drive, place, spec, heartbeat, launch_command, stop)
        return await _reported(run, stop, emit)
    finally:
        close_all(listeners)


def _check_step_checkpoints(directory: object, every_steps: int | None, every_seconds: float | None) -> None:
    """Checkpoints inside epochs need a directory: asking for them without one is a mistake."""
    if directory is not None or (every_steps is None and every_seconds is None):
        return
    every = "checkpoint_every_n_steps" if every_steps is not None else "checkpoint_every_seconds"
    msg = f"fit: {every} asks for checkpoints inside epochs, but checkpoint_dir is None: say where"
    raise ConfigurationError(msg)


def _check_checkpoint_extras(
    extras: Mapping[str, CheckpointExtra] | None,
    directory: object,
    every_steps: int | None,
    every_seconds: float | None,
) -> Mapping[str, CheckpointExtra]:
    """Extras need a checkpoint directory, and refuse checkpoints inside epochs."""
    checked = check_extras("fit", extras)
    if not checked:
        return checked
    if directory is None:
        msg = f"fit: checkpoint_extras {sorted(checked)} go into checkpoints, but checkpoint_dir is None"
        raise ConfigurationError(msg)
    if every_steps is not None or every_seconds is not None:
        every = "checkpoint_every_n_steps" if every_steps is not None else "checkpoint_every_seconds"
        msg = (
            f"fit: {every} cannot be combined with checkpoint_extras: an extra's state (a stream "
            "buffer's) at a step boundary does not match a pass resumed there, which replays the "
            "epoch's first batches; with checkpoint_extras, checkpoints are written at epoch ends "
            "(make epochs shorter instead, e.g. buffer_batches(batches_per_epoch=...))"
        )
        raise ConfigurationError(msg)
    return checked


def _check_stateful_strategy(
    strategy: str, extras: Mapping[str, CheckpointExtra], every_steps: int | None, every_seconds: float | None
) -> None:
    """A strategy that keeps state saves it at epoch ends, under a reserved name (see rank_extras)."""
    if strategy == AUTO or not keeps_state(strategy_named(strategy)):
        return
    if SYNC_EXTRA in extras:
        msg = f"fit: checkpoint_extras name {SYNC_EXTRA!r} is taken by strategy {strategy!r}'s own state"
        raise ConfigurationError(msg)
    if every_steps is not None or every_seconds is not None:
        every = "checkpoint_every_n_steps" if every_steps is not None else "checkpoint_every_seconds"
        msg = (
            f"fit: {every} cannot be combined with strategy {strategy!r}: its state (error feedback, "
            "scales, outer momentum) is saved at epoch ends, where every rank's is consistent with the "
            "model; make epochs shorter instead"
        )
        raise ConfigurationError(msg)


async def _reported(run: Awaitable[LoopState], stop: StopRequest, emit: EventEmitter) -> LoopState:
    """Await the root's run under the signal handlers; report a stop or a failure; raise its first error.

    The run itself reports everything up to :class:`RunFinished`; how it failed is known here.
    """
    try:
        async with stop_on_signals(stop) as at_once:
            state = await run
        if at_once.cancelled_caught:
            msg = f"stopped at once by a second {stop.reason}: the work since the last checkpoint is lost"
            raise TrainingInterrupted(msg, epoch=-1, steps_done=-1, reason=stop.reason)
    except Exception as exc:
        error = _first_error(exc)
        if isinstance(error, TrainingInterrupted):  # a stop on request is no failure
            emit(RunStopped(error.reason, str(error)))
        else:
            if isinstance(error, PeerLostError) and error.rank is not None:
                emit(PeerLost(error.rank, error.how or "lost", str(error)))
            emit(RunFailed(f"{type(error).__name__}: {error}"))
        if error is exc:
            raise
        if error.__cause__ is not None:
            raise error from error.__cause__  # its own cause says more than the task groups' wrapping
        raise error from exc  # the task groups' wrapping, kept as the cause
    return state


def _first_error(exc: BaseException) -> BaseException:
    """The first error inside the exception groups that task groups wrap errors in (cancellations skipped).

    An error that every rank detects itself (a NaN loss...) comes first: what it causes
    elsewhere (a follower's abort, its process exiting with status 1) only follows from it.
    """
    own = error_detected_by_every_rank(exc)
    if own is not None:
        return own
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return exc
    leaves = [_first_error(e) for e in inner]
    errors = [e for e in leaves if not isinstance(e, anyio.get_cancelled_exc_class())]
    return errors[0] if errors else exc


async def _drive_with_followers(
    drive: Callable[..., Awaitable[LoopState]],
    place: _Place,
    spec: Any,
    heartbeat: _Heartbeat,
    launch_command: Sequence[str] | None,
    stop: StopRequest,
) -> LoopState:
    """Run the root: alone, under a launcher, or with followers this process starts itself."""
    if place.nranks == 1:
        return await drive(control=None)
    if place.env is not None:
        async with (
            open_root_control(place.env, model_spec=spec, **heartbeat) as root,
            share_stop_requests(stop, root),  # a rank that waits for data hears the others' stops
        ):
            return await drive(control=root, host=place.env.root_host)
    token = secrets.token_hex(16)
    async with (
        TcpControlRoot(host=_LOCAL, nranks=place.nranks, token=token, model_spec=spec, **heartbeat) as root,
        anyio.create_task_group() as followers,
    ):
        spawn_followers(
            followers,
            world_size=place.nranks,
            control_address=root.address,
            token=token,
            command=launch_command,
        )
        async with share_stop_requests(stop, root):
            state = await drive(control=root, host=_LOCAL)
        # The followers got Stop; give them a bounded time to exit before they are killed.
        followers.cancel_scope.deadline = anyio.current_time() + _FOLLOWER_EXIT_TIMEOUT_S
    return state


fit = blocking(fit_async)
fit.__name__ = fit.__qualname__ = "fit"
fit.__doc__ = (fit_async.__doc__ or "").replace(
    "Train ``model``,",
    "Train ``model`` (blocking: runs :func:`fit_async` in a new event loop, on a thread of its own "
    "when called inside one, as in a notebook),",
    1,
)
