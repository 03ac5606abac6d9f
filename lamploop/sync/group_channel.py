"""The tensor channel over a ``torch.distributed`` process group.

The channel owns the group's :class:`~lamploop.sync.collectives.Collectives` (Gloo for CPU
devices, NCCL for CUDA ones: built over a store by
:func:`lamploop.distributed.process_group.new_process_group`, never the global default
group, so several channels can live in one process) and makes each model's gradient
sync with the run's :class:`~lamploop.sync.strategy.SyncStrategy`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lamploop.sync.buckets import DEFAULT_BUCKET_CAP_MB
from lamploop.sync.buffers import average_buffers
from lamploop.sync.collectives import DEFAULT_COLLECTIVE_TIMEOUT_S, Collectives, Group, Pending
from lamploop.sync.strategy import GradientSync, SyncStrategy, strategy_named

__all__ = ["ProcessGroupChannel"]


class ProcessGroupChannel:
    """A :class:`~lamploop.sync.channel.TensorChannel` over one process group."""

    def __init__(
        self,
        collectives: Collectives,
        strategy: SyncStrategy,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        self.collectives = collectives
        self.strategy = strategy
        self._bucket_cap_mb = bucket_cap_mb
        self._syncs: dict[int, GradientSync] = {}

    @classmethod
    def of_group(
        cls,
        group: Group,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        strategy: str = "all_reduce",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> ProcessGroupChannel:
        """A channel over ``group`` with the registered ``strategy`` (to call ``one_epoch`` directly)."""
        collectives = Collectives(group, rank=rank, nranks=nranks, device=device, timeout=timeout)
        return cls(collectives, strategy_named(strategy), bucket_cap_mb=bucket_cap_mb)

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def nranks(self) -> int:
        return self.collectives.nranks

    def gradient_sync(self, module: torch.nn.Module) -> GradientSync:
        sync = self._syncs.get(id(module))
        if sync is None:
            sync = self.strategy.gradient_sync(
                self.collectives,
                list(module.parameters()),
                list(module.modules()),
                bucket_cap_mb=self._bucket_cap_mb,
            )
            self._syncs[id(module)] = sync
        return sync

    def syncs(self) -> list[GradientSync]:
        """The gradient syncs made so far (for reports)."""
        return list(self._syncs.values())

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return self.collectives.sum(values).wait()

    def sync_buffers(self, module: torch.nn.Module) -> None:
        average_buffers(self.collectives, module)

    def begin_all_reduce_sum(
        self, values: Sequence[float], *, per_rank: float | torch.Tensor | None = None
    ) -> Pending:
        return self.collectives.sum(values, per_rank=per_rank)

    def close(self, *, abandon: bool = False) -> None:
        """Release the gradient syncs; with ``abandon`` (the run failed) wait for nothing.

        The group itself is the owner's: after a failure it may hold work that a lost peer
        never joins, and destroying it would block (see :mod:`lamploop.sync.abandon`).
        """
        for sync in self._syncs.values():
            sync.close(abandon=abandon)
        self._syncs.clear()
