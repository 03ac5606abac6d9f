"""``reduce_to_root``: lamp's strategy; gradients are summed into the root, which steps alone.

After the root's step the parameters are broadcast from it in buckets, and the next
forward pass waits for them module by module (a forward pre-hook per module), so the
broadcast overlaps with the start of the next step.  Only the root holds optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from lamploop.sync.all_reduce import AllReduceSync
from lamploop.sync.buckets import FlatBuckets, bucket_layout
from lamploop.sync.collectives import Collectives, Work
from lamploop.sync.strategy import GradientSync

__all__ = ["ReduceToRoot", "ReduceToRootSync"]


class _ParameterBroadcast:
    """The parameters in flat buckets broadcast from the root; forwards wait for their buckets."""

    def __init__(
        self,
        collectives: Collectives,
        params: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        bucket_cap_mb: float,
    ) -> None:
        self._collectives = collectives
        self._flat = FlatBuckets(params, bucket_layout(params, bucket_cap_mb))
        self.flats = self._flat.flats
        with torch.no_grad():
            for i, p in enumerate(params):
                self._flat.views[i].copy_(p)
                p.data = self._flat.views[i]
        bucket_of = {id(params[i]): b for b, members in enumerate(self._flat.groups) for i in members}
        self._in_flight: dict[int, Work] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for m in modules:
            needed = sorted({bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of})
            if needed:
                self.handles.append(m.register_forward_pre_hook(self._await(needed)))

    def _await(self, needed: list[int]) -> Callable[..., None]:
        def before_forward(*_: object) -> None:
            for b in needed:
                work = self._in_flight.pop(b, None)
                if work is not None:
                    self._collectives.wait(work, "parameter broadcast")

        return before_forward

    def start(self) -> None:
        for b, flat in enumerate(self._flat.flats):
            self._in_flight[b] = self._collectives.broadcast_from_root([flat])

    def wait_all(self) -> None:
        for b in sorted(self._in_flight):
            self._collectives.wait(self._in_flight.pop(b), "parameter broadcast")

    def close(self, *, abandon: bool) -> None:
        if abandon:
            self._in_flight.clear()
        else:
            self.wait_all()
        for handle in self.handles:
            handle.remove()


class ReduceToRootSync(AllReduceSync):
    """The :class:`~lamploop.sync.strategy.GradientSync` of :class:`ReduceToRoot`."""

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> None:
        super().__init__(
            collectives,
            parameters,
            bucket_cap_mb=bucket_cap_mb,
            launch=collectives.reduce_to_root,
            keeps_result=collectives.rank == 0,
        )
        self._parameters = _ParameterBroadcast(collectives, self._buckets.params, modules, bucket_cap_mb)

    def parameter_bucket_bytes(self) -> list[int]:
        """The parameter broadcast buckets' sizes in bytes (for reports)."""
        return [flat.numel() * flat.element_size() for flat in self._parameters.flats]

    def after_step(self) -> None:
        super().after_step()
        self._parameters.start()

    def end_pass(self) -> None:
        self._parameters.wait_all()

    def close(self, *, abandon: bool) -> None:
        self._parameters.close(abandon=abandon)
        super().close(abandon=abandon)


@attrs.frozen
class ReduceToRoot:
    """The ``reduce_to_root`` strategy (registered by :mod:`lamploop.sync`)."""

    name: str = "reduce_to_root"
    steps_on_every_rank: bool = False

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        return ReduceToRootSync(collectives, parameters, modules, bucket_cap_mb=bucket_cap_mb)
