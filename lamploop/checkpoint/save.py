"""``save_checkpoint``: write one checkpoint directory atomically and point ``latest`` at it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from lamploop.checkpoint.codec import encode_tree
from lamploop.checkpoint.extras import ExtraState, extra_file
from lamploop.checkpoint.files import (
    _cpu_tensors,
    _delete,
    _exchange,
    _next_sequence,
    _prune,
    _remove_stale_temporaries,
    _temp_name,
    _write_latest,
    _write_tensors,
    make_directory,
)
from lamploop.checkpoint.format import (
    AVERAGED_MODEL_FILE,
    BEST_MODEL_FILE,
    DESCRIPTOR_NAME,
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    _Descriptor,
    _to_json,
    _type_name,
    checkpoint_name,
    lamploop_version,
    rank_rng_file,
)
from lamploop.checkpoint.rng import RngStates, _rng_to_disk, _RngRecord
from lamploop.checkpoint.sharded import ShardedModelState
from lamploop.checks import check_directory, check_sequence_of
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import model_spec
from lamploop.state import LoopStateWithModelAndOptimizerData, converter
from lamploop.strict_json import fsync_dir

# --------------------------------------------------------------------------------------------
# Saving


def check_keep_last(keep_last: int | None, where: str) -> None:
    """Raise ConfigurationError (naming ``where``) unless ``keep_last`` is ``None`` or an int >= 1."""
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        msg = f"{where}: keep_last must be None or an int >= 1, got {keep_last!r}"
        raise ConfigurationError(msg)


def _check_parts(position: object, rank_rngs: object, extras: object, rng: object) -> None:
    """``save_checkpoint``'s optional parts, each of its type (a raw error from deep inside before)."""
    if position is not None and not isinstance(position, EpochPosition):
        msg = f"save_checkpoint: position must be an EpochPosition or None, got {type(position).__name__}"
        raise ConfigurationError(msg)
    if rng is not None and not isinstance(rng, RngStates):
        msg = (
            f"save_checkpoint: rng must be RngStates (RngStates.capture()) or None, got {type(rng).__name__}"
        )
        raise ConfigurationError(msg)
    check_sequence_of("save_checkpoint: rank_rngs", rank_rngs, RngStates)
    if extras is not None and not isinstance(extras, Mapping):
        msg = (
            "save_checkpoint: extras must be a mapping of names to (tensors, meta) states or None, "
            f"got {type(extras).__name__}"
        )
        raise ConfigurationError(msg)


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: LoopStateWithModelAndOptimizerData,
    *,
    schedule_state: Any = None,
    keep_last: int | None = 3,
    rng: RngStates | None = None,
    position: EpochPosition | None = None,
    rank_rngs: Sequence[RngStates] = (),
    extras: Mapping[str, ExtraState] | None = None,
) -> pathlib.Path:
    """Save ``state`` as ``<directory>/epoch-NNNNNN`` and point ``<directory>/latest`` at it.

    The RNG states of this process are captured at call time (unless ``rng``
    is given).  The tensors of
    ``state`` must not change until this returns (the epoch loop awaits its
    ``checkpoint_state`` callback, so they do not).  A checkpoint of the same
    epoch that already exists is replaced.

    Args:
        directory: the root directory of the run's checkpoints; created if missing.
        state: what to save; ``state.loop_state.epoch`` names the directory.
        schedule_state: the learning-rate schedule state the next epoch will
            use (``None`` or plain data such as :class:`~lamploop.schedules.PlateauState`);
            stored as JSON through :data:`lamploop.state.converter`.
        keep_last: how many checkpoint directories to keep, counting the new
            one and ordered by when they were saved; ``None`` keeps all.
        rng: the RNG states to store (default: :meth:`RngStates.capture` now).
        position: where inside epoch ``state.loop_state.epoch`` this checkpoint is taken
            (a step boundary; ``None``: at the start of that epoch); names the directory
            ``epoch-NNNNNN-step-SSSSSS``.
        rank_rngs: the RNG states of ranks 1, 2... at that position (rank 0's are ``rng``).
        extras: named extra states ``(tensors, meta)`` (see :mod:`lamploop.checkpoint.extras`),
            written to ``extra-<name>.safetensors`` and the descriptor.

    A sharded run's state (strategy ``fsdp``) has a
    :class:`~lamploop.checkpoint.sharded.ShardedModelState` as its model: every rank's shards
    of the model, the optimizer and the best model go into the same directory before it is
    renamed into place (:class:`~lamploop.checkpoint.sharded.ShardWriter`).

    Returns:
        The new checkpoint directory.

    Raises:
        ConfigurationError: ``state`` is not a ``LoopStateWithModelAndOptimizerData``,
            its epoch is negative, ``keep_last`` is out of range, or ``directory`` is not
            a path or is a file.
        CheckpointError: something in ``state`` or ``schedule_state`` cannot be
            stored without pickle (a non-tensor in a state dict, an object in
            the optimizer state, a schedule state that is not plain data).
        OSError: writing, fsyncing or renaming failed (the previous checkpoint
            and ``latest`` are then left as they were).
    """
    if not isinstance(state, LoopStateWithModelAndOptimizerData):
        msg = (
            "save_checkpoint: state must be a LoopStateWithModelAndOptimizerData, "
            f"got {type(state).__qualname__}"
        )
        raise ConfigurationError(msg)
    check_keep_last(keep_last, "save_checkpoint")
    epoch = state.loop_state.epoch
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        msg = f"save_checkpoint: state.loop_state.epoch must be an int >= 0, got {epoch!r}"
        raise ConfigurationError(msg)
    root = check_directory("save_checkpoint: directory", directory)
    _check_parts(position, rank_rngs, extras, rng)
    if position is not None and position.epoch != epoch:
        msg = f"save_checkpoint: position.epoch={position.epoch} but state.loop_state.epoch={epoch}"
        raise ConfigurationError(msg)
    name = checkpoint_name(epoch, position.steps_done if position is not None else None)
    contents = _Contents.of(
        state, schedule_state, RngStates.capture() if rng is None else rng, rank_rngs, extras or {}
    )
    make_directory(root, "save_checkpoint")
    _remove_stale_temporaries(root)
    temp = root / _temp_name(name)
    make_directory(temp, "save_checkpoint")
    try:
        contents.write(temp, state, schedule_state, position, _next_sequence(root))
        if isinstance(state.model, ShardedModelState):  # every rank's shards, before the rename
            state.model.shard_writer.write_into(temp)
        final, replaced = _put_in_place(root, temp, name)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _write_latest(root, name)
    if replaced is not None:
        _delete(replaced, "the replaced checkpoint")
    if keep_last is not None:
        _prune(root, keep_last, final)
    return final


