"""Acceptance tests of docs/training.md (and README/index where they promise the same), from the docs.

Each test quotes the sentence it checks and compares lamploop with a reference written here:
hand loops under ``torch.autocast`` with ``torch.amp.GradScaler``, ``clip_grad_norm_``, torch's
own ``lr_scheduler`` stepped by hand, a float64 learning-rate range test, a parameter count
made here. Ranks are replicas of ``local_data_parallel_training_loop`` (a real Gloo group on
127.0.0.1 inside this process); nothing crosses a process here.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import lamploop
from lamploop.errors import ConfigurationError, MissingDependencyError

pytestmark = pytest.mark.timeout(60)

# ---------------------------------------------------------------------------------------------
# helpers


def seeded_mlp(seed: int = 1, n_in: int = 8, hidden: int = 32, n_out: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_out))


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def assert_bitwise(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), (name, (p - q).abs().max().item())


def latest_descriptor(root: Path) -> dict[str, Any]:
    """checkpoints.md: `latest` names the newest checkpoint directory; `checkpoint.json` its descriptor."""
    name = (root / "latest").read_text().strip()
    return json.loads((root / name / "checkpoint.json").read_text())


def loss_scale_of(root: Path) -> dict[str, Any]:
    """training.md: the loss scale is "written to checkpoints (beside the optimizer state, under
    `lamploop_loss_scale` ...)"."""
    return latest_descriptor(root)["optimizer"]["lamploop_loss_scale"]


