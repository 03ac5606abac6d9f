"""Gradient sync: how ranks combine what each computed.

- :mod:`~lamploop.sync.strategy` -- the :class:`SyncStrategy` / :class:`GradientSync`
  interface and the registry of strategies by name;
- :mod:`~lamploop.sync.all_reduce`, :mod:`~lamploop.sync.reduce_to_root` -- the two
  built-in strategies, over the buckets of :mod:`~lamploop.sync.buckets`;
- :mod:`~lamploop.sync.collectives` -- a process group's collectives, every wait bounded
  and abortable;
- :mod:`~lamploop.sync.channel`, :mod:`~lamploop.sync.group_channel` -- the tensor channel
  one epoch talks to: one process, or a process group.

See docs/architecture.md for adding a strategy.
"""

from lamploop.sync.all_reduce import AllReduce
from lamploop.sync.channel import SingleProcessChannel, TensorChannel
from lamploop.sync.collectives import AbortSignal, Collectives
from lamploop.sync.reduce_to_root import ReduceToRoot
from lamploop.sync.strategy import (
    AUTO,
    GradientSync,
    SyncStrategy,
    register_strategy,
    strategy_named,
    strategy_names,
)

register_strategy(AllReduce())
register_strategy(ReduceToRoot())

__all__ = [
    "AUTO",
    "AbortSignal",
    "Collectives",
    "GradientSync",
    "SingleProcessChannel",
    "SyncStrategy",
    "TensorChannel",
    "register_strategy",
    "strategy_named",
    "strategy_names",
]
