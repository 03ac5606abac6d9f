"""Acceptance tests of DESIGN.md sections 2 and 3: the public API contract.

Written from DESIGN.md, docs/contract-changes.md (where the project changed the contract on
purpose), docs/concepts/loop-state.md and the public docstrings and signatures only, without
reading the package's source. Every expected number is computed by hand (float64) or by a plain
PyTorch loop written here, apart from lamploop. Each test quotes the sentence of DESIGN.md it
checks.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import json
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import anyio
import attrs
import pytest
import torch
import torch.nn.functional as F

import lamploop
import lamploop.control
import lamploop.schedules
import lamploop.state
from lamploop.state import converter

# ---------------------------------------------------------------------------------------------
# Helpers: data, a tiny float64 model, a reference SGD loop written apart from lamploop.
# ---------------------------------------------------------------------------------------------

_GENERATOR = torch.Generator().manual_seed(20261129)
X = torch.randn(24, 3, generator=_GENERATOR, dtype=torch.float64)
Y = torch.randn(24, 1, generator=_GENERATOR, dtype=torch.float64)
MSE_SUM = lamploop.summed(F.mse_loss)


def make_module(*, zero: bool = False) -> torch.nn.Linear:
    module = torch.nn.Linear(3, 1, dtype=torch.float64)
    with torch.no_grad():
        if zero:
            module.weight.zero_()
            module.bias.zero_()
        else:
            module.weight.copy_(torch.tensor([[0.5, -0.25, 0.125]], dtype=torch.float64))
            module.bias.fill_(0.0625)
    return module


def sgd(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    def factory(parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=lr)

    return factory


def parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def assert_same_parameters(actual: torch.nn.Module | dict, expected: torch.nn.Module | dict) -> None:
    actual = parameters_of(actual) if isinstance(actual, torch.nn.Module) else actual
    expected = parameters_of(expected) if isinstance(expected, torch.nn.Module) else expected
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-12, atol=1e-12, msg=name)


Batch = tuple[torch.Tensor, torch.Tensor]


def reference_step(
    module: torch.nn.Module, batches: Sequence[Batch], lrs: Sequence[float]
) -> tuple[float, int]:
    """One plain SGD step on the gradient of (sum of every example's loss) / (number of examples).

    ``lrs`` holds one learning rate per parameter (in ``module.parameters()`` order).
    Returns the step's loss sum (before the step) and its example count.
    """
    module.zero_grad()
    total = sum(F.mse_loss(module(x), y, reduction="sum") for x, y in batches)
    count = sum(len(y) for _, y in batches)
    (total / count).backward()
    with torch.no_grad():
        for parameter, lr in zip(module.parameters(), lrs, strict=True):
            parameter -= lr * parameter.grad
    return float(total.detach()), count


def reference_mean_loss(module: torch.nn.Module, batches: Sequence[Batch]) -> float:
    with torch.no_grad():
        total = sum(float(F.mse_loss(module(x), y, reduction="sum")) for x, y in batches)
    return total / sum(len(y) for _, y in batches)


def per_rank_factory(per_rank: Sequence[Sequence[slice]], calls: list | None = None):
    """A stream factory: rank r's batches are ``(X[s], Y[s])`` for its slices, every epoch alike."""

    def make(context: lamploop.BatchContext) -> list[Batch]:
        if calls is not None:
            calls.append((context.epoch, context.rank, context.nranks))
        return [(X[s], Y[s]) for s in per_rank[context.rank]]

    return lamploop.iterable_batches(make)


def steps_of(per_rank: Sequence[Sequence[slice]], k: int) -> list[list[Batch]]:
    """The examples of each optimizer step: step i takes batches i*k .. i*k+k-1 of every rank
    that still has them (an exhausted rank contributes nothing)."""
    n_steps = max(-(-len(slices) // k) for slices in per_rank)
    return [
        [(X[s], Y[s]) for slices in per_rank for s in slices[i * k : (i + 1) * k]] for i in range(n_steps)
    ]


async def async_batches(batches: Sequence[Batch]):
    for batch in batches:
        yield batch


class Script:
    """Effects for ``epochs`` that look the losses up in tables and log every call."""

    def __init__(self, training: Sequence[float], validation: Sequence[float], log: list, first: int = 0):
        self.training = training
        self.validation = validation
        self.log = log
        self.current = first - 1  # the epoch being run
        self.factors: list[float] = []
        self.saved: list[int] = []
        self.checkpoints: list[tuple[lamploop.LoopState, Any]] = []

    async def train_epoch(self, factor: float) -> float:
        self.current += 1
        self.factors.append(factor)
        self.log.append(("train", self.current, factor))
        return self.training[self.current]

    async def validation_epoch(self) -> float:
        self.log.append(("valid", self.current))
        return self.validation[self.current]

    async def save_best(self) -> None:
        self.log.append(("save", self.current))
        self.saved.append(self.current)

    async def checkpoint_state(self, state: lamploop.LoopState, schedule_state: Any) -> None:
        self.log.append(("checkpoint", state.epoch))
        self.checkpoints.append((state, schedule_state))


class RecordingSchedule:
    """A schedule of exactly DESIGN's shape (``init`` and ``learning_rate_factor``, nothing else).

    Its state is the tuple of every question asked so far, so a state says exactly where the
    schedule stands; every question is also logged.
    """

    def __init__(self, log: list, factor: Callable[[int], float] = lambda epoch: 1.0) -> None:
        self.log = log
        self.factor = factor

    def init(self) -> tuple:
        return ()

    def learning_rate_factor(self, state: tuple, epoch: int, last_validation_loss: float | None):
        self.log.append(("ask", epoch, last_validation_loss, state))
        return (*state, (epoch, last_validation_loss)), self.factor(epoch)


def asks(log: list) -> list[tuple]:
    return [entry for entry in log if entry[0] == "ask"]


# ---------------------------------------------------------------------------------------------
# Section 2: names, signatures, data types.
# ---------------------------------------------------------------------------------------------

TOP_LEVEL_NAMES = [
    "LoopState",
    "LearningCurveEntry",
    "LoopStateWithModelAndOptimizerData",
    "noop",
    "decrement",
    "linear",
    "step_after",
    "reduce_lr_on_plateau",
    "cyclic",
    "from_epoch_count",
    "epochs",
    "one_epoch",
    "drive_distributed_training",
    "follow_distributed_training",
    "local_data_parallel_training_loop",
    "SupervisedModel",
    "BatchStream",
    # docs/contract-changes.md, "Public names" and "Model selection"
    "ALL_EPOCHS",
    "local_control",
    "TcpControlRoot",
    "TcpControlFollower",
]


@pytest.mark.parametrize("name", TOP_LEVEL_NAMES)
def test_public_name_is_exported_from_lamploop(name: str) -> None:
    """DESIGN.md section 1: "__init__.py        the public names, re-exported"; section 2 names them.

    docs/contract-changes.md: "The names in `lamploop.__all__` are the public API."
    """
    assert hasattr(lamploop, name)
    assert name in lamploop.__all__


MODULE_NAMES = [
    ("lamploop.state", "LoopState"),
    ("lamploop.state", "LoopStateWithModelAndOptimizerData"),
    ("lamploop.state", "LearningCurveEntry"),
    ("lamploop.state", "converter"),
    ("lamploop.schedules", "noop"),
    ("lamploop.schedules", "decrement"),
    ("lamploop.schedules", "linear"),
    ("lamploop.schedules", "step_after"),
    ("lamploop.schedules", "reduce_lr_on_plateau"),
    ("lamploop.schedules", "cyclic"),
    ("lamploop.schedules", "from_epoch_count"),
    ("lamploop.control", "ControlRoot"),
    ("lamploop.control", "ControlFollower"),
    ("lamploop.control", "Train"),
    ("lamploop.control", "Valid"),
    ("lamploop.control", "Stop"),
]


@pytest.mark.parametrize(("module", "name"), MODULE_NAMES, ids=[f"{m}.{n}" for m, n in MODULE_NAMES])
def test_name_lives_where_design_puts_it(module: str, name: str) -> None:
    """DESIGN.md section 1: "state.py           LoopState, LoopStateWithModelAndOptimizerData,
    LearningCurveEntry", "schedules.py       pure learning-rate schedules", "control/
    Command types and the two control channels"."""
    imported = __import__(module, fromlist=[name])
    value = getattr(imported, name)
    if hasattr(lamploop, name):
        assert getattr(lamploop, name) is value


REQUIRED = object()  # DESIGN gives the keyword without a default
NOOP = object()  # DESIGN's default `noop()`
RECORDED_DEFAULT = object()  # DESIGN gives no default; docs/contract-changes.md records one

_EPOCH_KEYWORDS = {
    "checkpoint_state": None,
    "validation_frequency": 1,
    "return_min_validation_loss_model": (),
    "learning_rate_schedule": NOOP,
    "init_state": None,
    "learning_rate_schedule_init_state": None,
    "validation_loss_exponential_smoothing_factor": 1.0,
}

DESIGN_SIGNATURES: dict[str, dict[str, object]] = {
    "epochs": {
        "max_epochs": REQUIRED,
        "train_epoch": REQUIRED,
        "validation_epoch": REQUIRED,
        "save_min_validation_loss_model": REQUIRED,
        **_EPOCH_KEYWORDS,
    },
    "one_epoch": {
        "model": REQUIRED,
        "batches": REQUIRED,
        "channel": RECORDED_DEFAULT,  # "`channel` defaults to the single-process channel"
        "step_optimizer": None,
        "forward_only": False,
        "accumulate_gradient_over_n_batches": 1,
    },
    "drive_distributed_training": {
        "nranks": REQUIRED,
        "device": REQUIRED,
        "control": REQUIRED,
        "model": REQUIRED,
        "optimizer_factory": REQUIRED,
        "train_batches": REQUIRED,
        "validation_batches": REQUIRED,
        "max_epochs": REQUIRED,
        "accumulate_gradient_over_n_batches": 1,
        **_EPOCH_KEYWORDS,
    },
    "follow_distributed_training": {
        "rank": REQUIRED,
        "nranks": REQUIRED,
        "device": REQUIRED,
        "control": REQUIRED,
        "model": REQUIRED,
        "train_batches": REQUIRED,
        "validation_batches": REQUIRED,
        "accumulate_gradient_over_n_batches": 1,
    },
}


def _check_default(name: str, parameter: inspect.Parameter, expected: object) -> None:
    if expected is REQUIRED:
        assert parameter.default is inspect.Parameter.empty, f"{name} should be required"
    elif expected is RECORDED_DEFAULT:
        pass
    elif expected is NOOP:
        assert parameter.default == lamploop.noop(), name
    else:
        assert parameter.default == expected, name
        assert type(parameter.default) is type(expected), name


@pytest.mark.parametrize("function", sorted(DESIGN_SIGNATURES))
def test_design_keywords_with_their_defaults(function: str) -> None:
    """DESIGN.md section 2: "async def epochs(*, max_epochs, train_epoch, validation_epoch,
    save_min_validation_loss_model, checkpoint_state=None, validation_frequency=1, ...)" and the
    signatures of one_epoch, drive_distributed_training and follow_distributed_training there:
    every keyword present, keyword-only, with DESIGN's default, and the function async."""
    target = getattr(lamploop, function)
    assert inspect.iscoroutinefunction(target)
    parameters = inspect.signature(target).parameters
    missing = sorted(set(DESIGN_SIGNATURES[function]) - set(parameters))
    assert not missing, f"{function} lacks {missing}"
    for name, expected in DESIGN_SIGNATURES[function].items():
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        _check_default(name, parameters[name], expected)


def test_local_data_parallel_training_loop_signature() -> None:
    """DESIGN.md section 2: "async def local_data_parallel_training_loop(models_with_data_streams,
    optimizer_factory, max_epochs, ...) -> LoopState   # one process, one replica per device";
    its docstring: "The other arguments are those of drive_distributed_training"."""
    target = lamploop.local_data_parallel_training_loop
    assert inspect.iscoroutinefunction(target)
    parameters = list(inspect.signature(target).parameters.values())
    assert [p.name for p in parameters[:3]] == ["models_with_data_streams", "optimizer_factory", "max_epochs"]
    for parameter in parameters[:3]:
        assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert parameter.default is inspect.Parameter.empty
    by_name = {p.name: p for p in parameters}
    for name, expected in {**_EPOCH_KEYWORDS, "accumulate_gradient_over_n_batches": 1}.items():
        assert name in by_name, name
        _check_default(name, by_name[name], expected)


SCHEDULE_SIGNATURES = {
    "noop": [],
    "decrement": ["every", "fraction"],
    "linear": ["start", "end", "max_steps"],
    "step_after": ["steps", "factor"],
    "from_epoch_count": ["f"],
}


@pytest.mark.parametrize("name", sorted(SCHEDULE_SIGNATURES))
def test_schedule_factory_parameters(name: str) -> None:
    """DESIGN.md section 2: "Provide lamp's set: `noop`, `decrement(every, fraction)`,
    `linear(start, end, max_steps)`, `step_after(steps, factor)`, `reduce_lr_on_plateau(...)`,
    `cyclic(...)`, `from_epoch_count(f)`."""
    parameters = inspect.signature(getattr(lamploop, name)).parameters
    assert list(parameters) == SCHEDULE_SIGNATURES[name]


SCHEDULE_EXAMPLES = {
    # name: (schedule, [(epoch, last_validation_loss, expected factor)]); the values follow
    # each factory's docstring.
    "noop": (lamploop.noop(), [(e, None, 1.0) for e in range(4)]),
    "decrement": (
        lamploop.decrement(2, 0.5),
        [(0, None, 1.0), (1, None, 1.0), (2, None, 0.5), (3, None, 0.5), (4, None, 0.25)],
    ),
    "linear": (
        lamploop.linear(1.0, 0.0, 4),
        [(0, None, 1.0), (1, None, 0.75), (2, None, 0.5), (3, None, 0.25), (4, None, 0.0), (5, None, 0.0)],
    ),
    "step_after": (
        lamploop.step_after(2, 0.1),
        [(0, None, 1.0), (1, None, 1.0), (2, None, 0.1), (5, None, 0.1)],
    ),
    "cyclic": (
        lamploop.cyclic(3.0, 4),
        [(0, None, 1.0), (1, None, 2.0), (2, None, 3.0), (3, None, 2.0), (4, None, 1.0)],
    ),
    "from_epoch_count": (
        lamploop.from_epoch_count(lambda e: 1.0 / (e + 1)),
        [(0, None, 1.0), (3, None, 0.25)],
    ),
    # docs/concepts/loop-state.md: patience 0, halving after each validation without improvement
    "reduce_lr_on_plateau": (
        lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5),
        [(0, None, 1.0), (1, 1.0, 1.0), (2, 0.75, 1.0), (3, 0.75, 0.5), (4, 0.625, 0.5), (5, 0.8125, 0.25)],
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULE_EXAMPLES))
def test_schedules_are_pure_state_machines(name: str) -> None:
    """DESIGN.md section 2: "Schedules are pure state machines (like optax): `init() -> S` and
    `learning_rate_factor(state: S, epoch: int, last_validation_loss: float | None) -> (S, float)`."
    """
    schedule, questions = SCHEDULE_EXAMPLES[name]
    assert list(inspect.signature(schedule.learning_rate_factor).parameters) == [
        "state",
        "epoch",
        "last_validation_loss",
    ]
    state = schedule.init()
    assert schedule.init() == state
    for epoch, loss, expected in questions:
        again = schedule.learning_rate_factor(state, epoch, loss)  # pure: asking twice is the same
        new_state, factor = schedule.learning_rate_factor(state, epoch, loss)
        assert again == (new_state, factor)
        assert factor == pytest.approx(expected, rel=1e-15, abs=1e-15), epoch
        state = new_state


DATA_TYPES = {
    "LoopState": (
        lamploop.LoopState,
        ["epoch", "last_validation_loss", "min_validation_loss", "min_validation_epoch", "learning_curve"],
        lambda: lamploop.LoopState(
            epoch=1,
            last_validation_loss=0.5,
            min_validation_loss=0.5,
            min_validation_epoch=0,
            learning_curve=(lamploop.LearningCurveEntry(0, 0.75, (0.5, 0.5)),),
        ),
    ),
    "LearningCurveEntry": (
        lamploop.LearningCurveEntry,
        ["epoch", "training_loss", "validation_loss"],
        lambda: lamploop.LearningCurveEntry(epoch=0, training_loss=0.75, validation_loss=(0.5, 0.25)),
    ),
    "LoopStateWithModelAndOptimizerData": (
        lamploop.LoopStateWithModelAndOptimizerData,
        ["loop_state", "model", "optimizer", "best_model"],
        lambda: lamploop.LoopStateWithModelAndOptimizerData(
            loop_state=lamploop.LoopState(),
            model={"w": torch.zeros(2)},
            optimizer={"state": {}, "param_groups": []},
            best_model={"w": torch.ones(2)},
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(DATA_TYPES))
def test_data_types_are_frozen_attrs_classes_with_design_fields(name: str) -> None:
    """DESIGN.md section 2: "@attrs.frozen class LoopState: epoch: int; last_validation_loss ...;
    min_validation_loss ...; min_validation_epoch ...; learning_curve ..." (and LearningCurveEntry,
    LoopStateWithModelAndOptimizerData there). docs/contract-changes.md adds fields after them."""
    cls, fields, make = DATA_TYPES[name]
    assert attrs.has(cls)
    assert [field.name for field in attrs.fields(cls)][: len(fields)] == fields
    value = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(value, fields[0], getattr(value, fields[0]))


def test_learning_curve_is_a_tuple_oldest_first() -> None:
    """DESIGN.md section 2: "learning_curve: tuple[LearningCurveEntry, ...]   # oldest first"."""
    entries = [lamploop.LearningCurveEntry(0, 1.0, None), lamploop.LearningCurveEntry(1, 0.5, None)]
    state = lamploop.LoopState(epoch=2, learning_curve=entries)
    assert isinstance(state.learning_curve, tuple)
    assert state.learning_curve == tuple(entries)


JSON_STATES = {
    "fresh": lamploop.LoopState(),
    "full": lamploop.LoopState(
        epoch=3,
        last_validation_loss=0.375,
        min_validation_loss=0.25,
        min_validation_epoch=1,
        learning_curve=(
            lamploop.LearningCurveEntry(0, 0.9, (0.5, 0.5)),
            lamploop.LearningCurveEntry(1, 0.7, (0.25, 0.125)),
            lamploop.LearningCurveEntry(2, 0.6, None),
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(JSON_STATES))
def test_loop_state_json_round_trip_through_cattrs(name: str) -> None:
    """DESIGN.md section 6: "a JSON descriptor (cattrs: loop state, schedule state, ...)";
    docs/concepts/loop-state.md: the rest is stored as JSON "through `lamploop.state.converter`"."""
    state = JSON_STATES[name]
    text = json.dumps(converter.unstructure(state), allow_nan=False)
    back = converter.structure(json.loads(text), lamploop.LoopState)
    assert back == state
    assert isinstance(back.learning_curve, tuple)
    for entry in back.learning_curve:
        assert entry.validation_loss is None or type(entry.validation_loss) is tuple


def test_schedule_state_json_round_trip_through_cattrs() -> None:
    """DESIGN.md section 6: "a JSON descriptor (cattrs: loop state, schedule state, ...)";
    docs/contract-changes.md: a schedule has "`state_type` (so a checkpoint can read the schedule
    state back from JSON)"."""
    schedule = lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5)
    state = schedule.init()
    for epoch, loss in enumerate([None, 1.0, 0.75, 0.75]):
        state, _ = schedule.learning_rate_factor(state, epoch, loss)
    text = json.dumps(converter.unstructure(state))
    back = converter.structure(json.loads(text), schedule.state_type)
    assert back == state
    assert schedule.learning_rate_factor(back, 4, 0.625) == schedule.learning_rate_factor(state, 4, 0.625)


def test_control_commands_are_immutable_values() -> None:
    """DESIGN.md section 5: "Commands: `Train(epoch, lr_factor)`, `Valid(epoch)`, `Stop(reason)`";
    section 0: "Plain immutable data (`LoopState`, ...) is threaded through async functions"."""
    control = lamploop.control
    assert control.Train(epoch=2, lr_factor=0.5) == control.Train(2, 0.5)
    assert control.Valid(epoch=2) == control.Valid(2)
    assert control.Stop(reason="done") == control.Stop("done")
    assert control.Train(2, 0.5) != control.Train(3, 0.5)
    for command, field in [
        (control.Train(2, 0.5), "epoch"),
        (control.Valid(2), "epoch"),
        (control.Stop("x"), "reason"),
    ]:
        with pytest.raises(AttributeError):
            setattr(command, field, getattr(command, field))


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_in_process_control_channel_carries_commands_in_order() -> None:
    """DESIGN.md section 5: "`ControlRoot`: `on_rendezvous_ready(rendezvous)`, `peers()`,
    `broadcast(command)`. `ControlFollower`: `join() -> (rendezvous, commands)`. ... In-process:
    anyio memory streams."""
    control = lamploop.control
    root, followers = lamploop.local_control(3)
    assert isinstance(root, control.ControlRoot)
    assert all(isinstance(follower, control.ControlFollower) for follower in followers)
    rendezvous = control.Rendezvous(host="127.0.0.1", port=29555)
    sent = [control.Train(0, 1.0), control.Valid(0), control.Train(1, 0.5), control.Stop("max epochs")]
    received: dict[int, tuple[Any, list]] = {}

    async def follow(rank: int, follower: Any) -> None:
        got, commands = await follower.join()
        received[rank] = (got, [command async for command in commands])

    with anyio.fail_after(30):
        async with root, followers[0], followers[1], anyio.create_task_group() as group:
            for rank, follower in enumerate(followers, start=1):
                group.start_soon(follow, rank, follower)
            await root.on_rendezvous_ready(rendezvous)
            assert root.peers() == (1, 2)
            for command in sent:
                await root.broadcast(command)
    assert received == {1: (rendezvous, sent), 2: (rendezvous, sent)}


# ---------------------------------------------------------------------------------------------
# Section 3 through `epochs` with hand-written effects.
# ---------------------------------------------------------------------------------------------


async def run_epochs(script: Script, **keywords: Any) -> lamploop.LoopState:
    keywords.setdefault("validation_epoch", script.validation_epoch)
    return await lamploop.epochs(
        train_epoch=script.train_epoch,
        save_min_validation_loss_model=script.save_best,
        checkpoint_state=script.checkpoint_state,
        **keywords,
    )


SMOOTHING_CASES = {
    # a, raw validation losses, expected (smoothed, raw) per epoch; exact binary fractions
    "a=0.25": (0.25, [1.0, 2.0, 0.5], [(1.0, 1.0), (1.25, 2.0), (1.0625, 0.5)]),
    "a=0.5": (0.5, [1.0, 0.5, 0.75, 0.5], [(1.0, 1.0), (0.75, 0.5), (0.75, 0.75), (0.625, 0.5)]),
    "a=1-default": (None, [1.0, 2.0, 0.5], [(1.0, 1.0), (2.0, 2.0), (0.5, 0.5)]),
}


@pytest.mark.parametrize("case", sorted(SMOOTHING_CASES))
@pytest.mark.anyio
async def test_smoothing_formula(case: str) -> None:
    """DESIGN.md section 3: "Smoothing: `smoothed = raw * a + previous_smoothed * (1 - a)`,
    previous defaulting to raw." and section 2: "validation_loss: tuple[float, float] | None
    # (smoothed, raw)"; "last_validation_loss: float | None      # smoothed"."""
    a, raw, expected = SMOOTHING_CASES[case]
    script = Script([1.0] * len(raw), raw, [])
    keywords = {} if a is None else {"validation_loss_exponential_smoothing_factor": a}
    final = await run_epochs(script, max_epochs=len(raw), **keywords)
    assert [entry.validation_loss for entry in final.learning_curve] == expected
    assert [entry.epoch for entry in final.learning_curve] == list(range(len(raw)))
    assert final.last_validation_loss == expected[-1][0]
    assert final.epoch == len(raw)


@pytest.mark.anyio
async def test_smoothed_loss_carries_over_epochs_without_validation() -> None:
    """DESIGN.md section 3: "The last smoothed validation loss carries over epochs in which
    validation does not run (lamp reset it to None there, which broke plateau schedules with
    `validation_frequency > 1`)."""
    log: list = []
    script = Script([1.0] * 5, [1.0, None, 2.0, None, 0.5], log)
    final = await run_epochs(
        script,
        max_epochs=5,
        validation_frequency=2,
        validation_loss_exponential_smoothing_factor=0.25,
        learning_rate_schedule=RecordingSchedule(log),
    )
    assert [entry[1] for entry in log if entry[0] == "valid"] == [0, 2, 4]
    assert [entry.validation_loss for entry in final.learning_curve] == [
        (1.0, 1.0),
        None,
        (1.25, 2.0),  # smoothed from epoch 0's 1.0, carried over epoch 1
        None,
        (1.0625, 0.5),
    ]
    # what the schedule sees before each epoch (and at the stop): the carried smoothed loss
    assert [(epoch, loss) for _, epoch, loss, _ in asks(log)] == [
        (0, None),
        (1, 1.0),
        (2, 1.0),
        (3, 1.25),
        (4, 1.25),
        (5, 1.0625),
    ]
    assert [state.last_validation_loss for state, _ in script.checkpoints] == [1.0, 1.0, 1.25, 1.25, 1.0625]
    assert final.last_validation_loss == 1.0625


@pytest.mark.anyio
async def test_plateau_schedule_with_validation_frequency_two() -> None:
    """DESIGN.md section 3: lamp's reset "broke plateau schedules with `validation_frequency > 1`";
    docs/contract-changes.md: "`reduce_lr_on_plateau(..., validation_frequency=1)` ... `epochs`
    raises `ConfigurationError` if the two frequencies differ. A perfectly flat loss counts as a
    plateau"."""
    script = Script([1.0] * 6, [1.0] * 6, [])
    await run_epochs(
        script,
        max_epochs=6,
        validation_frequency=2,
        learning_rate_schedule=lamploop.reduce_lr_on_plateau(patience=0, validation_frequency=2),
    )
    # validations at 0, 2, 4 (all 1.0): the first sets the best, each later flat one reduces
    assert script.factors == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    with pytest.raises(lamploop.errors.ConfigurationError):
        await run_epochs(
            Script([1.0] * 2, [1.0] * 2, []),
            max_epochs=2,
            validation_frequency=2,
            learning_rate_schedule=lamploop.reduce_lr_on_plateau(patience=0),
        )


@pytest.mark.anyio
async def test_schedule_asked_before_each_epoch_and_once_more_at_the_stop() -> None:
    """DESIGN.md section 3: "The schedule is asked for epoch e's factor before epoch e runs (also
    once more at the stop)." Section 2: "train_epoch: Callable[[float], Awaitable[float]]   (lr
    factor -> mean training loss)"."""
    log: list = []
    script = Script([0.9, 0.8, 0.7], [1.0, 0.5, 0.25], log)
    schedule = RecordingSchedule(log, factor=lambda epoch: 2.0**-epoch)
    final = await run_epochs(script, max_epochs=3, learning_rate_schedule=schedule)
    order = [(kind, epoch) for kind, epoch, *_ in log if kind in ("ask", "train")]
    assert order == [("ask", 0), ("train", 0), ("ask", 1), ("train", 1), ("ask", 2), ("train", 2), ("ask", 3)]
    assert script.factors == [1.0, 0.5, 0.25]
    assert final.epoch == 3
    assert [entry.training_loss for entry in final.learning_curve] == [0.9, 0.8, 0.7]
    # validation runs after the epoch's training, and the checkpoint after both
    for epoch in range(3):
        assert (
            log.index(("train", epoch, 2.0**-epoch))
            < log.index(("valid", epoch))
            < log.index(("checkpoint", epoch + 1))
        )


@pytest.mark.parametrize("stop_factor", [0.0, -0.5], ids=["zero", "negative"])
@pytest.mark.anyio
async def test_factor_at_most_zero_ends_training(stop_factor: float) -> None:
    """DESIGN.md section 2: "A factor <= 0 ends training (early stopping)."."""
    factors = {0: 1.0, 1: 0.5, 2: stop_factor, 3: 1.0, 4: 1.0}
    script = Script([1.0] * 5, [1.0] * 5, [])
    final = await run_epochs(
        script, max_epochs=5, learning_rate_schedule=lamploop.from_epoch_count(factors.__getitem__)
    )
    assert script.factors == [1.0, 0.5]
    assert final.epoch == 2
    assert len(final.learning_curve) == 2


@pytest.mark.anyio
async def test_checkpoint_state_gets_next_epoch_and_next_schedule_state_and_resume_is_exact() -> None:
    """DESIGN.md section 3: "`checkpoint_state` receives the schedule state that the next epoch
    will use, so that a resumed run asks the schedule exactly what an uninterrupted run would have
    asked". Section 2: "checkpoint_state: ..., called after every epoch with LoopState(epoch + 1,
    ...), so that resuming from it continues at the next epoch."."""
    training = [0.9, 0.7, 0.6, 0.5]
    validation = [1.0, 0.5, 0.75, 0.25]
    log: list = []
    script = Script(training, validation, log)
    keywords = {
        "max_epochs": 4,
        "validation_loss_exponential_smoothing_factor": 0.5,
        "return_min_validation_loss_model": lamploop.ALL_EPOCHS,
    }
    final = await run_epochs(script, learning_rate_schedule=RecordingSchedule(log), **keywords)
    questions = [(epoch, loss) for _, epoch, loss, _ in asks(log)]
    # smoothed: 1.0, 0.75, 0.75, 0.5
    assert questions == [(0, None), (1, 1.0), (2, 0.75), (3, 0.75), (4, 0.5)]
    assert [state.epoch for state, _ in script.checkpoints] == [1, 2, 3, 4]
    for e, (state, schedule_state) in enumerate(script.checkpoints):
        assert schedule_state == tuple(questions[: e + 1]), e  # what epoch e + 1 is asked with
        assert len(state.learning_curve) == e + 1
    assert script.checkpoints[-1][0] == final

    # resume after epoch 1 from exactly what checkpoint_state received
    state, schedule_state = script.checkpoints[1]
    resumed_log: list = []
    again = Script(training, validation, resumed_log, first=state.epoch)
    resumed = await run_epochs(
        again,
        learning_rate_schedule=RecordingSchedule(resumed_log),
        init_state=state,
        learning_rate_schedule_init_state=schedule_state,
        **keywords,
    )
    assert resumed == final
    assert asks(resumed_log) == asks(log)[2:]
    assert again.factors == script.factors[2:]
    assert again.saved == [e for e in script.saved if e >= 2]


SELECTION_CASES = {
    # eligible epochs, a, raw losses, expected saves, expected (min loss, min epoch)
    "listed-1-2-3": ((1, 2, 3), 1.0, [0.5, 1.0, 0.75, 0.75, 0.25], [1, 2], (0.75, 2)),
    "default-none": (None, 1.0, [0.5, 1.0, 0.75, 0.75, 0.25], [], (None, None)),
    "all-epochs": (lamploop.ALL_EPOCHS, 1.0, [0.5, 1.0, 0.75, 0.5, 0.25], [0, 4], (0.25, 4)),
    # docs/concepts/loop-state.md: smoothed 1.0, 0.75, 0.75, 0.625, 0.8125, 0.78125
    "all-epochs-smoothed": (
        lamploop.ALL_EPOCHS,
        0.5,
        [1.0, 0.5, 0.75, 0.5, 1.0, 0.75],
        [0, 1, 3],
        (0.625, 3),
    ),
}


@pytest.mark.parametrize("case", sorted(SELECTION_CASES))
@pytest.mark.anyio
async def test_model_selection_only_listed_epochs_and_strict_improvement(case: str) -> None:
    """DESIGN.md section 3: "Model selection: only epochs listed in
    `return_min_validation_loss_model` (a convenience for "all epochs" is welcome) may become the
    best; the best model is snapshotted when the smoothed loss improves strictly."."""
    eligible, a, raw, saves, (min_loss, min_epoch) = SELECTION_CASES[case]
    script = Script([1.0] * len(raw), raw, [])
    keywords: dict[str, Any] = {"validation_loss_exponential_smoothing_factor": a}
    if eligible is not None:
        keywords["return_min_validation_loss_model"] = eligible
    final = await run_epochs(script, max_epochs=len(raw), **keywords)
    assert script.saved == saves
    assert (final.min_validation_loss, final.min_validation_epoch) == (min_loss, min_epoch)


# ---------------------------------------------------------------------------------------------
# Section 3 through `one_epoch` on one process.
# ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_one_epoch_forward_only_returns_mean_over_examples() -> None:
    """DESIGN.md section 2: "async def one_epoch(*, model, batches, channel, step_optimizer=None,
    forward_only=False, ...) -> float   # global mean loss"; section 3: "sum of losses / sum of
    examples"."""
    module = make_module(zero=True)  # output 0: each example's loss is target**2
    model = lamploop.SupervisedModel(module, MSE_SUM)
    batches = [
        (torch.zeros(1, 3, dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)),
        (torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64)),
    ]
    loss = await lamploop.one_epoch(model=model, batches=async_batches(batches), forward_only=True)
    assert isinstance(loss, float)
    assert loss == 1.0  # (4 + 0) / 4 examples; a mean of batch means would be 2.0
    assert_same_parameters(module, make_module(zero=True))


ACCUMULATION_SLICES = [slice(0, 2), slice(2, 3), slice(3, 6)]


@pytest.mark.parametrize("k", [1, 2, 3, 4], ids=lambda k: f"k{k}")
@pytest.mark.anyio
async def test_one_epoch_accumulation_and_epoch_ending_mid_group(k: int) -> None:
    """DESIGN.md section 3: "An epoch that ends in the middle of an accumulation group still steps
    with what it has." and "one optimizer step uses the gradient of (sum of losses of every example
    in the step, ...) / (number of those examples)"."""
    module = make_module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    steps: list[int] = []

    def step() -> None:
        steps.append(1)
        optimizer.step()

    batches = [(X[s], Y[s]) for s in ACCUMULATION_SLICES]
    loss = await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module, MSE_SUM),
        batches=async_batches(batches),
        step_optimizer=step,
        accumulate_gradient_over_n_batches=k,
    )
    reference = make_module()
    groups = [batches[i : i + k] for i in range(0, len(batches), k)]
    sums = [reference_step(reference, group, [0.1, 0.1]) for group in groups]
    assert len(steps) == len(groups)  # 3 batches: k=2 -> 2 steps, k=4 -> 1 step
    assert_same_parameters(module, reference)
    assert loss == pytest.approx(sum(s for s, _ in sums) / 6, rel=1e-12)


@pytest.mark.anyio
async def test_one_epoch_empty_batch_is_a_clear_error() -> None:
    """DESIGN.md section 3: "A stream that yields an empty batch is an error with a clear
    message."."""
    module = make_module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    batches = [(X[0:2], Y[0:2]), (X[0:0], Y[0:0])]
    with pytest.raises(lamploop.errors.LamploopError, match=r"(?i)empty"):
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, MSE_SUM),
            batches=async_batches(batches),
            step_optimizer=optimizer.step,
        )


