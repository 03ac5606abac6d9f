"""``ProducerDirectory``: which rank's receiver serves which producer, sticky and round-robin.

With several ranks, each rank has a :class:`~lamploop.streaming.receiver.SampleReceiver`, but
the producers know one address: the root rank's.  The root's receiver holds a directory (every
rank's receiver address, in rank order) and answers each producer's hello with the receiver
assigned to it.  A producer's first arrival assigns it the rank with the fewest producers so far
(the lowest such rank: from an empty directory that is plain round-robin, 0, 1, ..., n-1, 0, ...);
the assignment never changes afterwards, across reconnections and, restored from a checkpoint
(:attr:`ProducerDirectory.assignments`), across restarts, so that a producer always goes back
to the rank whose buffer holds its acknowledged samples.

.. versionadded:: 0.2
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

from lamploop.checks import check_mapping
from lamploop.errors import ConfigurationError
from lamploop.streaming.wire import check_producer_name

__all__ = ["ProducerDirectory"]


def _address(where: str, value: object) -> tuple[str, int]:
    if not (
        isinstance(value, tuple | list)
        and len(value) == 2
        and isinstance(value[0], str)
        and value[0]
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
        and 1 <= value[1] <= 65535
    ):
        msg = f"{where} must be a (host, port) pair with a port in [1, 65535], got {value!r:.80}"
        raise ConfigurationError(msg)
    return (value[0], value[1])


class ProducerDirectory:
    """The producers' assignment to ranks (restored, or empty), and the ranks' addresses once known.

    Args:
        assignments: producer name -> rank index, from a checkpoint (:attr:`assignments`), or
            fixed beforehand.
        own_index: this receiver's rank index, if known before :meth:`set_addresses`: its own
            producers are then served at once, before the addresses are known.

    Raises:
        ConfigurationError: a name is not a producer's name, or an index not an int >= 0.
    """

    def __init__(self, assignments: Mapping[str, int] | None = None, *, own_index: int | None = None) -> None:
        if own_index is not None and (
            not isinstance(own_index, int) or isinstance(own_index, bool) or own_index < 0
        ):
            msg = f"directory_index must be a rank index (an int >= 0), got {own_index!r:.40}"
            raise ConfigurationError(msg)
        self._assigned: dict[str, int] = {}
        for name, index in check_mapping("directory_assignments", assignments or {}).items():
            reason = check_producer_name(name)
            if reason is not None:
                msg = f"directory_assignments: {reason}"
                raise ConfigurationError(msg)
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                msg = f"directory_assignments[{name!r}] must be a rank index (an int >= 0), got {index!r:.40}"
                raise ConfigurationError(msg)
            self._assigned[name] = index
        self._addresses: tuple[tuple[str, int], ...] | None = None
        self._own = own_index
        # A receiver on its own thread assigns while its owner sets the addresses: the two are
        # one step each under this lock, and a producer taken before the addresses is kept in
        # ``_taken_early`` (it stays here whichever side came first).
        self._lock = threading.Lock()
        self._taken_early: set[str] = set()

    def must_wait(self, name: str) -> bool:
        """Whether producer ``name`` must wait for the addresses: it is assigned to another
        receiver (or to one unknown, ``own_index`` not given) and the addresses are not known yet.
        An unassigned producer never waits: taken before the addresses, it stays here."""
        if self._addresses is not None or name not in self._assigned:
            return False
        return self._own is None or self._assigned[name] != self._own

    @property
    def ready(self) -> bool:
        """Whether the ranks' addresses are known (:meth:`set_addresses` was called)."""
        return self._addresses is not None

    @property
    def assignments(self) -> dict[str, int]:
        """Producer name -> rank index, for checkpoints (a copy, JSON-ready)."""
        return dict(self._assigned)

    def set_addresses(
        self,
        addresses: Sequence[tuple[str, int]],
        *,
        own_index: int | None = None,
        served: Iterable[str] = (),
    ) -> None:
        """Learn every rank's receiver address; ``own_index`` is this receiver's (default: the one
        given when made, else 0).

        The producers in ``served`` (those this receiver took before it knew the addresses) stay
        with it: they are assigned ``own_index`` unless assigned already.

        Raises:
            ConfigurationError: called twice, ``addresses`` is empty or malformed,
                ``own_index`` out of range, or a restored assignment names a rank beyond them
                (a run resumed with fewer ranks).
        """
        with self._lock:
            self._set_addresses(addresses, own_index, served)

    def _set_addresses(
        self, addresses: Sequence[tuple[str, int]], own_index: int | None, served: Iterable[str]
    ) -> None:
        if self._addresses is not None:
            msg = "set_directory() was called already: a receiver's directory is set once"
            raise ConfigurationError(msg)
        if isinstance(addresses, str | bytes) or not isinstance(addresses, Sequence) or not addresses:
            msg = f"the directory is a non-empty sequence of (host, port) pairs, got {addresses!r:.80}"
            raise ConfigurationError(msg)
        checked = tuple(_address(f"addresses[{i}]", value) for i, value in enumerate(addresses))
        if own_index is None:
            own_index = 0 if self._own is None else self._own
        elif self._own is not None and own_index != self._own:
            msg = f"own_index={own_index!r:.40}, but this receiver's directory_index is {self._own}"
            raise ConfigurationError(msg)
        if not isinstance(own_index, int) or isinstance(own_index, bool) or not 0 <= own_index < len(checked):
            msg = f"own_index must be in [0, {len(checked) - 1}], got {own_index!r:.40}"
            raise ConfigurationError(msg)
        beyond = {name: index for name, index in self._assigned.items() if index >= len(checked)}
        if beyond:
            msg = (
                f"the restored directory assigns producers to ranks beyond the {len(checked)} given "
                f"({dict(sorted(beyond.items()))!s:.200}): resume with as many ranks as the checkpointed run"
            )
            raise ConfigurationError(msg)
        for name in (*served, *self._taken_early):
            self._assigned.setdefault(name, own_index)
        self._addresses, self._own = checked, own_index

    def assign(self, name: str) -> tuple[str, int] | None:
        """The address serving producer ``name`` (assigned now on its first arrival), or ``None``
        when this receiver serves it itself (it is its own, or the addresses are not known yet:
        then it stays here once they are, as the ``served`` of :meth:`set_addresses`)."""
        with self._lock:
            if self._addresses is None:
                self._taken_early.add(name)
                return None
            index = self._assigned.get(name)
            if index is None:  # the rank with the fewest producers (the lowest such): round-robin
                counts = [0] * len(self._addresses)
                for assigned in self._assigned.values():
                    counts[assigned] += 1
                index = self._assigned[name] = counts.index(min(counts))
            return None if index == self._own else self._addresses[index]
