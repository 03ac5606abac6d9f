"""What a training step does when a loss is NaN or infinite: the policy and its error.

The check costs no synchronisation of its own.  With several ranks, each rank's loss sum
of the step rides in the per-step sum of example counts, in a slot of its own (see
:meth:`lamploop.sync.channel.TensorChannel.begin_all_reduce_sum`), so every rank learns,
from the same numbers, whether any rank's loss was bad and which: all raise alike, or
all skip the step alike.  With one rank on the CPU the loss is already a host number.
The error is one that every rank detects itself
(:attr:`~lamploop.errors.LamploopError.detected_by_every_rank`), so each rank raises its
own, never the abort message of the first rank to raise it.

>>> check_policy("skip_step")
'skip_step'
>>> check_policy("ignore")
Traceback (most recent call last):
...
lamploop.errors.ConfigurationError: on_non_finite_loss must be one of ('raise', 'skip_step'), got 'ignore'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, Literal, TypeAlias

import torch

from lamploop.errors import ConfigurationError, NonFiniteLossError

__all__ = [
    "NON_FINITE_POLICIES",
    "NonFiniteLossPolicy",
    "bad_ranks",
    "check_policy",
    "step_error",
    "step_loss",
]

NonFiniteLossPolicy: TypeAlias = Literal["raise", "skip_step"]
"""``"raise"``: stop with :class:`NonFiniteLossError` before the bad step changes anything.
``"skip_step"``: every rank skips that optimizer step (its gradients are dropped and its
batches do not count in the epoch's loss), logs a warning and goes on."""

NON_FINITE_POLICIES: Final = ("raise", "skip_step")


def check_policy(value: object) -> NonFiniteLossPolicy:
    """``value`` if it is a policy's name, else ConfigurationError listing them."""
    if value not in NON_FINITE_POLICIES:
        msg = f"on_non_finite_loss must be one of {NON_FINITE_POLICIES}, got {value!r}"
        raise ConfigurationError(msg)
    return value


def step_loss(losses: Sequence[torch.Tensor]) -> float | torch.Tensor:
    """The sum of one step's batch losses on this rank: a host number when they are on the
    CPU (reading it costs nothing), else a device tensor (reading it would wait for the device)."""
    if not losses:
        return 0.0
    if losses[0].device.type == "cpu":
        return math.fsum(float(loss) for loss in losses)
    return torch.stack(list(losses)).sum()


def bad_ranks(per_rank: Sequence[float]) -> tuple[int, ...]:
    """The ranks whose entry (their step's loss sum) is NaN or infinite."""
    return tuple(rank for rank, value in enumerate(per_rank) if not math.isfinite(value))


def step_error(
    *,
    epoch: int | None,
    step: int,
    batches: range,
    ranks: Sequence[int],
    per_rank: Sequence[float],
    rank: int,
    batch: int | None,
    skipped: bool = False,
) -> NonFiniteLossError:
    """What happened, naming the epoch, the step, the ranks and their batches.

    ``batches`` are the step's batch indices on a rank; ``batch`` is this rank's (``rank``)
    first bad one, ``None`` when its losses were finite.  Raised under policy ``"raise"``;
    under ``"skip_step"`` (``skipped``) its text is the warning.
    """
    place = f"step {step}" if epoch is None else f"epoch {epoch}, step {step}"
    span = f"batch {batches.start}" if len(batches) == 1 else f"batches {batches.start}-{batches[-1]}"

    def on(r: int) -> str:
        if r == rank and batch is not None:
            where = f"batch {batch}"
        else:
            where = span if len(batches) == 1 else f"one of {span}"
        return f"rank {r} ({where}, step loss sum {per_rank[r]})"

    if skipped:
        then = "every rank skipped the step (on_non_finite_loss='skip_step')"
    else:
        then = "the optimizer step was not taken (on_non_finite_loss='skip_step' skips such steps instead)"
    msg = f"{place}: a non-finite loss on {', '.join(on(r) for r in ranks)}; {then}"
    return NonFiniteLossError(msg, epoch=epoch, batch=batch, step=step, ranks=tuple(ranks))
