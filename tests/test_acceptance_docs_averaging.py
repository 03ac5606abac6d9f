"""Acceptance tests for weight averaging (EMA, SWA) and model selection, from the docs alone.

Written against docs/training.md ("Weight averaging: EMA and SWA", "Metrics"),
docs/contract-changes.md (0.3), docs/strategies.md (fsdp refusals), DESIGN.md sections 3 and 8
and the docstrings of ``lamploop.averaging`` and ``lamploop.fit``; not against the
implementation. References are PyTorch's ``torch.optim.swa_utils`` (``AveragedModel``,
``get_ema_multi_avg_fn``, ``update_bn``) and float64 averages written by hand, fed with the
weights the run holds after each optimizer step (recorded by wrapping ``optimizer.step``).
Everything runs in process, one rank, tiny float64 models.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

import lamploop
from lamploop.averaging import EMA, SWA, ema, swa
from lamploop.errors import ConfigurationError, LamploopError
from lamploop.metrics import accuracy

N_TRAIN, N_VALID, BATCH = 64, 32, 16
STEPS_PER_EPOCH = N_TRAIN // BATCH  # 4 batches, one step each unless accumulating
TOL = 1e-12  # the docs: "the tests compare them ... to 1e-12"

StateDict = dict[str, torch.Tensor]


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(N_TRAIN + N_VALID, 5, generator=generator, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 0.7).long()
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


X, Y, XV, YV = data()


def make_module(*, batchnorm: bool = True, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(5, 8)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(8))
    layers += [torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    return torch.nn.Sequential(*layers).double()


def clone_state(module: torch.nn.Module) -> StateDict:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def param_names(module: torch.nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters()]


def buffer_names(module: torch.nn.Module) -> list[str]:
    return [name for name, _ in module.named_buffers()]


class Recorder:
    """An optimizer factory that records the module's whole state after every optimizer step."""

    def __init__(self, module: torch.nn.Module, *, lr: float = 0.1, fail_at_step: int | None = None) -> None:
        self.module = module
        self.lr = lr
        self.fail_at_step = fail_at_step
        self.snapshots: list[StateDict] = []
        self.factory_calls = 0

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        self.factory_calls += 1
        params = list(params)
        ids = {id(p) for p in self.module.parameters()}
        assert all(id(p) in ids for p in params), "one rank should train the module itself"
        optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        inner = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.fail_at_step is not None and len(self.snapshots) + 1 == self.fail_at_step:
                raise RuntimeError("injected crash before this step")
            out = inner(*args, **kwargs)
            self.snapshots.append(clone_state(self.module))
            return out

        optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    def end_of_epoch(self, epoch: int, steps_per_epoch: int = STEPS_PER_EPOCH) -> StateDict:
        return self.snapshots[(epoch + 1) * steps_per_epoch - 1]


def train_batches(*, shuffle: bool = True) -> lamploop.BatchStreamFactory:
    return lamploop.tensor_batches(X, Y, batch_size=BATCH, shuffle=shuffle)


def valid_batches() -> lamploop.BatchStreamFactory:
    return lamploop.tensor_batches(XV, YV, batch_size=BATCH, shuffle=False)


def reference_average(
    init: torch.nn.Module, snapshots: list[StateDict], *, decay: float | None
) -> AveragedModel:
    """PyTorch's AveragedModel fed the given weights in order (EMA with ``decay``, else SWA's mean)."""
    scratch = copy.deepcopy(init)
    if decay is None:
        averaged = AveragedModel(scratch)
    else:
        averaged = AveragedModel(scratch, multi_avg_fn=get_ema_multi_avg_fn(decay))
    for snapshot in snapshots:
        scratch.load_state_dict(snapshot)
        averaged.update_parameters(scratch)
    return averaged


def hand_ema(snapshots: list[StateDict], names: list[str], decay: float) -> StateDict:
    average: StateDict = {}
    for snapshot in snapshots:
        for name in names:
            p = snapshot[name].to(torch.float64)
            average[name] = p.clone() if name not in average else decay * average[name] + (1 - decay) * p
    return average


