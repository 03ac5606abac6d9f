"""One settings object: ``settings=`` on the lower-level entry points, and ``fit``'s flat keywords.

A setting is one :class:`TrainingSettings` field and one keyword of ``fit``.  The drivers
take everything beyond lamp's keywords as ``settings=``, and still take the settings
keywords they took before it (declared once, frozen), merged by one function that refuses
a setting given both ways and a keyword it does not know.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import anyio
import attrs
import pytest
import torch

import lamploop
from lamploop import ALL_EPOCHS, SupervisedModel, TrainingSettings
from lamploop.averaging import ema
from lamploop.distributed import (
    drive_distributed_training,
    follow_distributed_training,
    local_data_parallel_training_loop,
)
from lamploop.errors import ConfigurationError
from lamploop.schedules import linear
from lamploop.schedules.step import warmup_linear
from lamploop.settings import LocalSettingKeywords, RankSettingKeywords, SettingKeywords

# The keywords of fit that are no setting: what to train, where, with whom, and what to do
# around the run.  A new keyword of fit is either a TrainingSettings field or listed here.
FIT_NOT_SETTINGS = frozenset(
    {
        "model",
        "optimizer_factory",
        "train_batches",
        "validation_batches",
        "checkpoint_dir",
        "keep_last",
        "resume",
        "device",
        "on_epoch",
        "world_size",
        "launch_command",
        "heartbeat_interval",
        "heartbeat_timeout",
        "reporters",
        "checkpoint_extras",
    }
)

# fit's defaults that differ from TrainingSettings' on purpose.
FIT_OWN_DEFAULTS = {"return_min_validation_loss_model": ALL_EPOCHS}

# The settings keywords the drivers accepted before settings=; frozen (new settings are not added).
FROZEN_RANK_KEYWORDS = frozenset(
    {
        "strategy",
        "bucket_cap_mb",
        "collective_timeout",
        "on_non_finite_loss",
        "max_gradient_norm",
        "precision",
        "step_schedule",
        "lr_scheduler",
        "lr_scheduler_interval",
    }
)
FROZEN_LOCAL_KEYWORDS = FROZEN_RANK_KEYWORDS | {
    "averaging",
    "model_selection_metric",
    "model_selection_mode",
    "early_stopping_patience",
}
FROZEN_DRIVE_KEYWORDS = FROZEN_LOCAL_KEYWORDS | {"checkpoint_every_n_steps", "checkpoint_every_seconds"}

# Beyond lamp: every one of these changes the run (the average is what the model ends holding).
SETTINGS: Mapping[str, Any] = {
    "strategy": "all_reduce",
    "max_gradient_norm": 0.05,
    "step_schedule": warmup_linear(warmup_steps=3, total_steps=12, steps_per_epoch=4),
    "averaging": ema(0.5),
}


def _keys(typed_dict: type) -> frozenset[str]:
    return frozenset(typed_dict.__required_keys__ | typed_dict.__optional_keys__)  # type: ignore[attr-defined]


def _fields() -> dict[str, attrs.Attribute[Any]]:
    return attrs.fields_dict(TrainingSettings)


def test_every_setting_is_a_keyword_of_fit_and_every_keyword_of_fit_is_a_setting_or_named() -> None:
    parameters = inspect.signature(lamploop.fit_async).parameters
    assert set(_fields()) - set(parameters) == set(), "a TrainingSettings field that fit does not take"
    assert set(parameters) - set(_fields()) - FIT_NOT_SETTINGS == set(), "a keyword of fit that is no setting"
    assert set(parameters) >= FIT_NOT_SETTINGS, "FIT_NOT_SETTINGS names a keyword fit no longer has"
    assert inspect.signature(lamploop.fit).parameters == parameters  # fit is fit_async, blocking
    for name, field in _fields().items():
        default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default  # type: ignore[arg-type]
        expected = FIT_OWN_DEFAULTS.get(name, default)
        if parameters[name].default is not inspect.Parameter.empty:  # max_epochs is required
            assert parameters[name].default == expected, name


def test_the_drivers_settings_keywords_are_frozen_and_are_settings() -> None:
    assert _keys(RankSettingKeywords) == FROZEN_RANK_KEYWORDS
    assert _keys(LocalSettingKeywords) == FROZEN_LOCAL_KEYWORDS
    assert _keys(SettingKeywords) == FROZEN_DRIVE_KEYWORDS
    assert set(_fields()) >= FROZEN_DRIVE_KEYWORDS
    assert FROZEN_RANK_KEYWORDS | {"accumulate_gradient_over_n_batches"} == set(TrainingSettings.EVERY_RANK)
    for function in (
        drive_distributed_training,
        follow_distributed_training,
        local_data_parallel_training_loop,
    ):
        parameters = inspect.signature(function).parameters
        assert parameters["settings"].default is None
        assert parameters["keywords"].kind is inspect.Parameter.VAR_KEYWORD
        assert not FROZEN_DRIVE_KEYWORDS & set(parameters), f"{function.__name__} declares a setting again"


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(64, 5, generator=generator, dtype=torch.float64), torch.randint(
        0, 3, (64,), generator=generator
    )


def _module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(5, 3).double()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


async def _drive(**arguments: Any) -> tuple[lamploop.LoopState, dict[str, torch.Tensor]]:
    x, y = _data()
    module = _module()
    state = await drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=SupervisedModel(module),
        optimizer_factory=_sgd,
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
        max_epochs=3,
        **arguments,
    )
    return state, module.state_dict()


def _assert_same_run(
    a: tuple[lamploop.LoopState, dict[str, torch.Tensor]],
    b: tuple[lamploop.LoopState, dict[str, torch.Tensor]],
) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.anyio
async def test_settings_and_keywords_give_the_same_run_on_one_rank() -> None:
    by_keywords = await _drive(validation_frequency=2, **SETTINGS)
    by_settings = await _drive(validation_frequency=2, settings=TrainingSettings(**SETTINGS))
    lamp_in_settings = await _drive(settings=TrainingSettings(validation_frequency=2, **SETTINGS))
    plain = await _drive(validation_frequency=2)
    _assert_same_run(by_keywords, by_settings)
    _assert_same_run(by_keywords, lamp_in_settings)
    assert plain[0] != by_keywords[0]  # the settings took effect both ways


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_settings_and_keywords_give_the_same_run_on_two_local_replicas() -> None:
    """The follower's path too: local_data_parallel_training_loop hands the settings to both drivers."""
    x, y = _data()

    async def run(**arguments: Any) -> tuple[lamploop.LoopState, dict[str, torch.Tensor]]:
        modules = [_module(), _module(seed=1)]
        replicas = [
            (
                SupervisedModel(m),
                lamploop.tensor_batches(x[r::2], y[r::2], batch_size=8),
                lamploop.tensor_batches(x[r::2], y[r::2], batch_size=16, shuffle=False),
            )
            for r, m in enumerate(modules)
        ]
        with anyio.fail_after(50):
            state = await local_data_parallel_training_loop(replicas, _sgd, 2, **arguments)
        return state, modules[0].state_dict()

    by_keywords = await run(learning_rate_schedule=linear(1.0, 0.5, 4), **SETTINGS)
    by_settings = await run(settings=TrainingSettings(learning_rate_schedule=linear(1.0, 0.5, 4), **SETTINGS))
    _assert_same_run(by_keywords, by_settings)