def grad_scaler_loop(
    module: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    epochs: int,
    lr: float,
    clip: float | None = None,
) -> torch.amp.GradScaler:
    """The recipe of torch's AMP docs: autocast fp16 forward, GradScaler scale/step/update."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(epochs):
        for start in range(0, len(y), batch_size):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(module(x[start : start + batch_size]), y[start : start + batch_size])
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
    return scaler


def stream_failing_at(inner: lamploop.BatchStreamFactory, failing: dict[str, bool], epoch: int, batch: int):
    """A batch factory whose stream raises at (epoch, batch) while ``failing["on"]``: a run cut short."""

    def factory(context: lamploop.BatchContext):
        async def stream():
            index = 0
            async for item in inner(context):
                if failing["on"] and context.epoch == epoch and index == batch:
                    msg = "the disk went away"
                    raise OSError(msg)
                index += 1
                yield item

        return stream()

    return factory


# ---------------------------------------------------------------------------------------------
# "Every feature here is off by default"


def test_every_feature_is_off_by_default_and_lr_find_has_the_documented_defaults() -> None:
    """training.md: "Every feature here is off by default"; precision "default `"32"`";
    lr_scheduler_interval "`"epoch"`, the default"; on_non_finite_loss `"raise"` (default);
    lr_find: `num_steps` (100), `min_lr` (1e-7), `max_lr` (10), `smoothing=0.9`,
    `divergence_threshold` (4)."""
    fit = inspect.signature(lamploop.fit).parameters
    assert fit["precision"].default == "32"
    assert fit["lr_scheduler_interval"].default == "epoch"
    assert fit["on_non_finite_loss"].default == "raise"
    for off in (
        "max_gradient_norm",
        "step_schedule",
        "lr_scheduler",
        "averaging",
        "model_selection_metric",
        "early_stopping_patience",
    ):
        assert fit[off].default is None, off
    find = inspect.signature(lamploop.lr_find).parameters
    assert find["num_steps"].default == 100
    assert find["min_lr"].default == 1e-7
    assert find["max_lr"].default == 10
    assert find["smoothing"].default == 0.9
    assert find["divergence_threshold"].default == 4


# ---------------------------------------------------------------------------------------------
# Mixed precision


def test_bf16_autocasts_every_forward_and_loss_and_trains_like_a_hand_autocast_loop() -> None:
    """training.md: `precision="bf16"` "runs every forward pass, model and loss, training and
    validation, under `torch.autocast` with that dtype; parameters, backward and the optimizer
    step stay in the parameters' dtype. bf16 has float32's range and needs nothing more."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    seen: list[tuple[bool, bool, torch.dtype]] = []  # (training, autocast on in the loss, output dtype)
    grad_dtypes: set[torch.dtype] = set()

    def loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        seen.append((module.training, torch.is_autocast_enabled("cpu"), output.dtype))
        return F.cross_entropy(output, target, reduction="sum"), len(target)

    def factory(params):
        optimizer = torch.optim.SGD(params, lr=0.1)
        step = optimizer.step

        def stepping(*a, **k):
            grad_dtypes.update(p.grad.dtype for p in module.parameters())
            return step(*a, **k)

        optimizer.step = stepping
        return optimizer

    module = seeded_mlp()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, loss),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(x, y, batch_size=16, shuffle=False),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
        max_epochs=2,
        precision="bf16",
        reporters=[],
    )
    assert {(on, dtype) for training, on, dtype in seen if training} == {(True, torch.bfloat16)}
    assert grad_dtypes == {torch.float32}
    assert {p.dtype for p in module.parameters()} == {torch.float32}

    def hand(autocast: bool) -> tuple[torch.nn.Module, list[float], list[float]]:
        reference = seeded_mlp()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        train, valid = [], []
        for _ in range(2):
            total = 0.0
            for start in range(0, 64, 16):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    batch_loss = F.cross_entropy(reference(x[start : start + 16]), y[start : start + 16])
                total += batch_loss.item() * 16
                batch_loss.backward()
                optimizer.step()
            train.append(total / 64)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                valid.append(
                    sum(
                        F.cross_entropy(reference(x[s : s + 32]), y[s : s + 32], reduction="sum").item()
                        for s in (0, 32)
                    )
                    / 64
                )
        return reference, train, valid

    reference, train, valid = hand(autocast=True)
    plain, _, _ = hand(autocast=False)
    assert max_difference(plain, reference) > 1e-5  # bf16 makes a difference to see
    assert max_difference(module, reference) < 1e-6
    assert [e.training_loss for e in state.learning_curve] == pytest.approx(train, abs=1e-5)
    assert len(valid) == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_validation_passes_run_under_autocast_too(precision: str) -> None:
    """training.md: `precision="bf16"` or `"fp16"` "runs every forward pass, model and loss,
    training and validation, under `torch.autocast` with that dtype". With lr 0 the model stays as
    it was, so the validation loss is that of the initial weights under autocast."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    seen: list[tuple[bool, bool, torch.dtype]] = []

    def loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        seen.append((module.training, torch.is_autocast_enabled("cpu"), output.dtype))
        return F.cross_entropy(output, target, reduction="sum"), len(target)

    module = seeded_mlp()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
        train_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
        max_epochs=1,
        precision=precision,
        reporters=[],
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        autocast_loss = (
            sum(
                F.cross_entropy(module(x[s : s + 32]), y[s : s + 32], reduction="sum").item() for s in (0, 32)
            )
            / 64
        )
    with torch.no_grad():
        float32_loss = F.cross_entropy(module(x), y).item()
    assert abs(autocast_loss - float32_loss) > 1e-6  # the two are told apart
    assert {(on, out) for training, on, out in seen if not training} == {(True, dtype)}
    assert state.learning_curve[0].validation_loss[1] == pytest.approx(autocast_loss, abs=1e-6)


def test_fp16_single_rank_is_grad_scaler_step_for_step_with_overflows_and_the_scale_in_checkpoints(
    tmp_path: Path,
) -> None:
    """training.md: "fp16 gets a dynamic loss scale with `torch.amp.GradScaler`'s rules ... a step
    whose gradients hold an inf or a NaN is skipped while the scale halves (from 2^16)"; "written
    to checkpoints (beside the optimizer state, under `lamploop_loss_scale`, which
    `load_state_dict` ignores)". Inputs of size 30 overflow float16 at the first steps."""
    torch.manual_seed(0)
    x, y = 30 * torch.randn(64, 8), torch.randint(0, 4, (64,))
    steps: list[int] = []

    def factory(params):
        optimizer = torch.optim.SGD(params, lr=0.01)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
        return optimizer

    module = seeded_mlp()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(x, y, batch_size=16, shuffle=False),
        max_epochs=2,
        precision="fp16",
        checkpoint_dir=tmp_path,
        reporters=[],
    )
    reference = seeded_mlp()
    scaler = grad_scaler_loop(reference, x, y, batch_size=16, epochs=2, lr=0.01)
    saved = loss_scale_of(tmp_path)
    assert scaler.get_scale() < 2.0**16  # GradScaler did skip steps
    assert saved["scale"] == scaler.get_scale()
    skipped = round(math.log2(2.0**16 / scaler.get_scale()))
    assert saved["skipped_steps"] == skipped
    assert len(steps) == 8 - skipped  # a skipped step does not reach the optimizer
    assert_bitwise(module, reference)

    # "which `load_state_dict` ignores": the saved optimizer state loads into a plain SGD.
    optimizer_json = latest_descriptor(tmp_path)["optimizer"]
    fresh = torch.optim.SGD(seeded_mlp().parameters(), lr=0.5)
    fresh.load_state_dict(optimizer_json)  # SGD without momentum: no tensors in its state
    assert fresh.param_groups[0]["lr"] == 0.01


def test_fp16_scale_doubles_after_2000_good_steps(tmp_path: Path) -> None:
    """training.md: the scale starts "from 2^16; after 2000 good steps it doubles"."""
    torch.manual_seed(0)
    n = 2003
    x, y = 0.1 * torch.randn(n, 2), torch.randint(0, 2, (n,))

    def linear() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Linear(2, 2)

    module = linear()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=1e-3),
        train_batches=lamploop.tensor_batches(x, y, batch_size=1, shuffle=False),
        max_epochs=1,
        precision="fp16",
        checkpoint_dir=tmp_path,
        reporters=[],
    )
    reference = linear()
    scaler = grad_scaler_loop(reference, x, y, batch_size=1, epochs=1, lr=1e-3)
    assert scaler.get_scale() == 2.0**17
    saved = loss_scale_of(tmp_path)
    assert saved["scale"] == 2.0**17
    assert saved["skipped_steps"] == 0
    assert_bitwise(module, reference)