def hand_mean(snapshots: list[StateDict], names: list[str]) -> StateDict:
    return {name: torch.stack([s[name] for s in snapshots]).mean(dim=0) for name in names}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    difference = (actual.to(torch.float64) - expected.to(torch.float64)).abs().max().item()
    assert difference <= TOL, f"{what}: max |difference| {difference:.3g} > {TOL}"


def assert_state_equal(actual: StateDict, expected: StateDict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{name} differs (bitwise)"


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-6


# --- EMA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
def test_ema_is_averaged_model_over_every_optimizer_step_and_the_model_ends_holding_it(
    accumulate: int,
) -> None:
    """training.md: EMA "updated after every optimizer step"; follows AveragedModel ("the first
    update copies the weights; buffers are the live model's"); "At the end of the run the model
    holds the average, instead of the best validation epoch's model"."""
    decay, max_epochs = 0.8, 3
    module = make_module()
    init = copy.deepcopy(module)
    recorder = Recorder(module)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=recorder,
        train_batches=train_batches(),
        validation_batches=valid_batches(),
        max_epochs=max_epochs,
        accumulate_gradient_over_n_batches=accumulate,
        averaging=ema(decay),
        reporters=[],
    )
    assert state is not None
    assert state.epoch == max_epochs
    steps = max_epochs * STEPS_PER_EPOCH // accumulate
    assert len(recorder.snapshots) == steps
    final = clone_state(module)
    live = recorder.snapshots[-1]
    reference = reference_average(init, recorder.snapshots, decay=decay).module.state_dict()
    by_hand = hand_ema(recorder.snapshots, param_names(module), decay)
    for name in param_names(module):
        assert_close(final[name], reference[name], f"{name} vs AveragedModel(get_ema_multi_avg_fn)")
        assert_close(final[name], by_hand[name], f"{name} vs the float64 EMA")
    for name in buffer_names(module):  # the live model's buffers, not refreshed for EMA
        assert torch.equal(final[name], live[name]), name
    # the average is not the last weights, nor the best validation epoch's model
    weight = param_names(module)[0]
    assert differs(final[weight], live[weight])
    best = state.min_validation_epoch
    assert best is not None
    assert differs(final[weight], recorder.end_of_epoch(best, STEPS_PER_EPOCH // accumulate)[weight])


def test_ema_docs_example_float32() -> None:
    """training.md's example: "module now holds the EMA of its weights over the 12 steps"."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    module = torch.nn.Linear(5, 3)
    recorder = Recorder(module)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=recorder,
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=3,
        averaging=ema(0.9),
        reporters=[],
    )
    assert len(recorder.snapshots) == 12
    expected = hand_ema(recorder.snapshots, ["weight", "bias"], 0.9)
    for name, tensor in module.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor.double(), expected[name], rtol=1e-6, atol=1e-7)


# --- SWA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("start_epoch", [0, 2])
def test_swa_is_averaged_model_of_epoch_ends_with_update_bn(start_epoch: int) -> None:
    """training.md: SWA is "the equal-weight mean of the weights at the end of every epoch from
    start_epoch on ... and at the end refreshes the BatchNorm statistics of the averaged model
    with one pass over the training data"; follows AveragedModel + update_bn; the model ends
    holding it rather than the best validation epoch's model."""
    max_epochs = 4
    module = make_module()
    init = copy.deepcopy(module)
    recorder = Recorder(module)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=recorder,
        train_batches=train_batches(shuffle=False),  # the refresh pass is then the same batches
        validation_batches=valid_batches(),
        max_epochs=max_epochs,
        averaging=swa(start_epoch),
        reporters=[],
    )
    assert state is not None
    assert state.epoch == max_epochs
    ends = [recorder.end_of_epoch(e) for e in range(start_epoch, max_epochs)]
    averaged = reference_average(init, ends, decay=None)
    update_bn([(X[i : i + BATCH], Y[i : i + BATCH]) for i in range(0, N_TRAIN, BATCH)], averaged)
    reference = averaged.module.state_dict()
    final = clone_state(module)
    mean = hand_mean(ends, param_names(module))
    for name in param_names(module):
        assert_close(final[name], reference[name], f"{name} vs AveragedModel")
        assert_close(final[name], mean[name], f"{name} vs the float64 mean")
    for name in ("1.running_mean", "1.running_var"):
        assert_close(final[name], reference[name], f"{name} vs update_bn")
        assert differs(final[name], recorder.snapshots[-1][name])  # refreshed, not the live ones
    assert int(final["1.num_batches_tracked"]) == int(reference["1.num_batches_tracked"])
    weight = param_names(module)[0]
    assert differs(final[weight], recorder.snapshots[-1][weight])
    assert state.min_validation_epoch is not None
    assert differs(final[weight], recorder.end_of_epoch(state.min_validation_epoch)[weight])


def test_swa_without_batchnorm_refresh_keeps_the_live_buffers() -> None:
    """help(swa): ``refresh_batchnorm`` (default True); "buffers are the live model's"."""
    max_epochs, start_epoch = 3, 1
    module = make_module()
    recorder = Recorder(module)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=recorder,
        train_batches=train_batches(),
        max_epochs=max_epochs,
        averaging=swa(start_epoch, refresh_batchnorm=False),
        reporters=[],
    )
    final = clone_state(module)
    mean = hand_mean([recorder.end_of_epoch(e) for e in range(start_epoch, max_epochs)], param_names(module))
    for name in param_names(module):
        assert_close(final[name], mean[name], name)
    for name in buffer_names(module):
        assert torch.equal(final[name], recorder.snapshots[-1][name]), name


