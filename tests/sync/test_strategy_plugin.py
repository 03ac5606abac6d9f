"""A new gradient-sync strategy is one new module: this file defines one and trains with it.

The strategy sums gradients in float64 over an all-reduce (one collective per parameter,
no buckets), registered from here with :func:`lamploop.register_strategy`; nothing in the
loop or the drivers knows it.  It must give the same result as one process on the union
of the ranks' batches, like the built-in strategies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import attrs
import pytest
import torch
from test_distributed import (
    EPOCHS,
    LOSS_TOL,
    PARAMS_ATOL,
    assert_same_curve,
    assert_same_params,
    equivalence_run,
    reference,
)
from workers import rank as worker

import lamploop
from lamploop.errors import ConfigurationError
from lamploop.sync import Collectives, GradientSync, SyncStrategy

pytestmark = pytest.mark.anyio


class Float64Sync:
    """Every rank all-reduces each gradient in float64 after the step's backward, then steps."""

    def __init__(
        self, collectives: Collectives, parameters: Sequence[torch.nn.Parameter], calls: list[int]
    ) -> None:
        self._collectives = collectives
        self._parameters = [p for p in parameters if p.requires_grad]
        self._calls = calls

    def begin_pass(self) -> None:
        for p in self._parameters:
            p.grad = None

    def last_backward(self) -> None:
        """Nothing starts early: the sum runs in reduce()."""

    def reduce(self, scale: float) -> None:
        self._calls.append(1)
        for p in self._parameters:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            wide = grad.to(torch.float64)
            self._collectives.wait(self._collectives.all_reduce([wide]), "float64 gradient sum")
            p.grad = (wide * scale).to(p.dtype)

    def after_step(self) -> None:
        self.begin_pass()

    def end_pass(self) -> None:
        """Nothing in flight."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Stateless."""

    def close(self, *, abandon: bool) -> None:
        """No hooks."""


@attrs.frozen
class Float64AllReduce:
    name: str = "test_float64_all_reduce"
    steps_on_every_rank: bool = True
    calls: list[int] = attrs.field(factory=list)

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        return Float64Sync(collectives, parameters, self.calls)


def test_the_test_strategy_fits_the_protocols() -> None:
    strategy = Float64AllReduce()
    assert isinstance(strategy, SyncStrategy)
    assert isinstance(Float64Sync.__new__(Float64Sync), GradientSync)


@pytest.mark.timeout(60)
async def test_a_strategy_registered_from_outside_trains_like_one_process() -> None:
    strategy = Float64AllReduce()
    lamploop.register_strategy(strategy, replace=True)
    assert strategy.name in lamploop.strategy_names()
    run = equivalence_run(2, 2, "all_reduce")
    run["data"]["seed"] += 2000
    data = run["data"]
    expected_state, expected_best, _ = await reference(run)
    modules = [worker.make_module(run["model"], rank) for rank in range(2)]
    train = worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r))
    valid = worker.stream_factory(lambda e, r: worker.valid_batches_of(data, e, r))
    with anyio.fail_after(50):
        state = await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, valid) for m in modules],
            worker.optimizer_factory(run["optimizer"]),
            EPOCHS,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            learning_rate_schedule=worker.make_schedule(run["schedule"]),
            accumulate_gradient_over_n_batches=2,
            strategy=strategy.name,
        )
    steps = sum(len(worker.union_train_batches(data, e, 2, 2)) for e in range(EPOCHS))
    assert len(strategy.calls) == 2 * steps  # both replicas, every step: the strategy did the work
    assert_same_curve(state, expected_state, LOSS_TOL)
    assert_same_params(modules[0].state_dict(), expected_best, atol=PARAMS_ATOL)


def test_registering_a_taken_name_or_a_non_strategy_is_refused() -> None:
    lamploop.register_strategy(Float64AllReduce(), replace=True)
    with pytest.raises(ConfigurationError, match="is taken"):
        lamploop.register_strategy(Float64AllReduce())
    for replace in (False, True):  # "auto" picks a strategy: never a name, replace or not
        with pytest.raises(ConfigurationError, match="'auto' is reserved"):
            lamploop.register_strategy(Float64AllReduce(name="auto"), replace=replace)
    not_a_strategy: Any = object()
    with pytest.raises(ConfigurationError, match="lacks"):
        lamploop.register_strategy(not_a_strategy)


def test_an_unknown_strategy_is_refused_before_training_with_the_choices() -> None:
    with pytest.raises(
        ConfigurationError, match=r"strategy must be 'auto' or one of .*all_reduce.*, got 'fastest'"
    ):
        lamploop.TrainingSettings(strategy="fastest")
