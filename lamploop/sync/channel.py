"""The tensor channel: how the ranks that train together combine gradients and statistics.

:func:`lamploop.one_epoch` talks to other ranks only through a :class:`TensorChannel`, so
the same epoch code serves one process (:class:`SingleProcessChannel`) and many
(:class:`~lamploop.sync.group_channel.ProcessGroupChannel`, over a ``torch.distributed``
process group).  The gradient contract is :class:`~lamploop.sync.strategy.GradientSync`'s.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from lamploop.sync.strategy import GradientSync

__all__ = ["KnownSum", "PendingSum", "SingleProcessChannel", "TensorChannel"]


class PendingSum(Protocol):
    """A sum over ranks in flight."""

    def wait(self) -> list[float]:
        """Block until the sum is known and return it."""
        ...


class KnownSum:
    """A sum already known (one rank)."""

    def __init__(self, values: Sequence[float]) -> None:
        self._values = [float(v) for v in values]

    def wait(self) -> list[float]:
        return self._values


class TensorChannel(Protocol):
    """What one epoch needs from the ranks that train together."""

    @property
    def rank(self) -> int: ...

    @property
    def nranks(self) -> int: ...

    def gradient_sync(self, module: torch.nn.Module) -> GradientSync:
        """The gradient sync of ``module``'s parameters (the same object for the same module)."""
        ...

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum small float vectors over all ranks (float64, blocking)."""
        ...

    def sync_buffers(self, module: torch.nn.Module) -> None:
        """Make ``module``'s buffers alike on every rank (blocking; see :mod:`lamploop.sync.buffers`)."""
        ...

    def begin_all_reduce_sum(
        self, values: Sequence[float], *, per_rank: float | torch.Tensor | None = None
    ) -> PendingSum:
        """Start summing ``values`` over all ranks; ``.wait()`` gives the sums.

        With ``per_rank`` (a number, or a 0-dim tensor that may still be computing on the
        device), the result has ``nranks`` more entries: entry ``len(values) + r`` is rank
        ``r``'s ``per_rank``, carried by the same collective (each rank fills its own slot).
        """
        ...


class _LocalGradients:
    """One rank: gradients are complete after backward; only the scale is applied."""

    reduces_linearly = True

    def __init__(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        self._parameters = [p for p in parameters if p.requires_grad]

    def begin_pass(self) -> None:
        for p in self._parameters:
            p.grad = None

    def last_backward(self) -> None:
        """Nothing to start."""

    def reduce(self, scale: float) -> None:
        if scale != 1.0:
            grads = [p.grad for p in self._parameters if p.grad is not None]
            torch._foreach_mul_(grads, scale)

    def after_step(self) -> None:
        self.begin_pass()

    def end_pass(self) -> None:
        """Nothing in flight."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Stateless."""

    def close(self, *, abandon: bool) -> None:
        """No hooks to remove."""


class SingleProcessChannel:
    """The trivial channel of a run with one rank."""

    rank = 0
    nranks = 1

    def __init__(self) -> None:
        self._syncs: weakref.WeakKeyDictionary[torch.nn.Module, GradientSync] = weakref.WeakKeyDictionary()

    def gradient_sync(self, module: torch.nn.Module) -> GradientSync:
        """Gradients need no reduction; ``reduce`` only rescales them (the same object for the
        same module, as :class:`TensorChannel` promises)."""
        sync = self._syncs.get(module)
        if sync is None:
            sync = self._syncs[module] = _LocalGradients(list(module.parameters()))
        return sync

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """The sum over one rank is the values themselves."""
        return [float(v) for v in values]

    def sync_buffers(self, module: torch.nn.Module) -> None:
        """One rank's buffers are alike already."""

    def begin_all_reduce_sum(
        self, values: Sequence[float], *, per_rank: float | torch.Tensor | None = None
    ) -> PendingSum:
        """Already known: the values themselves (and ``per_rank``, this rank's slot)."""
        return KnownSum(list(values) if per_rank is None else [*values, float(per_rank)])