# --- checkpoints and resuming ----------------------------------------------------------------


def descriptors(root: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(root.rglob("checkpoint.json"))]


def test_swa_resumed_at_an_epoch_boundary_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """training.md: "every checkpoint holds it (averaged_model.safetensors, with the update count in
    the descriptor), so a resumed run goes on averaging and ends with the same weights as an
    uninterrupted one"."""
    max_epochs, start_epoch = 4, 1

    def run(epochs: int, module: torch.nn.Module, checkpoint_dir: Path | None) -> Recorder:
        recorder = Recorder(module)
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=recorder,
            train_batches=train_batches(shuffle=False),
            validation_batches=valid_batches(),
            max_epochs=epochs,
            averaging=swa(start_epoch),
            checkpoint_dir=checkpoint_dir,
            keep_last=None,
            reporters=[],
        )
        return recorder

    whole_module = make_module()
    run(max_epochs, whole_module, None)
    first = run(2, make_module(), tmp_path)
    assert len(first.snapshots) == 2 * STEPS_PER_EPOCH
    # the checkpoint after epoch 1 (2 epochs done) holds the average of one update: epoch 1's end
    files = sorted(tmp_path.rglob("averaged_model.safetensors"))
    assert files, "no averaged_model.safetensors in the checkpoints"
    saved = [d for d in descriptors(tmp_path) if d["loop_state"]["epoch"] == 2]
    assert len(saved) == 1
    assert saved[0]["averaged_count"] == 1
    average = load_file(str(files[-1]))
    for name in param_names(whole_module):
        assert torch.equal(average[name], first.end_of_epoch(1)[name]), name
    resumed_module = make_module(seed=7)  # loading the checkpoint must replace everything
    resumed = run(max_epochs, resumed_module, tmp_path)
    assert len(resumed.snapshots) == 2 * STEPS_PER_EPOCH
    assert_state_equal(clone_state(resumed_module), clone_state(whole_module))