def storable_schedule_state(schedule_state: Any) -> Any:
    """``schedule_state`` as the JSON a checkpoint stores; CheckpointError if it cannot be stored."""
    schedule_json = converter.unstructure(schedule_state)
    try:
        json.dumps(schedule_json)
    except (TypeError, ValueError) as e:
        msg = (
            f"schedule state: a {type(schedule_state).__qualname__} cannot be stored as JSON ({e}); "
            "schedule states must be None or attrs classes of plain values"
        )
        raise CheckpointError(msg) from e
    return schedule_json


@attrs.frozen
class _Contents:
    """What a checkpoint holds, checked and converted before anything touches the disk."""

    model: dict[str, torch.Tensor]
    best_model: dict[str, torch.Tensor]
    averaged_model: dict[str, torch.Tensor]
    optimizer_json: Any
    optimizer_tensors: dict[str, torch.Tensor]
    schedule_json: Any
    rngs: list[tuple[_RngRecord, dict[str, torch.Tensor]]]
    extras: dict[str, ExtraState]

    @classmethod
    def of(
        cls,
        state: LoopStateWithModelAndOptimizerData,
        schedule_state: Any,
        rng: RngStates,
        rank_rngs: Sequence[RngStates],
        extras: Mapping[str, ExtraState],
    ) -> _Contents:
        if not isinstance(state.optimizer, Mapping):
            msg = (
                "optimizer state: expected a mapping (optimizer.state_dict()), "
                f"got {type(state.optimizer).__qualname__}"
            )
            raise CheckpointError(msg)
        raw_optimizer_tensors: dict[str, torch.Tensor] = {}
        optimizer_json = encode_tree(state.optimizer, raw_optimizer_tensors, error=CheckpointError)
        schedule_json = storable_schedule_state(schedule_state)
        return cls(
            model=_cpu_tensors(state.model, "model state dict"),
            best_model=_cpu_tensors(state.best_model, "best model state dict"),
            averaged_model=_cpu_tensors(state.averaged_model, "averaged model state dict"),
            optimizer_json=optimizer_json,
            optimizer_tensors=_cpu_tensors(raw_optimizer_tensors, "optimizer state"),
            schedule_json=schedule_json,
            rngs=[_rng_to_disk(r) for r in (rng, *rank_rngs)],
            extras={
                name: (_cpu_tensors(tensors, f"checkpoint extra {name!r}"), meta)
                for name, (tensors, meta) in extras.items()
            },
        )

    def write(
        self,
        directory: pathlib.Path,
        state: LoopStateWithModelAndOptimizerData,
        schedule_state: Any,
        position: EpochPosition | None,
        sequence: int,
    ) -> None:
        """Every file into ``directory``, the descriptor last, each fsynced, then the directory."""
        files = {
            MODEL_FILE: _write_tensors(directory / MODEL_FILE, self.model, "model state dict"),
            BEST_MODEL_FILE: _write_tensors(
                directory / BEST_MODEL_FILE, self.best_model, "best model state dict"
            ),
            OPTIMIZER_FILE: _write_tensors(
                directory / OPTIMIZER_FILE, self.optimizer_tensors, "optimizer state"
            ),
        }
        if self.averaged_model:
            files[AVERAGED_MODEL_FILE] = _write_tensors(
                directory / AVERAGED_MODEL_FILE, self.averaged_model, "averaged model state dict"
            )
        for rank, (_, tensors) in enumerate(self.rngs):
            file = RNG_FILE if rank == 0 else rank_rng_file(rank)
            files[file] = _write_tensors(directory / file, tensors, f"rank {rank}'s RNG states")
        for name, (tensors, _) in self.extras.items():
            file = extra_file(name)
            files[file] = _write_tensors(directory / file, tensors, f"checkpoint extra {name!r}")
        descriptor = _Descriptor(
            format_version=FORMAT_VERSION,
            lamploop_version=lamploop_version(),
            saved_at_unix_ns=time.time_ns(),
            loop_state=state.loop_state,
            schedule_state_type=_type_name(type(schedule_state)),
            schedule_state=self.schedule_json,
            model_spec=model_spec(self.model),
            best_model_spec=model_spec(self.best_model),
            optimizer_tensors=model_spec(self.optimizer_tensors),
            optimizer=self.optimizer_json,
            rng=self.rngs[0][0],
            files=files,
            position=position,
            rank_rngs=[record for record, _ in self.rngs[1:]],
            sequence=sequence,
            averaged_model_spec=model_spec(self.averaged_model) if self.averaged_model else None,
            averaged_count=state.averaged_count,
            extras={name: meta for name, (_, meta) in self.extras.items()},
        )
        with open(directory / DESCRIPTOR_NAME, "w", encoding="utf-8") as f:
            raw = converter.unstructure(descriptor)
            if not raw["extras"]:  # without extras, exactly what lamploop wrote before them
                del raw["extras"]
            f.write(_to_json(raw) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(directory)


def _put_in_place(
    root: pathlib.Path, temp: pathlib.Path, name: str
) -> tuple[pathlib.Path, pathlib.Path | None]:
    """Rename the written ``temp`` to ``root/name``; the final path, and where a replaced copy went."""
    final = root / name
    replaced: pathlib.Path | None = None
    if final.exists() and _exchange(temp, final):
        # The new copy took the old one's place in one step; the old one is now at temp.
        replaced = root / _temp_name(f"trash-{name}")
        os.rename(temp, replaced)
    elif final.exists():
        # Without an atomic exchange: move the old one aside first (latest names it
        # meanwhile; a load then falls back to the newest valid checkpoint).
        replaced = root / _temp_name(f"trash-{name}")
        os.rename(final, replaced)
        try:
            os.rename(temp, final)
        except BaseException:
            os.rename(replaced, final)
            raise
    else:
        os.rename(temp, final)
    fsync_dir(root)
    return final, replaced
