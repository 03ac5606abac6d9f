"""The check each reporter with an optional package makes when it is made."""

from __future__ import annotations

import importlib

from lamploop.errors import MissingDependencyError

__all__ = ["require_extra"]


def require_extra(who: str, package: str, extra: str, *also: str) -> None:
    """Import ``package`` (and the modules ``also`` names) now, so that a reporter made without
    its optional package fails where it is made, not at the first event.

    ``package`` itself is imported first: its submodules may be cached while it is not.

    Raises:
        MissingDependencyError: one cannot be imported; the message names ``who``, ``package``
            and ``pip install "lamploop[<extra>]"``.
    """
    try:
        for module in (package, *also):
            importlib.import_module(module)
    except ImportError as exc:
        msg = f'{who} needs {package}: pip install "lamploop[{extra}]"'
        raise MissingDependencyError(msg) from exc
