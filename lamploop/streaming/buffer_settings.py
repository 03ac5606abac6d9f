"""A stream buffer's settings (policy, capacity, watermark, seed, max_reads), its callbacks and stats.

:class:`~lamploop.streaming.buffers.StreamBuffer` and its subclasses take the settings as
keywords; :meth:`BufferSettings.check` turns them into one checked value, filling what was
left out from the policy (a FIFO's ``seed`` is 0, a reservoir's ``max_reads`` is ``None``),
and names the first bad one in a :class:`~lamploop.errors.ConfigurationError`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final

import attrs

from lamploop.errors import ConfigurationError
from lamploop.streaming.buffer_policy import Policy

__all__ = ["POLICY_DEFAULT", "BufferSettings", "BufferStats", "OnEvict", "OnRead", "check_int"]

OnRead = Callable[[tuple[str, int], int], None]
"""``on_read(key, seen)``: a sample was read; ``seen`` counts this read."""

OnEvict = Callable[[tuple[str, int], int], None]
"""``on_evict(key, seen)``: a reservoir evicted a sample that had been read ``seen`` times."""


class _Unset(enum.Enum):
    """An argument left out: the policy's default applies."""

    POLICY_DEFAULT = "the policy's default"

    def __repr__(self) -> str:
        return "<the policy's default>"


POLICY_DEFAULT: Final = _Unset.POLICY_DEFAULT
"""``max_reads``' default: the policy's ``default_max_reads`` (``None`` is a value: unlimited)."""

Unset = _Unset  # for annotations: ``int | Unset | None``


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``.

    Raises:
        ConfigurationError: naming ``owner`` and ``name``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"{owner}: {name} must be an int >= {minimum}, got {value!r}"
        raise ConfigurationError(msg)
    return value


def _policy(owner: str, given: Policy | None, fixed: Policy | None) -> Policy:
    """``given``, else the class's ``fixed`` policy; a class with a fixed policy takes no other."""
    if given is None:
        if fixed is None:
            msg = f"{owner}: policy= is required (FifoPolicy(), FiroPolicy(), ReservoirPolicy() or your own)"
            raise ConfigurationError(msg)
        return fixed
    if not isinstance(given, Policy):
        msg = f"{owner}: policy must be a lamploop.streaming.buffer_policy.Policy, got {given!r}"
        raise ConfigurationError(msg)
    if fixed is not None and given != fixed:
        msg = (
            f"{owner}: policy={given!r}, but a {owner}'s is {fixed!r}; "
            "for another policy, make a StreamBuffer(policy=...)"
        )
        raise ConfigurationError(msg)
    return given


@attrs.frozen
class BufferSettings:
    """What a buffer was made with, checked (see :class:`~lamploop.streaming.buffers.StreamBuffer`)."""

    policy: Policy
    capacity: int
    watermark: int
    seed: int
    max_reads: int | None

    @classmethod
    def check(
        cls,
        owner: str,
        *,
        policy: Policy | None,
        fixed_policy: Policy | None,
        capacity: int,
        watermark: int,
        seed: int | None,
        max_reads: int | Unset | None,
    ) -> BufferSettings:
        """The settings of buffer class ``owner``, with the policy's defaults for what was left out.

        ``fixed_policy`` is the class's own policy (``None`` for :class:`StreamBuffer`, whose
        ``policy`` is required); ``seed`` is ``None`` and ``max_reads`` :data:`POLICY_DEFAULT`
        when left out.

        Raises:
            ConfigurationError: a setting is out of range or missing, naming it.
        """
        chosen = _policy(owner, policy, fixed_policy)
        check_int(owner, "capacity", capacity, 1)
        check_int(owner, "watermark", watermark, 1)
        if watermark > capacity:
            msg = (
                f"{owner}: watermark={watermark} is above capacity={capacity}; reads would "
                "wait for more samples than the buffer can hold"
            )
            raise ConfigurationError(msg)
        if seed is None and chosen.draws:
            msg = f"{owner}: seed is required: the {chosen.name} policy draws at random"
            raise ConfigurationError(msg)
        check_int(owner, "seed", 0 if seed is None else seed, 0)
        reads = chosen.default_max_reads if max_reads is POLICY_DEFAULT else max_reads
        if reads is None:
            if not chosen.unlimited_reads:
                msg = (
                    f"{owner}: max_reads=None (unlimited) is only for ReservoirBuffer; a FIFO "
                    "or FIRO sample must leave after some reads, or producers wait forever"
                )
                raise ConfigurationError(msg)
        else:
            check_int(owner, "max_reads", reads, 1)
        return cls(chosen, capacity, watermark, 0 if seed is None else seed, reads)


@attrs.frozen
class BufferStats:
    """A buffer's counters at one moment, for metrics.

    Attributes:
        policy: the policy's name: ``"fifo"``, ``"firo"`` or ``"reservoir"``.
        capacity: the most samples it holds.
        fill: the samples it holds now.
        received: the samples put since it was made.
        read_total: the reads since it was made (a sample read twice counts twice).
        evicted: the samples a reservoir evicted (always 0 for FIFO and FIRO).
        closed: whether the producers said they were done.
    """

    policy: str
    capacity: int
    fill: int
    received: int
    read_total: int
    evicted: int
    closed: bool