# ---------------------------------------------------------------------------------------------
# Section 2 and 3 through the drivers.
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_factor_multiplies_every_param_groups_base_lr() -> None:
    """DESIGN.md section 2: "The factor multiplies every param group's base lr."."""
    factors = (0.5, 0.5, 0.25, 1.0)  # epoch 2 halves the base lr of epoch 1 again: not cumulative
    module = make_module()

    def two_groups(parameters: Any) -> torch.optim.Optimizer:
        weight, bias = list(parameters)
        return torch.optim.SGD([{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.2}], lr=0.3)

    with anyio.fail_after(50):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, MSE_SUM),
            optimizer_factory=two_groups,
            train_batches=per_rank_factory([[slice(0, 4)]]),
            validation_batches=None,
            max_epochs=3,
            learning_rate_schedule=lamploop.from_epoch_count(factors.__getitem__),
        )
    reference = make_module()
    for factor in factors[:3]:
        reference_step(reference, [(X[0:4], Y[0:4])], [0.1 * factor, 0.2 * factor])
    assert final.epoch == 3
    assert_same_parameters(module, reference)


def two_groups_with_momentum(parameters: Any) -> torch.optim.Optimizer:
    weight, bias = list(parameters)
    return torch.optim.SGD(
        [{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.2}], lr=0.3, momentum=0.9
    )