def test_fp16_with_clipping_unscales_before_it_clips_as_the_grad_scaler_recipe() -> None:
    """training.md: "the gradients summed over the ranks are unscaled" and `max_gradient_norm`
    "clips each step's gradient to that global L2 norm, as `torch.nn.utils.clip_grad_norm_`
    does": under fp16, the recipe of torch's AMP docs (unscale_, clip_grad_norm_, step)."""
    torch.manual_seed(0)
    x, y = 3 * torch.randn(64, 8), torch.randint(0, 4, (64,))
    module = seeded_mlp()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16, shuffle=False),
        max_epochs=2,
        precision="fp16",
        max_gradient_norm=0.5,
        reporters=[],
    )
    reference = seeded_mlp()
    grad_scaler_loop(reference, x, y, batch_size=16, epochs=2, lr=0.1, clip=0.5)
    unclipped = seeded_mlp()
    grad_scaler_loop(unclipped, x, y, batch_size=16, epochs=2, lr=0.1)
    assert max_difference(unclipped, reference) > 1e-3  # the clip did something
    assert max_difference(module, reference) < 1e-6


def _two_replicas_fp16(
    x: torch.Tensor, y: torch.Tensor, *, batch_size: int, epochs: int, lr: float
) -> tuple[list[torch.nn.Module], list[dict[str, Any]]]:
    """Two ranks (replicas in this process); rank r trains on x[r::2] in order."""

    def shard(rank: int) -> lamploop.BatchStreamFactory:
        inner = lamploop.tensor_batches(x[rank::2], y[rank::2], batch_size=batch_size, shuffle=False)
        return lambda context: inner(lamploop.BatchContext(epoch=context.epoch, rank=0, nranks=1))

    scales: list[dict[str, Any]] = []

    async def checkpoint(state, _schedule_state) -> None:
        scales.append(copy.deepcopy(state.optimizer["lamploop_loss_scale"]))

    replicas = [(lamploop.SupervisedModel(seeded_mlp()), shard(rank), None) for rank in range(2)]
    anyio.run(
        lambda: lamploop.local_data_parallel_training_loop(
            replicas,
            lambda params: torch.optim.SGD(params, lr=lr),
            epochs,
            checkpoint_state=checkpoint,
            precision="fp16",
            strategy="all_reduce",
        )
    )
    return [replica[0].module for replica in replicas], scales


def test_fp16_on_two_ranks_every_rank_skips_the_same_steps() -> None:
    """training.md: "With `all_reduce` every rank holds the same summed gradients, so every rank
    finds the same overflow and skips the same step with no message between them": the replicas
    end equal, bit for bit, after steps that overflowed."""
    torch.manual_seed(0)
    x, y = 8 * torch.randn(64, 8), torch.randint(0, 4, (64,))
    modules, scales = _two_replicas_fp16(x, y, batch_size=8, epochs=2, lr=0.01)
    assert scales[-1]["skipped_steps"] >= 1
    assert_bitwise(modules[0], modules[1])


def test_fp16_on_two_ranks_skips_only_the_steps_grad_scaler_skips_on_the_union() -> None:
    """training.md: fp16 "with `torch.amp.GradScaler`'s rules ... a step whose gradients hold an
    inf or a NaN is skipped while the scale halves (from 2^16)"; README: "R ranks x k accumulated
    batches of size b give the parameters of one batch of R*k*b". Ordinary data (unit Gaussian
    inputs): GradScaler on the union of the two ranks' batches never overflows."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 4, (256,))
    modules, scales = _two_replicas_fp16(x, y, batch_size=32, epochs=3, lr=0.01)

    reference = seeded_mlp()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        for step in range(4):
            part = slice(step * 32, (step + 1) * 32)
            xs, ys = torch.cat([x[0::2][part], x[1::2][part]]), torch.cat([y[0::2][part], y[1::2][part]])
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(reference(xs), ys)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scaler.get_scale() == 2.0**16  # GradScaler skipped nothing
    assert [s["skipped_steps"] for s in scales] == [0, 0, 0]
    assert scales[-1]["scale"] == 2.0**16
    assert max_difference(modules[0], reference) < 1e-3


def test_fp16_with_reduce_to_root_is_a_configuration_error() -> None:
    """training.md: "with `reduce_to_root` only the root would see them, so fp16 there is a
    `ConfigurationError`"."""
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    replicas = [
        (lamploop.SupervisedModel(seeded_mlp()), lamploop.tensor_batches(x, y, batch_size=4), None)
        for _ in range(2)
    ]
    with pytest.raises(ConfigurationError) as caught:
        anyio.run(
            lambda: lamploop.local_data_parallel_training_loop(
                replicas,
                lambda params: torch.optim.SGD(params, lr=0.1),
                1,
                precision="fp16",
                strategy="reduce_to_root",
            )
        )
    assert "fp16" in str(caught.value)
    assert "reduce_to_root" in str(caught.value)


