"""Step boundaries of a distributed run: stop on request, checkpoint inside an epoch.

Every rank's training pass asks its :class:`RankBoundary` at each step whether it wants a
checkpoint (the root, every N steps or T seconds) or a stop (any rank that got SIGTERM or
SIGINT: :class:`StopRequest`).  At a boundary the ranks agreed on, each rank sends its
progress and RNG states to the others (:meth:`~lamploop.sync.collectives.Collectives.gather_json`),
and the root hands them, as an :class:`~lamploop.loop.boundary.EpochPosition` and every
rank's RNG states, to its ``save`` function, which writes the checkpoint before any rank
goes on.  See docs/reliability.md.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from lamploop.checkpoint import RngStates
from lamploop.checkpoint.sharded import ShardWriter
from lamploop.loop.boundary import EpochPosition, StepProgress
from lamploop.loop.stop_request import StopRequest  # its home; importable from here as before
from lamploop.sync.collectives import Collectives

__all__ = ["RankBoundary", "SavePosition", "StopRequest", "rng_from_json", "rng_to_json"]

SavePosition = Callable[[EpochPosition, Sequence[RngStates]], Awaitable[None]]
"""The root's: write the checkpoint of a boundary, given every rank's RNG states."""


def rng_to_json(rng: RngStates) -> dict[str, Any]:
    """This process's RNG states as JSON-ready values (to travel between ranks, no pickle)."""
    algorithm, keys, pos, has_gauss, cached = rng.numpy
    version, internal, gauss_next = rng.python
    return {
        "torch_cpu": rng.torch_cpu.tolist(),
        "torch_cuda": [state.tolist() for state in rng.torch_cuda],
        "numpy": [str(algorithm), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [int(version), list(internal), gauss_next],
    }


def rng_from_json(value: dict[str, Any]) -> RngStates:
    """The inverse of :func:`rng_to_json`."""
    algorithm, keys, pos, has_gauss, cached = value["numpy"]
    version, internal, gauss_next = value["python"]
    return RngStates(
        torch_cpu=torch.tensor(value["torch_cpu"], dtype=torch.uint8),
        torch_cuda=tuple(torch.tensor(state, dtype=torch.uint8) for state in value["torch_cuda"]),
        numpy=(algorithm, np.array(keys, dtype=np.uint32), pos, has_gauss, cached),
        python=(version, tuple(internal), gauss_next),
    )


class RankBoundary:
    """One rank's :class:`~lamploop.loop.boundary.StepBoundary` in a run of one or more ranks.

    Args:
        collectives: the process group's, or ``None`` with one rank.
        stop: this rank's stop request.
        keep_rngs: at the end of every pass, send every rank's RNG states to the root
            (:attr:`kept_rngs`), for the checkpoint at the end of the epoch.
        epoch, lr_factor: the epoch in progress and its factor (set by the replica per epoch).
        save: the root's :data:`SavePosition` (``None`` on followers).
        every_steps, every_seconds: the root's checkpoint cadence inside an epoch (``None``: never).
    """

    def __init__(
        self,
        collectives: Collectives | None,
        stop: StopRequest,
        *,
        keep_rngs: bool = False,
        save: SavePosition | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
    ) -> None:
        self._collectives = collectives
        self._keep_rngs = keep_rngs
        self.kept_rngs: list[RngStates] = []
        self._stop = stop
        self._save = save
        self._every_steps = every_steps
        self._every_seconds = every_seconds
        self._last = time.monotonic()
        self._heard_reason = ""
        self.epoch = 0
        self.lr_factor = 1.0
        # A sharded model's (strategy fsdp): every rank writes its shards into the root's checkpoint.
        self.shard_writer: ShardWriter | None = None

    @property
    def stop_reason(self) -> str:
        """What asked for the stop (empty before any request): this rank's request, else the
        first one another rank gave at the last boundary (a request heard only in the step's
        sum may reach this rank before the control channel brings its reason)."""
        return self._stop.reason or self._heard_reason

    def requests(self, steps_done: int) -> tuple[bool, bool]:
        due = self._save is not None and (
            (self._every_steps is not None and (steps_done + 1) % self._every_steps == 0)
            or (self._every_seconds is not None and time.monotonic() - self._last >= self._every_seconds)
        )
        return due, self._stop.is_set()

    def _gather(self, mine: dict[str, Any], what: str) -> list[dict[str, Any]]:
        return [mine] if self._collectives is None else self._collectives.gather_json(mine, what)

    def keep_rng_states(self) -> None:
        """Every rank, at the end of a pass: the root keeps every rank's RNG states (if asked to)."""
        if self._keep_rngs:
            everyone = self._gather({"rng": rng_to_json(RngStates.capture())}, "RNG states")
            self.kept_rngs = [rng_from_json(rank["rng"]) for rank in everyone]

    async def reached(self, progress: StepProgress, *, stop: bool) -> None:
        mine: dict[str, Any] = {
            "progress": [progress.loss_sum, progress.example_count],
            "metrics": list(progress.metric_sums),
            "rng": rng_to_json(RngStates.capture()),
            "stop_reason": self._stop.reason,
        }
        everyone = self._gather(mine, "step boundary")
        self._heard_reason = next((str(rank["stop_reason"]) for rank in everyone if rank["stop_reason"]), "")
        self._last = time.monotonic()
        if self._save is None:
            if self.shard_writer is not None and self._keep_rngs:  # the root checkpoints here
                self.shard_writer.serve()
            return
        position = EpochPosition(
            epoch=self.epoch,
            lr_factor=self.lr_factor,
            steps_done=progress.steps_done,
            last_step_examples=progress.last_step_examples,
            loss_sums=tuple(float(rank["progress"][0]) for rank in everyone),
            example_counts=tuple(int(rank["progress"][1]) for rank in everyone),
            metric_sums=tuple(tuple(float(v) for v in rank["metrics"]) for rank in everyone),
        )
        await self._save(position, [rng_from_json(rank["rng"]) for rank in everyone])