async def drive_alone(max_epochs: int, **keywords: Any) -> tuple[torch.nn.Module, lamploop.LoopState, list]:
    module = make_module()
    saved: list[tuple[lamploop.LoopStateWithModelAndOptimizerData, Any]] = []

    async def checkpoint(data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        saved.append((copy.deepcopy(data), schedule_state))

    with anyio.fail_after(50):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, MSE_SUM),
            optimizer_factory=two_groups_with_momentum,
            train_batches=per_rank_factory([[slice(0, 4), slice(4, 8)]]),
            validation_batches=None,
            max_epochs=max_epochs,
            checkpoint_state=checkpoint,
            learning_rate_schedule=lamploop.from_epoch_count((0.5, 0.5, 0.25, 0.25, 1.0).__getitem__),
            **keywords,
        )
    return module, final, saved


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_factor_multiplies_base_lr_also_after_resuming() -> None:
    """DESIGN.md section 2: "The factor multiplies every param group's base lr." (a resumed run's
    optimizer state holds the factored lr; the next factor must still apply to the base one) and
    section 6: "Resuming at epoch k and training on gives the same parameters as a run that was
    never interrupted."."""
    full, final, saved = await drive_alone(4)
    reference = make_module()
    optimizer = two_groups_with_momentum(reference.parameters())
    for factor in (0.5, 0.5, 0.25, 0.25):
        for group, base in zip(optimizer.param_groups, (0.1, 0.2), strict=True):
            group["lr"] = base * factor
        for part in (slice(0, 4), slice(4, 8)):
            optimizer.zero_grad()
            (F.mse_loss(reference(X[part]), Y[part], reduction="sum") / 4).backward()
            optimizer.step()
    assert_same_parameters(full, reference)

    data, schedule_state = saved[1]  # after epoch 1: the optimizer holds lr = base * 0.5
    resumed, resumed_final, _ = await drive_alone(
        4, init_state=data, learning_rate_schedule_init_state=schedule_state
    )
    assert resumed_final == final
    assert_same_parameters(resumed, full)


