"""``all_reduce``: every rank gets the summed gradients and steps its own optimizer replica.

Communication is bucketed and overlapped with the step's last backward
(:class:`~lamploop.sync.buckets.BucketedReduction`), as in DistributedDataParallel.
Every rank needs an optimizer; they stay identical because they start from the root's
state and see the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from lamploop.sync.buckets import BucketedReduction
from lamploop.sync.collectives import Collectives, Work
from lamploop.sync.strategy import GradientSync

__all__ = ["AllReduce", "AllReduceSync"]


class AllReduceSync:
    """The :class:`~lamploop.sync.strategy.GradientSync` of :class:`AllReduce`.

    Also the base of strategies that reduce in buckets with another collective
    (``launch``), such as :class:`~lamploop.sync.reduce_to_root.ReduceToRootSync`.
    """

    reduces_linearly = True  # a sum, scaled after: the loop may guess the step's count

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        *,
        bucket_cap_mb: float,
        launch: Callable[[list[torch.Tensor]], Work] | None = None,
        keeps_result: bool = True,
    ) -> None:
        self._buckets = BucketedReduction(
            collectives,
            parameters,
            launch=launch if launch is not None else collectives.all_reduce,
            keeps_result=keeps_result,
            bucket_cap_mb=bucket_cap_mb,
        )

    def bucket_bytes(self) -> list[int]:
        """The gradient buckets' sizes in bytes, in launch order (for reports)."""
        return self._buckets.bucket_bytes()

    def begin_pass(self) -> None:
        self._buckets.clear()

    def last_backward(self) -> None:
        self._buckets.arm()

    def reduce(self, scale: float) -> None:
        self._buckets.reduce(scale)

    def after_step(self) -> None:
        self._buckets.clear()

    def end_pass(self) -> None:
        """Nothing stays in flight after :meth:`reduce`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Stateless: nothing to restore."""

    def close(self, *, abandon: bool) -> None:
        self._buckets.close()


@attrs.frozen
class AllReduce:
    """The ``all_reduce`` strategy (registered by :mod:`lamploop.sync`)."""

    name: str = "all_reduce"
    steps_on_every_rank: bool = True

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        return AllReduceSync(collectives, parameters, bucket_cap_mb=bucket_cap_mb)
