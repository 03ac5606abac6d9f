"""Checks of what a batch stream yields, and of the losses, with errors that say where.

Every message names the epoch, the batch (0-based, on this rank) and the rank when it is
not the root, so that a bad item in a stream of thousands is found at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch

from lamploop.batches import Batch
from lamploop.errors import BatchError, ConfigurationError, LamploopError, NonFiniteLossError
from lamploop.model import SupervisedModel

__all__ = ["NONE_BATCH", "check_finite", "check_stream", "loss_of", "prepare", "where"]


def where(epoch: int | None, batch: int, rank: int, stream: str = "") -> str:
    """``epoch 3, batch 7`` (``epoch 3, batch 7 (validation)`` when ``stream`` says so), and the
    rank when it is not 0."""
    place = f"batch {batch}" if epoch is None else f"epoch {epoch}, batch {batch}"
    if stream:
        place += f" ({stream})"
    return place if rank == 0 else f"{place} on rank {rank}"


def _leading_sizes(features: Any) -> list[int]:
    if isinstance(features, torch.Tensor):
        return [int(features.shape[0])] if features.dim() > 0 else []
    if isinstance(features, Mapping):
        features = list(features.values())
    if isinstance(features, (list, tuple)):
        return [size for f in features for size in _leading_sizes(f)]
    return []


class _NoneBatch:
    """A stream's ``None`` item, where the training pass's ``None`` means "the stream ended"."""


NONE_BATCH: Final = _NoneBatch()


def prepare(
    item: Any, device: torch.device | None, epoch: int | None, index: int, rank: int, stream: str = ""
) -> Batch:
    """Check one batch and move it to ``device``; errors name the epoch, batch and rank (and the
    ``stream``, ``"validation"`` for a validation pass's)."""

    def place() -> str:
        return where(epoch, index, rank, stream)

    if not isinstance(item, (tuple, list)) or len(item) != 2:
        got = "NoneType" if item is NONE_BATCH else type(item).__name__
        msg = f"{place()}: expected a (features, target) pair, got {got}"
        raise BatchError(msg)
    features, target = item
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        msg = f"{place()}: the target must be a tensor with a batch dimension, got {target!r:.80}"
        raise BatchError(msg)
    n = int(target.shape[0])
    if n == 0:
        msg = f"{place()}: the batch is empty (0 examples)"
        raise BatchError(msg)
    sizes = _leading_sizes(features)
    if any(size != n for size in sizes):
        msg = f"{place()}: features have batch size {sizes[0] if sizes[0] != n else sizes}, target has {n}"
        raise BatchError(msg)
    if device is not None:
        features = _to_device(features, device)
        target = target.to(device, non_blocking=True)
    return features, target


def loss_of(
    model: SupervisedModel, batch: Batch, epoch: int | None, index: int, rank: int, stream: str = ""
) -> tuple[torch.Tensor, int, Sequence[tuple[torch.Tensor, int]]]:
    """The model's loss sum, example count and metrics on one batch; an error inside names the batch."""
    values: Sequence[tuple[torch.Tensor, int]]
    try:
        if model.metrics:
            loss_sum, count, values = model.loss_and_metrics(*batch)
        else:
            (loss_sum, count), values = model.loss_sum_and_count(*batch), ()
    except (LamploopError, torch.OutOfMemoryError):
        raise  # ours say where already; running out of memory is no fault of the batch
    except Exception as exc:
        # e.g. a target of the wrong dtype for the loss, a metric dividing by zero: the error's
        # message, and where it happened
        failed = "the model, its loss or a metric" if model.metrics else "the model or its loss"
        msg = f"{where(epoch, index, rank, stream)}: {failed} failed: {type(exc).__name__}: {exc}"
        raise BatchError(msg) from exc
    if torch.is_grad_enabled() and not loss_sum.requires_grad:
        # A training pass (validation runs under no_grad): backward would fail with torch's
        # "element 0 of tensors does not require grad", naming neither the loss nor the batch.
        msg = (
            f"{where(epoch, index, rank)}: the loss sum does not depend on any parameter that requires "
            "grad (no grad_fn): does the loss detach it (.item(), torch.tensor(...), .detach()), or are "
            "all of the module's parameters frozen?"
        )
        raise ConfigurationError(msg)
    return loss_sum, count, values


def check_stream(batches: object, made_by: str | None = None) -> None:
    """``batches`` is an async iterable, as a batch factory must return.

    ``made_by`` says where it came from in the error, e.g. ``"train_batches(epoch 0, rank 1 of 2)"``.
    """
    if not hasattr(batches, "__aiter__"):
        hint = ""
        if hasattr(batches, "__iter__"):
            hint = "; make the factory with lamploop.iterable_batches(factory_of_plain_iterables)"
        source = "" if made_by is None else f" that {made_by} returned"
        kind = type(batches).__name__
        msg = f"the batch stream{source} is a {kind}, not an async iterable of batches{hint}"
        raise ConfigurationError(msg)


def _to_device(features: Any, device: torch.device) -> Any:
    if isinstance(features, torch.Tensor):
        return features.to(device, non_blocking=True)
    if isinstance(features, Mapping):
        return {key: _to_device(value, device) for key, value in features.items()}
    if isinstance(features, (list, tuple)):
        return type(features)(_to_device(f, device) for f in features)
    return features


def check_finite(
    losses: Sequence[torch.Tensor],
    total: float,
    epoch: int | None,
    rank: int,
    *,
    first_index: int = 0,
    stream: str = "",
) -> None:
    """Raise NonFiniteLossError naming the first bad batch (``losses[0]`` is batch ``first_index``)."""
    if math.isfinite(total):
        return
    bad = (
        [i for i, finite in enumerate(torch.isfinite(torch.stack(list(losses))).tolist()) if not finite]
        if losses
        else []
    )
    if bad:
        index = first_index + bad[0]
        msg = f"{where(epoch, index, rank, stream)}: the loss is {float(losses[bad[0]])}"
        raise NonFiniteLossError(msg, epoch=epoch, batch=index)
    place = "" if epoch is None else f" of epoch {epoch}"
    msg = f"the mean loss{place} is {total}: a non-finite loss came from another rank"
    raise NonFiniteLossError(msg, epoch=epoch, batch=None)