@pytest.mark.parametrize(
    ("eligible", "best_epoch"), [((0,), 0), ((), None)], ids=["listed-epoch-0", "none-listed"]
)
@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_driver_copies_best_model_and_checkpoints_next_epoch(
    eligible: tuple[int, ...], best_epoch: int | None
) -> None:
    """DESIGN.md section 2: "When training ends the best model (if any epoch was eligible) is copied
    into the model." and "called after every epoch with LoopState(epoch + 1, ...)"; section 3:
    "`checkpoint_state` receives the schedule state that the next epoch will use"."""
    module = make_module()
    log: list = []
    snapshots: list[tuple[lamploop.LoopState, dict, dict, Any]] = []

    async def checkpoint(data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        assert isinstance(data, lamploop.LoopStateWithModelAndOptimizerData)
        model = {name: value.detach().clone() for name, value in data.model.items()}
        best = {name: value.detach().clone() for name, value in data.best_model.items()}
        snapshots.append((data.loop_state, model, best, schedule_state))

    with anyio.fail_after(50):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, MSE_SUM),
            optimizer_factory=sgd(0.1),
            train_batches=per_rank_factory([[slice(0, 4), slice(4, 8)]]),
            validation_batches=per_rank_factory([[slice(8, 12)]]),
            max_epochs=3,
            checkpoint_state=checkpoint,
            return_min_validation_loss_model=eligible,
            learning_rate_schedule=RecordingSchedule(log),
        )
    assert [state.epoch for state, *_ in snapshots] == [1, 2, 3]
    questions = [(epoch, loss) for _, epoch, loss, _ in asks(log)]
    assert [epoch for epoch, _ in questions] == [0, 1, 2, 3]
    assert [schedule_state for *_, schedule_state in snapshots] == [
        tuple(questions[: e + 1]) for e in range(3)
    ]
    assert final.min_validation_epoch == best_epoch
    last_model = snapshots[-1][1]
    assert not torch.equal(last_model["weight"], snapshots[0][1]["weight"])
    if best_epoch is None:
        assert_same_parameters(module, last_model)
        assert len(snapshots[-1][2]) == 0
    else:
        assert_same_parameters(module, snapshots[best_epoch][1])
        assert_same_parameters(snapshots[-1][2], snapshots[best_epoch][1])