def test_ema_resumed_mid_epoch_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """training.md (resumed run "ends with the same weights as an uninterrupted one") with DESIGN.md
    section 6 (a step-boundary checkpoint resumes bitwise equal on CPU)."""
    max_epochs, decay = 3, 0.7

    crashed: list[Recorder] = []

    def run(
        module: torch.nn.Module, checkpoint_dir: Path | None, fail_at_step: int | None = None
    ) -> Recorder:
        recorder = Recorder(module, fail_at_step=fail_at_step)
        crashed.append(recorder)
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=recorder,
            train_batches=train_batches(),
            max_epochs=max_epochs,
            averaging=ema(decay),
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_n_steps=None if checkpoint_dir is None else 3,
            keep_last=None,
            reporters=[],
        )
        return recorder

    whole_module = make_module()
    run(whole_module, None)
    with pytest.raises(Exception, match="injected crash"):
        run(make_module(), tmp_path, fail_at_step=8)  # epoch 1, its 4th step: after a checkpoint
    first = crashed[-1]
    # every checkpoint holds the EMA of the steps so far, and their count
    names = param_names(whole_module)
    counts = []
    for path in sorted(tmp_path.rglob("checkpoint.json")):
        count = json.loads(path.read_text())["averaged_count"]
        counts.append(count)
        average = load_file(str(path.parent / "averaged_model.safetensors"))
        expected = hand_ema(first.snapshots[:count], names, decay)
        for name in names:
            assert_close(average[name], expected[name], f"{path.parent.name}: {name}")
        for name in buffer_names(whole_module):  # the live buffers at that point
            assert torch.equal(average[name], first.snapshots[count - 1][name]), name
    assert any(count % STEPS_PER_EPOCH for count in counts), f"no checkpoint inside an epoch: {counts}"
    resumed_module = make_module(seed=7)
    resumed = run(resumed_module, tmp_path)
    assert len(resumed.snapshots) % STEPS_PER_EPOCH != 0, "did not resume inside an epoch"
    assert_state_equal(clone_state(resumed_module), clone_state(whole_module))


# --- model selection -------------------------------------------------------------------------

# A validation metric scripted per epoch (dyadic values: every mean and smoothing is exact).
SCRIPT = (0.25, 0.625, 0.5, 0.625, 0.375, 0.5625)


class Scripted:
    """A metric whose validation value in epoch e is SCRIPT[e], and a validation factory telling it e."""

    def __init__(self) -> None:
        self.epoch: int | None = None

    def metric(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        n = int(target.shape[0])
        value = 0.0 if self.epoch is None else SCRIPT[self.epoch]
        return torch.tensor(value * n, dtype=torch.float64), n

    def validation(self) -> Callable[[lamploop.BatchContext], AsyncIterator[Any]]:
        inner = valid_batches()

        def factory(context: lamploop.BatchContext) -> AsyncIterator[Any]:
            async def stream() -> AsyncIterator[Any]:
                self.epoch = context.epoch
                async for batch in inner(context):
                    yield batch

            return stream()

        return factory


def smooth(raw: list[float], a: float) -> list[float]:
    out: list[float] = []
    for value in raw:
        out.append(value if not out else value * a + out[-1] * (1 - a))
    return out


def expected_best(smoothed: list[float], eligible: set[int], mode: str) -> int:
    best: int | None = None
    for epoch, value in enumerate(smoothed):
        if epoch not in eligible:
            continue
        if best is None or (value > smoothed[best] if mode == "max" else value < smoothed[best]):
            best = epoch  # strictly better only: ties keep the earlier epoch
    assert best is not None
    return best


@pytest.mark.parametrize(
    ("mode", "smoothing", "eligible", "best"),
    [
        ("max", 1.0, None, 1),  # 0.625 at epochs 1 and 3: the earlier wins
        ("max", 0.5, None, 3),  # smoothed: .25 .4375 .46875 .546875 .4609375 .51171875
        ("min", 1.0, None, 0),
        ("max", 1.0, {0, 2, 4, 5}, 5),
    ],
)
def test_model_selection_metric_picks_the_documented_epoch(
    mode: str, smoothing: float, eligible: set[int] | None, best: int
) -> None:
    """training.md "Metrics": model_selection_metric/mode pick the best model by the smoothed
    validation metric; min_validation_loss then holds that best value; the schedules still see
    the validation loss. DESIGN.md 3: only eligible epochs; improvement must be strict. The model
    ends holding the best epoch's model (help(fit), "model")."""
    max_epochs = len(SCRIPT)
    scripted = Scripted()
    module = make_module()
    recorder = Recorder(module)
    extra: dict[str, Any] = {} if eligible is None else {"return_min_validation_loss_model": eligible}
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, metrics={"scripted": scripted.metric}),
        optimizer_factory=recorder,
        train_batches=train_batches(),
        validation_batches=scripted.validation(),
        max_epochs=max_epochs,
        validation_loss_exponential_smoothing_factor=smoothing,
        model_selection_metric="scripted",
        model_selection_mode=mode,
        reporters=[],
        **extra,
    )
    assert state is not None
    smoothed = smooth(list(SCRIPT), smoothing)
    assert expected_best(smoothed, set(range(max_epochs)) if eligible is None else eligible, mode) == best
    for epoch, entry in enumerate(state.learning_curve):
        assert entry.validation_metrics["scripted"] == (smoothed[epoch], SCRIPT[epoch])
    assert state.min_validation_epoch == best
    assert state.min_validation_loss == smoothed[best]
    last = state.learning_curve[-1].validation_loss
    assert last is not None
    assert state.last_validation_loss == last[0]  # the loss, not the metric
    assert state.last_validation_loss != smoothed[-1]
    assert_state_equal(clone_state(module), recorder.end_of_epoch(best))


