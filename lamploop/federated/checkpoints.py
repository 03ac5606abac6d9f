"""The aggregator's checkpoint after every round, and resuming from it.

A round's checkpoint is an ordinary lamploop checkpoint (:func:`lamploop.save_checkpoint`:
safetensors and a JSON descriptor, written to a temporary directory, fsynced, renamed, then
``latest`` updated; old ones pruned), so ``lamploop inspect`` reads it: the global model
as the model, ``epoch`` = the rounds done, one learning-curve entry per round, and the
round records and the plan's hash in the extra ``federated``.

.. versionadded:: 0.3
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

import cattrs
import torch

from lamploop.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from lamploop.errors import CheckpointError, FederatedError
from lamploop.federated.records import RoundRecord, rounds_from_json, rounds_to_json
from lamploop.state import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData

__all__ = ["EXTRA_NAME", "load_round_checkpoint", "save_round_checkpoint"]

EXTRA_NAME = "federated"
"""The checkpoint extra that holds the plan's hash and the round records."""


def _curve(rounds: Sequence[RoundRecord]) -> tuple[LearningCurveEntry, ...]:
    entries = []
    for record in rounds:
        before = record.validation_before
        validation = None if before is None else (before.loss, before.loss)
        metrics = {} if before is None else {name: (v, v) for name, v in before.metrics.items()}
        entries.append(LearningCurveEntry(record.round, record.training_loss, validation, {}, metrics))
    return tuple(entries)


def save_round_checkpoint(
    directory: str | os.PathLike[str],
    model: Mapping[str, torch.Tensor],
    rounds: Sequence[RoundRecord],
    plan_hash: str,
    *,
    keep_last: int | None = 3,
) -> pathlib.Path:
    """Checkpoint the global model after ``len(rounds)`` rounds; returns the checkpoint directory."""
    state = LoopStateWithModelAndOptimizerData(
        loop_state=LoopState(epoch=len(rounds), learning_curve=_curve(rounds)), model=model, optimizer={}
    )
    meta = {"plan_hash": plan_hash, "rounds": rounds_to_json(rounds)}
    return save_checkpoint(directory, state, extras={EXTRA_NAME: ({}, meta)}, keep_last=keep_last)


def load_round_checkpoint(
    directory: str | os.PathLike[str], *, plan_hash: str, model: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], tuple[RoundRecord, ...]] | None:
    """The latest round checkpoint in ``directory`` (``None`` if there is none yet).

    Returns:
        ``(global model, round records)``.

    Raises:
        CheckpointError: a checkpoint that is corrupt or does not fit ``model``.
        FederatedError: the checkpoint is of another plan (both hashes named) or not federated.
    """
    if latest_checkpoint(directory) is None:
        return None
    checkpoint = load_checkpoint(directory, model=model)
    extra = checkpoint.extras.get(EXTRA_NAME)
    path = latest_checkpoint(directory)
    if extra is None or not isinstance(extra[1], dict):
        msg = f"{path}: not a federated checkpoint (no {EXTRA_NAME!r} extra)"
        raise FederatedError(msg)
    meta = extra[1]
    if meta.get("plan_hash") != plan_hash:
        msg = f"{path}: the checkpoint is of plan {meta.get('plan_hash')!r}, this run's plan is {plan_hash!r}"
        raise FederatedError(msg)
    try:
        rounds = rounds_from_json(meta.get("rounds"))
    except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
        msg = f"{path}: the round records do not read back: {exc}"
        raise CheckpointError(msg) from exc
    if len(rounds) != checkpoint.state.loop_state.epoch:
        msg = f"{path}: {len(rounds)} round records for {checkpoint.state.loop_state.epoch} rounds done"
        raise CheckpointError(msg)
    return dict(checkpoint.state.model), rounds