def equivalence_slices(r_ranks: int, k: int, b: int, n_steps: int = 2) -> list[list[slice]]:
    """Rank r's batch j of step s: b examples at s*R*k*b + r*k*b + j*b (so step s of every rank
    together covers the examples s*R*k*b .. (s+1)*R*k*b - 1)."""
    size = r_ranks * k * b
    return [
        [
            slice(s * size + r * k * b + j * b, s * size + r * k * b + (j + 1) * b)
            for s in range(n_steps)
            for j in range(k)
        ]
        for r in range(r_ranks)
    ]


def one_batch_steps(size: int, n_steps: int = 2) -> list[list[Batch]]:
    return [[(X[s * size : (s + 1) * size], Y[s * size : (s + 1) * size])] for s in range(n_steps)]


# R = 2 ranks x k = 2 accumulated batches x b = 2 examples = one step of 8 examples; 2 steps per epoch
EQUIVALENCE_SLICES = equivalence_slices(2, 2, 2)
EQUIVALENCE_STEPS = one_batch_steps(8)


def reference_epochs(
    steps: list[list[Batch]], n_epochs: int, lr: float, module: torch.nn.Module | None = None
):
    """Plain SGD over ``steps`` for ``n_epochs``: the final module and each epoch's mean training loss."""
    module = make_module() if module is None else module
    losses = []
    for _ in range(n_epochs):
        sums = [reference_step(module, batches, [lr, lr]) for batches in steps]
        losses.append(sum(s for s, _ in sums) / sum(n for _, n in sums))
    return module, losses


