"""``local_sgd<H>``, ``diloco<H>``: each rank steps on its own gradients; parameters averaged every H steps.

No gradient crosses ranks.  Each rank's gradients are scaled to the mean loss of *its own*
examples of the step and its optimizer steps on them; after every ``H`` steps the ranks
average their parameters, each weighted by the examples it trained on since the last
average (a rank with no batch left weighs nothing and does not step: its gradients stay
``None``, which PyTorch optimizers skip).  The end of a pass, and every step boundary
where the loop may checkpoint or stop, averages too, so that validation and checkpoints
see one model, the same on every rank.

What it approximates: between averages the ranks drift apart on their own data; the
average of the ranks' parameters is not the parameters a step on the averaged gradient
gives, except for plain SGD with ``H = 1``, where both are ``p - lr * sum_r(n_r g_r) / N``
(equal up to rounding: tests/sync/test_local_sgd.py).  Optimizer state (momentum, Adam's
moments) stays per rank: each rank's optimizer sees only its own gradients.

With an outer optimizer (:class:`OuterNesterov`, as in DiLoCo, Douillard et al. 2023) the
average is not taken as the new parameters: the difference between the parameters at the
last average and the new average is an "outer gradient", and SGD with Nesterov momentum
steps on it.  ``lr=1, momentum=0`` is plain averaging.

Costs: one all-reduce of every parameter per ``H`` steps (``1/H`` of all-reduce's bytes per
step), blocking where it happens.  DiLoCo keeps two more copies of the parameters (the
last average and the momentum), both in :meth:`LocalSGDSync.state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from lamploop.checks import int_at_least
from lamploop.errors import ConfigurationError, DistributedError
from lamploop.sync.buckets import FlatBuckets, bucket_layout
from lamploop.sync.collectives import Collectives
from lamploop.sync.strategy import GradientSync, check_saved_state

__all__ = ["LocalSGD", "LocalSGDSync", "OuterNesterov"]


def _check_outer_lr(_: object, __: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        msg = f"OuterNesterov: lr must be a finite number > 0, got {value!r}"
        raise ConfigurationError(msg)


def _check_momentum(_: object, __: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        msg = f"OuterNesterov: momentum must be a number in [0, 1), got {value!r}"
        raise ConfigurationError(msg)


@attrs.frozen
class OuterNesterov:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on the averaged parameter change.

    Attributes:
        lr: the outer learning rate (DiLoCo: 0.7).
        momentum: the outer momentum (DiLoCo: 0.9).

    Raises:
        ConfigurationError: ``lr`` not above 0, ``momentum`` outside ``[0, 1)``.
    """

    lr: float = attrs.field(default=0.7, validator=_check_outer_lr)
    momentum: float = attrs.field(default=0.9, validator=_check_momentum)


