"""``powersgd<r>``: gradients all-reduced as rank-``r`` factors (PowerSGD, Vogels et al. 2019).

Each weight matrix's gradient ``M`` (``n x m``; a convolution's kernel as ``out x rest``)
plus the error this rank left out before is sent as two thin factors instead of ``n*m``
numbers: ``P = M Q`` is summed over ranks and orthonormalised, then ``Q = M^T P`` is
summed, and every rank uses ``P Q^T``, the projection of the summed gradient on ``P``'s
columns.  What each rank's projection missed, ``M - P (M^T P)^T``, is its error feedback,
added to its next gradient, so nothing is lost, only delayed.  ``Q`` is kept from step to
step (warm start: one power iteration per step refines the subspace), so rank 4 tracks
the dominant directions well after a few steps.

Costs: ``r * (n + m)`` numbers per matrix instead of ``n * m``, in two all-reduces per step
(one latency more than all-reduce) that start only after backward (no overlap with it);
a QR of ``n x r`` and three thin matrix products per matrix; the error feedback is one
more copy of the compressed gradients per rank.  Tensors where the factors would not be
:attr:`PowerSGD.min_compression_ratio` times smaller (biases, small layers) are
all-reduced whole, in one flat buffer.  With ``r`` at least ``min(n, m)`` and every
matrix compressed the sum is exact (up to rounding): tests/sync/test_strategies_compression.py.

Example weighting and the uneven-stream rule hold: the factors are sums like the
gradients, scaled after; a rank with no batch sends its error feedback only.  The state
(each matrix's ``Q``, identical on every rank, and this rank's error feedback) is
:meth:`PowerSGDSync.state_dict`.  Learned from PyTorch's ``powerSGD_hook``; the error
here is each rank's own residual, as in the paper, which makes the full-rank case exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from lamploop.checks import int_at_least
from lamploop.errors import ConfigurationError
from lamploop.sync.buckets import FlatBuckets, bucket_layout
from lamploop.sync.collectives import Collectives, Work
from lamploop.sync.strategy import GradientSync, check_saved_state

__all__ = ["PowerSGD", "PowerSGDSync"]


@attrs.define
class _Matrix:
    """One compressed gradient: its parameter, shape as a matrix, factor rank and state."""

    param: torch.nn.Parameter
    rows: int
    cols: int
    rank: int
    q: torch.Tensor
    error: torch.Tensor


def _orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``p``'s columns (Householder QR: orthonormal even if ``p`` is singular)."""
    q: torch.Tensor = torch.linalg.qr(p, mode="reduced").Q
    return q


