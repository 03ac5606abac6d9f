"""A pass's metric sums: per batch, as tensors, until the pass ends (see :mod:`lamploop.metrics`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lamploop.errors import ConfigurationError

__all__ = ["MetricSums"]


class MetricSums:
    """The per-batch ``(sum, count)`` of each named metric, batch positions as in the pass's losses.

    ``start``: the totals a pass resumed at a step boundary had before it (see :meth:`totals`).
    """

    def __init__(self, names: Sequence[str], start: Sequence[float] = ()) -> None:
        self.names = tuple(names)
        if start and len(start) != 2 * len(self.names):
            msg = (
                f"the pass resumes with the sums of {len(start) // 2} metrics, but the model has "
                f"{len(self.names)} ({list(self.names)}): resume with the metrics it was saved with"
            )
            raise ConfigurationError(msg)
        self._start = list(start) if start else [0.0] * (2 * len(self.names))
        self._sums: list[list[torch.Tensor]] = [[] for _ in self.names]
        self._counts: list[list[int]] = [[] for _ in self.names]

    def __bool__(self) -> bool:
        return bool(self.names)

    def add(self, values: Sequence[tuple[torch.Tensor, int]]) -> None:
        """One batch's values, in :attr:`names` order."""
        for sums, counts, (value, count) in zip(self._sums, self._counts, values, strict=True):
            sums.append(torch.as_tensor(value).detach().to(torch.float64))
            counts.append(int(count))

    def drop_from(self, position: int) -> None:
        """Leave out the batches from ``position`` on (a skipped step's)."""
        for sums, counts in zip(self._sums, self._counts, strict=True):
            sums[position:] = [torch.zeros_like(s) for s in sums[position:]]
            counts[position:] = [0] * len(counts[position:])

    def totals(self) -> list[float]:
        """``[sum, count]`` of each metric over this rank's batches, flattened (to be summed over ranks)."""
        out: list[float] = []
        for sums, counts in zip(self._sums, self._counts, strict=True):
            out += [float(torch.stack(sums).sum()) if sums else 0.0, float(sum(counts))]
        return [begun + now for begun, now in zip(self._start, out, strict=True)]

    def means(self, reduced: Sequence[float]) -> dict[str, float]:
        """Each metric's mean from :meth:`totals` summed over the ranks (metrics nobody counted left out)."""
        pairs = zip(self.names, reduced[0::2], reduced[1::2], strict=True)
        return {name: total / count for name, total, count in pairs if count > 0}