def test_early_stopping_is_judged_by_the_selected_metric() -> None:
    """training.md: early_stopping_patience "stops training once N validations in a row have
    brought no new best value, judged as the model selection judges"."""
    scripted = Scripted()
    module = make_module()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, metrics={"scripted": scripted.metric}),
        optimizer_factory=Recorder(module),
        train_batches=train_batches(),
        validation_batches=scripted.validation(),
        max_epochs=len(SCRIPT),
        model_selection_metric="scripted",
        model_selection_mode="max",
        early_stopping_patience=2,
        reporters=[],
    )
    assert state is not None
    # best 0.625 at epoch 1; epochs 2 (0.5) and 3 (0.625, a tie) bring no new best: stop after 3
    assert len(state.learning_curve) == 4
    assert state.min_validation_epoch == 1


def test_accuracy_selection_docs_example_against_accuracy_computed_by_hand() -> None:
    """training.md's example: ``model_selection_metric="accuracy", model_selection_mode="max"``."""
    max_epochs = 4
    module = make_module(batchnorm=False)
    recorder = Recorder(module, lr=0.5)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, metrics={"accuracy": accuracy}),
        optimizer_factory=recorder,
        train_batches=train_batches(),
        validation_batches=valid_batches(),
        max_epochs=max_epochs,
        model_selection_metric="accuracy",
        model_selection_mode="max",
        reporters=[],
    )
    assert state is not None
    scratch = copy.deepcopy(module).eval()
    accuracies = []
    for epoch in range(max_epochs):
        scratch.load_state_dict(recorder.end_of_epoch(epoch))
        with torch.no_grad():
            accuracies.append((scratch(XV).argmax(dim=1) == YV).double().mean().item())
    best = expected_best(accuracies, set(range(max_epochs)), "max")
    for epoch, entry in enumerate(state.learning_curve):
        assert math.isclose(entry.validation_metrics["accuracy"][1], accuracies[epoch], abs_tol=TOL)
    assert state.min_validation_epoch == best
    assert_state_equal(clone_state(module), recorder.end_of_epoch(best))


# --- bad inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0, 0.0, 1, 1.0, -0.5, 1.5, math.nan, math.inf, "0.9", None])
def test_ema_decay_outside_its_range_is_a_configuration_error(decay: Any) -> None:
    """help(ema): "decay in (0, 1)"; Raises ConfigurationError: decay outside (0, 1)."""
    with pytest.raises(ConfigurationError, match="decay") as raised:
        ema(decay)
    assert isinstance(raised.value, LamploopError)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("start_epoch", [-1, -10, 1.5, 2.0, "2", None])
def test_swa_start_epoch_not_an_int_at_least_zero_is_a_configuration_error(start_epoch: Any) -> None:
    """help(swa): Raises ConfigurationError: start_epoch is not an int >= 0."""
    with pytest.raises(ConfigurationError, match="start_epoch"):
        swa(start_epoch)