async def _never(**arguments: Any) -> None:
    """Call the driver named in ``arguments`` with arguments it refuses before it starts anything."""
    function = arguments.pop("function")
    x, y = _data()
    common: dict[str, Any] = {
        "nranks": 2,
        "device": "cpu",
        "control": None,
        "model": SupervisedModel(_module()),
        "train_batches": lamploop.tensor_batches(x, y, batch_size=16),
        "validation_batches": None,
    }
    if function is drive_distributed_training:
        await function(**common, optimizer_factory=_sgd, max_epochs=1, **arguments)
    else:
        await function(**common, rank=1, **arguments)


@pytest.mark.anyio
@pytest.mark.parametrize("function", [drive_distributed_training, follow_distributed_training])
async def test_a_setting_given_both_ways_is_refused(function: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^{function.__name__}: strategy given both as a keyword"):
        await _never(function=function, settings=TrainingSettings(), strategy="all_reduce")


@pytest.mark.anyio
async def test_a_lamp_keyword_that_disagrees_with_the_settings_is_refused() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"^drive_distributed_training: validation_frequency=3 and settings\.validation_frequency=2:",
    ):
        await _never(
            function=drive_distributed_training,
            validation_frequency=3,
            settings=TrainingSettings(validation_frequency=2),
        )


@pytest.mark.anyio
async def test_local_data_parallel_refuses_a_setting_given_both_ways() -> None:
    x, y = _data()
    with pytest.raises(ConfigurationError, match=r"^local_data_parallel_training_loop: precision given both"):
        await local_data_parallel_training_loop(
            [(SupervisedModel(_module()), lamploop.tensor_batches(x, y, batch_size=16), None)],
            _sgd,
            1,
            settings=TrainingSettings(),
            precision="bf16",
        )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("function", "keyword"),
    [
        (drive_distributed_training, "stratgy"),
        (follow_distributed_training, "averaging"),  # a setting of the root alone
        (follow_distributed_training, "max_epochs"),  # the root's
    ],
)
async def test_an_unknown_keyword_is_refused_naming_it_and_the_function(function: Any, keyword: str) -> None:
    with pytest.raises(
        ConfigurationError, match=rf"^{function.__name__}: unknown keyword argument '{keyword}'"
    ):
        await _never(function=function, **{keyword: None})


@pytest.mark.anyio
async def test_local_data_parallel_refuses_the_checkpoint_cadence_it_has_no_checkpoints_for() -> None:
    x, y = _data()
    with pytest.raises(
        ConfigurationError,
        match=r"^local_data_parallel_training_loop: unknown keyword argument 'checkpoint_every_n_steps'",
    ):
        await local_data_parallel_training_loop(
            [(SupervisedModel(_module()), lamploop.tensor_batches(x, y, batch_size=16), None)],
            _sgd,
            1,
            checkpoint_every_n_steps=2,  # type: ignore[call-arg]
        )


@pytest.mark.anyio
async def test_settings_must_be_training_settings() -> None:
    with pytest.raises(ConfigurationError, match=r"^drive_distributed_training: settings must be a lamploop"):
        await _never(function=drive_distributed_training, settings={"strategy": "all_reduce"})


def test_fit_collects_its_keywords_into_the_same_settings() -> None:
    """fit hands its settings to the driver as one object: a checked value reaches the run."""
    x, y = _data()
    state = lamploop.fit(
        model=SupervisedModel(_module()),
        optimizer_factory=_sgd,
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
        max_epochs=4,
        validation_frequency=2,
        device="cpu",
        reporters=[],
    )
    assert state is not None
    assert state.epoch == 4
    validated = [entry.epoch for entry in state.learning_curve if entry.validation_loss is not None]
    assert validated == [0, 2]
