"""``one_epoch`` on one process: gradient accumulation, forward-only passes, bad input.

The reference for training is a plain PyTorch loop written here: for each optimizer
step, ``zero_grad``; ``mean loss over the step's examples``; ``backward``; ``step``.
Everything is float64, so equivalences hold to ``atol=1e-6`` with margin.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lamploop
from lamploop import SupervisedModel, cross_entropy_loss, mse_loss, one_epoch
from lamploop.errors import BatchError, ConfigurationError, NonFiniteLossError

D_IN, D_OUT = 3, 2


def make_module(seed: int = 0, *, dropout: float = 0.0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(D_IN, 5), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(5, D_OUT))
        return nn.Sequential(*layers).double()


def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=generator, dtype=torch.float64)
    y = torch.randn(n, D_OUT, generator=generator, dtype=torch.float64)
    return x, y


def cut(x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    assert sum(sizes) == x.shape[0]
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def group(
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The big batches one optimizer step sees: k consecutive batches concatenated."""
    return [
        (torch.cat([b[0] for b in batches[i : i + k]]), torch.cat([b[1] for b in batches[i : i + k]]))
        for i in range(0, len(batches), k)
    ]


async def stream(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05),
}


def reference_training(
    module: nn.Module, optimizer: torch.optim.Optimizer, steps: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Plain PyTorch: one step per big batch on the mean squared error per example."""
    module.train()
    total, count = 0.0, 0
    for x, y in steps:
        optimizer.zero_grad()
        per_example = ((module(x) - y) ** 2).sum(dim=1)
        per_example.mean().backward()
        optimizer.step()
        total += float(per_example.detach().sum())
        count += x.shape[0]
    return total / count


async def lamploop_training(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    k: int,
    epoch: int = 0,
) -> float:
    return await one_epoch(
        model=SupervisedModel(module, mse_loss),
        batches=stream(batches),
        step_optimizer=optimizer.step,
        accumulate_gradient_over_n_batches=k,
        epoch=epoch,
    )


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        try:
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


async def check_accumulation(sizes: Sequence[int], k: int, optimizer: str, n_epochs: int = 2) -> None:
    x, y = make_data(sum(sizes))
    batches = cut(x, y, sizes)
    big = group(batches, k)

    accumulated = make_module()
    one_big = copy.deepcopy(accumulated)
    reference = copy.deepcopy(accumulated)
    opt_accumulated = OPTIMIZERS[optimizer](accumulated.parameters())
    opt_one_big = OPTIMIZERS[optimizer](one_big.parameters())
    opt_reference = OPTIMIZERS[optimizer](reference.parameters())

    for epoch in range(n_epochs):
        loss_accumulated = await lamploop_training(accumulated, opt_accumulated, batches, k, epoch)
        loss_one_big = await lamploop_training(one_big, opt_one_big, big, 1, epoch)
        loss_reference = reference_training(reference, opt_reference, big)
        assert_same_parameters(accumulated, reference)
        assert_same_parameters(one_big, reference)
        torch.testing.assert_close(loss_accumulated, loss_reference, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(loss_one_big, loss_reference, atol=1e-9, rtol=1e-9)
    # the parameters did move: the comparison is not between untouched copies
    assert not torch.allclose(next(accumulated.parameters()), next(make_module().parameters()))


@pytest.mark.anyio
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("k", "b", "steps"), [(2, 3, 4), (3, 4, 3), (4, 1, 5)])
async def test_accumulated_batches_equal_one_big_batch(optimizer: str, k: int, b: int, steps: int) -> None:
    await check_accumulation([b] * (k * steps), k, optimizer)


@pytest.mark.anyio
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
async def test_uneven_last_group_steps_with_what_it_has(optimizer: str) -> None:
    # 7 batches, k = 3: steps over batches [0, 1, 2], [3, 4, 5] and [6]; the last batch is short.
    await check_accumulation([4, 4, 4, 4, 4, 4, 2], 3, optimizer)


@pytest.mark.anyio
async def test_step_count_is_ceil_of_batches_over_k() -> None:
    module = make_module()
    x, y = make_data(20)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    steps = []

    def step() -> None:
        steps.append(1)
        optimizer.step()

    await one_epoch(
        model=SupervisedModel(module, mse_loss),
        batches=stream(cut(x, y, [3] * 6 + [2])),
        step_optimizer=step,
        accumulate_gradient_over_n_batches=3,
    )
    assert len(steps) == 3
    assert all(p.grad is None or not p.grad.any() for p in module.parameters())


@settings(deadline=None, max_examples=25)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=9),
    k=st.integers(1, 4),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
)
def test_accumulation_with_arbitrary_batch_sizes(sizes: list[int], k: int, optimizer: str) -> None:
    # batch sizes differ inside a group too, first batch included
    anyio.run(check_accumulation, sizes, k, optimizer, 1, backend="asyncio")


@pytest.mark.anyio
async def test_stale_gradients_do_not_leak_into_the_first_step() -> None:
    """DESIGN 3: a step uses the gradient of the mean loss of *its* examples.

    Gradients left on the parameters before the epoch (a user's earlier
    backward, an aborted epoch) must not be added to the first step, as
    a PyTorch loop that calls ``zero_grad()`` before each step guarantees.
    """
    x, y = make_data(8)
    module = make_module()
    reference = copy.deepcopy(module)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    await lamploop_training(module, optimizer, cut(x, y, [4, 4]), k=1)
    reference_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1), cut(x, y, [4, 4]))
    assert_same_parameters(module, reference)


# --------------------------------------------------------------------------- forward only


@pytest.mark.anyio
async def test_a_validation_pass_does_not_switch_off_gradients_of_a_training_pass_beside_it() -> None:
    """Gradient mode is per thread: a forward-only pass awaiting its batches must not leave it
    off for another task of the same event loop, which trains (found with federated nodes)."""
    x, y = make_data(16)
    validated, trained, reference = make_module(1), make_module(), make_module()

    async def slow(items: Sequence[Any]) -> AsyncIterator[Any]:
        for item in items:
            await anyio.sleep(0.01)  # the training pass runs while validation waits here
            yield item

    async def validate() -> None:
        await one_epoch(
            model=SupervisedModel(validated, mse_loss), batches=slow(cut(x, y, [4] * 4)), forward_only=True
        )

    async def train() -> None:
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        await one_epoch(
            model=SupervisedModel(trained, mse_loss),
            batches=slow(cut(x, y, [4] * 4)),
            step_optimizer=optimizer.step,
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(validate)
        tg.start_soon(train)
    reference_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1), cut(x, y, [4] * 4))
    assert_same_parameters(trained, reference)


@pytest.mark.anyio
async def test_forward_only_is_the_exact_mean_over_examples() -> None:
    x, y = make_data(16)
    module = make_module(dropout=0.5)
    module.train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    sizes = [5, 3, 7, 1]  # uneven: the mean of batch means would differ

    loss = await one_epoch(
        model=SupervisedModel(module, mse_loss), batches=stream(cut(x, y, sizes)), forward_only=True
    )

    assert module.training is False
    with torch.no_grad():
        direct = float(((module(x) - y) ** 2).sum() / x.shape[0])  # eval mode: dropout off
        batch_means = [float(((module(a) - b) ** 2).sum(dim=1).mean()) for a, b in cut(x, y, sizes)]
    assert loss == pytest.approx(direct, rel=1e-12)
    assert abs(sum(batch_means) / len(batch_means) - direct) > 1e-6  # the test can tell the two apart
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.anyio
async def test_forward_only_cross_entropy_matches_torch_mean() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(23, D_IN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, D_OUT, (23,), generator=generator)
    module = make_module()
    loss = await one_epoch(
        model=SupervisedModel(module, cross_entropy_loss),
        batches=stream(cut(x, labels, [10, 10, 3])),
        forward_only=True,
    )
    with torch.no_grad():
        expected = float(F.cross_entropy(module(x), labels))
    assert loss == pytest.approx(expected, rel=1e-12)


@pytest.mark.anyio
async def test_forward_only_needs_no_optimizer_and_ignores_accumulation() -> None:
    x, y = make_data(9)
    module = make_module()
    a = await one_epoch(
        model=SupervisedModel(module, mse_loss), batches=stream(cut(x, y, [4, 5])), forward_only=True
    )
    b = await one_epoch(
        model=SupervisedModel(module, mse_loss),
        batches=stream(cut(x, y, [2, 2, 2, 3])),
        forward_only=True,
        accumulate_gradient_over_n_batches=3,
    )
    assert a == pytest.approx(b, rel=1e-12)


# --------------------------------------------------------------------------- bad input


def _model() -> SupervisedModel:
    return SupervisedModel(make_module(), mse_loss)


def _optimizer_step(model: SupervisedModel) -> Callable[[], object]:
    return torch.optim.SGD(model.module.parameters(), lr=0.1).step


@pytest.mark.anyio
@pytest.mark.parametrize("forward_only", [False, True])
async def test_empty_batch_names_epoch_and_batch(forward_only: bool) -> None:
    x, y = make_data(6)
    batches = [*cut(x, y, [3, 3]), (x[:0], y[:0])]
    model = _model()
    with pytest.raises(BatchError, match="empty") as info:
        await one_epoch(
            model=model,
            batches=stream(batches),
            step_optimizer=_optimizer_step(model),
            forward_only=forward_only,
            epoch=5,
        )
    assert "epoch 5" in str(info.value)
    assert "batch 2" in str(info.value)


@pytest.mark.anyio
async def test_mismatched_batch_sizes() -> None:
    x, y = make_data(7)
    model = _model()
    with pytest.raises(BatchError) as info:
        await one_epoch(
            model=model,
            batches=stream([(x[:3], y[:3]), (x[3:7], y[3:6])]),
            step_optimizer=_optimizer_step(model),
            epoch=0,
        )
    message = str(info.value)
    assert "batch 1" in message
    assert "4" in message
    assert "3" in message


@pytest.mark.anyio
@pytest.mark.parametrize("item", ["tensor", "triple", "string"])
async def test_item_that_is_not_a_pair(item: str) -> None:
    x, y = make_data(4)
    bad = {"tensor": x, "triple": (x, y, y), "string": "xy"}[item]
    model = _model()
    with pytest.raises(BatchError, match=r"\(features, target\)") as info:
        await one_epoch(
            model=model,
            batches=stream([(x, y), bad]),
            step_optimizer=_optimizer_step(model),
            epoch=1,
        )
    assert "epoch 1" in str(info.value)
    assert "batch 1" in str(info.value)


@pytest.mark.anyio
@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("k", [1, 2])
async def test_nan_loss_names_epoch_and_batch(forward_only: bool, k: int) -> None:
    x, y = make_data(12)
    x = x.clone()
    x[6, 1] = float("nan")  # batch 3 of batches of 2
    model = _model()
    with pytest.raises(NonFiniteLossError) as info:
        await one_epoch(
            model=model,
            batches=stream(cut(x, y, [2] * 6)),
            step_optimizer=_optimizer_step(model),
            forward_only=forward_only,
            accumulate_gradient_over_n_batches=k,
            epoch=2,
        )
    assert "epoch 2" in str(info.value)
    assert "batch 3" in str(info.value)
    assert info.value.epoch == 2
    assert info.value.batch == 3


@pytest.mark.anyio
@pytest.mark.parametrize("forward_only", [False, True])
async def test_empty_stream(forward_only: bool) -> None:
    model = _model()
    with pytest.raises(BatchError, match="empty"):
        await one_epoch(
            model=model, batches=stream([]), step_optimizer=_optimizer_step(model), forward_only=forward_only
        )


@pytest.mark.anyio
@pytest.mark.parametrize("k", [0, -1, 1.5])
async def test_bad_accumulation(k: Any) -> None:
    x, y = make_data(4)
    model = _model()
    with pytest.raises(ConfigurationError, match="accumulate_gradient_over_n_batches"):
        await one_epoch(
            model=model,
            batches=stream([(x, y)]),
            step_optimizer=_optimizer_step(model),
            accumulate_gradient_over_n_batches=k,
        )


@pytest.mark.anyio
async def test_training_needs_step_optimizer() -> None:
    x, y = make_data(4)
    model = _model()
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(ConfigurationError, match="step_optimizer"):
        await one_epoch(model=model, batches=stream([(x, y)]))
    assert all(torch.equal(p, q) for p, q in zip(model.module.parameters(), before, strict=True))


def test_errors_are_value_errors_and_lamploop_errors() -> None:
    assert issubclass(BatchError, ValueError)
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(NonFiniteLossError, lamploop.errors.LamploopError)
