"""Mixed precision: autocast for the forward passes, and for fp16 a dynamic loss scale.

``precision="bf16"`` runs each forward pass (model and loss) under ``torch.autocast`` with
bfloat16; its range is float32's, so gradients need no scaling.  ``"fp16"`` autocasts to
float16 and scales the loss, as ``torch.amp.GradScaler`` does: backward is seeded with
``scale / expected`` instead of ``1 / expected``, the reduced gradients are unscaled, and a
step whose gradients hold an inf or a NaN is skipped while the scale halves; after
``growth_interval`` good steps in a row it doubles.  With ``all_reduce`` every rank holds the
same reduced gradients, so every rank finds the same overflow and skips the same steps
without any message between them.  Backward and the optimizer step run in the parameters'
own precision.

>>> scale = LossScale(scale=8.0, growth_interval=2)
>>> [scale.update(found_inf=f) or scale.scale for f in (False, False, True, False)]
[8.0, 16.0, 8.0, 8.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Final, Literal, TypeAlias

import torch

from lamploop.errors import ConfigurationError

__all__ = [
    "LOSS_SCALE_KEY",
    "PRECISIONS",
    "LossScale",
    "Precision",
    "autocast",
    "check_precision",
    "unscale_and_check",
]

LOSS_SCALE_KEY: Final = "lamploop_loss_scale"
"""Where a checkpoint's optimizer state keeps the fp16 loss scale (``load_state_dict`` ignores it)."""

Precision: TypeAlias = Literal["32", "bf16", "fp16"]
PRECISIONS: Final = ("32", "bf16", "fp16")
_DTYPES: Final = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(value: object) -> Precision:
    """``value`` if it names a precision, else ConfigurationError listing them."""
    if value not in PRECISIONS:
        msg = f"precision must be one of {PRECISIONS}, got {value!r}"
        raise ConfigurationError(msg)
    return value


@contextlib.contextmanager
def autocast(precision: Precision, device: torch.device | None) -> Iterator[None]:
    """The forward pass's autocast for ``precision`` on ``device`` (nothing for ``"32"``)."""
    if precision == "32":
        yield
        return
    with torch.autocast(device.type if device is not None else "cpu", dtype=_DTYPES[precision]):
        yield


class LossScale:
    """fp16's dynamic loss scale, GradScaler's rules, as plain numbers (one per run, kept across epochs).

    Attributes:
        scale: what the loss is multiplied by before backward.
        good_steps: steps since the last overflow or growth.
        skipped_steps: steps skipped for an overflow, in all.
    """

    def __init__(
        self,
        *,
        scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale, self.good_steps, self.skipped_steps = float(scale), 0, 0
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )

    def to_json(self) -> dict[str, float | int]:
        """The scale's state, JSON-ready (for checkpoints and for the other ranks)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_json(self, state: Any) -> None:
        """Go on from :meth:`to_json`'s state."""
        self.scale = float(state["scale"])
        self.good_steps, self.skipped_steps = int(state["good_steps"]), int(state["skipped_steps"])

    def update(self, *, found_inf: bool) -> None:
        """After a step: back off on an overflow, grow after ``growth_interval`` good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


def unscale_and_check(parameters: Sequence[torch.nn.Parameter], scale: float) -> bool:
    """Divide the gradients by ``scale``; whether any of them holds an inf or a NaN."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return False
    torch._foreach_mul_(grads, 1.0 / scale)
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    return not bool(finite)
