"""Checkpoint extras: named state saved beside the model, such as a stream buffer's.

An extra is any object with ``state_dict() -> (tensors, meta)`` and
``load_state_dict(tensors, meta)`` (:class:`CheckpointExtra`): ``tensors`` a flat mapping of
names to tensors, ``meta`` plain JSON (dicts, lists, strings, numbers, booleans, ``None``).
The :class:`~lamploop.checkpoint.Checkpointer` asks each for its state at the moment of the
save (on the caller's thread, so the state is a snapshot of that moment), writes the
tensors of extra ``name`` to ``extra-<name>.safetensors`` (listed with its sha256 and size
in ``checkpoint.json`` like every other file) and its ``meta`` into ``checkpoint.json``
under ``"extras"``.  A checkpoint without extras is written exactly as before, and older
checkpoints (no ``"extras"``) load unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

import torch

from lamploop.errors import CheckpointError, ConfigurationError

__all__ = [
    "CheckpointExtra",
    "ExtraState",
    "RankAware",
    "capture_extras",
    "check_extras",
    "extra_file",
    "rank_extra_name",
]

_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_RANK_SUFFIX: Final = re.compile(r"\.rank[0-9]+$")

ExtraState: TypeAlias = tuple[dict[str, torch.Tensor], Any]
"""An extra's saved state: its tensors and its JSON ``meta``."""


@runtime_checkable
class CheckpointExtra(Protocol):
    """Named state a checkpoint carries beside the model (see the module)."""

    def state_dict(self) -> tuple[Mapping[str, torch.Tensor], Any]:
        """``(tensors, meta)``: the state now; ``meta`` must be plain JSON."""
        ...

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        """Restore a state :meth:`state_dict` returned (raise ``CheckpointError`` if it does not fit)."""
        ...


@runtime_checkable
class RankAware(Protocol):
    """An extra that takes part when the ranks of a run meet (optional, beside :class:`CheckpointExtra`).

    Each rank's :meth:`rank_info` travels to every rank, and every rank's
    :meth:`ranks_joined` receives them all in rank order, before any training.  A stream
    state uses it to tell the root where each rank's receiver listens.
    """

    def rank_info(self) -> Any:
        """What the other ranks should know of this rank's extra (plain JSON)."""
        ...

    def ranks_joined(self, infos: list[Any], rank: int) -> None:
        """Every rank's :meth:`rank_info`, in rank order; ``rank`` is this rank."""
        ...


def rank_extra_name(name: str, rank: int) -> str:
    """Where rank ``rank``'s extra ``name`` is saved: ``name`` on rank 0, else ``name.rank<r>``."""
    return name if rank == 0 else f"{name}.rank{rank}"


def extra_file(name: str) -> str:
    """The file holding extra ``name``'s tensors: ``extra-<name>.safetensors``.

    Raises:
        ConfigurationError: ``name`` is not 1 to 100 of ``A-Z a-z 0-9 _ . -`` (not starting
            with ``.`` or ``-``): the file stays in its checkpoint's directory.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        msg = (
            "extra_file: an extra's name is 1 to 100 of A-Z a-z 0-9 _ . - (not starting with . or -), "
            f"got {name!r:.80}"
        )
        raise ConfigurationError(msg)
    return f"extra-{name}.safetensors"


def check_extras(where: str, extras: Mapping[str, CheckpointExtra] | None) -> Mapping[str, CheckpointExtra]:
    """``extras`` (``{}`` for ``None``) after checking every name and object.

    The mapping itself is kept, not a copy: a :class:`~lamploop.distributed.rank_extras.RankExtras`
    grows by the followers' states as a run goes on.

    Raises:
        ConfigurationError: not a mapping, a name that is not 1 to 100 of ``A-Z a-z 0-9 _ . -``
            (not starting with ``.`` or ``-``), or an object without ``state_dict`` and
            ``load_state_dict``.
    """
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        msg = f"{where}: checkpoint_extras must be a mapping of names to extras, got {type(extras).__name__}"
        raise ConfigurationError(msg)
    for name, extra in extras.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            msg = (
                f"{where}: checkpoint_extras name {name!r} is not 1 to 100 of A-Z a-z 0-9 _ . - "
                "(not starting with . or -); it names the file extra-<name>.safetensors"
            )
            raise ConfigurationError(msg)
        if _RANK_SUFFIX.search(name):
            msg = (
                f"{where}: checkpoint_extras name {name!r} ends like the names of other ranks' extras "
                "(<name>.rank<r>); choose another"
            )
            raise ConfigurationError(msg)
        if not isinstance(extra, CheckpointExtra):
            msg = (
                f"{where}: checkpoint_extras[{name!r}] is a {type(extra).__qualname__}, which has no "
                "state_dict() and load_state_dict(tensors, meta)"
            )
            raise ConfigurationError(msg)
    return extras


def capture_extras(extras: Mapping[str, CheckpointExtra]) -> dict[str, ExtraState]:
    """Every extra's state now: its tensors, and a private copy of its meta (checked to be JSON).

    Raises:
        CheckpointError: a ``state_dict()`` that does not return ``(tensors, meta)`` with
            ``meta`` JSON and ``tensors`` a mapping.
    """
    captured: dict[str, ExtraState] = {}
    for name, extra in extras.items():
        state = extra.state_dict()
        if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], Mapping)):
            got = type(state).__name__
            msg = f"checkpoint extra {name!r}: state_dict() must return (tensors, meta), got a {got}"
            raise CheckpointError(msg)
        tensors, meta = state
        try:
            text = json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            msg = f"checkpoint extra {name!r}: its meta cannot be stored as JSON ({e})"
            raise CheckpointError(msg) from e
        captured[name] = (dict(tensors), json.loads(text))
    return captured