def test_fp16_resumed_at_an_epoch_and_a_step_boundary_goes_on_from_the_saved_scale(tmp_path: Path) -> None:
    """training.md: "The loss scale is kept for the whole run and written to checkpoints ...; a
    resumed run ... starts from the root's saved scale and ends as an uninterrupted one would."
    The first steps overflow, so a resumed run that started again from 2^16 would skip again."""
    torch.manual_seed(0)
    x, y = 30 * torch.randn(64, 8), torch.randint(0, 4, (64,))
    failing = {"on": False}
    batches = stream_failing_at(lamploop.tensor_batches(x, y, batch_size=8, shuffle=False), failing, 1, 5)

    def run(directory: Path, epochs: int, **more: Any) -> torch.nn.Module:
        module = seeded_mlp()
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
            train_batches=batches,
            max_epochs=epochs,
            precision="fp16",
            checkpoint_dir=directory,
            reporters=[],
            **more,
        )
        return module

    straight = run(tmp_path / "straight", 3)
    straight_scale = loss_scale_of(tmp_path / "straight")
    reference = seeded_mlp()
    scaler = grad_scaler_loop(reference, x, y, batch_size=8, epochs=3, lr=0.01)
    assert straight_scale["scale"] == scaler.get_scale() < 2.0**16
    assert_bitwise(straight, reference)

    run(tmp_path / "epochs", 1)
    assert loss_scale_of(tmp_path / "epochs")["scale"] < 2.0**16
    resumed = run(tmp_path / "epochs", 3)
    assert loss_scale_of(tmp_path / "epochs") == straight_scale
    assert_bitwise(resumed, straight)

    failing["on"] = True
    with pytest.raises(Exception, match="the disk went away"):
        run(tmp_path / "steps", 3, checkpoint_every_n_steps=2)
    assert lamploop.latest_checkpoint(tmp_path / "steps").name == "epoch-000001-step-000004"
    failing["on"] = False
    resumed = run(tmp_path / "steps", 3, checkpoint_every_n_steps=2)
    assert loss_scale_of(tmp_path / "steps")["scale"] == straight_scale["scale"]
    assert_bitwise(resumed, straight)


# ---------------------------------------------------------------------------------------------
# Per-step learning rates and torch schedulers


@pytest.mark.parametrize("factor", [-0.5, float("inf")], ids=["negative", "infinite"])
def test_a_negative_or_infinite_step_factor_is_a_configuration_error_naming_epoch_and_step(
    factor: float,
) -> None:
    """training.md: "a factor that is NaN, infinite or negative is a `ConfigurationError` naming
    the epoch and step"."""

    class Bad:
        def factor(self, epoch: int, step: int) -> float:
            return factor if (epoch, step) == (1, 2) else 1.0

    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(seeded_mlp()),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(
                torch.randn(16, 8), torch.randint(0, 4, (16,)), batch_size=4
            ),
            max_epochs=3,
            step_schedule=Bad(),
            reporters=[],
        )
    text = str(caught.value)
    assert "epoch 1" in text
    assert "step 2" in text


class RateRecordingSGD(torch.optim.SGD):
    """SGD that records (lr, momentum) of its first group at every step."""

    rates: list[tuple[float, float]]

    def step(self, closure=None):
        self.rates.append((self.param_groups[0]["lr"], self.param_groups[0]["momentum"]))
        return super().step(closure)


