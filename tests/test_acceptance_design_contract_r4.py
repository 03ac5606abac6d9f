"""Acceptance tests, round 4, written from the contract alone (/work/shared/DESIGN.md and docs/).

Every test checks a promise a user relies on against something computed apart from lamploop:
a plain-torch float64 loop, values worked out by hand from the documented formulas, or the
documented error type with a message that names what was wrong.  Multi-rank runs use 2 ranks at
most, Gloo on 127.0.0.1, tiny models and a few batches; every wait is bounded.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import pytest
import torch
import torch.nn.functional as F
from support import free_port

import lamploop
from lamploop.control import Rendezvous, TcpControlFollower, TcpControlRoot
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    DistributedError,
    HandshakeError,
    LamploopError,
    NonFiniteLossError,
    PeerLostError,
)
from lamploop.state import converter

pytestmark = pytest.mark.timeout(120)

Batch = tuple[torch.Tensor, torch.Tensor]
TOKEN = "round 4 acceptance token"
RUN_BOUND_S = 60.0  # a whole multi-rank run of a few batches; far above what one needs


# --------------------------------------------------------------------------- helpers


def make_module(seed: int, features: int = 3, classes: int = 2) -> torch.nn.Module:
    """A tiny float64 MLP, its weights drawn from ``seed`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(features, 5), torch.nn.Tanh(), torch.nn.Linear(5, classes)
        ).double()


def batch(n: int, seed: int, features: int = 3, classes: int = 2) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=generator)
    return x, y


def seeded_batches(epoch: int, rank: int, sizes: Sequence[int]) -> list[Batch]:
    """Batches that are a pure function of (epoch, rank), as DESIGN section 2 asks."""
    return [batch(n, 10_000 * epoch + 100 * rank + i) for i, n in enumerate(sizes)]


def factory_of(make: Callable[[int, int], Sequence[Batch]]) -> lamploop.BatchStreamFactory:
    """A batch factory whose stream for (epoch, rank) yields ``make(epoch, rank)``."""

    def factory(context: lamploop.BatchContext) -> lamploop.BatchStream:
        batches = list(make(context.epoch, context.rank))

        async def stream() -> Any:
            for features, target in batches:
                yield features.clone(), target.clone()

        return stream()

    return factory


def ce_sum(module: torch.nn.Module, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module(features), target, reduction="sum")


def step_groups(per_rank: Sequence[Sequence[Batch]], k: int) -> list[list[Batch]]:
    """The batches of every optimizer step: batches ``s*k .. s*k+k-1`` of every rank that still
    has them, until no rank has any (a rank that ran out contributes nothing)."""
    groups = []
    step = 0
    while True:
        group = [b for batches in per_rank for b in batches[step * k : (step + 1) * k]]
        if not group:
            return groups
        groups.append(group)
        step += 1


def reference_epoch(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: Sequence[Sequence[Batch]],
    *,
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = ce_sum,
    max_norm: float | None = None,
    rates: Sequence[float] | None = None,
) -> float:
    """One plain-torch epoch: each step backpropagates (sum of its losses) / (its examples)."""
    total, count = 0.0, 0
    for index, group in enumerate(groups):
        if rates is not None:
            for param_group in optimizer.param_groups:
                param_group["lr"] = rates[index]
        optimizer.zero_grad()
        step_sum = torch.zeros((), dtype=torch.float64)
        for features, target in group:
            step_sum = step_sum + loss(module, features, target)
        examples = sum(len(target) for _, target in group)
        (step_sum / examples).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        optimizer.step()
        total += step_sum.item()
        count += examples
    return total / count


def reference_mean_loss(module: torch.nn.Module, batches: Sequence[Batch]) -> float:
    with torch.no_grad():
        total = sum(ce_sum(module, x, y).item() for x, y in batches)
    return total / sum(len(y) for _, y in batches)


def reference_accuracy(module: torch.nn.Module, batches: Sequence[Batch]) -> float:
    with torch.no_grad():
        right = sum(int((module(x).argmax(dim=1) == y).sum()) for x, y in batches)
    return right / sum(len(y) for _, y in batches)


def assert_same_parameters(
    actual: torch.nn.Module | Mapping[str, torch.Tensor],
    expected: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    atol: float = 1e-10,
) -> None:
    a = actual.state_dict() if isinstance(actual, torch.nn.Module) else actual
    e = expected.state_dict() if isinstance(expected, torch.nn.Module) else expected
    assert list(a) == list(e)
    for name in a:
        torch.testing.assert_close(a[name], e[name], rtol=1e-9, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def chain_text(error: BaseException | None) -> str:
    """An error with its causes and contexts, as one line."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)


def sgd(lr: float = 0.3, momentum: float = 0.9) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


async def run_ranks(
    calls: Mapping[str, Callable[[], Awaitable[Any]]],
) -> tuple[dict[str, Any], dict[str, Exception]]:
    """Run every rank as a task of this event loop; what each returned, and what each raised."""
    results: dict[str, Any] = {}
    errors: dict[str, Exception] = {}

    async def guarded(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[name] = await call()
        except Exception as error:
            errors[name] = error

    async with anyio.create_task_group() as group:
        for name, call in calls.items():
            group.start_soon(guarded, name, call)
    return results, errors


def two_ranks(
    kind: str, root: dict[str, Any], follower: dict[str, Any]
) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Root (rank 0) and follower (rank 1) on the CPU, over ``local_control`` or TCP on 127.0.0.1."""
    if kind == "local":
        root_control, followers = lamploop.local_control(2, join_timeout=30.0)
        follower_control: Any = followers[0]
    else:
        port = free_port()
        root_control = TcpControlRoot(
            host="127.0.0.1",
            port=port,
            nranks=2,
            token=TOKEN,
            model_spec=lamploop.model_spec(root["model"].module),
            join_timeout=30.0,
        )
        follower_control = TcpControlFollower(
            host="127.0.0.1",
            port=port,
            rank=1,
            nranks=2,
            token=TOKEN,
            model_spec=lamploop.model_spec(follower["model"].module),
            connect_timeout=30.0,
        )

    async def drive() -> lamploop.LoopState:
        async with root_control:
            return await lamploop.drive_distributed_training(
                nranks=2, device="cpu", control=root_control, **root
            )

    async def follow() -> None:
        async with follower_control:
            await lamploop.follow_distributed_training(
                rank=1, nranks=2, device="cpu", control=follower_control, **follower
            )

    return {"root": drive, "follower": follow}


class TableEffects:
    """Stand-in effects for ``epochs``: the losses of each epoch are looked up in tables."""

    def __init__(self, training: Sequence[float], validation: Sequence[float], epoch: int = 0) -> None:
        self.training, self.validation, self.epoch = training, validation, epoch
        self.trained: list[int] = []
        self.factors: list[float] = []
        self.validated: list[int] = []
        self.saved: list[int] = []
        self.checkpoints: list[tuple[lamploop.LoopState, Any]] = []

    async def train_epoch(self, factor: float) -> float:
        self.trained.append(self.epoch)
        self.factors.append(factor)
        return self.training[self.epoch]

    async def validation_epoch(self) -> float:
        self.validated.append(self.epoch)
        return self.validation[self.epoch]

    async def save_best(self) -> None:
        self.saved.append(self.epoch)

    async def checkpoint_state(self, state: lamploop.LoopState, schedule_state: Any) -> None:
        self.checkpoints.append((state, schedule_state))
        self.epoch = state.epoch


async def run_epochs(effects: TableEffects, **keywords: Any) -> lamploop.LoopState:
    arguments: dict[str, Any] = {
        "max_epochs": len(effects.training),
        "train_epoch": effects.train_epoch,
        "validation_epoch": effects.validation_epoch,
        "save_min_validation_loss_model": effects.save_best,
        "checkpoint_state": effects.checkpoint_state,
    }
    arguments.update(keywords)
    with anyio.fail_after(20):
        return await lamploop.epochs(**arguments)


# --------------------------------------------------------------------------- pure data types


def test_loop_state_is_an_immutable_value_and_a_fresh_one_starts_at_epoch_zero() -> None:
    fresh = lamploop.LoopState()
    assert (
        fresh.epoch,
        fresh.last_validation_loss,
        fresh.min_validation_loss,
        fresh.min_validation_epoch,
        fresh.learning_curve,
    ) == (0, None, None, None, ())
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fresh.epoch = 1  # type: ignore[misc]
    entry = lamploop.LearningCurveEntry(0, 0.5, (0.4, 0.3))
    later = attrs.evolve(fresh, epoch=1, learning_curve=(entry,))
    assert fresh == lamploop.LoopState()
    assert later != fresh
    assert later.learning_curve == (entry,)
    assert lamploop.LoopState(learning_curve=[entry]).learning_curve == (entry,)
    assert isinstance(later.learning_curve, tuple)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        entry.training_loss = 1.0  # type: ignore[misc]

    module = make_module(0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    data = lamploop.LoopStateWithModelAndOptimizerData(
        loop_state=later,
        model=module.state_dict(),
        optimizer=optimizer.state_dict(),
        best_model=module.state_dict(),
    )
    assert data.loop_state == later
    assert_same_parameters(data.model, module)
    assert_same_parameters(data.best_model, module)
    assert data.optimizer["param_groups"][0]["momentum"] == 0.9
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        data.loop_state = fresh  # type: ignore[misc]


def test_learning_curve_entry_factor_is_informational_and_empty_fields_stay_out_of_json() -> None:
    # docs/contract-changes.md: learning_rate_factor is left out of ==, and out of the JSON
    # when None; the metrics are left out of the JSON when empty.
    a = lamploop.LearningCurveEntry(1, 0.5, (0.4, 0.3), learning_rate_factor=0.5)
    b = lamploop.LearningCurveEntry(1, 0.5, (0.4, 0.3), learning_rate_factor=0.25)
    assert a == b
    assert a != lamploop.LearningCurveEntry(1, 0.5, (0.4, 0.2), learning_rate_factor=0.5)
    plain = converter.unstructure(lamploop.LearningCurveEntry(2, 0.7, None))
    assert set(plain) == {"epoch", "training_loss", "validation_loss"}
    again = converter.structure(converter.unstructure(a), lamploop.LearningCurveEntry)
    assert again == a
    assert again.learning_rate_factor == 0.5


# --------------------------------------------------------------------------- epochs


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("max_epochs", "init_epoch"), [(0, None), (3, 3), (2, 4)], ids=["zero", "at-the-end", "past-the-end"]
)
async def test_epochs_with_nothing_left_to_run_trains_nothing_and_returns_the_state(
    max_epochs: int, init_epoch: int | None
) -> None:
    init = None
    if init_epoch is not None:
        curve = tuple(lamploop.LearningCurveEntry(e, 1.0 - e / 10, (0.5, 0.5)) for e in range(init_epoch))
        init = lamploop.LoopState(
            epoch=init_epoch,
            last_validation_loss=0.5,
            min_validation_loss=0.5,
            min_validation_epoch=0,
            learning_curve=curve,
        )
    asked: list[int] = []
    schedule = lamploop.from_epoch_count(lambda e: asked.append(e) or 1.0)
    effects = TableEffects([1.0] * 5, [1.0] * 5)
    state = await run_epochs(effects, max_epochs=max_epochs, init_state=init, learning_rate_schedule=schedule)
    assert state == (init if init is not None else lamploop.LoopState())
    assert effects.trained == []
    assert effects.validated == []
    assert effects.saved == []
    assert effects.checkpoints == []
    assert asked == [init_epoch or 0]  # asked once, at the stop (DESIGN section 3)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("eligible", "saved", "best_epoch", "best"),
    [
        (range(2, 4), [2, 3], 3, 0.6),
        (frozenset({0, 2}), [0, 2], 2, 0.7),
        ([4], [4], 4, 0.4),
        (lamploop.ALL_EPOCHS, [0, 1, 4], 4, 0.4),
        ((), [], None, None),
    ],
    ids=["range", "frozenset", "list", "all", "none"],
)
async def test_eligible_epochs_may_be_any_container(
    eligible: Any, saved: list[int], best_epoch: int | None, best: float | None
) -> None:
    effects = TableEffects([1.0] * 5, [0.9, 0.5, 0.7, 0.6, 0.4])
    state = await run_epochs(effects, return_min_validation_loss_model=eligible)
    assert effects.saved == saved
    assert (state.min_validation_epoch, state.min_validation_loss) == (best_epoch, best)
    assert state.last_validation_loss == 0.4
    assert state.epoch == 5


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("validation", "patience", "eligible", "trained"),
    [
        ([1.0, 0.8, 0.9, 0.85, 0.95, 0.7, 0.6], 3, lamploop.ALL_EPOCHS, 5),
        ([1.0, 0.8, 0.9, 0.85, 0.95, 0.7, 0.6], 3, (), 5),
        ([1.0, 0.8, 0.9, 0.85, 0.95, 0.7, 0.6], 4, lamploop.ALL_EPOCHS, 7),
        ([1.0, 0.8, 0.8, 0.8, 0.5], 2, lamploop.ALL_EPOCHS, 4),
    ],
    ids=["worse-3", "worse-3-nothing-eligible", "patience-4-recovers", "ties-are-no-new-best"],
)
async def test_early_stopping_patience_counts_validations_without_a_new_best(
    validation: list[float], patience: int, eligible: Any, trained: int
) -> None:
    effects = TableEffects([1.0] * len(validation), validation)
    state = await run_epochs(
        effects, early_stopping_patience=patience, return_min_validation_loss_model=eligible
    )
    assert effects.trained == list(range(trained))
    assert state.epoch == trained
    assert len(state.learning_curve) == trained
    assert [entry.validation_loss for entry in state.learning_curve] == [(v, v) for v in validation[:trained]]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("validation", "keywords", "trained"),
    [
        # validations at epochs 0, 2, 4: those of 2 and 4 bring no new best (patience counts
        # validations, not epochs)
        ([1.0, 9.0, 1.1, 9.0, 1.2, 9.0, 0.5], {"validation_frequency": 2}, 5),
        # judged on the smoothed loss: 1.0, 1.5, 1.2 (a raw 0.9 would have been a new best)
        ([1.0, 2.0, 0.9, 0.9, 0.1], {"validation_loss_exponential_smoothing_factor": 0.5}, 3),
    ],
    ids=["every-other-epoch", "smoothed"],
)
async def test_early_stopping_counts_validations_of_the_smoothed_loss(
    validation: list[float], keywords: dict[str, Any], trained: int
) -> None:
    effects = TableEffects([1.0] * len(validation), validation)
    state = await run_epochs(effects, early_stopping_patience=2, **keywords)
    assert effects.trained == list(range(trained))
    assert state.epoch == trained


@pytest.mark.anyio
async def test_epochs_selects_and_stops_early_by_a_metric_to_maximise() -> None:
    accuracies = [0.5, 0.7, 0.6, 0.7, 0.9]
    losses = [1.0, 0.9, 0.8, 0.75, 0.6]  # keeps improving: only the metric judges
    effects = TableEffects([1.0] * 5, losses)

    async def validation_epoch() -> float:
        effects.validated.append(effects.epoch)
        epoch = effects.epoch
        return lamploop.PassResult(losses[epoch], {"accuracy": accuracies[epoch]})

    state = await run_epochs(
        effects,
        validation_epoch=validation_epoch,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        model_selection_metric="accuracy",
        model_selection_mode="max",
        early_stopping_patience=2,
    )
    assert effects.trained == [0, 1, 2, 3]  # epochs 2 (worse) and 3 (a tie) bring no new best
    assert effects.saved == [0, 1]
    assert (state.min_validation_epoch, state.min_validation_loss) == (1, 0.7)
    assert state.last_validation_loss == 0.75  # what schedules see stays the loss
    assert [entry.validation_metrics["accuracy"] for entry in state.learning_curve] == [
        (a, a) for a in accuracies[:4]
    ]


@pytest.mark.anyio
async def test_early_stopping_resumed_mid_count_stops_where_the_uninterrupted_run_does() -> None:
    validation = [1.0, 0.8, 0.9, 0.95, 0.7, 0.6]
    effects = TableEffects([1.0] * 6, validation)
    keywords = {"early_stopping_patience": 2, "return_min_validation_loss_model": lamploop.ALL_EPOCHS}
    final = await run_epochs(effects, **keywords)
    assert effects.trained == [0, 1, 2, 3]
    assert final.epoch == 4
    state, schedule_state = effects.checkpoints[2]  # after epoch 2: one validation of the two
    assert state.epoch == 3
    again = TableEffects([1.0] * 6, validation, epoch=3)
    resumed = await run_epochs(
        again, init_state=state, learning_rate_schedule_init_state=schedule_state, **keywords
    )
    assert again.trained == [3]
    assert resumed == final


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["training", "validation"])
async def test_epochs_non_finite_loss_raises_naming_the_epoch(where: str) -> None:
    training = [1.0, 0.9, 0.8, 0.7]
    validation = [1.0, 0.9, 0.8, 0.7]
    if where == "training":
        training[2] = math.nan
    else:
        validation[2] = math.inf
    effects = TableEffects(training, validation)
    with pytest.raises(NonFiniteLossError, match=r"epoch 2\b"):
        await run_epochs(effects)
    assert effects.trained == [0, 1, 2]
    assert [state.epoch for state, _ in effects.checkpoints] == [1, 2]  # nothing after the bad epoch


# --------------------------------------------------------------------------- one_epoch


async def _stream(batches: Sequence[Any]) -> Any:
    for item in batches:
        yield item


@pytest.mark.anyio
@pytest.mark.parametrize("max_norm", [None, 0.05], ids=["no-clipping", "clipped"])
async def test_one_epoch_uneven_accumulation_and_clipping_equal_a_float64_reference(
    max_norm: float | None,
) -> None:
    sizes = [4, 1, 5, 2, 6]  # k=2: steps of 5, 7 and 6 examples (the last one mid-group)
    batches = [batch(n, 50 + i) for i, n in enumerate(sizes)]
    module = make_module(3)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    with anyio.fail_after(20):
        loss = await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=_stream(batches),
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=2,
            max_gradient_norm=max_norm,
        )
    expected = reference_epoch(
        reference,
        torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9),
        step_groups([batches], 2),
        max_norm=max_norm,
    )
    assert loss == pytest.approx(expected, rel=1e-12)
    assert_same_parameters(module, reference)


@pytest.mark.anyio
@pytest.mark.parametrize("k", [1, 2])
async def test_one_epoch_skip_step_equals_a_run_that_never_saw_the_bad_step(
    k: int, caplog: pytest.LogCaptureFixture
) -> None:
    batches = [batch(3, 70 + i) for i in range(6)]
    batches[2][0][1, 0] = math.nan
    module = make_module(4)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.4, momentum=0.5)
    with warnings.catch_warnings(record=True) as caught, anyio.fail_after(20):
        warnings.simplefilter("always")
        loss = await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=_stream(batches),
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=k,
            on_non_finite_loss="skip_step",
            epoch=0,
        )
    kept = [group for group in step_groups([batches], k) if not any(b is batches[2] for b in group)]
    expected = reference_epoch(reference, torch.optim.SGD(reference.parameters(), lr=0.4, momentum=0.5), kept)
    assert math.isfinite(loss)
    assert loss == pytest.approx(expected, rel=1e-12)
    assert_same_parameters(module, reference)
    said = [str(w.message) for w in caught] + [record.getMessage() for record in caplog.records]
    assert any("non-finite" in text for text in said), said


@pytest.mark.anyio
async def test_one_epoch_non_finite_loss_raises_before_that_optimizer_step() -> None:
    batches = [batch(3, 90 + i) for i in range(6)]
    batches[3][0][2, 1] = math.nan  # (an inf input gives a finite loss through tanh, then NaN weights)
    module = make_module(5)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.4, momentum=0.9)
    with anyio.fail_after(20), pytest.raises(NonFiniteLossError) as caught:
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=_stream(batches),
            step_optimizer=optimizer.step,
            epoch=7,
        )
    error = caught.value
    assert (error.epoch, error.step, error.batch, error.ranks) == (7, 3, 3, (0,))
    assert "epoch 7" in str(error)
    reference_epoch(
        reference, torch.optim.SGD(reference.parameters(), lr=0.4, momentum=0.9), [[b] for b in batches[:3]]
    )
    assert_same_parameters(module, reference)  # steps 0..2 taken, step 3 not


@pytest.mark.anyio
async def test_one_epoch_forward_only_with_metrics_gives_means_over_examples_and_changes_nothing() -> None:
    batches = [batch(5, 11), batch(5, 12), batch(2, 13)]  # means of batches would weigh 2 like 5
    module = make_module(6)
    before = copy.deepcopy(module.state_dict())
    with anyio.fail_after(20):
        result = await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, metrics={"accuracy": lamploop.accuracy}),
            batches=_stream(batches),
            forward_only=True,
        )
    assert isinstance(result, float)
    assert isinstance(result, lamploop.PassResult)
    assert float(result) == pytest.approx(reference_mean_loss(module, batches), rel=1e-12)
    assert result.metrics["accuracy"] == pytest.approx(reference_accuracy(module, batches), rel=1e-12)
    assert_same_parameters(module, before, atol=0)


@pytest.mark.anyio
async def test_one_epoch_a_model_that_fails_on_a_batch_is_a_batch_error_naming_epoch_and_batch() -> None:
    module = make_module(0)
    bad = (torch.randn(4, 7, dtype=torch.float64), torch.zeros(4, dtype=torch.long))  # 7 features, not 3
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with anyio.fail_after(20), pytest.raises(BatchError, match=r"epoch 3, batch 1") as caught:
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=_stream([batch(4, 1), bad]),
            step_optimizer=optimizer.step,
            epoch=3,
        )
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own error as the cause


@pytest.mark.anyio
async def test_summed_turns_a_mean_loss_into_one_that_trains_like_its_mean() -> None:
    # lamploop.summed(F.l1_loss): a loss of (sum, count); a step's gradient is that of the
    # L1 mean over the step's examples.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        module = torch.nn.Linear(3, 1).double()
    reference = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(9)
    batches = [
        (
            torch.randn(n, 3, generator=generator, dtype=torch.float64),
            torch.randn(n, 1, generator=generator, dtype=torch.float64),
        )
        for n in (4, 6, 2)
    ]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.3)
    with anyio.fail_after(20):
        loss = await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, lamploop.summed(F.l1_loss)),
            batches=_stream(batches),
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=2,
        )

    def l1_sum(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(m(x), y, reduction="sum")

    expected = reference_epoch(
        reference, torch.optim.SGD(reference.parameters(), lr=0.3), step_groups([batches], 2), loss=l1_sum
    )
    assert loss == pytest.approx(expected, rel=1e-12)
    assert_same_parameters(module, reference)


@pytest.mark.anyio
async def test_one_epoch_after_step_sees_each_steps_example_count_and_loss_sum() -> None:
    sizes = [4, 1, 5, 2, 6]  # k=2: steps of 5, 7 and 6 examples
    batches = [batch(n, 80 + i) for i, n in enumerate(sizes)]
    module = make_module(7)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.2)
    seen: list[tuple[int, float]] = []
    with anyio.fail_after(20):
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=_stream(batches),
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=2,
            after_step=lambda count, loss_sum: seen.append((int(count), float(loss_sum))),
        )
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    expected = []
    for group in step_groups([batches], 2):
        with torch.no_grad():
            step_sum = sum(ce_sum(reference, x, y).item() for x, y in group)
        expected.append((sum(len(y) for _, y in group), step_sum))
        reference_epoch(reference, reference_optimizer, [group])
    assert [count for count, _ in seen] == [5, 7, 6]
    assert [loss for _, loss in seen] == pytest.approx([loss for _, loss in expected], rel=1e-12)


@pytest.mark.anyio
async def test_one_epoch_features_may_be_a_structure_of_tensors() -> None:
    # docs/concepts/batch-streams.md: features may be any structure the module takes; the first
    # dimension of each tensor is the batch.
    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 2).double()
            self.b = torch.nn.Linear(1, 2).double()

        def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.a(features["a"]) + self.b(features["b"])

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(14)
        module = TwoInputs()
    reference = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(15)
    batches = []
    for n in (3, 5, 2):
        features = {
            "a": torch.randn(n, 2, generator=generator, dtype=torch.float64),
            "b": torch.randn(n, 1, generator=generator, dtype=torch.float64),
        }
        batches.append((features, torch.randint(0, 2, (n,), generator=generator)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    with anyio.fail_after(20):
        loss = await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=_stream(batches),
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=2,
        )
    expected = reference_epoch(
        reference, torch.optim.SGD(reference.parameters(), lr=0.5), step_groups([batches], 2)
    )
    assert loss == pytest.approx(expected, rel=1e-12)
    assert_same_parameters(module, reference)


def test_tensor_batches_with_drop_last_deal_full_batches_each_example_at_most_once() -> None:
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    factory = lamploop.tensor_batches(x, y, batch_size=3, seed=2, drop_last=True)

    async def targets(epoch: int, rank: int, nranks: int) -> list[list[int]]:
        stream = factory(lamploop.BatchContext(epoch=epoch, rank=rank, nranks=nranks))
        return [target.tolist() async for _, target in stream]

    alone = anyio.run(targets, 0, 0, 1)
    assert [len(b) for b in alone] == [3, 3, 3]
    assert len({t for b in alone for t in b}) == 9
    assert anyio.run(targets, 0, 0, 2) == alone[0::2]
    assert anyio.run(targets, 0, 1, 2) == alone[1::2]
    assert anyio.run(targets, 0, 0, 1) == alone  # a pure function of (seed, epoch, rank)
    assert anyio.run(targets, 1, 0, 1) != alone


# --------------------------------------------------------------------------- one rank, the driver


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate of every step it takes."""

    rates: list[float]

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.rates = []

    def step(self, closure: Any = None) -> Any:
        self.rates.append(self.param_groups[0]["lr"])
        return super().step(closure)


@pytest.mark.anyio
async def test_driver_alone_epoch_factor_times_step_factor_is_each_steps_rate() -> None:
    module = make_module(10)
    reference = copy.deepcopy(module)
    optimizers: list[RecordingSGD] = []

    def factory(params: Any) -> RecordingSGD:
        optimizers.append(RecordingSGD(params, lr=0.2))
        return optimizers[-1]

    with anyio.fail_after(RUN_BOUND_S):
        state = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module),
            optimizer_factory=factory,
            train_batches=factory_of(lambda e, r: seeded_batches(e, r, [4, 4, 4])),
            validation_batches=None,
            max_epochs=2,
            learning_rate_schedule=lamploop.decrement(every=1, fraction=0.5),
            step_schedule=lamploop.warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3),
        )
    # decrement: 0.5 ** epoch; warmup_linear(2, 6, 3) per docs: 0.5, 1, 1, 0.75, 0.5, 0.25
    epoch_factors = [1, 1, 1, 0.5, 0.5, 0.5]
    step_factors = [0.5, 1, 1, 0.75, 0.5, 0.25]
    expected = [0.2 * e * s for e, s in zip(epoch_factors, step_factors, strict=True)]
    assert optimizers[0].rates == pytest.approx(expected, rel=1e-12)
    assert [entry.learning_rate_factor for entry in state.learning_curve] == [1.0, 0.5]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for epoch in range(2):
        groups = [[b] for b in seeded_batches(epoch, 0, [4, 4, 4])]
        reference_epoch(reference, optimizer, groups, rates=expected[3 * epoch : 3 * epoch + 3])
    assert_same_parameters(module, reference)


@pytest.mark.anyio
async def test_driver_alone_torch_scheduler_stepped_every_step() -> None:
    module = make_module(11)
    optimizers: list[RecordingSGD] = []

    def factory(params: Any) -> RecordingSGD:
        optimizers.append(RecordingSGD(params, lr=0.1))
        return optimizers[-1]

    with anyio.fail_after(RUN_BOUND_S):
        await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module),
            optimizer_factory=factory,
            train_batches=factory_of(lambda e, r: seeded_batches(e, r, [3, 3])),
            validation_batches=None,
            max_epochs=2,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
            lr_scheduler_interval="step",
        )
    assert optimizers[0].rates == pytest.approx([0.1, 0.05, 0.025, 0.0125], rel=1e-12)


@pytest.mark.anyio
async def test_driver_alone_ema_leaves_the_hand_computed_average_in_the_model() -> None:
    module = make_module(12)
    reference = copy.deepcopy(module)
    with anyio.fail_after(RUN_BOUND_S):
        await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module),
            optimizer_factory=sgd(0.5, 0.0),
            train_batches=factory_of(lambda e, r: seeded_batches(e, r, [4, 4])),
            validation_batches=None,
            max_epochs=2,
            averaging=lamploop.ema(0.5),
        )
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    average: dict[str, torch.Tensor] | None = None
    for epoch in range(2):
        for b in seeded_batches(epoch, 0, [4, 4]):
            reference_epoch(reference, optimizer, [[b]])
            weights = {name: p.detach().clone() for name, p in reference.state_dict().items()}
            if average is None:  # the first update copies the weights
                average = weights
            else:
                average = {name: 0.5 * average[name] + 0.5 * weights[name] for name in weights}
    assert average is not None
    assert_same_parameters(module, average, atol=1e-12)


@pytest.mark.anyio
async def test_driver_alone_selects_by_the_largest_smoothed_validation_accuracy() -> None:
    module = make_module(13)
    reference = copy.deepcopy(module)
    train = [batch(8, 300 + i) for i in range(3)]
    valid = [batch(12, 400)]
    with anyio.fail_after(RUN_BOUND_S):
        state = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, metrics={"accuracy": lamploop.accuracy}),
            optimizer_factory=sgd(1.0, 0.0),
            train_batches=factory_of(lambda e, r: train),
            validation_batches=factory_of(lambda e, r: valid),
            max_epochs=4,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            validation_loss_exponential_smoothing_factor=0.5,
            model_selection_metric="accuracy",
            model_selection_mode="max",
        )
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    smoothed_loss = smoothed_accuracy = None
    best = best_epoch = None
    snapshot: dict[str, torch.Tensor] = {}
    for epoch in range(4):
        training_loss = reference_epoch(reference, optimizer, [[b] for b in train])
        raw_loss, raw_accuracy = reference_mean_loss(reference, valid), reference_accuracy(reference, valid)
        smoothed_loss = raw_loss if smoothed_loss is None else raw_loss * 0.5 + smoothed_loss * 0.5
        smoothed_accuracy = (
            raw_accuracy if smoothed_accuracy is None else raw_accuracy * 0.5 + smoothed_accuracy * 0.5
        )
        entry = state.learning_curve[epoch]
        assert entry.training_loss == pytest.approx(training_loss, rel=1e-10)
        assert entry.validation_loss == pytest.approx((smoothed_loss, raw_loss), rel=1e-10)
        assert entry.validation_metrics["accuracy"] == pytest.approx(
            (smoothed_accuracy, raw_accuracy), rel=1e-12
        )
        if best is None or smoothed_accuracy > best:
            best, best_epoch = smoothed_accuracy, epoch
            snapshot = copy.deepcopy(reference.state_dict())
    assert state.min_validation_epoch == best_epoch
    assert state.min_validation_loss == pytest.approx(best, rel=1e-12)
    assert state.last_validation_loss == pytest.approx(smoothed_loss, rel=1e-10)  # still the loss
    assert_same_parameters(module, snapshot)


# --------------------------------------------------------------------------- two ranks


@pytest.mark.anyio
async def test_drive_follow_uneven_streams_with_accumulation_equal_a_float64_reference() -> None:
    # rank 0 has 5 batches, rank 1 has 2: with k=2, step 0 takes 2 batches of each rank, steps 1
    # and 2 only rank 0's (rank 1 takes part with zero examples). Validation shares 4 and 3.
    train = {0: [3, 4, 2, 5, 3], 1: [2, 6]}
    valid = {0: [4], 1: [3]}
    root_module, follower_module = make_module(20), make_module(21)  # the follower starts from the root's
    reference = copy.deepcopy(root_module)
    train_batches = factory_of(lambda e, r: seeded_batches(e, r, train[r]))
    valid_batches = factory_of(lambda e, r: seeded_batches(100 + e, r, valid[r]))
    calls = two_ranks(
        "local",
        root={
            "model": lamploop.SupervisedModel(root_module),
            "optimizer_factory": sgd(0.3, 0.9),
            "train_batches": train_batches,
            "validation_batches": valid_batches,
            "max_epochs": 3,
            "accumulate_gradient_over_n_batches": 2,
            "return_min_validation_loss_model": lamploop.ALL_EPOCHS,
            "validation_loss_exponential_smoothing_factor": 0.5,
        },
        follower={
            "model": lamploop.SupervisedModel(follower_module),
            "train_batches": train_batches,
            "validation_batches": valid_batches,
            "accumulate_gradient_over_n_batches": 2,
        },
    )
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    assert errors == {}
    assert results["follower"] is None  # followers have no loop state of their own
    state = results["root"]

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    smoothed = best = best_epoch = None
    snapshot: dict[str, torch.Tensor] = {}
    for epoch in range(3):
        groups = step_groups([seeded_batches(epoch, r, train[r]) for r in (0, 1)], 2)
        assert [len(g) for g in groups] == [4, 2, 1]
        training_loss = reference_epoch(reference, optimizer, groups)
        raw = reference_mean_loss(
            reference, [b for r in (0, 1) for b in seeded_batches(100 + epoch, r, valid[r])]
        )
        smoothed = raw if smoothed is None else raw * 0.5 + smoothed * 0.5
        entry = state.learning_curve[epoch]
        assert entry.epoch == epoch
        assert entry.training_loss == pytest.approx(training_loss, rel=1e-10)
        assert entry.validation_loss == pytest.approx((smoothed, raw), rel=1e-10)
        if best is None or smoothed < best:
            best, best_epoch = smoothed, epoch
            snapshot = copy.deepcopy(reference.state_dict())
    assert state.epoch == 3
    assert state.min_validation_epoch == best_epoch
    assert state.min_validation_loss == pytest.approx(best, rel=1e-10)
    assert state.last_validation_loss == pytest.approx(smoothed, rel=1e-10)
    assert_same_parameters(root_module, snapshot, atol=1e-9)  # the best model is copied in at the end


@pytest.mark.anyio
async def test_drive_follow_over_tcp_replicated_adam_equals_a_float64_reference() -> None:
    root_module, follower_module = make_module(30), make_module(31)
    reference = copy.deepcopy(root_module)

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01)

    train_batches = factory_of(lambda e, r: seeded_batches(e, r, [4, 3, 5]))
    calls = two_ranks(
        "tcp",
        root={
            "model": lamploop.SupervisedModel(root_module),
            "optimizer_factory": adam,
            "train_batches": train_batches,
            "validation_batches": None,
            "max_epochs": 2,
        },
        follower={
            "model": lamploop.SupervisedModel(follower_module),
            "optimizer_factory": adam,  # every rank has one: all_reduce, every rank steps
            "train_batches": train_batches,
            "validation_batches": None,
        },
    )
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    assert errors == {}
    assert results["follower"] is None  # followers have no loop state of their own
    state = results["root"]
    optimizer = adam(reference.parameters())
    for epoch in range(2):
        groups = step_groups([seeded_batches(epoch, r, [4, 3, 5]) for r in (0, 1)], 1)
        training_loss = reference_epoch(reference, optimizer, groups)
        assert state.learning_curve[epoch].training_loss == pytest.approx(training_loss, rel=1e-10)
        assert state.learning_curve[epoch].validation_loss is None
    assert (state.epoch, state.min_validation_epoch, state.min_validation_loss) == (2, None, None)
    assert_same_parameters(root_module, reference, atol=1e-9)
    assert_same_parameters(follower_module, reference, atol=1e-9)


@pytest.mark.anyio
async def test_ranks_asking_for_different_strategies_fail_both_naming_each() -> None:
    data = factory_of(lambda e, r: seeded_batches(e, r, [2, 2]))
    calls = two_ranks(
        "local",
        root={
            "model": lamploop.SupervisedModel(make_module(40)),
            "optimizer_factory": sgd(),
            "train_batches": data,
            "validation_batches": None,
            "max_epochs": 1,
            "strategy": "all_reduce",
        },
        follower={
            "model": lamploop.SupervisedModel(make_module(41)),
            "optimizer_factory": sgd(),
            "train_batches": data,
            "validation_batches": None,
            "strategy": "reduce_to_root",
        },
    )
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    assert results == {}
    for name in ("root", "follower"):
        error = errors[name]
        assert isinstance(error, DistributedError), f"{name}: {chain_text(error)}"
        assert "all_reduce" in str(error), f"{name}: {error}"
        assert "reduce_to_root" in str(error), f"{name}: {error}"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("setting", "root_value", "follower_value"),
    [("accumulate_gradient_over_n_batches", 2, 1), ("max_gradient_norm", 1.0, 2.0)],
)
async def test_ranks_holding_an_every_rank_setting_differently_fail_naming_it(
    setting: str, root_value: Any, follower_value: Any
) -> None:
    assert setting in lamploop.TrainingSettings.EVERY_RANK
    data = factory_of(lambda e, r: seeded_batches(e, r, [2, 2, 2]))
    calls = two_ranks(
        "local",
        root={
            "model": lamploop.SupervisedModel(make_module(42)),
            "optimizer_factory": sgd(),
            "train_batches": data,
            "validation_batches": None,
            "max_epochs": 1,
            setting: root_value,
        },
        follower={
            "model": lamploop.SupervisedModel(make_module(43)),
            "train_batches": data,
            "validation_batches": None,
            setting: follower_value,
        },
    )
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    assert results == {}, "ranks that disagree on an every-rank setting trained anyway"
    for name in ("root", "follower"):
        assert isinstance(errors[name], LamploopError), f"{name}: {chain_text(errors[name])}"
        assert setting in str(errors[name]), f"{name}: {errors[name]}"


def failing_stream(sizes: Sequence[int], *, epoch: int, message: str) -> lamploop.BatchStreamFactory:
    """Seeded batches; in ``epoch`` the stream raises ``message`` after its first batch."""

    def factory(context: lamploop.BatchContext) -> lamploop.BatchStream:
        batches = seeded_batches(context.epoch, context.rank, sizes)

        async def stream() -> Any:
            for index, item in enumerate(batches):
                if context.epoch == epoch and index == 1:
                    raise RuntimeError(message)
                yield item

        return stream()

    return factory


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["local", "tcp"])
async def test_a_follower_whose_stream_fails_ends_the_root_at_once_naming_rank_1(kind: str) -> None:
    message = "the follower's data source broke"
    calls = two_ranks(
        kind,
        root={
            "model": lamploop.SupervisedModel(make_module(50)),
            "optimizer_factory": sgd(),
            "train_batches": factory_of(lambda e, r: seeded_batches(e, r, [3, 3, 3])),
            "validation_batches": None,
            "max_epochs": 3,
        },
        follower={
            "model": lamploop.SupervisedModel(make_module(51)),
            "train_batches": failing_stream([3, 3, 3], epoch=1, message=message),
            "validation_batches": None,
        },
    )
    started = time.monotonic()
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    elapsed = time.monotonic() - started
    assert results == {}
    root_error = errors["root"]
    assert isinstance(root_error, PeerLostError), chain_text(root_error)
    assert root_error.rank == 1
    assert message in str(root_error)
    assert message in chain_text(errors["follower"])
    assert elapsed < 15.0


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["local", "tcp"])
async def test_a_root_whose_validation_fails_ends_the_follower_naming_rank_0(kind: str) -> None:
    message = "the root's validation source broke"
    data = factory_of(lambda e, r: seeded_batches(e, r, [3, 3]))
    calls = two_ranks(
        kind,
        root={
            "model": lamploop.SupervisedModel(make_module(52)),
            "optimizer_factory": sgd(),
            "train_batches": data,
            "validation_batches": failing_stream([2, 2], epoch=0, message=message),
            "max_epochs": 2,
        },
        follower={
            "model": lamploop.SupervisedModel(make_module(53)),
            "train_batches": data,
            "validation_batches": factory_of(lambda e, r: seeded_batches(e, r, [2, 2])),
        },
    )
    started = time.monotonic()
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    elapsed = time.monotonic() - started
    assert results == {}
    follower_error = errors["follower"]
    assert isinstance(follower_error, PeerLostError), chain_text(follower_error)
    assert follower_error.rank == 0
    assert message in chain_text(errors["root"])
    assert elapsed < 15.0


@pytest.mark.anyio
async def test_a_nan_loss_on_one_rank_is_the_same_error_on_both_ranks() -> None:
    def make(epoch: int, rank: int) -> list[Batch]:
        batches = seeded_batches(epoch, rank, [3, 3, 3])
        if rank == 1:
            batches[1][0][0, 0] = math.nan
        return batches

    data = factory_of(make)
    calls = two_ranks(
        "local",
        root={
            "model": lamploop.SupervisedModel(make_module(54)),
            "optimizer_factory": sgd(),
            "train_batches": data,
            "validation_batches": None,
            "max_epochs": 2,
        },
        follower={
            "model": lamploop.SupervisedModel(make_module(55)),
            "train_batches": data,
            "validation_batches": None,
        },
    )
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    assert results == {}
    for name in ("root", "follower"):
        error = errors[name]
        assert isinstance(error, NonFiniteLossError), f"{name}: {chain_text(error)}"
        assert (error.epoch, error.step, error.ranks) == (0, 1, (1,)), f"{name}: {error}"
    assert errors["follower"].batch == 1
    assert errors["root"].batch is None  # the root's own batch was fine


@pytest.mark.anyio
async def test_local_data_parallel_losses_are_global_means_over_uneven_shares() -> None:
    # training: rank 0 has 8 examples in 2 batches, rank 1 has 4 in 1; validation 6 and 4.
    train = {0: [batch(4, 600), batch(4, 602)], 1: [batch(4, 601)]}
    valid = {0: [batch(4, 700), batch(2, 702)], 1: [batch(4, 701)]}
    first, second = make_module(60), make_module(61)
    reference = copy.deepcopy(first)
    replicas = [
        (
            lamploop.SupervisedModel(module),
            factory_of(lambda e, r: train[r]),
            factory_of(lambda e, r: valid[r]),
        )
        for module in (first, second)
    ]
    with anyio.fail_after(RUN_BOUND_S):
        state = await lamploop.local_data_parallel_training_loop(replicas, sgd(0.5, 0.0), 1)
    training_loss = reference_epoch(
        reference, torch.optim.SGD(reference.parameters(), lr=0.5), step_groups([train[0], train[1]], 1)
    )
    raw = reference_mean_loss(reference, valid[0] + valid[1])
    (entry,) = state.learning_curve
    assert entry.training_loss == pytest.approx(training_loss, rel=1e-10)
    assert entry.validation_loss == pytest.approx((raw, raw), rel=1e-10)
    assert state.last_validation_loss == pytest.approx(raw, rel=1e-10)
    assert state.min_validation_epoch is None  # the contract's default: no epoch eligible
    assert_same_parameters(first, reference, atol=1e-9)


@pytest.mark.anyio
async def test_local_data_parallel_skip_step_drops_that_step_on_every_rank() -> None:
    def make(epoch: int, rank: int) -> list[Batch]:
        batches = seeded_batches(epoch, rank, [3, 3, 3])
        if rank == 1:
            batches[1][0][2, 2] = math.nan
        return batches

    first, second = make_module(62), make_module(63)
    reference = copy.deepcopy(first)
    replicas = [(lamploop.SupervisedModel(module), factory_of(make), None) for module in (first, second)]
    with warnings.catch_warnings(record=True), anyio.fail_after(RUN_BOUND_S):
        warnings.simplefilter("always")
        state = await lamploop.local_data_parallel_training_loop(
            replicas, sgd(0.3, 0.9), 1, on_non_finite_loss="skip_step"
        )
    groups = step_groups([make(0, 0), make(0, 1)], 1)
    kept = [groups[0], groups[2]]  # step 1 is dropped on both ranks
    training_loss = reference_epoch(
        reference, torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9), kept
    )
    assert state.learning_curve[0].training_loss == pytest.approx(training_loss, rel=1e-10)
    assert_same_parameters(first, reference, atol=1e-9)


@pytest.mark.anyio
async def test_a_rank_without_any_batch_takes_part_with_zero_examples() -> None:
    # DESIGN section 3: a rank whose stream is exhausted contributes zero examples; here rank 1's
    # training and validation streams are empty from the start (not empty on every rank).
    train = {0: [batch(4, 800), batch(3, 801)], 1: []}
    valid = {0: [batch(5, 900)], 1: []}
    first, second = make_module(64), make_module(65)
    reference = copy.deepcopy(first)
    replicas = [
        (
            lamploop.SupervisedModel(module),
            factory_of(lambda e, r: train[r]),
            factory_of(lambda e, r: valid[r]),
        )
        for module in (first, second)
    ]
    with anyio.fail_after(RUN_BOUND_S):
        state = await lamploop.local_data_parallel_training_loop(replicas, sgd(0.5, 0.9), 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for epoch in range(2):
        training_loss = reference_epoch(reference, optimizer, [[b] for b in train[0]])
        raw = reference_mean_loss(reference, valid[0])
        assert state.learning_curve[epoch].training_loss == pytest.approx(training_loss, rel=1e-10)
        assert state.learning_curve[epoch].validation_loss == pytest.approx((raw, raw), rel=1e-10)
    assert_same_parameters(first, reference, atol=1e-9)


@pytest.mark.anyio
async def test_drive_follow_early_stopping_ends_both_ranks_when_validation_stalls() -> None:
    # lr 0: the validation loss never changes, so every validation after the first ties (no new
    # best); with early_stopping_patience=2 the run ends after epoch 2, on both ranks.
    data = factory_of(lambda e, r: seeded_batches(e, r, [3, 3]))
    valid = factory_of(lambda e, r: seeded_batches(500, r, [4]))
    trained: list[tuple[int, int]] = []

    def counting(factory: lamploop.BatchStreamFactory) -> lamploop.BatchStreamFactory:
        def make(context: lamploop.BatchContext) -> lamploop.BatchStream:
            trained.append((context.epoch, context.rank))
            return factory(context)

        return make

    calls = two_ranks(
        "local",
        root={
            "model": lamploop.SupervisedModel(make_module(66)),
            "optimizer_factory": sgd(0.0, 0.0),
            "train_batches": counting(data),
            "validation_batches": valid,
            "max_epochs": 10,
            "early_stopping_patience": 2,
        },
        follower={
            "model": lamploop.SupervisedModel(make_module(67)),
            "train_batches": counting(data),
            "validation_batches": valid,
        },
    )
    with anyio.fail_after(RUN_BOUND_S):
        results, errors = await run_ranks(calls)
    assert errors == {}
    state = results["root"]
    assert state.epoch == 3
    assert len(state.learning_curve) == 3
    assert sorted(trained) == [(e, r) for e in range(3) for r in (0, 1)]


@pytest.mark.anyio
async def test_driver_alone_non_finite_validation_loss_raises_naming_the_epoch() -> None:
    def valid(epoch: int, rank: int) -> list[Batch]:
        batches = seeded_batches(600 + epoch, rank, [3, 3])
        if epoch == 1:
            batches[1][0][0, 0] = math.nan
        return batches

    checkpoints: list[int] = []

    async def checkpoint(state: Any, schedule_state: Any) -> None:
        checkpoints.append(state.loop_state.epoch)

    with anyio.fail_after(RUN_BOUND_S), pytest.raises(NonFiniteLossError, match=r"epoch 1\b"):
        await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(make_module(68)),
            optimizer_factory=sgd(),
            train_batches=factory_of(lambda e, r: seeded_batches(e, r, [3])),
            validation_batches=factory_of(valid),
            max_epochs=3,
            checkpoint_state=checkpoint,
        )
    assert checkpoints == [1]  # epoch 0's checkpoint only: nothing is written for the bad epoch


# --------------------------------------------------------------------------- TCP handshake


@pytest.mark.anyio
async def test_tcp_rank_started_twice_is_refused_and_fails_the_root_naming_it() -> None:
    # docs/control-channel.md: "rank 1 has already joined from ...: is rank 1 started twice?"; the
    # refused follower raises HandshakeError, and since the job cannot succeed, so does the root.
    spec = lamploop.model_spec(make_module(70))
    port = free_port()
    root = TcpControlRoot(
        host="127.0.0.1", port=port, nranks=3, token=TOKEN, model_spec=spec, join_timeout=15.0
    )

    async def root_side() -> None:
        async with root:
            await root.on_rendezvous_ready(Rendezvous(host="127.0.0.1", port=1))

    def follower_side(delay: float) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await anyio.sleep(delay)
            follower = TcpControlFollower(
                host="127.0.0.1",
                port=port,
                rank=1,
                nranks=3,
                token=TOKEN,
                model_spec=spec,
                connect_timeout=15.0,
            )
            async with follower:
                await follower.join()

        return run

    started = time.monotonic()
    with anyio.fail_after(30):
        results, errors = await run_ranks(
            {"root": root_side, "first": follower_side(0.0), "second": follower_side(0.5)}
        )
    assert results == {}
    assert isinstance(errors["root"], HandshakeError), chain_text(errors["root"])
    assert "twice" in str(errors["root"])
    assert "rank 1" in str(errors["root"])
    refused = [e for e in (errors["first"], errors["second"]) if isinstance(e, HandshakeError)]
    assert any("twice" in str(e) for e in refused), [chain_text(e) for e in errors.values()]
    assert time.monotonic() - started < 15.0  # not the 15 s join timeout


# --------------------------------------------------------------------------- bad inputs


async def _epochs(**keywords: Any) -> Any:
    async def train(factor: float) -> float:
        return 1.0

    async def valid() -> float:
        return 1.0

    async def save() -> None:
        return None

    arguments: dict[str, Any] = {
        "max_epochs": 3,
        "train_epoch": train,
        "validation_epoch": valid,
        "save_min_validation_loss_model": save,
    }
    arguments.update(keywords)
    return await lamploop.epochs(**arguments)


async def _one_epoch(batches: Sequence[Any], *, model: Any = None, **keywords: Any) -> Any:
    supervised = model or lamploop.SupervisedModel(make_module(0))
    optimizer = torch.optim.SGD(supervised.module.parameters(), lr=0.1)
    arguments: dict[str, Any] = {"step_optimizer": optimizer.step, "epoch": 3}
    arguments.update(keywords)
    return await lamploop.one_epoch(model=supervised, batches=_stream(batches), **arguments)


async def _drive_alone(**keywords: Any) -> Any:
    arguments: dict[str, Any] = {
        "nranks": 1,
        "device": "cpu",
        "control": None,
        "model": lamploop.SupervisedModel(make_module(0)),
        "optimizer_factory": sgd(0.1, 0.0),
        "train_batches": factory_of(lambda e, r: seeded_batches(e, r, [4, 4, 4])),
        "validation_batches": None,
        "max_epochs": 1,
    }
    arguments.update(keywords)
    return await lamploop.drive_distributed_training(**arguments)


async def _iterate(factory: lamploop.BatchStreamFactory) -> None:
    async for _ in factory(lamploop.BatchContext(epoch=0)):
        pass


async def _sync(call: Callable[[], Any]) -> Any:
    return call()


async def _follow_as_rank_zero() -> None:
    _, followers = lamploop.local_control(2, join_timeout=5.0)
    async with followers[0]:
        await lamploop.follow_distributed_training(
            rank=0,
            nranks=2,
            device="cpu",
            control=followers[0],
            model=lamploop.SupervisedModel(make_module(0)),
            train_batches=factory_of(lambda e, r: seeded_batches(e, r, [2])),
            validation_batches=None,
        )


def _plain_generator(context: lamploop.BatchContext) -> Any:
    yield batch(2, 0)


@attrs.frozen
class _NegativeAtStepOne:
    def factor(self, epoch: int, step: int) -> float:
        return -1.0 if step == 1 else 1.0


def case(name: str, error: Any, match: str, call: Callable[[], Awaitable[Any]]) -> Any:
    return pytest.param(error, match, call, id=name)


_X, _Y = batch(4, 1)
BAD_INPUTS = [
    case("epochs-negative-max_epochs", ConfigurationError, r"max_epochs", lambda: _epochs(max_epochs=-1)),
    case(
        "epochs-validation_frequency-0",
        ConfigurationError,
        r"validation_frequency",
        lambda: _epochs(validation_frequency=0),
    ),
    case(
        "epochs-smoothing-above-1",
        ConfigurationError,
        r"smoothing",
        lambda: _epochs(validation_loss_exponential_smoothing_factor=1.5),
    ),
    case(
        "epochs-plateau-without-validation",
        ConfigurationError,
        r"validation",
        lambda: _epochs(validation_epoch=None, learning_rate_schedule=lamploop.reduce_lr_on_plateau()),
    ),
    case(
        "epochs-plateau-other-validation-frequency",
        ConfigurationError,
        r"validation_frequency",
        lambda: _epochs(validation_frequency=2, learning_rate_schedule=lamploop.reduce_lr_on_plateau()),
    ),
    case(
        "epochs-unknown-selection-mode",
        ConfigurationError,
        r"model_selection_mode|median",
        lambda: _epochs(model_selection_mode="median"),
    ),
    case(
        "epochs-nan-factor",
        ConfigurationError,
        r"(?s)(nan.*epoch 1|epoch 1.*nan)",
        lambda: _epochs(
            learning_rate_schedule=lamploop.from_epoch_count(lambda e: math.nan if e == 1 else 1.0)
        ),
    ),
    case(
        "epochs-factor-not-a-number",
        ConfigurationError,
        r"(?s)(epoch 1|\(1\)).*half|half.*(epoch 1|\(1\))",  # the epoch may be shown as the call's argument
        lambda: _epochs(
            learning_rate_schedule=lamploop.from_epoch_count(lambda e: "half" if e == 1 else 1.0)
        ),
    ),
    case(
        "one_epoch-accumulate-0",
        ConfigurationError,
        r"accumulate_gradient_over_n_batches",
        lambda: _one_epoch([(_X, _Y)], accumulate_gradient_over_n_batches=0),
    ),
    case(
        "one_epoch-unknown-non-finite-policy",
        ConfigurationError,
        r"on_non_finite_loss|ignore",
        lambda: _one_epoch([(_X, _Y)], on_non_finite_loss="ignore"),
    ),
    case("one_epoch-item-not-a-pair", BatchError, r"batch 0", lambda: _one_epoch([_X])),
    case(
        "one_epoch-features-and-target-sizes-differ",
        BatchError,
        r"epoch 3, batch 1",
        lambda: _one_epoch([(_X, _Y), (_X, _Y[:3])]),
    ),
    case(
        "one_epoch-empty-batch-in-validation",
        BatchError,
        r"empty|0 examples",
        lambda: _one_epoch([(_X, _Y), (_X[:0], _Y[:0])], forward_only=True, step_optimizer=None),
    ),
    case(
        "one_epoch-loss-returns-a-mean",
        ConfigurationError,
        r"summed",
        lambda: _one_epoch([(_X, _Y)], model=lamploop.SupervisedModel(make_module(0), F.cross_entropy)),
    ),
    case(
        "tensor_batches-batch_size-0",
        ConfigurationError,
        r"batch_size",
        lambda: _iterate(lamploop.tensor_batches(_X, _Y, batch_size=0)),
    ),
    case(
        "tensor_batches-lengths-differ",
        (ConfigurationError, BatchError),
        r"\b4\b.*\b3\b|\b3\b.*\b4\b",
        lambda: _iterate(lamploop.tensor_batches(_X, _Y[:3], batch_size=2)),
    ),
    case(
        "local_control-no-ranks",
        ConfigurationError,
        r"nranks",
        lambda: _sync(lambda: lamploop.local_control(0)),
    ),
    case(
        "local_data_parallel-no-replicas",
        ConfigurationError,
        r"replica|models_with_data_streams",
        lambda: lamploop.local_data_parallel_training_loop([], sgd(), 1),
    ),
    case("follow-as-rank-0", ConfigurationError, r"rank", _follow_as_rank_zero),
    case(
        "tcp-follower-rank-out-of-range",
        ConfigurationError,
        r"rank",
        lambda: _sync(
            lambda: TcpControlFollower(
                host="127.0.0.1",
                port=1,
                rank=5,
                nranks=2,
                token=TOKEN,
                model_spec=lamploop.model_spec(make_module(0)),
            )
        ),
    ),
    case("drive-nranks-0", ConfigurationError, r"nranks", lambda: _drive_alone(nranks=0)),
    case("drive-two-ranks-without-control", ConfigurationError, r"control", lambda: _drive_alone(nranks=2)),
    case(
        "drive-unknown-strategy",
        ConfigurationError,
        r"all-reduce",
        lambda: _drive_alone(strategy="all-reduce"),
    ),
    case(
        "drive-unknown-keyword",
        ConfigurationError,
        r"(?s)(drive_distributed_training.*learning_rate|learning_rate.*drive_distributed_training)",
        lambda: _drive_alone(learning_rate=0.1),
    ),
    case(
        "drive-setting-as-keyword-and-in-settings",
        ConfigurationError,
        r"max_gradient_norm",
        lambda: _drive_alone(
            max_gradient_norm=1.0, settings=lamploop.TrainingSettings(max_gradient_norm=2.0)
        ),
    ),
    case(
        "drive-lamp-keyword-contradicts-settings",
        ConfigurationError,
        r"accumulate_gradient_over_n_batches",
        lambda: _drive_alone(
            accumulate_gradient_over_n_batches=2,
            settings=lamploop.TrainingSettings(accumulate_gradient_over_n_batches=3),
        ),
    ),
    case(
        "drive-negative-max_gradient_norm",
        ConfigurationError,
        r"max_gradient_norm",
        lambda: _drive_alone(max_gradient_norm=-1.0),
    ),
    case(
        "drive-factory-returns-a-plain-generator",
        ConfigurationError,
        r"iterable_batches",
        lambda: _drive_alone(train_batches=_plain_generator),
    ),
    case(
        "drive-stream-empty-on-every-rank",
        BatchError,
        r"epoch 0",
        lambda: _drive_alone(train_batches=factory_of(lambda e, r: [])),
    ),
    case(
        "drive-negative-step-factor",
        ConfigurationError,
        r"(?s)(epoch 0.*step 1|step 1.*epoch 0)",
        lambda: _drive_alone(step_schedule=_NegativeAtStepOne()),
    ),
    case(
        "drive-torch-scheduler-beside-a-step-schedule",
        ConfigurationError,
        r"lr_scheduler owns the learning rates",
        lambda: _drive_alone(
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1),
            step_schedule=lamploop.warmup_linear(warmup_steps=1, total_steps=3, steps_per_epoch=3),
        ),
    ),
    case(
        "drive-torch-reduce-lr-on-plateau",
        ConfigurationError,
        r"ReduceLROnPlateau|reduce_lr_on_plateau",
        lambda: _drive_alone(
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        ),
    ),
    case(
        "drive-swa-that-never-averages",
        ConfigurationError,
        r"start_epoch|swa|SWA",
        lambda: _drive_alone(averaging=lamploop.swa(5), max_epochs=3),
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("error", "match", "call"), BAD_INPUTS)
async def test_bad_input_is_the_documented_error_naming_what_was_wrong(
    error: Any, match: str, call: Callable[[], Awaitable[Any]]
) -> None:
    with anyio.fail_after(20), pytest.raises(error, match=match) as caught:
        await call()
    assert isinstance(caught.value, LamploopError), chain_text(caught.value)