EQUIVALENCE_CASES = {
    # id: (R, k, b, strategy)
    "R2-k2-b2-auto": (2, 2, 2, None),
    "R2-k2-b2-reduce_to_root": (2, 2, 2, "reduce_to_root"),
    "R2-k2-b2-all_reduce": (2, 2, 2, "all_reduce"),
    "R3-k3-b1-auto": (3, 3, 1, None),
    "R3-k1-b4-auto": (3, 1, 4, None),
}


@pytest.mark.parametrize("case", list(EQUIVALENCE_CASES))
@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_gradient_equivalence_local_data_parallel(case: str) -> None:
    """DESIGN.md section 3: "R ranks x k accumulated batches of size b gives the same parameters (to
    float tolerance) as 1 rank x 1 batch of size R*k*b over the same examples. This equivalence is
    the core test."."""
    r_ranks, k, b, strategy = EQUIVALENCE_CASES[case]
    size = r_ranks * k * b
    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(r_ranks)]
    factory = per_rank_factory(equivalence_slices(r_ranks, k, b))
    keywords = {} if strategy is None else {"strategy": strategy}
    with anyio.fail_after(50):
        final = await lamploop.local_data_parallel_training_loop(
            [(model, factory, None) for model in models],
            sgd(0.1),
            2,
            accumulate_gradient_over_n_batches=k,
            **keywords,
        )
    reference, losses = reference_epochs(one_batch_steps(size), 2, 0.1)
    assert final.epoch == 2
    assert_same_parameters(models[0].module, reference)
    assert [entry.training_loss for entry in final.learning_curve] == pytest.approx(losses, rel=1e-12)

    # and lamploop itself with 1 rank x 1 batch of R*k*b over the same examples
    single = make_module()
    with anyio.fail_after(50):
        await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(single, MSE_SUM),
            optimizer_factory=sgd(0.1),
            train_batches=per_rank_factory([[slice(0, size), slice(size, 2 * size)]]),
            validation_batches=None,
            max_epochs=2,
        )
    assert_same_parameters(models[0].module, single)