def test_onecycle_per_step_with_momentum_resumed_at_an_epoch_and_a_step_boundary(tmp_path: Path) -> None:
    """training.md: `lr_scheduler=` "stepped after every optimizer step (`lr_scheduler_interval=
    "step"`)"; "Its `state_dict()` goes into checkpoints beside the optimizer state (under
    `lamploop_lr_scheduler` ...) ..., so a run resumed at an epoch or step boundary steps on
    exactly (the hyperparameters it set, OneCycleLR's momentum included, are the checkpoint's)".
    Float64, against a hand loop that steps the same scheduler."""
    from torch.optim.lr_scheduler import OneCycleLR

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=generator)

    def linear() -> torch.nn.Module:
        torch.manual_seed(2)
        return torch.nn.Linear(5, 3).double()

    def scheduler(optimizer):
        return OneCycleLR(optimizer, max_lr=0.5, total_steps=12)

    reference = linear()
    hand = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    hand_scheduler = scheduler(hand)
    expected: list[tuple[float, float]] = []
    for _ in range(3):
        for start in range(0, 48, 12):
            expected.append((hand.param_groups[0]["lr"], hand.param_groups[0]["momentum"]))
            hand.zero_grad()
            F.cross_entropy(reference(x[start : start + 12]), y[start : start + 12]).backward()
            hand.step()
            hand_scheduler.step()

    failing = {"on": False}
    batches = stream_failing_at(lamploop.tensor_batches(x, y, batch_size=12, shuffle=False), failing, 1, 3)

    def run(directory: Path, epochs: int) -> tuple[torch.nn.Module, list[tuple[float, float]]]:
        module, rates = linear(), []

        def factory(params):
            optimizer = RateRecordingSGD(params, lr=0.1, momentum=0.9)
            optimizer.rates = rates
            return optimizer

        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=factory,
            train_batches=batches,
            max_epochs=epochs,
            lr_scheduler=scheduler,
            lr_scheduler_interval="step",
            checkpoint_dir=directory,
            checkpoint_every_n_steps=2,
            reporters=[],
        )
        return module, rates

    def assert_rates(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> None:
        assert len(got) == len(want)
        for (lr, momentum), (want_lr, want_momentum) in zip(got, want, strict=True):
            assert lr == pytest.approx(want_lr, rel=1e-12, abs=1e-15)
            assert momentum == pytest.approx(want_momentum, rel=1e-12)

    straight, rates = run(tmp_path / "straight", 3)
    assert_rates(rates, expected)
    for p, q in zip(straight.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)

    _, first = run(tmp_path / "epochs", 1)
    assert_rates(first, expected[:4])
    saved = latest_descriptor(tmp_path / "epochs")["optimizer"]["lamploop_lr_scheduler"]
    assert saved["last_epoch"] == 4  # stepped after each of the 4 optimizer steps
    resumed, rest = run(tmp_path / "epochs", 3)
    assert_rates(rest, expected[4:])
    assert_bitwise(resumed, straight)

    failing["on"] = True
    with pytest.raises(Exception, match="the disk went away"):
        run(tmp_path / "steps", 3)
    assert lamploop.latest_checkpoint(tmp_path / "steps").name == "epoch-000001-step-000002"
    failing["on"] = False
    resumed, rest = run(tmp_path / "steps", 3)
    assert_rates(rest, expected[6:])
    assert_bitwise(resumed, straight)


def test_a_per_epoch_scheduler_resumed_at_an_epoch_boundary_steps_on(tmp_path: Path) -> None:
    """training.md: the scheduler is stepped "after every training epoch (`"epoch"`, the
    default)"; "a run resumed at an epoch ... boundary steps on exactly". StepLR halving each
    epoch: after 3 epochs, 1 and then 2 more, the rate is 0.1 * 0.5**3 and each epoch's steps ran
    at 0.1, 0.05, 0.025."""
    from torch.optim.lr_scheduler import StepLR

    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    rates: list[tuple[float, float]] = []
    optimizers: list[torch.optim.Optimizer] = []

    def factory(params):
        optimizer = RateRecordingSGD(params, lr=0.1, momentum=0.0)
        optimizer.rates = rates
        optimizers.append(optimizer)
        return optimizer

    for epochs in (1, 3):
        lamploop.fit(
            model=lamploop.SupervisedModel(seeded_mlp()),
            optimizer_factory=factory,
            train_batches=lamploop.tensor_batches(x, y, batch_size=16),
            max_epochs=epochs,
            lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.5),
            checkpoint_dir=tmp_path,
            reporters=[],
        )
    assert [lr for lr, _ in rates] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025], rel=1e-12)
    assert optimizers[-1].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# lr_find


def _lr_find_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=generator, dtype=torch.float64)
    return x, (x[:, :3].sum(dim=1) > 0).long()


def _dropout_mlp() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 2)
    ).double()