def test_valid_averaging_values_repr() -> None:
    """help(lamploop.averaging)'s doctest."""
    assert repr(ema(0.9)) == "EMA(decay=0.9)"
    assert repr(swa(start_epoch=3)) == "SWA(start_epoch=3, refresh_batchnorm=True)"
    assert swa(0) == SWA(0)
    assert ema(0.5) == EMA(0.5)


class Untouched:
    """Batch and optimizer factories that count whether training started."""

    def __init__(self) -> None:
        self.train_calls = 0
        self.module = make_module()
        self.recorder = Recorder(self.module)

    def train(self, context: lamploop.BatchContext) -> Any:
        self.train_calls += 1
        return train_batches()(context)

    def fit(self, **kwargs: Any) -> Any:
        arguments: dict[str, Any] = {
            "model": lamploop.SupervisedModel(self.module, metrics={"accuracy": accuracy}),
            "optimizer_factory": self.recorder,
            "train_batches": self.train,
            "validation_batches": valid_batches(),
            "max_epochs": 2,
            "reporters": [],
        }
        arguments.update(kwargs)
        return lamploop.fit(**arguments)

    def assert_not_started(self) -> None:
        assert self.train_calls == 0, "training started before the error"
        assert self.recorder.snapshots == [], "an optimizer step ran before the error"


BAD_FIT_ARGUMENTS: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    ("averaging-a-string", lambda: {"averaging": "ema"}, "averaging"),
    ("averaging-a-float", lambda: {"averaging": 0.9}, "averaging"),
    ("averaging-an-AveragedModel", lambda: {"averaging": AveragedModel(make_module())}, "averaging"),
    ("EMA-class-decay-1.5", lambda: {"averaging": EMA(1.5)}, "decay"),
    ("EMA-class-decay-a-string", lambda: {"averaging": EMA("x")}, "decay"),
    ("SWA-class-start-epoch--1", lambda: {"averaging": SWA(-1)}, "start_epoch"),
    ("averaging-with-fsdp", lambda: {"averaging": ema(0.9), "strategy": "fsdp"}, "averaging"),
    ("selection-metric-not-in-metrics", lambda: {"model_selection_metric": "f1"}, "f1"),
    ("selection-metric-not-a-str", lambda: {"model_selection_metric": 3}, "model_selection_metric"),
    (
        "selection-mode-unknown",
        lambda: {"model_selection_metric": "accuracy", "model_selection_mode": "maximize"},
        "maximize",
    ),
    ("selection-mode-unknown-no-metric", lambda: {"model_selection_mode": "biggest"}, "biggest"),
]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [pytest.param(a, n, id=i) for i, a, n in BAD_FIT_ARGUMENTS],
)
def test_bad_averaging_or_selection_arguments_are_refused_before_training(
    arguments: Callable[[], dict[str, Any]], named: str
) -> None:
    """help(fit): bad arguments are LamploopError subclasses; training.md "Usability checks": fit
    checks before anything starts and raises ConfigurationError; errors.py: each message names the
    offending value; strategies.md: fsdp refuses ``averaging`` up front with a ConfigurationError
    naming the setting."""
    untouched = Untouched()
    with pytest.raises(ConfigurationError, match=named):
        untouched.fit(**arguments())
    untouched.assert_not_started()


def test_selection_metric_not_in_metrics_is_a_configuration_error_naming_it() -> None:
    """help(fit): "the model's metrics must have it" (whenever it is found)."""
    with pytest.raises(ConfigurationError, match=r"'f1'.*accuracy"):
        Untouched().fit(model_selection_metric="f1")
    untouched = Untouched()
    with pytest.raises(ConfigurationError, match="'accuracy'"):
        untouched.fit(model=lamploop.SupervisedModel(untouched.module), model_selection_metric="accuracy")


def test_selection_metric_on_a_model_without_metrics_is_refused_before_training() -> None:
    """help(fit): "the model's metrics must have it"."""
    untouched = Untouched()
    with pytest.raises(ConfigurationError, match="accuracy"):
        untouched.fit(model=lamploop.SupervisedModel(untouched.module), model_selection_metric="accuracy")
    untouched.assert_not_started()
