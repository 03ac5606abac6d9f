"""What the ranks settle once, before the first epoch, identically on every rank.

1. they agree on the gradient-sync strategy (``"auto"`` becomes ``all_reduce`` when every
   rank has an optimizer, else ``reduce_to_root``, before the ranks compare: a rank asking
   for ``"auto"`` agrees with one naming what it resolves to) and on the model's parameter
   names, shapes and dtypes;
2. the root's model state is broadcast, so followers start from it, also when resuming;
3. when every rank steps, the root's optimizer state is broadcast too (JSON skeleton and
   tensors over the group: nothing is pickled).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import attrs
import torch

from lamploop.checkpoint import RngStates
from lamploop.checkpoint.codec import decode_tree, encode_tree
from lamploop.distributed.boundaries import rng_from_json, rng_to_json
from lamploop.errors import DistributedError, mark_detected_by_every_rank
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import model_spec
from lamploop.sync.collectives import Collectives
from lamploop.sync.strategy import AUTO, SyncStrategy, strategy_named

__all__ = ["described_names", "frozen_parameters", "initial_sync", "share_resume_point"]

logger = logging.getLogger("lamploop")


def _resolve(collectives: Collectives, requested: str, has_optimizer: bool) -> SyncStrategy:
    """The strategy every rank settles on: ``"auto"`` resolved, then compared across the ranks.

    ``"auto"`` is ``all_reduce`` when every rank has an optimizer, else ``reduce_to_root``,
    so a rank that asks for ``"auto"`` agrees with one that names what it resolves to; ranks
    whose resolved strategies differ are refused on every rank, naming what each asked for.
    """
    with_optimizer = int(collectives.sum([float(has_optimizer)]).wait()[0])
    automatic = "all_reduce" if with_optimizer == collectives.nranks else "reduce_to_root"
    name = automatic if requested == AUTO else requested
    shown = f"{name} ({AUTO!r} resolved)" if requested == AUTO else name
    collectives.check_agreement("the sync strategy", name, shown=shown)
    if requested == AUTO and collectives.rank == 0:
        logger.info(
            "strategy 'auto' is %s: %d of %d ranks have an optimizer",
            name,
            with_optimizer,
            collectives.nranks,
        )
    return strategy_named(name)


def _broadcast_optimizer_state(collectives: Collectives, optimizer: torch.optim.Optimizer) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = (
        encode_tree(optimizer.state_dict(), tensors, error=DistributedError)
        if collectives.rank == 0
        else None
    )
    specs = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()]
    skeleton, specs = collectives.broadcast_json([skeleton, specs], "root's optimizer state")
    if collectives.rank != 0:
        tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in specs}
    collectives.broadcast_tensors(list(tensors.values()), "root's optimizer tensors")
    if collectives.rank != 0:
        optimizer.load_state_dict(
            decode_tree(skeleton, tensors, "the root's optimizer state", error=DistributedError)
        )


def initial_sync(
    collectives: Collectives,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    requested_strategy: str,
) -> tuple[SyncStrategy, torch.optim.Optimizer | None]:
    """Settle the strategy and the starting state; returns the strategy and this rank's optimizer.

    The optimizer is ``None`` on followers when the strategy steps on the root alone.

    Raises:
        DistributedError: the ranks disagree (the message names on what), or a collective failed.
    """
    strategy = _resolve(collectives, requested_strategy, optimizer is not None)
    collectives.check_agreement(
        "the model's parameter names, shapes and dtypes", model_spec(module).fingerprint()
    )
    # What is trained decides the gradient buckets: ranks that differ here would exchange
    # buffers of other sizes, which Gloo answers by aborting the process.
    frozen = frozen_parameters(module)
    collectives.check_agreement(
        "the model's frozen parameters (requires_grad=False)",
        hashlib.sha256("\n".join(frozen).encode()).hexdigest(),
        shown=described_names(frozen),
    )
    collectives.broadcast_tensors(list(module.state_dict().values()), "root's model state")
    if not strategy.steps_on_every_rank:
        return strategy, optimizer if collectives.rank == 0 else None
    if optimizer is None:
        msg = (
            f"rank {collectives.rank}: strategy {strategy.name!r} steps on every rank, "
            "but this rank has no optimizer (pass optimizer_factory)"
        )
        raise DistributedError(msg)
    _broadcast_optimizer_state(collectives, optimizer)
    return strategy, optimizer


def share_resume_point(
    collectives: Collectives,
    resume: tuple[EpochPosition | None, Sequence[RngStates]] | None,
    keep_rngs: bool,
) -> tuple[EpochPosition | None, bool]:
    """What the root resumes from, on every rank: the step boundary (if any), and whether to keep RNG states.

    Each rank restores its own RNG states from the checkpoint when it holds every rank's.
    ``keep_rngs`` (the root's: does it checkpoint?) tells every rank to send its RNG states
    to the root at the end of every pass, for the epoch-boundary checkpoints.

    Raises:
        DistributedError: (on every rank, detected by every rank) the checkpoint holds the
            RNG states of another number of ranks than this run's.
    """
    payload = None
    if collectives.rank == 0:
        position, rngs = resume if resume is not None else (None, ())
        payload = {
            "position": attrs.asdict(position) if position is not None else None,
            "rngs": [rng_to_json(rng) for rng in rngs],
            "keep_rngs": keep_rngs,
        }
    shared = collectives.broadcast_json(payload, "resume point")
    saved = len(shared["rngs"])
    if saved == collectives.nranks:
        rng_from_json(shared["rngs"][collectives.rank]).restore()
    elif saved > 1:  # every rank sees the same count: every rank refuses alike
        msg = f"the checkpoint holds the RNG states of {saved} ranks, this run has {collectives.nranks}"
        raise mark_detected_by_every_rank(DistributedError(msg))
    elif saved == 1 and collectives.rank == 1:
        logger.warning("the checkpoint holds the root's RNG states only: followers start from their own")
    raw = shared["position"]
    if raw is None:
        return None, bool(shared["keep_rngs"])
    position = EpochPosition(
        epoch=int(raw["epoch"]),
        lr_factor=float(raw["lr_factor"]),
        steps_done=int(raw["steps_done"]),
        last_step_examples=int(raw["last_step_examples"]),
        loss_sums=tuple(float(v) for v in raw["loss_sums"]),
        example_counts=tuple(int(v) for v in raw["example_counts"]),
        metric_sums=tuple(tuple(float(v) for v in sums) for sums in raw.get("metric_sums", ())),
    )
    return position, bool(shared["keep_rngs"])


def frozen_parameters(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s parameters that are not trained (``requires_grad=False``), in order."""
    return [name for name, parameter in module.named_parameters() if not parameter.requires_grad]


def described_names(names: Sequence[str], shown: int = 4) -> str:
    """``names`` for a message: the first few, and how many more; ``"none"`` when empty."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