def test_lr_find_is_the_range_test_of_a_hand_loop_and_leaves_everything_as_it_was() -> None:
    """training.md: lr_find "trains a deep copy of the model for up to `num_steps` optimizer steps
    with a learning rate that grows exponentially from `min_lr` to `max_lr`, every parameter
    group alike, records each step's training loss and its smoothed value (an exponential moving
    average, bias-corrected, `smoothing=0.9`), and stops early once the smoothed loss exceeds
    `divergence_threshold` (4) times the best so far"; "the batch factory is asked for epochs 0,
    1, ... until the steps are taken"; the suggestion is "the rate at the lowest smoothed loss,
    divided by 10"; "The model, any optimizer already made for it, and torch's random number
    generators are left as they were, bit for bit"."""
    x, y = _lr_find_data()
    module = _dropout_mlp()
    existing = torch.optim.Adam(module.parameters(), lr=1e-3)
    F.cross_entropy(module(x[:8]), y[:8]).backward()
    existing.step()
    existing.zero_grad()
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    existing_state = copy.deepcopy(existing.state_dict())
    reference = copy.deepcopy(module)  # what the range test starts from

    asked: list[lamploop.BatchContext] = []
    inner = lamploop.tensor_batches(x, y, batch_size=32, shuffle=False)
    group_rates: list[list[float]] = []

    def factory(params):
        params = list(params)
        optimizer = torch.optim.SGD(
            [{"params": params[:2], "lr": 0.3}, {"params": params[2:]}], lr=0.1, momentum=0.9
        )
        step = optimizer.step
        optimizer.step = lambda *a, **k: (
            group_rates.append([g["lr"] for g in optimizer.param_groups]),
            step(*a, **k),
        )[1]
        return optimizer

    torch.manual_seed(123)
    rng = torch.get_rng_state()
    result = lamploop.lr_find(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=factory,
        train_batches=lambda context: asked.append(context) or inner(context),
        min_lr=1e-4,
        max_lr=100.0,
        num_steps=40,
    )
    assert torch.equal(torch.get_rng_state(), rng)
    for name, tensor in before.items():
        assert torch.equal(module.state_dict()[name], tensor), name
    after_state = existing.state_dict()
    assert after_state["param_groups"] == existing_state["param_groups"]
    for index, entry in existing_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(after_state["state"][index][key], value), (index, key)

    n = len(result.lrs)
    assert result.diverged
    assert 2 < n < 40
    assert [c.epoch for c in asked] == list(range(len(asked)))
    assert len(asked) == math.ceil(n / 3)  # 3 batches of 32 per epoch
    wanted = [1e-4 * (100.0 / 1e-4) ** (i / 39) for i in range(n)]
    assert result.lrs == pytest.approx(wanted, rel=1e-12)
    assert group_rates[:n] == [[lr, lr] for lr in result.lrs]

    # the hand range test: same copy, same RNG stream (dropout), same batches in order
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(123)
    raw, smoothed, average = [], [], 0.0
    for i, lr in enumerate(wanted):
        for group in optimizer.param_groups:
            group["lr"] = lr
        start = (i % 3) * 32
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(x[start : start + 32]), y[start : start + 32])
        loss.backward()
        optimizer.step()
        raw.append(loss.item())
        average = 0.9 * average + 0.1 * loss.item()
        smoothed.append(average / (1 - 0.9 ** (i + 1)))
    assert result.raw_losses == pytest.approx(raw, rel=1e-10)
    assert result.losses == pytest.approx(smoothed, rel=1e-10)
    best = [min(smoothed[: i + 1]) for i in range(n)]
    assert smoothed[-1] > 4 * best[-2]  # the last step diverged
    assert all(smoothed[i] <= 4 * best[i - 1] for i in range(1, n - 1))  # and none before it
    lowest = min(range(n), key=lambda i: smoothed[i])
    assert result.suggestion == pytest.approx(wanted[lowest] / 10, rel=1e-12)


def test_lr_find_without_a_threshold_stops_at_a_non_finite_loss() -> None:
    """training.md: lr_find "stops early once the smoothed loss exceeds `divergence_threshold` ...
    or the loss is NaN or infinite"; its docstring: `None`: "never stop early, but on a NaN or
    infinite loss". Every loss the model computes is seen here: the test ends at the first
    non-finite one (which is no step taken, so not in the result)."""
    generator = torch.Generator().manual_seed(1)
    x = 100 * torch.randn(64, 4, generator=generator)
    y = 100 * torch.randn(64, 1, generator=generator)
    computed: list[float] = []

    def loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        value = F.mse_loss(output, target, reduction="sum")
        computed.append(value.item() / len(target))
        return value, len(target)

    torch.manual_seed(0)
    result = lamploop.lr_find(
        model=lamploop.SupervisedModel(torch.nn.Linear(4, 1), loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        min_lr=1e-6,
        max_lr=1e6,
        num_steps=60,
        divergence_threshold=None,
    )
    n = len(result.lrs)
    assert n < 60
    assert not math.isfinite(computed[-1])
    assert all(math.isfinite(v) for v in computed[:-1])
    assert list(result.raw_losses) == pytest.approx(computed[:n], rel=1e-6)
    assert len(computed) == n + 1
    smoothed = result.losses
    assert max(smoothed) > 4 * min(smoothed)  # a threshold of 4 would have stopped earlier


def test_lr_find_takes_no_step_after_the_one_that_diverged() -> None:
    """training.md: lr_find "trains a deep copy of the model for up to `num_steps` optimizer steps
    ... and stops early once the smoothed loss exceeds `divergence_threshold` (4) times the best
    so far"; LrFindResult: "one entry per optimizer step taken"."""
    x, y = _lr_find_data()
    module = _dropout_mlp()
    existing = torch.optim.Adam(module.parameters(), lr=1e-3)
    F.cross_entropy(module(x[:8]), y[:8]).backward()
    existing.step()
    taken: list[float] = []

    def factory(params):
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (taken.append(optimizer.param_groups[0]["lr"]), step(*a, **k))[1]
        return optimizer

    torch.manual_seed(123)
    result = lamploop.lr_find(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
        min_lr=1e-4,
        max_lr=100.0,
        num_steps=40,
    )
    assert result.diverged
    assert len(result.lrs) % 3 != 0  # it diverged inside an epoch (3 steps per epoch)
    assert taken == list(result.lrs)


def test_lr_find_with_accumulation_and_clipping_counts_optimizer_steps() -> None:
    """training.md: "`accumulate_gradient_over_n_batches`, `precision` and `max_gradient_norm`
    work as in `fit` (a step is an optimizer step)"."""
    x, y = _lr_find_data()
    module = _dropout_mlp()
    module[1].p = 0.0
    result = lamploop.lr_find(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16, shuffle=False),
        min_lr=1e-3,
        max_lr=1.0,
        num_steps=6,
        divergence_threshold=None,
        accumulate_gradient_over_n_batches=2,
        max_gradient_norm=0.05,
    )
    reference = _dropout_mlp()
    reference[1].p = 0.0
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    raw = []
    for i in range(6):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * 1000.0 ** (i / 5)
        start = (i % 3) * 32  # two batches of 16 per step
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(x[start : start + 32]), y[start : start + 32])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        optimizer.step()
        raw.append(loss.item())
    assert len(result.lrs) == 6
    assert result.raw_losses == pytest.approx(raw, rel=1e-10)


