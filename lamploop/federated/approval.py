"""Plan approval: each node's allow-list of plan hashes, kept by its operator.

A node trains only plans whose hash (:func:`lamploop.federated.plan.plan_hash`) is on its
allow-list, a JSON file the operator edits with ``lamploop federated approve PLAN.json
--allow-list FILE`` (or :func:`approve_plan`)::

    {"approved": [{"hash": "3f1c...", "name": "digits-mlp", "approved_at": "2026-11-23T16:30:00Z"}]}

The node reads the file again at every round, so an approval (or a removal) takes effect
without restarting it.

.. versionadded:: 0.3
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import attrs
import cattrs

from lamploop.checkpoint.files import read_json_object
from lamploop.errors import ConfigurationError
from lamploop.federated.plan import TrainingPlan, plan_hash
from lamploop.strict_json import field_errors, strict_converter, write_atomically

__all__ = ["AllowList", "Approval", "approve_plan", "load_allow_list", "save_allow_list"]

_HEX = frozenset("0123456789abcdef")


def _sha256_hex(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        msg = f"{attribute.name} must be 64 lowercase hex digits (a sha256), got {value!r:.80}"
        raise ConfigurationError(msg)


@attrs.frozen
class Approval:
    """One approved plan: its hash, its name (for people) and when it was approved (ISO 8601, UTC)."""

    hash: str = attrs.field(validator=_sha256_hex)
    name: str = ""
    approved_at: str = ""


@attrs.frozen
class AllowList:
    """The plans a node may train."""

    approved: tuple[Approval, ...] = attrs.field(default=())

    @approved.validator
    def _check_approved(self, _: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, tuple) or not all(isinstance(a, Approval) for a in value):
            msg = f"AllowList: approved must be a tuple of Approval, got {type(value).__name__}"
            raise ConfigurationError(msg)

    def allows(self, digest: str) -> bool:
        """Whether the plan hash ``digest`` is approved."""
        return any(entry.hash == digest for entry in self.approved)


_CONVERTER = strict_converter()


def load_allow_list(path: str | os.PathLike[str], *, missing_ok: bool = False) -> AllowList:
    """The allow-list in ``path``.

    Args:
        path: the JSON file.
        missing_ok: a missing file is an empty list (else an error).

    Raises:
        ConfigurationError: the file is missing (unless ``missing_ok``), not JSON, or not an
            allow-list; the message starts with the path.
    """
    target = Path(path)
    if missing_ok and not target.exists():
        return AllowList()
    raw = read_json_object(target, ConfigurationError, missing="missing: no allow-list file there")
    try:
        return _CONVERTER.structure(raw, AllowList)
    except ConfigurationError as exc:
        msg = f"{target}: {exc}"
        raise ConfigurationError(msg) from exc
    except cattrs.BaseValidationError as exc:
        msg = f"{target}: {'; '.join(field_errors(exc))}"
        raise ConfigurationError(msg) from exc


def save_allow_list(allow_list: AllowList, path: str | os.PathLike[str]) -> Path:
    """Write ``allow_list`` to ``path`` atomically (creating its directory); returns the path."""
    if not isinstance(allow_list, AllowList):
        msg = f"save_allow_list: allow_list must be an AllowList, got {type(allow_list).__name__}"
        raise ConfigurationError(msg)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_CONVERTER.unstructure(allow_list), indent=2) + "\n"
    write_atomically(target, text.encode())
    return target


def approve_plan(plan: TrainingPlan, path: str | os.PathLike[str]) -> tuple[str, bool]:
    """Add ``plan``'s hash to the allow-list in ``path`` (created if missing).

    Returns:
        ``(hash, added)``: ``added`` is false when the hash was approved already.

    Raises:
        ConfigurationError: the existing file is not an allow-list.
    """
    if not isinstance(plan, TrainingPlan):
        msg = f"approve_plan: plan must be a TrainingPlan, got {type(plan).__name__}"
        raise ConfigurationError(msg)
    digest = plan_hash(plan)
    current = load_allow_list(path, missing_ok=True)
    if current.allows(digest):
        return digest, False
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    save_allow_list(AllowList((*current.approved, Approval(digest, plan.name, now))), path)
    return digest, True
