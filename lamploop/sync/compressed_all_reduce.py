"""``all_reduce_bf16`` and ``all_reduce_fp16``: the all-reduce strategy with half-width gradients.

Each gradient bucket is cast to 16 bits right before its all-reduce (still launched as the
bucket fills during the step's last backward, as in :mod:`~lamploop.sync.all_reduce`), and
the sum is widened back into the bucket before it is scaled: half the bytes on the wire,
the example weighting and the uneven-stream rule unchanged (a rank with no batch sends
zeros).  What it approximates: each rank's gradient and every partial sum is rounded to 16
bits (bf16 keeps 8 significant bits, fp16 11).

fp16 has a narrow range (largest finite 65504), so it travels pre-divided by the number
of ranks (the sum cannot exceed what one rank sent) and multiplied by a loss-scale-like
factor that every rank holds alike: it halves when a reduced bucket comes back with an
infinity or NaN (that bucket is then all-reduced again in full width, so the step is
still right) and doubles after :attr:`CompressedAllReduce.growth_interval` steps without
one.  Every rank sees the same reduced bucket, so they take the same decisions without
talking.  The factor and its count of good steps are the sync's state (checkpointed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal

import attrs
import torch

from lamploop.checks import int_at_least
from lamploop.errors import ConfigurationError
from lamploop.sync.buckets import BucketedReduction
from lamploop.sync.collectives import Collectives, Work
from lamploop.sync.strategy import GradientSync

__all__ = ["CompressedAllReduce", "CompressedAllReduceSync", "WireDtype"]

WireDtype = Literal["bf16", "fp16"]
_DTYPES: Final = {"bf16": torch.bfloat16, "fp16": torch.float16}
INITIAL_FP16_SCALE: Final = 2.0**16
"""The fp16 factor's start (as ``torch.amp.GradScaler``); the first overflows bring it down."""
MAX_FP16_SCALE: Final = 2.0**24


class CompressedAllReduceSync:
    """The :class:`~lamploop.sync.strategy.GradientSync` of :class:`CompressedAllReduce`.

    Attributes:
        payload_bytes: bytes handed to all-reduces so far by this rank (16-bit buckets,
            plus the full-width retries of fp16 overflows).
        fallbacks: fp16 buckets that overflowed and were all-reduced again in full width.
    """

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        *,
        wire: WireDtype,
        growth_interval: int,
        bucket_cap_mb: float,
    ) -> None:
        self._collectives = collectives
        self._wire = _DTYPES[wire]
        self._scaled = wire == "fp16"
        # bf16 has float32's range: a guessed scale corrected after the sum is harmless.
        # fp16's range and its scale factor need gradients in the step's units.
        self.reduces_linearly = not self._scaled
        self._growth_interval = growth_interval
        self.scale = INITIAL_FP16_SCALE if self._scaled else 1.0
        self.good_steps = 0
        self.payload_bytes = 0
        self.fallbacks = 0
        self._low: dict[int, torch.Tensor] = {}  # a 16-bit staging buffer per flat bucket
        self._launched: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._buckets = BucketedReduction(
            collectives, parameters, launch=self._launch, keeps_result=False, bucket_cap_mb=bucket_cap_mb
        )

    def _launch(self, tensors: list[torch.Tensor]) -> Work:
        (flat,) = tensors
        low = self._low.get(id(flat))
        if low is None:
            low = self._low[id(flat)] = torch.empty_like(flat, dtype=self._wire)
        if self._scaled:
            # The sum of nranks values below 65504 / nranks stays finite.
            torch.mul(flat, self.scale / self._collectives.nranks, out=low)
        else:
            low.copy_(flat)
        self._launched.append((flat, low))
        self.payload_bytes += low.numel() * low.element_size()
        return self._collectives.all_reduce([low])

    def begin_pass(self) -> None:
        self._buckets.clear()

    def last_backward(self) -> None:
        self._buckets.arm()

    def reduce(self, scale: float) -> None:
        self._buckets.reduce(1.0)  # waits for every bucket; the sums are in the 16-bit buffers
        overflowed = False
        for flat, low in self._launched:
            if self._scaled and not bool(torch.isfinite(low).all()):
                # Every rank holds the same sum, so every rank retries this bucket.
                overflowed = True
                self.fallbacks += 1
                self.payload_bytes += flat.numel() * flat.element_size()
                self._collectives.wait(self._collectives.all_reduce([flat]), "full-width gradient retry")
                flat.mul_(scale)
                continue
            flat.copy_(low)
            factor = scale * self._collectives.nranks / self.scale if self._scaled else scale
            if factor != 1.0:
                flat.mul_(factor)
        self._launched.clear()
        if self._scaled:
            self._update_scale(overflowed=overflowed)

    def _update_scale(self, *, overflowed: bool) -> None:
        if overflowed:
            self.scale /= 2.0
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self._growth_interval:
            self.scale = min(self.scale * 2.0, MAX_FP16_SCALE)
            self.good_steps = 0

    def after_step(self) -> None:
        self._buckets.clear()

    def end_pass(self) -> None:
        """Nothing stays in flight after :meth:`reduce`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp16: the scale and its count of good steps (identical on every rank); bf16: nothing."""
        if not self._scaled:
            return {}
        return {
            "fp16_scale": torch.tensor(self.scale, dtype=torch.float64),
            "fp16_good_steps": torch.tensor(self.good_steps, dtype=torch.int64),
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors.

        Raises:
            ConfigurationError: keys missing or unexpected.
        """
        expected = set(self.state_dict())
        if set(state) != expected:
            msg = f"compressed all-reduce state: expected the keys {sorted(expected)}, got {sorted(state)}"
            raise ConfigurationError(msg)
        if self._scaled:
            self.scale = float(state["fp16_scale"])
            self.good_steps = int(state["fp16_good_steps"])

    def close(self, *, abandon: bool) -> None:
        self._launched.clear()
        self._buckets.close()


def _check_wire(_: object, __: attrs.Attribute[str], value: object) -> None:
    if value not in _DTYPES:
        msg = f"CompressedAllReduce: wire must be one of {sorted(_DTYPES)}, got {value!r}"
        raise ConfigurationError(msg)


def _default_name(self: CompressedAllReduce) -> str:
    return f"all_reduce_{self.wire}"


@attrs.frozen
class CompressedAllReduce:
    """All-reduce with gradients sent in 16 bits (``all_reduce_bf16`` and ``all_reduce_fp16`` are registered).

    Attributes:
        wire: ``"bf16"`` or ``"fp16"``, the width on the wire.
        growth_interval: fp16 only: steps without an overflow before the factor doubles.
        name: the registered name (default ``all_reduce_<wire>``).

    Raises:
        ConfigurationError: an unknown ``wire`` or a ``growth_interval`` below 1.
    """

    wire: WireDtype = attrs.field(default="bf16", validator=_check_wire)
    growth_interval: int = attrs.field(default=200, validator=int_at_least("CompressedAllReduce", 1))
    name: str = attrs.field(default=attrs.Factory(_default_name, takes_self=True))
    steps_on_every_rank: bool = attrs.field(default=True, init=False)

    @property
    def keeps_state(self) -> bool:
        """fp16 keeps its scale from step to step (checkpointed); bf16 keeps nothing."""
        return self.wire == "fp16"

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        return CompressedAllReduceSync(
            collectives,
            parameters,
            wire=self.wire,
            growth_interval=self.growth_interval,
            bucket_cap_mb=bucket_cap_mb,
        )