def test_lr_find_plot_writes_a_png_and_says_what_to_install_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """training.md: "`result.plot("lr.png")` draws the losses against the rate with the suggestion
    (matplotlib: `pip install "lamploop[plot]"`, else a `MissingDependencyError` that says so)"."""
    pytest.importorskip("matplotlib")
    x, y = _lr_find_data()
    result = lamploop.lr_find(
        model=lamploop.SupervisedModel(_dropout_mlp()),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=32),
        num_steps=10,
    )
    result.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError) as caught:
        result.plot(tmp_path / "again.png")
    assert "lamploop[plot]" in str(caught.value)
    assert not (tmp_path / "again.png").exists()


# ---------------------------------------------------------------------------------------------
# The model summary


def test_the_model_summary_is_the_documented_table_counted_by_hand(caplog: pytest.LogCaptureFixture) -> None:
    """training.md, "The model summary": the run starts with the documented lines; `summarize`
    gives `layers`, `trainable_parameters`, `non_trainable_parameters`, `total_parameters`,
    `size_bytes` and `size_mb` "(parameters only, buffers aside)"; "`depth=2` adds the modules
    inside each top-level one"; a frozen `ModelSummary`."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = (x[:, :4].sum(dim=1) > 0).long()
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    caplog.set_level(logging.INFO, logger="lamploop")
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=32),
        max_epochs=3,
        reporters=[lamploop.LoggingReporter()],
    )
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("lamploop"))
    documented = (
        "training on 1 rank(s) from epoch 0 to 3\n"
        "model: Sequential, 354 parameters (354 trainable, 0 non-trainable), 0.001 MB\n"
        "  name  type    parameters  trainable\n"
        "  0     Linear         288  yes\n"
        "  1     ReLU             0  -\n"
        "  2     Linear          66  yes"
    )
    assert documented in text, text
    assert "\n".join(lamploop.summarize(module).lines()) in documented

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 4)
            self.norm = torch.nn.BatchNorm1d(4)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.head = torch.nn.Linear(4, 2).half()
            self.frozen = torch.nn.Linear(2, 2).double().requires_grad_(False)

    model = Model()
    summary = lamploop.summarize(model, depth=2)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules() if name}
    rows = {layer.name: layer.parameters for layer in summary.layers}
    assert rows == {
        name: counts[name] for name in ("encoder", "encoder.fc", "encoder.norm", "head", "frozen")
    }
    assert [layer.name for layer in summary.layers] == [
        "encoder",
        "encoder.fc",
        "encoder.norm",
        "head",
        "frozen",
    ]
    assert summary.trainable_parameters == 16 + 8 + 10
    assert summary.non_trainable_parameters == 6
    assert summary.total_parameters == 40
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # buffers aside
    assert summary.size_bytes == size == 16 * 4 + 8 * 4 + 10 * 2 + 6 * 8
    assert summary.size_mb == pytest.approx(size / 1e6, rel=0.05) or summary.size_mb == pytest.approx(
        size / 2**20, rel=0.05
    )
    assert len(lamploop.summarize(model, depth=1).layers) == 3
    with pytest.raises(Exception):  # noqa: B017, PT011 - frozen: any attrs/dataclass error
        summary.total_parameters = 0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Gradient clipping


def test_clipping_with_accumulation_clips_the_whole_steps_gradient_float64() -> None:
    """training.md: `max_gradient_norm=` "clips each step's gradient to that global L2 norm, as
    `torch.nn.utils.clip_grad_norm_` does"; README: k accumulated batches of b "give the
    parameters of one batch of" k*b. So the clip applies to the accumulated gradient of a step."""
    generator = torch.Generator().manual_seed(2)
    x = 5 * torch.randn(48, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=generator)

    def net() -> torch.nn.Module:
        torch.manual_seed(6)
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()

    module = net()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.5),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
        max_epochs=2,
        accumulate_gradient_over_n_batches=2,
        max_gradient_norm=0.3,
        reporters=[],
    )
    reference = net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    norms = []
    for _ in range(2):
        for start in range(0, 48, 16):
            optimizer.zero_grad()
            F.cross_entropy(reference(x[start : start + 16]), y[start : start + 16]).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)))
            optimizer.step()
    assert min(norms) > 0.3  # every step was clipped
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Metrics and early stopping across a resume