class PowerSGDSync:
    """The :class:`~lamploop.sync.strategy.GradientSync` of :class:`PowerSGD`.

    Attributes:
        payload_bytes: bytes handed to all-reduces so far by this rank.
    """

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        strategy: PowerSGD,
        *,
        bucket_cap_mb: float,
    ) -> None:
        self._collectives = collectives
        self._strategy = strategy
        self._params = [p for p in parameters if p.requires_grad]
        self._matrices: dict[int, _Matrix] = {}
        self.steps = 0
        self.payload_bytes = 0
        small: list[int] = []
        for i, p in enumerate(self._params):
            matrix = self._as_matrix(i, p)
            if matrix is None:
                small.append(i)
            else:
                self._matrices[i] = matrix
        self._small = small
        self._small_flat = FlatBuckets(
            [self._params[i] for i in small], bucket_layout([self._params[i] for i in small], bucket_cap_mb)
        )

    def _as_matrix(self, index: int, p: torch.nn.Parameter) -> _Matrix | None:
        if p.dim() < 2:
            return None
        rows = p.shape[0]
        cols = p.numel() // rows
        rank = min(self._strategy.rank, rows, cols)
        if rows * cols < self._strategy.min_compression_ratio * rank * (rows + cols):
            return None
        q = self._fresh_q(index, cols, rank, p)
        return _Matrix(p, rows, cols, rank, q, torch.zeros(rows, cols, dtype=p.dtype, device=p.device))

    def _fresh_q(self, index: int, cols: int, rank: int, p: torch.Tensor) -> torch.Tensor:
        # The same seed on every rank gives every rank the same Q without sending it.
        generator = torch.Generator().manual_seed(self._strategy.seed + 1_000_003 * self.steps + index)
        return torch.randn(cols, rank, generator=generator, dtype=p.dtype).to(p.device)

    def compressed(self) -> list[tuple[int, int, int]]:
        """``(rows, cols, rank)`` of every compressed gradient, in parameter order (for reports)."""
        return [(m.rows, m.cols, m.rank) for m in self._matrices.values()]

    def begin_pass(self) -> None:
        for p in self._params:
            p.grad = None

    def last_backward(self) -> None:
        """Nothing starts during backward: the factors need the complete gradients."""

    def _all_reduce(self, flats: list[torch.Tensor]) -> list[Work]:
        works = []
        for flat in flats:
            self.payload_bytes += flat.numel() * flat.element_size()
            works.append(self._collectives.all_reduce([flat]))
        return works

    def _wait(self, works: list[Work], what: str) -> None:
        for work in works:
            self._collectives.wait(work, what)

    def reduce(self, scale: float) -> None:
        # The small tensors travel whole while the factors are computed.
        for view, i in zip(self._small_flat.views, self._small, strict=True):
            grad = self._params[i].grad
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
        small_works = self._all_reduce(self._small_flat.flats)
        if self._matrices:
            self._reduce_matrices(scale)
        self._wait(small_works, "uncompressed gradients")
        for view, i in zip(self._small_flat.views, self._small, strict=True):
            p = self._params[i]
            if scale != 1.0:
                view.mul_(scale)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
        self.steps += 1

    def _reduce_matrices(self, scale: float) -> None:
        matrices = list(self._matrices.values())
        if not self._strategy.warm_start:
            for i, m in self._matrices.items():
                m.q = self._fresh_q(i, m.cols, m.rank, m.param)
        inputs = []
        for m in matrices:
            grad = m.param.grad
            # The gradient plus what this rank's earlier projections left out, in the
            # error buffer itself (no 16 MB allocation per step for a 2048 x 2048 layer).
            if grad is not None:
                m.error.add_(grad.reshape(m.rows, m.cols))
            inputs.append(m.error)
        ps = [x @ m.q for x, m in zip(inputs, matrices, strict=True)]
        ps = self._summed(ps, "PowerSGD P factors")
        ps = [_orthonormal_columns(p) for p in ps]
        # (P^T M)^T, not M^T P: the same numbers, 20x faster on a CPU than a transposed M.
        local_qs = [(p.T @ x).T for x, p in zip(inputs, ps, strict=True)]
        flat_q, works = self._start_sum(local_qs)
        # While the Q factors travel: what this rank's projection leaves out, for next time.
        for p, q, m in zip(ps, local_qs, matrices, strict=True):
            m.error.addmm_(p, q.T, alpha=-1.0)
        self._wait(works, "PowerSGD Q factors")
        qs = self._split(flat_q, local_qs)
        for p, q, m in zip(ps, qs, matrices, strict=True):
            grad = m.param.grad
            if grad is None or not grad.is_contiguous():
                grad = m.param.grad = torch.empty_like(m.param, memory_format=torch.contiguous_format)
            torch.mm(p, q.T, out=grad.view(m.rows, m.cols))
            if scale != 1.0:
                grad.mul_(scale)
            m.q = q  # warm start: the next step's power iteration begins from here

    def _start_sum(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[Work]]:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return flat, self._all_reduce([flat])

    @staticmethod
    def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, offset = [], 0
        for t in like:
            out.append(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return out

    def _summed(self, tensors: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        flat, works = self._start_sum(tensors)
        self._wait(works, what)
        return self._split(flat, tensors)

    def after_step(self) -> None:
        for p in self._params:
            p.grad = None

    def end_pass(self) -> None:
        """Nothing stays in flight after :meth:`reduce`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``steps``; ``q.<i>``, ``error.<i>`` per compressed parameter ``i`` (among the trainable ones)."""
        state = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        for i, m in self._matrices.items():
            state[f"q.{i}"] = m.q.detach().clone()
            state[f"error.{i}"] = m.error.detach().clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors (saved by a sync of the same model and rank).

        Raises:
            CheckpointError: keys or shapes that do not match this model's compressed gradients.
        """
        check_saved_state("PowerSGD", state, self.state_dict())
        self.steps = int(state["steps"])
        for i, m in self._matrices.items():
            m.q = state[f"q.{i}"].to(m.q).clone()
            m.error.copy_(state[f"error.{i}"])

    def close(self, *, abandon: bool) -> None:
        self.begin_pass()


def _check_ratio(_: object, __: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        msg = f"PowerSGD: min_compression_ratio must be a finite number >= 0, got {value!r}"
        raise ConfigurationError(msg)


def _default_name(self: PowerSGD) -> str:
    return f"powersgd{self.rank}"


def _below_2_to_the_63(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value >= 2**63:
        msg = (
            f"PowerSGD: {attribute.name} must be below 2**63 (each step's generator adds to it), got {value}"
        )
        raise ConfigurationError(msg)


@attrs.frozen
class PowerSGD:
    """The PowerSGD strategy (``powersgd1`` and ``powersgd4`` are registered; register others).

    Attributes:
        rank: the factors' rank ``r`` (capped per matrix at ``min(n, m)``).
        warm_start: keep ``Q`` from step to step (else a fresh random ``Q`` every step).
        min_compression_ratio: compress a gradient only if ``n*m >= ratio * r*(n+m)``;
            ``0`` compresses every matrix (even where the factors are larger).
        seed: seeds the random initial ``Q`` (the same on every rank).
        name: the registered name (default ``powersgd<rank>``).

    Raises:
        ConfigurationError: a rank below 1, a negative or infinite ratio, a negative seed.

    Example::

        lamploop.register_strategy(PowerSGD(rank=8))  # then TrainingSettings(strategy="powersgd8")
    """

    rank: int = attrs.field(default=4, validator=int_at_least("PowerSGD", 1))
    warm_start: bool = True
    min_compression_ratio: float = attrs.field(default=2.0, validator=_check_ratio)
    # Half of the 64 bits: each step's generator is seeded with seed + 1_000_003 * step + index.
    seed: int = attrs.field(default=0, validator=[int_at_least("PowerSGD", 0), _below_2_to_the_63])
    name: str = attrs.field(default=attrs.Factory(_default_name, takes_self=True))
    steps_on_every_rank: bool = attrs.field(default=True, init=False)
    keeps_state: bool = attrs.field(default=True, init=False)  # Q and the error feedback, checkpointed

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        return PowerSGDSync(collectives, parameters, self, bucket_cap_mb=bucket_cap_mb)
