"""A NaN or infinite loss is caught at its step, on every rank alike: raise or skip.

Multi-rank cases run real Gloo process groups (``local_data_parallel_training_loop``'s
replicas, one thread each).  "Skipped" is checked against a run that never saw the bad
step's batches on any rank: the two must end with the same parameters and losses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from workers import rank as worker

import lamploop
from lamploop.batches import BatchContext
from lamploop.errors import ConfigurationError, NonFiniteLossError
from lamploop.settings import TrainingSettings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

Batch = tuple[torch.Tensor, torch.Tensor]
DATA = {"seed": 5, "batches": [8, 8, 8]}
BAD_EPOCH = 2


def _stream(
    bad: dict[int, set[int]],
    *,
    drop: set[int] = frozenset(),  # type: ignore[assignment]
) -> lamploop.BatchStreamFactory:
    """Rank r's batches; in epoch BAD_EPOCH batch i of rank r is NaN if i in bad[r], left out if in drop."""

    def factory(context: BatchContext) -> AsyncIterator[Batch]:
        async def stream() -> AsyncIterator[Batch]:
            for i, (x, y) in enumerate(worker.train_batches_of(DATA, context.epoch, context.rank)):
                if context.epoch == BAD_EPOCH and i in drop:
                    continue
                if context.epoch == BAD_EPOCH and i in bad.get(context.rank, set()):
                    x = x.clone()
                    x[0, 0] = float("nan")
                yield x, y

        return stream()

    return factory


async def _train(
    nranks: int, stream: lamploop.BatchStreamFactory, **kwargs: object
) -> tuple[list[float], dict]:
    modules = [worker.make_module({"seed": 3}, rank) for rank in range(nranks)]
    with anyio.fail_after(60):
        state = await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), stream, None) for m in modules],
            worker.optimizer_factory({"name": "adam", "lr": 0.02}),
            3,
            **kwargs,  # type: ignore[arg-type]
        )
    losses = [entry.training_loss for entry in state.learning_curve]
    return losses, {k: v.clone() for k, v in modules[0].state_dict().items()}


@pytest.mark.parametrize(("nranks", "k"), [(2, 1), (3, 2)])
async def test_skip_step_equals_a_run_that_never_saw_the_step(nranks: int, k: int) -> None:
    step = 1  # batches k..2k-1 of every rank
    bad_rank = nranks - 1
    poisoned = _stream({bad_rank: {step * k + k - 1}})
    without = _stream({}, drop=set(range(step * k, step * k + k)))
    skipped_losses, skipped = await _train(
        nranks, poisoned, accumulate_gradient_over_n_batches=k, on_non_finite_loss="skip_step"
    )
    reference_losses, reference = await _train(nranks, without, accumulate_gradient_over_n_batches=k)
    assert skipped_losses == pytest.approx(reference_losses, rel=1e-12, abs=0)
    for name, tensor in reference.items():
        torch.testing.assert_close(skipped[name], tensor, rtol=1e-12, atol=1e-14, msg=name)
    # and the bad step did matter: a run that trained on it would differ
    clean_losses, _ = await _train(nranks, _stream({}), accumulate_gradient_over_n_batches=k)
    assert clean_losses[BAD_EPOCH] != pytest.approx(skipped_losses[BAD_EPOCH], rel=1e-9)


@pytest.mark.parametrize(("nranks", "bad_ranks"), [(2, (0,)), (3, (1,)), (3, (0, 2))])
async def test_raise_names_epoch_step_and_every_bad_rank(nranks: int, bad_ranks: tuple[int, ...]) -> None:
    bad_batch = 5  # step 5 with k=1
    stream = _stream({r: {bad_batch} for r in bad_ranks})
    with pytest.raises(NonFiniteLossError) as info:
        await _train(nranks, stream)
    error = info.value
    assert (error.epoch, error.step, error.ranks) == (BAD_EPOCH, bad_batch, bad_ranks)
    text = str(error)
    assert f"epoch {BAD_EPOCH}, step {bad_batch}:" in text
    for r in bad_ranks:
        assert f"rank {r} (" in text
    assert all(f"rank {r} (" not in text for r in range(nranks) if r not in bad_ranks)
    # whichever replica's error came first: a bad rank names its batch, a good one none
    assert error.batch in (bad_batch, None)


