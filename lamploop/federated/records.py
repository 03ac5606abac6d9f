"""What a federated run records: per node and per round, as JSON through cattrs.

Only aggregate statistics appear here (sample counts, timings, losses and metric means);
no example ever leaves a node.

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import cattrs
import torch

from lamploop.federated.wire import Evaluation

__all__ = [
    "RECORD_CONVERTER",
    "FederatedResult",
    "MissingNode",
    "NodeReport",
    "RoundRecord",
    "pooled",
    "rounds_from_json",
    "rounds_to_json",
]


@attrs.frozen
class NodeReport:
    """One node's answer to a round (see :class:`~lamploop.federated.wire.RoundReply`)."""

    node: str
    sample_count: int
    train_wall_s: float
    train_cpu_s: float
    training_loss: float
    before: Evaluation | None
    after: Evaluation | None


@attrs.frozen
class MissingNode:
    """A node that was sent the round but did not answer it, and why (lost, refused, too late)."""

    node: str
    why: str


@attrs.frozen
class RoundRecord:
    """One finished round: who answered, who did not, and the pooled statistics.

    Attributes:
        round: the 0-based round.
        attempts: how many times the round was sent (more than 1 after too few answers).
        answered: the nodes averaged, in name order.
        missing: the nodes sent the round that were not averaged, and why.
        wall_s: seconds from sending the round to the new global model.
        training_loss: the answering nodes' training losses, weighted by sample count.
        validation_before: the round's global model on the nodes' validation data, pooled
            over their examples (``None`` without validation data).
        validation_after: the nodes' locally trained models, pooled likewise.
    """

    round: int
    attempts: int
    answered: tuple[NodeReport, ...]
    missing: tuple[MissingNode, ...]
    wall_s: float
    training_loss: float
    validation_before: Evaluation | None
    validation_after: Evaluation | None


@attrs.frozen
class FederatedResult:
    """What :func:`~lamploop.federated.aggregator.run_aggregator` returns.

    Attributes:
        model: the final global model (CPU tensors, the plan's dtypes).
        rounds: every round's record, oldest first (also those of a run that was resumed).
        plan_hash: the plan's hash.
    """

    model: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    rounds: tuple[RoundRecord, ...]
    plan_hash: str


def pooled(evaluations: Sequence[Evaluation | None]) -> Evaluation | None:
    """The evaluations pooled over their examples (means weighted by example counts)."""
    present = [e for e in evaluations if e is not None and e.examples > 0]
    if not present:
        return None
    total = sum(e.examples for e in present)
    loss = sum(e.loss * e.examples for e in present) / total
    names = sorted(set.intersection(*(set(e.metrics) for e in present)))
    metrics = {name: sum(e.metrics[name] * e.examples for e in present) / total for name in names}
    return Evaluation(loss, metrics, total)


def _make_converter() -> cattrs.Converter:
    return cattrs.Converter(forbid_extra_keys=True)


RECORD_CONVERTER: Final = _make_converter()
"""Round records to and from JSON."""


def rounds_to_json(rounds: Sequence[RoundRecord]) -> list[Any]:
    """The records as plain JSON."""
    out: list[Any] = RECORD_CONVERTER.unstructure(list(rounds))
    return out


def rounds_from_json(value: Any) -> tuple[RoundRecord, ...]:
    """Records from plain JSON (raises cattrs' errors; the caller says where)."""
    return tuple(RECORD_CONVERTER.structure(value, list[RoundRecord]))