async def drive_and_follow(
    per_rank_train: Sequence[Sequence[slice]],
    *,
    lr: float,
    k: int,
    max_epochs: int,
    calls: list | None = None,
) -> tuple[lamploop.LoopState, torch.nn.Module]:
    """Rank 0 drives and ranks 1.. follow, over the in-process control channel."""
    nranks = len(per_rank_train)
    root, followers = lamploop.local_control(nranks)
    train = per_rank_factory(per_rank_train, calls)
    modules = [make_module() for _ in range(nranks)]
    follower_results: list[object] = []

    async def follow(**keywords: Any) -> None:
        follower_results.append(await lamploop.follow_distributed_training(**keywords))

    with anyio.fail_after(50):
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(root)
            for follower in followers:
                await stack.enter_async_context(follower)
            async with anyio.create_task_group() as group:
                for rank, follower in enumerate(followers, start=1):
                    group.start_soon(
                        partial(
                            follow,
                            rank=rank,
                            nranks=nranks,
                            device="cpu",
                            control=follower,
                            model=lamploop.SupervisedModel(modules[rank], MSE_SUM),
                            train_batches=train,
                            validation_batches=None,
                            accumulate_gradient_over_n_batches=k,
                        )
                    )
                final = await lamploop.drive_distributed_training(
                    nranks=nranks,
                    device="cpu",
                    control=root,
                    model=lamploop.SupervisedModel(modules[0], MSE_SUM),
                    optimizer_factory=sgd(lr),
                    train_batches=train,
                    validation_batches=None,
                    max_epochs=max_epochs,
                    accumulate_gradient_over_n_batches=k,
                )
    assert isinstance(final, lamploop.LoopState)
    assert follower_results == [None] * (nranks - 1)  # "-> None"
    return final, modules[0]


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_gradient_equivalence_drive_and_follow() -> None:
    """DESIGN.md section 3: "R ranks x k accumulated batches of size b gives the same parameters (to
    float tolerance) as 1 rank x 1 batch of size R*k*b over the same examples."; section 2:
    "`train_batches` / `validation_batches` are factories called once per epoch with a context
    (epoch, rank, nranks)"."""
    calls: list = []
    final, module = await drive_and_follow(EQUIVALENCE_SLICES, lr=0.1, k=2, max_epochs=2, calls=calls)
    reference, losses = reference_epochs(EQUIVALENCE_STEPS, 2, 0.1)
    assert final.epoch == 2
    assert_same_parameters(module, reference)
    assert [entry.training_loss for entry in final.learning_curve] == pytest.approx(losses, rel=1e-12)
    assert collections.Counter(calls) == collections.Counter(
        (epoch, rank, 2) for epoch in range(2) for rank in range(2)
    )


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_global_losses_are_sum_over_all_examples_of_all_ranks_over_count() -> None:
    """DESIGN.md section 3: "Global losses: the training and validation losses reported are the
    mean over all examples of all ranks (sum of losses / sum of examples). lamp reported the root's
    local sum over the global count; do not copy that."."""
    # A zero model (output 0) with lr 0: each example's loss is target**2 in every step.
    targets = torch.tensor([[2.0], [2.0], [1.0], [1.0], [1.0], [1.0], [1.0], [1.0]], dtype=torch.float64)
    valid_targets = torch.tensor([[1.0], [1.0], [1.0], [3.0]], dtype=torch.float64)

    def factory(per_rank: list[list[tuple[int, int]]], y: torch.Tensor):
        def make(context: lamploop.BatchContext) -> list[Batch]:
            return [
                (torch.zeros(stop - start, 3, dtype=torch.float64), y[start:stop])
                for start, stop in per_rank[context.rank]
            ]

        return lamploop.iterable_batches(make)

    # training: rank 0 sum 8 over 2 examples, rank 1 sum 6 over 6 -> 14 / 8 = 1.75
    # (lamp's root sum / global count: 1.0; mean of rank means: 2.5)
    train = factory([[(0, 2)], [(2, 5), (5, 8)]], targets)
    # validation: rank 0 sum 3 over 3, rank 1 sum 9 over 1 -> 12 / 4 = 3.0 (lamp's: 0.75)
    valid = factory([[(0, 3)], [(3, 4)]], valid_targets)
    root, (follower,) = lamploop.local_control(2)
    module = make_module(zero=True)
    with anyio.fail_after(50):
        async with root, follower, anyio.create_task_group() as group:
            group.start_soon(
                partial(
                    lamploop.follow_distributed_training,
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=follower,
                    model=lamploop.SupervisedModel(make_module(zero=True), MSE_SUM),
                    train_batches=train,
                    validation_batches=valid,
                )
            )
            final = await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=root,
                model=lamploop.SupervisedModel(module, MSE_SUM),
                optimizer_factory=sgd(0.0),
                train_batches=train,
                validation_batches=valid,
                max_epochs=1,
            )
    (entry,) = final.learning_curve
    assert entry.training_loss == pytest.approx(1.75, rel=1e-12)
    assert entry.validation_loss == pytest.approx((3.0, 3.0), rel=1e-12)


