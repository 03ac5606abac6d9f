"""The on-disk format: file names, directory names, and the descriptor's schema (JSON via cattrs)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from typing import Any, Final

import attrs

from lamploop.checkpoint.rng import _RngRecord
from lamploop.checks import check_int
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import ModelSpec
from lamploop.state import LoopState

FORMAT_VERSION: Final = 2
"""The version of the on-disk format this lamploop writes and the newest it reads."""

DESCRIPTOR_NAME: Final = "checkpoint.json"
"""The descriptor's file name inside a checkpoint directory."""

LATEST_NAME: Final = "latest"
"""The pointer file in the root directory; it holds the newest checkpoint's directory name."""

MODEL_FILE: Final = "model.safetensors"
BEST_MODEL_FILE: Final = "best_model.safetensors"
AVERAGED_MODEL_FILE: Final = "averaged_model.safetensors"
OPTIMIZER_FILE: Final = "optimizer.safetensors"
RNG_FILE: Final = "rng.safetensors"

_log = logging.getLogger(__name__)

_CHECKPOINT_NAME: Final = re.compile(r"epoch-(\d{6,})(?:-step-(\d{6,}))?")
_TMP_PREFIX: Final = ".lamploop-tmp-"
_TMP_NAME: Final = re.compile(re.escape(_TMP_PREFIX) + r"([0-9a-f]{8})-(\d+)-[0-9a-f]+-.*")
_CHUNK: Final = 1 << 20

# Tags of the optimizer-state JSON encoding: a JSON object with exactly one of these keys stands
# for a value that plain JSON would lose.  Plain objects never have keys starting with "$".


def checkpoint_name(epoch: int, step: int | None = None) -> str:
    """The directory name of the checkpoint a run resumes at: ``epoch-000006`` (the start of
    epoch 6), or ``epoch-000005-step-000120`` (epoch 5 after its 120th step).

    Raises:
        ConfigurationError: ``epoch`` or ``step`` is not an int >= 0.
    """
    check_int("checkpoint_name: epoch", epoch, 0)
    if step is None:
        return f"epoch-{epoch:06d}"
    return f"epoch-{epoch:06d}-step-{check_int('checkpoint_name: step', step, 0):06d}"


def rank_rng_file(rank: int) -> str:
    """The file of rank ``rank``'s RNG states (ranks 1 and up; rank 0's are :data:`RNG_FILE`).

    Raises:
        ConfigurationError: ``rank`` is not an int >= 1.
    """
    return f"rng-rank{check_int('rank_rng_file: rank', rank, 1)}.safetensors"


# --------------------------------------------------------------------------------------------
# The descriptor


@attrs.frozen
class _FileRecord:
    sha256: str
    size: int


@attrs.frozen
class _Descriptor:
    format_version: int
    lamploop_version: str
    saved_at_unix_ns: int
    loop_state: LoopState
    schedule_state_type: str
    schedule_state: Any
    model_spec: ModelSpec
    best_model_spec: ModelSpec
    optimizer_tensors: ModelSpec
    optimizer: Any
    rng: _RngRecord
    files: dict[str, _FileRecord]
    # Format 2: a checkpoint at a step boundary inside an epoch, with every rank's RNG states.
    position: EpochPosition | None = None
    rank_rngs: list[_RngRecord] = attrs.Factory(list)
    sequence: int = 0
    # A run with weight averaging (lamploop.averaging): the averaged model and its update count.
    averaged_model_spec: ModelSpec | None = None
    averaged_count: int = 0
    # Checkpoint extras (lamploop.checkpoint.extras): each one's JSON meta; its tensors are in
    # extra-<name>.safetensors.  Absent in older checkpoints, and written only when there are any.
    extras: dict[str, Any] = attrs.Factory(dict)


def _to_json(value: Any, level: int = 0) -> str:
    """JSON text with one item per line, except containers short enough for one line."""
    compact = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or not value or len(compact) + 2 * level <= 100:
        return compact
    pad, end = "  " * (level + 1), "  " * level
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_to_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    items = [pad + _to_json(v, level + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + end + "]"


def _type_name(t: Any) -> str:
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', repr(t))}"


def lamploop_version() -> str:
    """The installed lamploop's version, as written into descriptors and run configurations."""
    try:
        return importlib.metadata.version("lamploop")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
