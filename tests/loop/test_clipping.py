"""Gradient clipping by global norm, after the ranks' gradients are summed.

Two ranks (real Gloo groups, both strategies) must train exactly like one rank on the union
of their batches with the same clipping; a hand-written loop with ``clip_grad_norm_`` is the
one-rank reference.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch
from workers import rank as worker

import lamploop
from lamploop.errors import ConfigurationError

pytestmark = pytest.mark.anyio

DATA = {"seed": 77, "batches": [6, 5]}
MAX_NORM = 0.05  # well under the gradients' norms here: every step is clipped
EPOCHS = 3


async def test_one_rank_clips_like_clip_grad_norm() -> None:
    batches = worker.train_batches_of(DATA, 0, 0)
    module, hand = worker.make_module({"seed": 2}, 0), worker.make_module({"seed": 2}, 0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    hand_optimizer = torch.optim.SGD(hand.parameters(), lr=0.5)
    norms = []
    for x, y in batches:
        hand_optimizer.zero_grad()
        torch.nn.functional.cross_entropy(hand(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hand.parameters(), MAX_NORM)))
        hand_optimizer.step()
    assert min(norms) > MAX_NORM  # clipping was at work in every step

    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in batches:
            yield batch

    await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module),
        batches=stream(),
        step_optimizer=optimizer.step,
        max_gradient_norm=MAX_NORM,
    )
    for mine, theirs in zip(module.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-14)


async def _union_run(max_gradient_norm: float | None) -> dict[str, torch.Tensor]:
    module = worker.make_module({"seed": 2}, 0)
    await lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=lamploop.SupervisedModel(module),
        optimizer_factory=worker.optimizer_factory({"name": "sgd", "lr": 0.3}),
        train_batches=worker.stream_factory(lambda e, r: worker.union_train_batches(DATA, e, 2, 1)),
        validation_batches=None,
        max_epochs=EPOCHS,
        max_gradient_norm=max_gradient_norm,
    )
    return module.state_dict()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
async def test_two_ranks_clip_like_one_rank_on_the_union(strategy: str) -> None:
    modules = [worker.make_module({"seed": 2}, rank) for rank in range(2)]
    train = worker.stream_factory(lambda e, r: worker.train_batches_of(DATA, e, r))
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, None) for m in modules],
            worker.optimizer_factory({"name": "sgd", "lr": 0.3}),
            EPOCHS,
            strategy=strategy,
            max_gradient_norm=MAX_NORM,
        )
    expected = await _union_run(MAX_NORM)
    unclipped = await _union_run(None)
    for name, value in expected.items():
        for module in modules:  # every rank ends with the same parameters
            torch.testing.assert_close(module.state_dict()[name], value, rtol=0, atol=1e-12, msg=name)
    assert any(
        not torch.allclose(unclipped[name], value, rtol=0, atol=1e-6) for name, value in expected.items()
    ), "clipping made no difference: the test would not notice it missing"


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "1", True])
async def test_a_bad_norm_is_refused_up_front(bad: Any) -> None:
    module = worker.make_module({"seed": 2}, 0)

    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in worker.train_batches_of(DATA, 0, 0):
            yield batch

    with pytest.raises(ConfigurationError, match="max_gradient_norm must be a positive finite number"):
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=stream(),
            step_optimizer=lambda: None,
            max_gradient_norm=bad,
        )
    with pytest.raises(ConfigurationError, match="max_gradient_norm must be a positive finite number"):
        lamploop.settings.TrainingSettings(max_gradient_norm=bad)
