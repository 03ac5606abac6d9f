"""The checks of the arguments the transport's users share (ports, limits, timeouts).

Every check names the argument and the bad value and raises
:class:`~lamploop.errors.ConfigurationError`.  The ranges are inclusive at both ends, and
the message says so (``port must be an integer in [0, 65535], got 70000``).

.. versionadded:: 0.3
   moved here from the control channel's private modules.
"""

from __future__ import annotations

import math

from lamploop.errors import ConfigurationError

__all__ = ["check_int_in", "check_seconds_each"]


def check_seconds_each(**values: float) -> None:
    """Each value is a positive, finite number of seconds; raises ConfigurationError naming the first not."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            msg = f"{name} must be a positive number of seconds, got {value!r}"
            raise ConfigurationError(msg)


def check_int_in(name: str, value: int, low: int, high: float = math.inf) -> None:
    """``value`` is an integer (not a bool) in ``[low, high]``; raises ConfigurationError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        msg = f"{name} must be an integer in [{low}, {high}], got {value!r}"
        raise ConfigurationError(msg)
