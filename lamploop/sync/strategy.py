"""The gradient-sync strategy interface, and the registry that names strategies.

:func:`lamploop.one_epoch` knows a strategy only through :class:`GradientSync`, the
object it makes for one model on one rank.  A training pass drives it like this, on
every rank alike::

    sync.begin_pass()
    for each step:
        for each of the step's batches:
            if it is the last: sync.last_backward()
            backward of (loss_sum / expected)
        sync.step_examples(...)       # only a sync that has it (CountsStepExamples)
        sync.reduce(expected / global example count)   # 1.0 unless the sync reduces linearly
        optimizer step                # every rank, or only the root (steps_on_every_rank)
        sync.after_step()
    sync.end_pass()

A :class:`SyncStrategy` makes such objects from the :class:`~lamploop.sync.collectives.Collectives`
of a process group.  Strategies are registered by name (:func:`register_strategy`), so
that a new one is one new module: ``all_reduce`` and ``reduce_to_root`` are registered by
:mod:`lamploop.sync` itself, and the name travels in :class:`~lamploop.settings.TrainingSettings`.

The units of the gradients a sync is given: the step's global example count is known
only once every rank has counted its batches, which the loop starts before the step's
last backward.  A sync that says it *reduces linearly* (``reduces_linearly = True``:
``reduce`` of ``c`` times the gradients is ``c`` times ``reduce`` of them, and nothing is
kept from them) lets the loop backpropagate with a guess of that count (the previous
step's, ``1`` at a pass's first step) and correct it with ``reduce(scale)``, so the count
overlaps the last backward.  Every other sync (the default) is given exact units: the loop
waits for the count before the last backward, so that ``.grad`` holds this rank's share of
the gradient of the step's mean loss when communication starts, and ``scale`` is exactly
``1.0``.  Error feedback, a loss-scale factor or any other state derived from gradients is
then in the units of the mean loss at every step, the first of a pass included.

.. versionadded:: 0.2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.sync.collectives import Collectives

__all__ = [
    "AUTO",
    "CountsStepExamples",
    "GradientSync",
    "SyncStrategy",
    "check_saved_state",
    "check_strategy_name",
    "keeps_state",
    "optimizer_state_per_rank",
    "reduces_linearly",
    "register_strategy",
    "strategy_named",
    "strategy_names",
]

AUTO = "auto"
"""Not a strategy but a choice: ``all_reduce`` when every rank has an optimizer, else ``reduce_to_root``."""


@runtime_checkable
class GradientSync(Protocol):
    """One model's gradient sync on one rank, reused step after step (see the module doc).

    The gradient contract: before :meth:`reduce` each rank's ``.grad`` holds the sum of its
    batches' gradients of ``loss_sum / expected``; after ``reduce(scale)`` every rank that
    steps holds the sum over ranks times ``scale`` (the gradient of the step's mean loss).
    ``expected`` is the step's global example count, so ``scale`` is exactly ``1.0``, unless
    the sync has ``reduces_linearly = True`` (see :func:`reduces_linearly` and the module doc):
    only such a sync is given a guessed ``expected`` and a ``scale`` that corrects it.
    """

    def begin_pass(self) -> None:
        """A training pass starts: clear gradients left from before."""
        ...

    def last_backward(self) -> None:
        """The next backward is the step's last: communication may start as gradients arrive."""
        ...

    def reduce(self, scale: float) -> None:
        """Complete the reduction and multiply the reduced gradients by ``scale``."""
        ...

    def after_step(self) -> None:
        """After the optimizer step: clear gradients, share parameters if the strategy needs it."""
        ...

    def end_pass(self) -> None:
        """The training pass ends: wait until nothing is in flight."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What the strategy keeps from step to step (e.g. error feedback), to checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors."""
        ...

    def close(self, *, abandon: bool) -> None:
        """Remove hooks; with ``abandon`` (the run failed) wait for nothing in flight."""
        ...


@runtime_checkable
class CountsStepExamples(Protocol):
    """Optional, beside :class:`GradientSync`: a sync told each step's example counts.

    The loop calls :meth:`step_examples` right before :meth:`GradientSync.reduce`, on every
    rank, when the sync has it (e.g. local SGD, which scales a rank's gradients to its own
    mean loss and weights the parameter average by the examples each rank saw).

    .. versionadded:: 0.3
    """

    def step_examples(self, *, expected: int, local: int, total: int) -> None:
        """This step: ``expected`` (the loss divisor of backward), this rank's and all ranks' examples."""
        ...


@runtime_checkable
class SyncStrategy(Protocol):
    """Makes the :class:`GradientSync` of a model on one rank.

    Attributes:
        name: the name it is registered under.
        steps_on_every_rank: ``True`` when every rank steps its own optimizer (which
            followers then need), ``False`` when only the root steps and shares parameters.
    """

    @property
    def name(self) -> str: ...

    @property
    def steps_on_every_rank(self) -> bool: ...

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        """The sync of ``parameters`` (of ``modules``, for hooks) over ``collectives``."""
        ...


def check_saved_state(
    what: str, state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """A saved sync state fits this sync: ``expected``'s keys (its own ``state_dict()``) and shapes.

    Raises:
        CheckpointError: keys missing or unexpected, or a shape that differs (saved by another
            strategy, model or rank).
    """
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        msg = f"{what} state: missing keys {missing}, unexpected keys {extra} (another strategy or model?)"
        raise CheckpointError(msg)
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            msg = f"{what} state {key!r}: shape {tuple(tensor.shape)}, expected {tuple(expected[key].shape)}"
            raise CheckpointError(msg)


def keeps_state(strategy: SyncStrategy) -> bool:
    """Whether ``strategy``'s syncs keep state from step to step that checkpoints must carry.

    A strategy says so with an optional ``keeps_state = True`` attribute (PowerSGD's error
    feedback, the fp16 scale, DiLoCo's outer momentum): the drivers then save every rank's
    :meth:`GradientSync.state_dict` at epoch ends (:mod:`lamploop.distributed.rank_extras`)
    and give it back on resume.
    """
    return getattr(strategy, "keeps_state", False) is True


def reduces_linearly(sync: GradientSync) -> bool:
    """Whether the loop may hand ``sync`` gradients of a guessed scale and correct them in ``reduce``.

    A sync says so with an optional ``reduces_linearly = True`` attribute: ``reduce`` of ``c``
    times the gradients equals ``c`` times ``reduce`` of them, and nothing derived from them
    outlives the call (plain sums: ``all_reduce``, ``reduce_to_root``, ``all_reduce_bf16``).
    The loop then backpropagates with a guess of the step's global example count and
    overlaps counting with the last backward.  Without it (the safe default: PowerSGD's
    error feedback, fp16's range and scale, local SGD) the loop waits for the count before
    the last backward, and ``reduce`` always gets ``scale == 1.0``.

    .. versionadded:: 0.3
    """
    return getattr(sync, "reduces_linearly", False) is True


def optimizer_state_per_rank(strategy: SyncStrategy) -> bool:
    """Whether each rank's optimizer state is its own (ranks step on their own gradients: local SGD).

    Optional ``optimizer_state_per_rank = True`` attribute; the drivers then save every
    rank's optimizer state with its sync state, not only the root's.
    """
    return getattr(strategy, "optimizer_state_per_rank", False) is True


_REGISTRY: dict[str, SyncStrategy] = {}


def register_strategy(strategy: SyncStrategy, *, replace: bool = False) -> None:
    """Make ``strategy`` available under ``strategy.name``.

    Raises:
        ConfigurationError: the name is ``"auto"`` or already taken (unless ``replace``),
            or ``strategy`` lacks the :class:`SyncStrategy` members.
    """
    if isinstance(strategy, type):
        msg = (
            f"register_strategy: {strategy.__qualname__} is a class; register an instance, "
            f"e.g. register_strategy({strategy.__qualname__}(...))"
        )
        raise ConfigurationError(msg)
    if not isinstance(strategy, SyncStrategy):
        msg = f"register_strategy: {strategy!r} lacks name, steps_on_every_rank or gradient_sync()"
        raise ConfigurationError(msg)
    name = strategy.name
    if not isinstance(name, str) or not name:
        kind = type(strategy).__name__
        msg = f"register_strategy: a strategy's name is a non-empty str, got {name!r:.60} ({kind})"
        raise ConfigurationError(msg)
    if name == AUTO:
        msg = f"register_strategy: the name {AUTO!r} is reserved (it picks a strategy); choose another name"
        raise ConfigurationError(msg)
    if name in _REGISTRY and not replace:
        msg = f"register_strategy: the name {name!r} is taken; pass replace=True to replace it"
        raise ConfigurationError(msg)
    _REGISTRY[name] = strategy


def strategy_names() -> tuple[str, ...]:
    """The registered strategies' names, sorted."""
    return tuple(sorted(_REGISTRY))


def check_strategy_name(name: object) -> str:
    """``name`` if it is ``"auto"`` or registered, else ConfigurationError listing the choices."""
    if name != AUTO and (not isinstance(name, str) or name not in _REGISTRY):
        msg = f"strategy must be 'auto' or one of {strategy_names()}, got {name!r}"
        raise ConfigurationError(msg)
    return str(name)


def strategy_named(name: str) -> SyncStrategy:
    """The registered strategy called ``name`` (``"auto"`` is resolved by the drivers first)."""
    check_strategy_name(name)
    if name == AUTO:
        msg = "strategy 'auto' is resolved when the ranks meet; ask for a concrete name"
        raise ConfigurationError(msg)
    return _REGISTRY[name]