async def _one_rank(stream: list[Batch], **kwargs: object) -> tuple[float, torch.nn.Module]:
    module = worker.make_module({"seed": 4}, 0)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.02)

    async def batches() -> AsyncIterator[Batch]:
        for batch in stream:
            yield batch

    loss = await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module),
        batches=batches(),
        step_optimizer=optimizer.step,
        epoch=BAD_EPOCH,
        **kwargs,  # type: ignore[arg-type]
    )
    return loss, module


def _poison(batch: Batch) -> Batch:
    x = batch[0].clone()
    x[-1, -1] = float("nan")
    return x, batch[1]


@pytest.mark.parametrize("k", [1, 3])
async def test_one_rank_skip_step(k: int, caplog: pytest.LogCaptureFixture) -> None:
    batches = worker.train_batches_of(DATA, BAD_EPOCH, 0)
    poisoned = [
        *batches[:k],
        *[_poison(b) if i == k - 1 else b for i, b in enumerate(batches[k : 2 * k])],
        *batches[2 * k :],
    ]
    with caplog.at_level(logging.WARNING, logger="lamploop.loop.epoch_pass"):
        loss, module = await _one_rank(
            poisoned, accumulate_gradient_over_n_batches=k, on_non_finite_loss="skip_step"
        )
    reference_loss, reference = await _one_rank(
        batches[:k] + batches[2 * k :], accumulate_gradient_over_n_batches=k
    )
    assert loss == pytest.approx(reference_loss, rel=1e-12)
    for mine, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"epoch {BAD_EPOCH}, step 1: a non-finite loss on rank 0 (batch {2 * k - 1}," in warning
    assert "skipped" in warning


async def test_one_rank_raise_stops_before_the_bad_step() -> None:
    batches = worker.train_batches_of(DATA, BAD_EPOCH, 0)
    module = worker.make_module({"seed": 4}, 0)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.02)
    steps: list[int] = []

    def step() -> None:
        steps.append(1)
        optimizer.step()

    async def stream() -> AsyncIterator[Batch]:
        for i, batch in enumerate(batches):
            yield _poison(batch) if i == 4 else batch

    with pytest.raises(
        NonFiniteLossError, match=r"epoch 2, step 4: a non-finite loss on rank 0 \(batch 4,"
    ) as info:
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module), batches=stream(), step_optimizer=step, epoch=BAD_EPOCH
        )
    assert len(steps) == 4  # steps 0..3 taken, the bad one not
    assert (info.value.step, info.value.batch, info.value.ranks) == (4, 4, (0,))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


async def test_every_step_skipped_is_an_error_not_an_empty_stream() -> None:
    batches = [_poison(b) for b in worker.train_batches_of(DATA, BAD_EPOCH, 0)[:3]]
    with pytest.raises(NonFiniteLossError, match="all 3 steps of epoch 2 had a non-finite loss"):
        await _one_rank(batches, on_non_finite_loss="skip_step")


async def test_a_policy_that_does_not_exist_is_refused_up_front() -> None:
    with pytest.raises(ConfigurationError, match="on_non_finite_loss must be one of"):
        await _one_rank(worker.train_batches_of(DATA, 0, 0), on_non_finite_loss="ignore")
    with pytest.raises(ConfigurationError, match="on_non_finite_loss must be one of"):
        TrainingSettings(on_non_finite_loss="warn")  # type: ignore[arg-type]
    assert "on_non_finite_loss" in TrainingSettings.EVERY_RANK


def _fit(on_non_finite_loss: str) -> lamploop.LoopState | None:
    (x, y), _ = worker.fit_data()
    x = x.clone()
    x[9, 0] = float("nan")  # one example: one step of every epoch has a NaN loss
    return lamploop.fit(
        model=lamploop.SupervisedModel(worker.make_module({"seed": 1}, 0)),
        optimizer_factory=worker.optimizer_factory({"name": "sgd", "lr": 0.05}),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, seed=2),
        max_epochs=2,
        on_non_finite_loss=on_non_finite_loss,  # type: ignore[arg-type]
    )


def test_fit_passes_the_policy_through() -> None:
    with pytest.raises(NonFiniteLossError, match=r"epoch 0, step \d+: a non-finite loss on rank 0"):
        _fit("raise")
    state = _fit("skip_step")
    assert state is not None
    assert len(state.learning_curve) == 2
    assert all(math.isfinite(entry.training_loss) for entry in state.learning_curve)
