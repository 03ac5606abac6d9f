"""The root's work before and after its epochs: arguments checked, optimizer made, result installed."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lamploop.averaging import install_average
from lamploop.batches import BatchContext, BatchStreamFactory
from lamploop.checkpoint import RngStates, restore_optimizer_state
from lamploop.checks import check_callable, check_sequence_of
from lamploop.control.commands import ControlRoot
from lamploop.distributed.inputs import check_control_size
from lamploop.distributed.replica import Replica, learning_rates
from lamploop.errors import ConfigurationError
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.optimizer import make_optimizer
from lamploop.model import unwrapped
from lamploop.state import LoopStateWithModelAndOptimizerData

__all__ = ["OptimizerFactory", "check_root_arguments", "install_result", "set_up_root"]

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def check_resume_point(
    checkpoint_position: object, init_position: object, init_rank_rngs: object, stop: object
) -> None:
    """The root's keywords of step-boundary checkpoints and stops, checked before anything starts."""
    where = "drive_distributed_training"
    check_callable(f"{where}: checkpoint_position", checkpoint_position, optional=True)
    if init_position is not None and not isinstance(init_position, EpochPosition):
        msg = (
            f"{where}: init_position must be an EpochPosition (a step-boundary checkpoint's "
            f".position) or None, got {type(init_position).__name__}"
        )
        raise ConfigurationError(msg)
    hint = " (a step-boundary checkpoint's .rank_rngs)"
    check_sequence_of(f"{where}: init_rank_rngs", init_rank_rngs, RngStates, hint)
    if stop is not None and not callable(getattr(stop, "is_set", None)):
        msg = (
            f"{where}: stop must be a lamploop.distributed.StopRequest (or anything with is_set()) "
            f"or None, got {type(stop).__name__}"
        )
        raise ConfigurationError(msg)


def check_root_arguments(
    nranks: int, control: ControlRoot | None, init_position: EpochPosition | None
) -> None:
    """ConfigurationError for a root that cannot run: no control channel, or a resume point of other size."""
    if nranks > 1 and control is None:
        msg = f"drive_distributed_training: nranks={nranks} needs a control channel, got control=None"
        raise ConfigurationError(msg)
    if control is not None and not all(
        callable(getattr(control, name, None)) for name in ("on_rendezvous_ready", "peers", "broadcast")
    ):
        hint = (
            "; the root takes the ControlRoot (a follower's end has join())"
            if hasattr(control, "join")
            else ""
        )
        msg = (
            "drive_distributed_training: control must be a ControlRoot (the first of "
            f"lamploop.local_control(n), or a TcpControlRoot), got {type(control).__name__}{hint}"
        )
        raise ConfigurationError(msg)
    if control is not None:
        check_control_size("drive_distributed_training", control, nranks)
    if init_position is not None and len(init_position.loss_sums) != nranks:
        msg = (
            f"drive_distributed_training: the step-boundary checkpoint to resume from was taken with "
            f"{len(init_position.loss_sums)} ranks, this run has nranks={nranks}; resume it with as "
            "many ranks, or from an epoch-boundary checkpoint"
        )
        raise ConfigurationError(msg)


def set_up_root(
    module: torch.nn.Module,
    device: torch.device,
    optimizer_factory: OptimizerFactory,
    init_state: LoopStateWithModelAndOptimizerData | None,
) -> tuple[torch.optim.Optimizer, tuple[float, ...]]:
    """Move the module, load the state to resume from, make the optimizer; its base learning rates."""
    module.to(device)
    if init_state is not None:
        try:
            unwrapped(module).load_state_dict(init_state.model)
        except (RuntimeError, TypeError, AttributeError) as exc:
            # torch's "Error(s) in loading state_dict for ...", without saying whose state it was
            msg = f"drive_distributed_training: init_state.model does not fit the model: {exc}"
            raise ConfigurationError(msg) from exc
    optimizer = make_optimizer(optimizer_factory, module.parameters(), where="rank 0")
    base_lrs = learning_rates(optimizer)  # before a loaded state sets the last epoch's rates
    if init_state is not None and init_state.optimizer:
        restore_optimizer_state(optimizer, init_state)
    return optimizer, base_lrs


async def install_result(
    replica: Replica, best: dict[str, torch.Tensor], train_batches: BatchStreamFactory, epochs_done: int
) -> None:
    """The model ends holding the weight average if there is one, else the best epoch's model."""
    average = replica.average
    if average is not None and average.count:
        # For SWA with its BatchNorm statistics refreshed on the last epoch's training data.
        last = BatchContext(epoch=max(epochs_done - 1, 0), rank=0, nranks=1)
        await install_average(average, train_batches(last), replica.device)
    elif best:
        unwrapped(replica.model.module).load_state_dict(best)