class LocalSGDSync:
    """The :class:`~lamploop.sync.strategy.GradientSync` of :class:`LocalSGD`.

    Also a :class:`~lamploop.sync.strategy.CountsStepExamples`: the loop tells it each
    step's example counts.  The parameters become views into flat buckets (averaged in
    place, as :mod:`~lamploop.sync.reduce_to_root` does for its broadcast).

    Attributes:
        payload_bytes: bytes handed to all-reduces so far by this rank.
        averages: how many times the parameters were averaged.
    """

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        strategy: LocalSGD,
        *,
        bucket_cap_mb: float,
    ) -> None:
        self._collectives = collectives
        self._every = strategy.every_n_steps
        self._outer = strategy.outer
        self._params = [p for p in parameters if p.requires_grad]
        layout = bucket_layout(self._params, bucket_cap_mb)
        self._flat = FlatBuckets(self._params, layout)
        with torch.no_grad():
            for p, view in zip(self._params, self._flat.views, strict=True):
                view.copy_(p)
                p.data = view
        self._anchor = FlatBuckets(self._params, layout) if self._outer is not None else None
        self._momentum = FlatBuckets(self._params, layout) if self._outer is not None else None
        self._refresh_anchor()
        self._gradient_scale: float | None = None
        self._steps_in_window = 0
        self._window_local = 0
        self._window_total = 0
        self.payload_bytes = 0
        self.averages = 0

    def _refresh_anchor(self) -> None:
        if self._anchor is not None:
            for anchor, flat in zip(self._anchor.flats, self._flat.flats, strict=True):
                anchor.copy_(flat)

    def step_examples(self, *, expected: int, local: int, total: int) -> None:
        """Scale this step's gradients by ``expected / local`` (this rank's mean loss); count the examples."""
        self._gradient_scale = expected / local if local > 0 else 0.0
        self._window_local += local
        self._window_total += total

    def begin_pass(self) -> None:
        self._clear_gradients()
        if self._steps_in_window == 0:
            # The loop may have loaded other parameters between passes (a resumed run).
            self._refresh_anchor()

    def last_backward(self) -> None:
        """Nothing to start: no gradient leaves this rank."""

    def reduce(self, scale: float) -> None:
        """Scale this rank's gradients to its own mean loss (``scale``, the global one, is not used).

        Raises:
            DistributedError: the loop did not call :meth:`step_examples` first.
        """
        factor = self._gradient_scale
        if factor is None:
            msg = "local SGD: reduce() without step_examples() first: this loop does not count examples"
            raise DistributedError(msg)
        self._gradient_scale = None
        if factor == 0.0:
            self._clear_gradients()  # no example here: the optimizer skips every parameter
            return
        if factor != 1.0:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)

    def after_step(self) -> None:
        self._clear_gradients()
        self._steps_in_window += 1
        if self._steps_in_window >= self._every:
            self._average()

    def end_pass(self) -> None:
        """Average now (the pass ends, or the loop may checkpoint): every rank ends alike."""
        self._average()

    def _clear_gradients(self) -> None:
        for p in self._params:
            p.grad = None

    def _average(self) -> None:
        total = self._window_total
        if total == 0:  # nothing trained since the last average: the ranks are alike
            self._steps_in_window = 0
            return
        weight = self._window_local / total
        works = []
        with torch.no_grad():
            for flat in self._flat.flats:
                flat.mul_(weight)
                self.payload_bytes += flat.numel() * flat.element_size()
                works.append(self._collectives.all_reduce([flat]))
            for work in works:
                self._collectives.wait(work, "parameter average")
            if self._outer is not None and self._anchor is not None and self._momentum is not None:
                self._outer_step(self._outer, self._anchor, self._momentum)
        self._steps_in_window = 0
        self._window_local = 0
        self._window_total = 0
        self.averages += 1

    def _outer_step(self, outer: OuterNesterov, anchor: FlatBuckets, momentum: FlatBuckets) -> None:
        for flat, start, velocity in zip(self._flat.flats, anchor.flats, momentum.flats, strict=True):
            outer_gradient = start - flat
            velocity.mul_(outer.momentum).add_(outer_gradient)
            update = outer_gradient.add_(velocity, alpha=outer.momentum)  # Nesterov
            start.sub_(update, alpha=outer.lr)
            flat.copy_(start)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The window's counters; with an outer optimizer ``anchor.<i>``, ``momentum.<i>`` per parameter."""
        state = {
            "steps_in_window": torch.tensor(self._steps_in_window, dtype=torch.int64),
            "window_examples": torch.tensor([self._window_local, self._window_total], dtype=torch.int64),
        }
        if self._anchor is not None and self._momentum is not None:
            for i, (a, m) in enumerate(zip(self._anchor.views, self._momentum.views, strict=True)):
                state[f"anchor.{i}"] = a.detach().clone()
                state[f"momentum.{i}"] = m.detach().clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors (saved by a sync of the same model and strategy).

        Raises:
            CheckpointError: keys or shapes that do not match.
        """
        check_saved_state("local SGD", state, self.state_dict())
        self._steps_in_window = int(state["steps_in_window"])
        self._window_local, self._window_total = (int(v) for v in state["window_examples"].tolist())
        if self._anchor is not None and self._momentum is not None:
            with torch.no_grad():
                for i, (a, m) in enumerate(zip(self._anchor.views, self._momentum.views, strict=True)):
                    a.copy_(state[f"anchor.{i}"])
                    m.copy_(state[f"momentum.{i}"])

    def close(self, *, abandon: bool) -> None:
        self._clear_gradients()


def _check_outer(_: object, __: attrs.Attribute[OuterNesterov | None], value: object) -> None:
    if value is not None and not isinstance(value, OuterNesterov):
        msg = f"LocalSGD: outer must be an OuterNesterov or None, got {value!r}"
        raise ConfigurationError(msg)


def _default_name(self: LocalSGD) -> str:
    return f"{'local_sgd' if self.outer is None else 'diloco'}{self.every_n_steps}"


@attrs.frozen
class LocalSGD:
    """Local SGD with periodic, example-weighted parameter averaging (optionally DiLoCo's outer step).

    Registered: ``local_sgd8`` (plain averaging) and ``diloco8`` (outer Nesterov,
    ``lr=0.7, momentum=0.5``: the published momentum 0.9, made for windows of hundreds of
    steps, overshoots at 8).  Register others by instance (with plain SGD,
    ``LocalSGD(every_n_steps=1)`` steps like ``all_reduce``).

    Attributes:
        every_n_steps: ``H``, optimizer steps between averages.
        outer: the outer optimizer, or ``None`` for plain averaging.
        name: the registered name (default ``local_sgd<H>``, or ``diloco<H>`` with ``outer``).

    Raises:
        ConfigurationError: ``every_n_steps`` below 1, or ``outer`` of another type.

    Example::

        lamploop.register_strategy(LocalSGD(every_n_steps=32, outer=OuterNesterov(lr=0.5)))
        # then TrainingSettings(strategy="diloco32")
    """

    every_n_steps: int = attrs.field(default=8, validator=int_at_least("LocalSGD", 1))
    outer: OuterNesterov | None = attrs.field(default=None, validator=_check_outer)
    name: str = attrs.field(default=attrs.Factory(_default_name, takes_self=True))
    steps_on_every_rank: bool = attrs.field(default=True, init=False)
    keeps_state: bool = attrs.field(default=True, init=False)  # the window; DiLoCo's anchor and momentum
    optimizer_state_per_rank: bool = attrs.field(default=True, init=False)  # each rank steps on its own

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        return LocalSGDSync(collectives, parameters, self, bucket_cap_mb=bucket_cap_mb)