def test_an_epoch_resumed_mid_way_ends_with_the_whole_epochs_metrics(tmp_path: Path) -> None:
    """training.md: "A step-boundary checkpoint keeps every rank's metric sums so far ..., so an
    epoch resumed mid-way ends with the whole epoch's metrics, as its loss does (to the rounding
    of one float64 addition)". The metric is checked against the training accuracy computed here."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(48, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=generator)
    failing = {"on": False}
    batches = stream_failing_at(lamploop.tensor_batches(x, y, batch_size=8, shuffle=False), failing, 1, 4)

    def linear() -> torch.nn.Module:
        torch.manual_seed(5)
        return torch.nn.Linear(5, 3).double()

    def run(directory: Path) -> lamploop.LoopState:
        return lamploop.fit(
            model=lamploop.SupervisedModel(linear(), metrics={"accuracy": lamploop.metrics.accuracy}),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.3),
            train_batches=batches,
            max_epochs=2,
            checkpoint_dir=directory,
            checkpoint_every_n_steps=3,
            reporters=[],
        )

    straight = run(tmp_path / "straight")
    failing["on"] = True
    with pytest.raises(Exception, match="the disk went away"):
        run(tmp_path / "cut")
    assert lamploop.latest_checkpoint(tmp_path / "cut").name == "epoch-000001-step-000003"
    failing["on"] = False
    resumed = run(tmp_path / "cut")

    # the training accuracy of each step's batch, before its step, by hand
    reference = linear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.3)
    accuracies = []
    for _ in range(2):
        correct = 0
        for start in range(0, 48, 8):
            output = reference(x[start : start + 8])
            correct += int((output.argmax(dim=1) == y[start : start + 8]).sum())
            optimizer.zero_grad()
            F.cross_entropy(output, y[start : start + 8]).backward()
            optimizer.step()
        accuracies.append(correct / 48)
    for got in (straight, resumed):
        assert [e.training_metrics["accuracy"] for e in got.learning_curve] == pytest.approx(
            accuracies, abs=1e-12
        )
    assert resumed.learning_curve[1].training_loss == pytest.approx(
        straight.learning_curve[1].training_loss, rel=1e-14
    )


def test_early_stopping_resumed_stops_where_the_uninterrupted_run_would(tmp_path: Path) -> None:
    """training.md: "The count is read off the learning curve, so it needs nothing more in
    checkpoints and a resumed run stops where the uninterrupted one would"."""
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def run(epochs: int) -> lamploop.LoopState:
        return lamploop.fit(
            model=lamploop.SupervisedModel(seeded_mlp()),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),  # never improves
            train_batches=lamploop.tensor_batches(x, y, batch_size=8),
            validation_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
            max_epochs=epochs,
            early_stopping_patience=3,
            checkpoint_dir=tmp_path,
            reporters=[],
        )

    assert run(2).epoch == 2
    resumed = run(10)
    assert resumed.epoch == 4  # epoch 0 is the best; epochs 1, 2 and 3 bring nothing new
    assert resumed.min_validation_epoch == 0


# ---------------------------------------------------------------------------------------------
# Notebooks and compiled modules


def test_fit_async_is_the_direct_way_inside_async_code() -> None:
    """training.md: "Inside your own async code, `await lamploop.fit_async(...)` is the direct
    way"; it trains as the blocking `fit` does."""
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def arguments(module: torch.nn.Module) -> dict[str, Any]:
        return {
            "model": lamploop.SupervisedModel(module),
            "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1),
            "train_batches": lamploop.tensor_batches(x, y, batch_size=8),
            "max_epochs": 2,
            "reporters": [],
        }

    awaited = seeded_mlp()

    async def main() -> lamploop.LoopState | None:
        return await lamploop.fit_async(**arguments(awaited))

    state = anyio.run(main)
    blocking = seeded_mlp()
    expected = lamploop.fit(**arguments(blocking))
    assert state == expected
    assert_bitwise(awaited, blocking)


def test_a_compiled_module_checkpoints_with_the_plain_keys(tmp_path: Path) -> None:
    """training.md: "A `torch.compile`d module checkpoints with the plain keys (`0.weight`, not
    `_orig_mod.0.weight`): its checkpoints load into the uncompiled module and back"."""
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    plain = seeded_mlp()
    compiled = torch.compile(plain, backend="eager")
    lamploop.fit(
        model=lamploop.SupervisedModel(compiled),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=1,
        checkpoint_dir=tmp_path,
        reporters=[],
    )
    tensors = load_file(tmp_path / "epoch-000001" / "model.safetensors")
    assert set(tensors) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    fresh = seeded_mlp(seed=9)
    fresh.load_state_dict(tensors)
    assert_bitwise(fresh, plain)

    # and back: the checkpoint resumes into the compiled module of a new run
    again = torch.compile(seeded_mlp(seed=9), backend="eager")
    state = lamploop.fit(
        model=lamploop.SupervisedModel(again),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=1,
        checkpoint_dir=tmp_path,
        reporters=[],
    )
    assert state.epoch == 1
    for name, tensor in plain.state_dict().items():
        assert torch.equal(again._orig_mod.state_dict()[name], tensor), name
