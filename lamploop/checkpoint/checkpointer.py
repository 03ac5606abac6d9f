"""``Checkpointer``: the training drivers' checkpoint callback, saving off the event loop."""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

from lamploop.checkpoint.extras import CheckpointExtra, capture_extras, check_extras
from lamploop.checkpoint.rng import RngStates
from lamploop.checkpoint.save import check_keep_last, save_checkpoint
from lamploop.checks import check_directory
from lamploop.loop.boundary import EpochPosition
from lamploop.state import LoopStateWithModelAndOptimizerData

# --------------------------------------------------------------------------------------------
# The epoch-loop callback


class Checkpointer:
    """A ``checkpoint_state`` callback for the training drivers: saves after every epoch.

    ``await checkpointer(state, schedule_state)`` runs :func:`save_checkpoint`
    in a worker thread, so the event loop (heartbeats, the control channel)
    stays responsive while files are written and fsynced.  Saves through one
    ``Checkpointer`` never overlap.  If the awaiting task is cancelled, the save
    in progress still finishes (a checkpoint is never abandoned half-written).

    Attributes:
        directory: the root directory.
        keep_last: passed to :func:`save_checkpoint`.
        extras: the checkpoint extras saved with every checkpoint (their states are taken at
            the call, on the caller's thread; see :mod:`lamploop.checkpoint.extras`).
        last_path: the directory of the last checkpoint saved, ``None`` before the first.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        extras: Mapping[str, CheckpointExtra] | None = None,
    ) -> None:
        """Save into ``directory``, keeping the last ``keep_last`` checkpoints.

        Raises:
            ConfigurationError: ``keep_last`` is not ``None`` or an int >= 1, an extra's
                name or object is unfit (see :func:`~lamploop.checkpoint.extras.check_extras`),
                or ``directory`` is not a path or is a file.
        """
        check_keep_last(keep_last, "Checkpointer")
        self.extras = check_extras("Checkpointer", extras)
        self.directory = check_directory("Checkpointer: directory", directory)
        self.keep_last = keep_last
        self.last_path: pathlib.Path | None = None
        self._lock = anyio.Lock()

    async def __call__(self, state: LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        """Save ``state`` and ``schedule_state``; see :func:`save_checkpoint` for what it raises."""
        # Captured here, in the caller's thread and at the moment of the call: other tasks
        # may draw random numbers while the worker thread writes.
        await self._save(state, schedule_state, rng=RngStates.capture())

    async def save_position(
        self,
        state: LoopStateWithModelAndOptimizerData,
        schedule_state: Any,
        position: EpochPosition,
        rank_rngs: Sequence[RngStates],
    ) -> None:
        """Save a checkpoint at a step boundary (see ``drive_distributed_training``).

        ``rank_rngs`` are every rank's RNG states there, rank 0's first.  Step 0 is the
        start of ``position.epoch``: saved as an epoch-boundary checkpoint, with the RNG states.
        """
        await self._save(
            state,
            schedule_state,
            rng=rank_rngs[0] if rank_rngs else RngStates.capture(),
            position=position if position.steps_done > 0 else None,
            rank_rngs=tuple(rank_rngs[1:]),
        )

    async def _save(
        self,
        state: LoopStateWithModelAndOptimizerData,
        schedule_state: Any,
        *,
        rng: RngStates,
        position: EpochPosition | None = None,
        rank_rngs: tuple[RngStates, ...] = (),
    ) -> None:
        # The extras too are captured in the caller's thread, before the worker thread writes.
        save = functools.partial(
            save_checkpoint,
            self.directory,
            state,
            schedule_state=schedule_state,
            keep_last=self.keep_last,
            rng=rng,
            position=position,
            rank_rngs=rank_rngs,
            extras=capture_extras(self.extras),
        )
        async with self._lock:
            self.last_path = await anyio.to_thread.run_sync(save)

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep_last={self.keep_last!r})"
