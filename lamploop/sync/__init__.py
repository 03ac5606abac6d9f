"""Gradient sync: how ranks combine what each computed.

- :mod:`~lamploop.sync.strategy` -- the :class:`SyncStrategy` / :class:`GradientSync`
  interface and the registry of strategies by name;
- :mod:`~lamploop.sync.all_reduce`, :mod:`~lamploop.sync.reduce_to_root` -- the two
  built-in strategies, over the buckets of :mod:`~lamploop.sync.buckets`;
- :mod:`~lamploop.sync.compressed_all_reduce` (``all_reduce_bf16``, ``all_reduce_fp16``),
  :mod:`~lamploop.sync.powersgd` (``powersgd1``, ``powersgd4``) and
  :mod:`~lamploop.sync.local_sgd` (``local_sgd8``, ``diloco8``) -- strategies that send
  less per step (docs/strategies.md);
- :mod:`~lamploop.sync.fsdp` (:class:`FullyShard`) -- parameters, gradients and optimizer
  state sharded over the ranks, on PyTorch's FSDP2 (with ``one_epoch``; not registered
  until the drivers shard the model, see docs/strategies.md);
- :mod:`~lamploop.sync.collectives` -- a process group's collectives, every wait bounded
  and abortable;
- :mod:`~lamploop.sync.channel`, :mod:`~lamploop.sync.group_channel` -- the tensor channel
  one epoch talks to: one process, or a process group.

See docs/architecture.md for adding a strategy.
"""

from lamploop.sync.all_reduce import AllReduce
from lamploop.sync.channel import SingleProcessChannel, TensorChannel
from lamploop.sync.collectives import AbortSignal, Collectives
from lamploop.sync.compressed_all_reduce import CompressedAllReduce
from lamploop.sync.fsdp import FullyShard
from lamploop.sync.local_sgd import LocalSGD, OuterNesterov
from lamploop.sync.powersgd import PowerSGD
from lamploop.sync.reduce_to_root import ReduceToRoot
from lamploop.sync.strategy import (
    AUTO,
    CountsStepExamples,
    GradientSync,
    SyncStrategy,
    register_strategy,
    strategy_named,
    strategy_names,
)

register_strategy(AllReduce())
register_strategy(ReduceToRoot())
register_strategy(CompressedAllReduce(wire="bf16"))
register_strategy(CompressedAllReduce(wire="fp16"))
register_strategy(PowerSGD(rank=1))
register_strategy(PowerSGD(rank=4))
register_strategy(LocalSGD(every_n_steps=8))
# DiLoCo's published outer momentum (0.9) was tuned for H in the hundreds with AdamW inside;
# at H=8 with an inner momentum optimizer it overshoots (docs/strategies.md measures it).
register_strategy(LocalSGD(every_n_steps=8, outer=OuterNesterov(lr=0.7, momentum=0.5)))

__all__ = [
    "AUTO",
    "AbortSignal",
    "Collectives",
    "CompressedAllReduce",
    "CountsStepExamples",
    "FullyShard",
    "GradientSync",
    "LocalSGD",
    "OuterNesterov",
    "PowerSGD",
    "SingleProcessChannel",
    "SyncStrategy",
    "TensorChannel",
    "register_strategy",
    "strategy_named",
    "strategy_names",
]
