"""``restore_optimizer_state``: load a checkpoint's optimizer state, refusing misfits clearly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lamploop.checkpoint.format import OPTIMIZER_FILE
from lamploop.checkpoint.load import Checkpoint
from lamploop.errors import CheckpointError
from lamploop.state import LoopStateWithModelAndOptimizerData

__all__ = ["restore_optimizer_state"]


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state: Checkpoint | LoopStateWithModelAndOptimizerData | Mapping[str, Any],
) -> None:
    """``optimizer.load_state_dict`` with the optimizer state of a checkpoint, refusing misfits clearly.

    Tensors are moved to each parameter's device (and floating-point state to
    its dtype) by ``load_state_dict`` itself.

    Args:
        optimizer: the freshly built optimizer of the resumed run, over the
            same parameters (in the same groups and order) as the saved one.
        state: a :class:`Checkpoint`, a ``LoopStateWithModelAndOptimizerData``
            or an ``optimizer.state_dict()``.

    Raises:
        CheckpointError: the saved state has another number of parameter
            groups or of parameters in a group, or ``load_state_dict`` refuses it.
    """
    where = ""
    saved: Any = state
    if isinstance(state, Checkpoint):
        where = f"{state.path / OPTIMIZER_FILE}: "
        saved = state.state.optimizer
    elif isinstance(state, LoopStateWithModelAndOptimizerData):
        saved = state.optimizer
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list):
        msg = f"{where}the optimizer state has no list of param_groups"
        raise CheckpointError(msg)
    if len(groups) != len(optimizer.param_groups):
        msg = (
            f"{where}the saved optimizer has {len(groups)} parameter groups, "
            f"this {type(optimizer).__name__} has {len(optimizer.param_groups)}"
        )
        raise CheckpointError(msg)
    for i, (s, g) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if len(s.get("params", ())) != len(g["params"]):
            msg = (
                f"{where}parameter group {i}: the saved optimizer has {len(s.get('params', ()))} parameters, "
                f"this {type(optimizer).__name__} has {len(g['params'])}"
            )
            raise CheckpointError(msg)
    try:
        optimizer.load_state_dict(dict(saved))
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        msg = f"{where}{type(optimizer).__name__}.load_state_dict refused the saved state: {e}"
        raise CheckpointError(msg) from e
    _check_same_kind(optimizer, groups, where)


def _check_same_kind(optimizer: torch.optim.Optimizer, saved_groups: list[Any], where: str) -> None:
    """The loaded groups have every setting this optimizer steps with (another class's would not).

    ``load_state_dict`` takes any groups and fills in only the settings that newer torch
    versions added; an Adam state loaded into SGD fails at the first step (``KeyError:
    'momentum'``), so say it here.
    """
    for i, group in enumerate(optimizer.param_groups):
        missing = sorted(set(optimizer.defaults) - set(group))
        if missing:
            theirs = sorted(set(saved_groups[i]) - set(optimizer.defaults) - {"params", "param_names"})
            msg = (
                f"{where}the saved optimizer state is not a {type(optimizer).__name__}'s: its parameter "
                f"group {i} lacks {missing}" + (f" and has {theirs}" if theirs else "") + "; resume with "
                "the optimizer the checkpoint was written with (or start afresh: resume=False)"
            )
            raise CheckpointError(msg)