UNEVEN_CASES = {
    # per-rank batch slices, k
    "r0-3-batches-r1-1-k1": ([[slice(0, 2), slice(2, 5), slice(5, 6)], [slice(6, 8)]], 1),
    "r0-3-batches-r1-none-k1": ([[slice(0, 2), slice(2, 5), slice(5, 6)], []], 1),
    "r0-3-batches-r1-2-k2": ([[slice(0, 2), slice(2, 5), slice(5, 6)], [slice(6, 8), slice(8, 9)]], 2),
    "root-exhausted-first-k2": ([[slice(0, 1)], [slice(1, 3), slice(3, 4), slice(4, 7)]], 2),
    "root-none-k2": ([[], [slice(1, 3), slice(3, 4), slice(4, 7)]], 2),
}


@pytest.mark.parametrize("case", sorted(UNEVEN_CASES))
@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_uneven_streams_drop_nothing_and_do_not_hang(case: str) -> None:
    """DESIGN.md section 3: "Uneven streams: ... Here a rank whose stream is exhausted contributes
    zero examples until every rank is exhausted; no example is dropped and nothing hangs."."""
    per_rank, k = UNEVEN_CASES[case]
    valid_per_rank = [[slice(s.start + 12, s.stop + 12) for s in slices] for slices in per_rank]
    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(2)]
    with anyio.fail_after(50):
        final = await lamploop.local_data_parallel_training_loop(
            [(model, per_rank_factory(per_rank), per_rank_factory(valid_per_rank)) for model in models],
            sgd(0.1),
            2,
            accumulate_gradient_over_n_batches=k,
        )
    reference = make_module()
    valid_batches = [(X[s], Y[s]) for slices in valid_per_rank for s in slices]
    for epoch in range(2):
        sums = [reference_step(reference, batches, [0.1, 0.1]) for batches in steps_of(per_rank, k)]
        entry = final.learning_curve[epoch]
        assert entry.training_loss == pytest.approx(
            sum(s for s, _ in sums) / sum(n for _, n in sums), rel=1e-12
        )
        assert entry.validation_loss[1] == pytest.approx(
            reference_mean_loss(reference, valid_batches), rel=1e-12
        )
    assert_same_parameters(models[0].module, reference)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_uneven_streams_drive_and_follow_root_exhausted_first() -> None:
    """DESIGN.md section 3: "a rank whose stream is exhausted contributes zero examples until every
    rank is exhausted; no example is dropped and nothing hangs." (drive/follow, rank 0 ends first,
    an epoch ending mid-accumulation on the follower)."""
    per_rank = [[slice(0, 1)], [slice(1, 3), slice(3, 4), slice(4, 7)]]
    final, module = await drive_and_follow(per_rank, lr=0.1, k=2, max_epochs=2)
    reference, losses = reference_epochs(steps_of(per_rank, 2), 2, 0.1)
    assert_same_parameters(module, reference)
    assert [entry.training_loss for entry in final.learning_curve] == pytest.approx(losses, rel=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_empty_batch_on_one_rank_is_a_clear_error_not_a_hang() -> None:
    """DESIGN.md section 3: "A stream that yields an empty batch is an error with a clear
    message." (on one of two ranks: every rank ends, nothing hangs)."""
    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(2)]
    factory = per_rank_factory([[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 6)]])
    with anyio.fail_after(50), pytest.raises(lamploop.errors.LamploopError, match=r"(?i)empty"):
        await lamploop.local_data_parallel_training_loop(
            [(model, factory, None) for model in models], sgd(0.1), 1
        )


@pytest.mark.anyio
async def test_batch_order_is_a_pure_function_of_seed_epoch_and_rank() -> None:
    """DESIGN.md section 2: "`train_batches` / `validation_batches` are factories called once per
    epoch with a context (epoch, rank, nranks), returning an async iterable of `(features, target)`
    batches; the order of batches must be a pure function of (seed, epoch, rank)"."""
    features = torch.arange(10, dtype=torch.float64).reshape(10, 1)
    targets = torch.arange(10, dtype=torch.float64)

    async def targets_seen(factory: Any, epoch: int, rank: int) -> list[float]:
        context = lamploop.BatchContext(epoch=epoch, rank=rank, nranks=2)
        return [float(t) for _, target in [batch async for batch in factory(context)] for t in target]

    first = lamploop.tensor_batches(features, targets, batch_size=2, seed=7)
    again = lamploop.tensor_batches(features, targets, batch_size=2, seed=7)
    for epoch in range(2):
        ranks = [await targets_seen(first, epoch, rank) for rank in range(2)]
        assert ranks == [await targets_seen(again, epoch, rank) for rank in range(2)]
        assert ranks == [await targets_seen(first, epoch, rank) for rank in range(2)]
        assert sorted(ranks[0] + ranks[1]) == [float(i) for i in range(10)]  # disjoint, complete


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_local_data_parallel_best_model_ends_in_first_replica() -> None:
    """DESIGN.md section 2: "local_data_parallel_training_loop(...) -> LoopState   # one process, one
    replica per device, trained model in the first" and "When training ends the best model (if any
    epoch was eligible) is copied into the model."."""
    snapshots: list[dict[str, torch.Tensor]] = []

    async def checkpoint(data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        snapshots.append({name: value.detach().clone() for name, value in data.model.items()})

    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(2)]
    train = per_rank_factory([[slice(0, 2)], [slice(2, 5)]])
    valid = per_rank_factory([[slice(12, 14)], [slice(14, 15)]])
    with anyio.fail_after(50):
        final = await lamploop.local_data_parallel_training_loop(
            [(model, train, valid) for model in models],
            sgd(0.1),
            3,
            checkpoint_state=checkpoint,
            return_min_validation_loss_model=(1,),
        )
    assert final.min_validation_epoch == 1
    assert len(snapshots) == 3
    assert not torch.equal(snapshots[1]["weight"], snapshots[2]["weight"])
    assert_same_parameters(models[0].module, snapshots[1])
