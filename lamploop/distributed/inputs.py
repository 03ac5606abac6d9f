"""Checks of the model and the batch factories a driver is given, made before anything starts.

They live below :mod:`lamploop.arguments` (which re-exports them for ``fit`` and ``lr_find``)
so that :func:`~lamploop.drive_distributed_training`, :func:`~lamploop.follow_distributed_training`
and :func:`~lamploop.local_data_parallel_training_loop` check their arguments alike: a bare
``nn.Module`` or a tensor would otherwise fail deep inside the first epoch with an
``AttributeError`` or ``TypeError`` that names neither.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from lamploop.checks import check_callable, signature_of, takes_one_argument
from lamploop.errors import ConfigurationError
from lamploop.model import check_model
from lamploop.state import LoopStateWithModelAndOptimizerData, check_loop_state

__all__ = [
    "check_batch_factory",
    "check_driver_arguments",
    "check_control_size",
    "check_follower_control",
    "check_model",
    "check_reporters",
    "check_resume_arguments",
]


def check_batch_factory(where: str, name: str, factory: Any, *, optional: bool = False) -> None:
    """``factory`` must be a batch factory (a callable of the batch context), not the data itself.

    ``None`` passes when ``optional`` (no validation batches: no validation).
    """
    if factory is None and optional:
        return
    if callable(factory) and not isinstance(factory, torch.Tensor | torch.nn.Module):
        if not takes_one_argument(factory):
            msg = (
                f"{where}: {name} must take the batch context (one positional argument: a "
                f"lamploop.BatchContext with epoch, rank, nranks), but its signature is "
                f"{signature_of(factory)}; e.g. lambda context: stream_for(context.epoch)"
            )
            raise ConfigurationError(msg)
        return
    kind = type(factory).__name__
    if isinstance(factory, torch.utils.data.DataLoader):
        hint = f"lamploop.dataloader_batches({name}_loader)"
    elif isinstance(factory, torch.Tensor | list | tuple):
        hint = "lamploop.tensor_batches(features, targets, batch_size=...)"
    else:
        hint = "lamploop.tensor_batches(...) or lamploop.dataloader_batches(...)"
    msg = (
        f"{where}: {name} must be a batch factory (called once per epoch with the batch context), "
        f"got {kind}; make one with {hint}"
    )
    raise ConfigurationError(msg)


def check_reporters(where: str, reporters: Any) -> None:
    """``reporters``: ``None`` or a sequence of objects with a ``report(event)`` method.

    A plain function (``reporters=[print]``) would fail at every event, each failure logged
    and the run going on: it is refused before anything starts, with what to pass instead.
    """
    if reporters is None:
        return
    if isinstance(reporters, str | bytes) or not isinstance(reporters, Sequence):
        msg = f"{where}: reporters must be a list of reporters, got {type(reporters).__name__}"
        raise ConfigurationError(msg)
    for i, reporter in enumerate(reporters):
        if isinstance(reporter, type):  # the class, whose report() lacks its self
            msg = (
                f"{where}: reporters[{i}] is the class {reporter.__qualname__}, not a reporter; "
                f"make one: {reporter.__qualname__}(...)"
            )
            raise ConfigurationError(msg)
        if not callable(getattr(reporter, "report", None)):
            msg = (
                f"{where}: reporters[{i}] ({reporter!r}) has no report(event) method; pass a reporter "
                "such as lamploop.reporting.LoggingReporter(), or an object of your own with "
                "report(self, event) (see lamploop.reporting.Reporter)"
            )
            raise ConfigurationError(msg)


def check_driver_arguments(
    where: str,
    model: Any,
    train_batches: Any,
    validation_batches: Any,
    *,
    init_state: object = None,
    checkpoint_state: object = None,
) -> None:
    """A driver's model, batch factories, state to resume from and checkpoint callback."""
    check_model(where, model)
    check_batch_factory(where, "train_batches", train_batches)
    check_batch_factory(where, "validation_batches", validation_batches, optional=True)
    check_resume_arguments(where, init_state, checkpoint_state)


def check_follower_control(where: str, control: object, nranks: int, rank: int) -> None:
    """``control`` is a follower's end of a control channel (it has ``join()``), made for this
    world size and rank when it says (:func:`check_control_size`)."""
    if not callable(getattr(control, "join", None)):
        msg = (
            f"{where}: control must be a ControlFollower (one of the followers of "
            f"lamploop.local_control(n), or a TcpControlFollower), got {type(control).__name__}"
        )
        raise ConfigurationError(msg)
    check_control_size(where, control, nranks)
    own = getattr(control, "rank", None)
    if type(own) is int and own != rank:
        msg = f"{where}: rank={rank}, but its control channel ({type(control).__name__}) is rank {own}'s"
        raise ConfigurationError(msg)


def check_control_size(where: str, control: object, nranks: int) -> None:
    """A control channel made for another world size than ``nranks`` (its ``nranks``, where it
    has one: lamploop's channels do) is refused now, naming both; else the ranks would wait in
    the process group's set-up until its timeout, and fail without saying why."""
    size = getattr(control, "nranks", None)
    if type(size) is int and size != nranks:
        msg = (
            f"{where}: nranks={nranks}, but its control channel ({type(control).__name__}) was made "
            f"for {size} ranks; give both the same world size"
        )
        raise ConfigurationError(msg)


def check_resume_arguments(where: str, init_state: object, checkpoint_state: object) -> None:
    """Check ``init_state`` (a ``LoopStateWithModelAndOptimizerData`` or None) and ``checkpoint_state``."""
    if init_state is not None and not isinstance(init_state, LoopStateWithModelAndOptimizerData):
        if type(init_state).__name__ == "LoopState":
            hint = "; a LoopState has no tensors: resume from lamploop.load_checkpoint(...)"
        elif isinstance(getattr(init_state, "state", None), LoopStateWithModelAndOptimizerData):
            hint = "; pass its .state (init_state=checkpoint.state)"  # a Checkpoint, as loaded
        else:
            hint = ""
        msg = (
            f"{where}: init_state must be a lamploop.LoopStateWithModelAndOptimizerData or None, "
            f"got {type(init_state).__name__}{hint}"
        )
        raise ConfigurationError(msg)
    if init_state is not None:
        check_loop_state(f"{where}: init_state.loop_state", init_state.loop_state)
    check_callable(f"{where}: checkpoint_state", checkpoint_state, optional=True)
    if checkpoint_state is not None and not _may_be_async(checkpoint_state):
        name = getattr(checkpoint_state, "__qualname__", type(checkpoint_state).__name__)
        msg = (
            f"{where}: checkpoint_state {name} is not an async function: it is awaited after every "
            "epoch; make it one (async def save(state, schedule_state): ...)"
        )
        raise ConfigurationError(msg)


def _may_be_async(function: object) -> bool:
    """False only for a plain function or method (or an object whose ``__call__`` is one) that is
    no coroutine function; anything else (a partial, a builtin) is judged when called."""
    target = function
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(function).__dict__.get("__call__")  # a class's own plain __call__, if any
        if not inspect.isfunction(target):
            return True
    return inspect.iscoroutinefunction(target)
