"""Mixed precision: bf16 and fp16 autocast (fp16 with a dynamic loss scale) on real data.

The digits set (scikit-learn's, 1,797 8x8 images) trains an MLP to about 0.97 validation
accuracy in float32; bf16 and fp16 must reach it within one point.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch
from sklearn.datasets import load_digits

import lamploop
from lamploop.checkpoint import load_checkpoint
from lamploop.errors import ConfigurationError
from lamploop.loop.precision import LOSS_SCALE_KEY, LossScale
from lamploop.metrics import accuracy

EPOCHS = 6


def _digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    x, y = load_digits(return_X_y=True)
    features = torch.tensor(x / 16.0, dtype=torch.float32)
    target = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(target), generator=torch.Generator().manual_seed(0))
    train, valid = order[:1400], order[1400:]
    return (features[train], target[train]), (features[valid], target[valid])


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _accuracy(precision: str) -> float:
    (x, y), (xv, yv) = _digits()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(_module(), metrics={"accuracy": accuracy}),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=3e-3),
        train_batches=lamploop.tensor_batches(x, y, batch_size=32),
        validation_batches=lamploop.tensor_batches(xv, yv, batch_size=128, shuffle=False),
        max_epochs=EPOCHS,
        precision=precision,  # type: ignore[arg-type]
        reporters=[],
    )
    assert state is not None
    return state.learning_curve[-1].validation_metrics["accuracy"][1]


@pytest.mark.timeout(120)
def test_bf16_and_fp16_reach_fp32_accuracy_on_digits() -> None:
    full = _accuracy("32")
    assert full > 0.93
    for precision in ("bf16", "fp16"):
        assert _accuracy(precision) >= full - 0.01, precision


@pytest.mark.anyio
async def test_autocast_runs_the_forward_in_the_lower_precision() -> None:
    seen: list[torch.dtype] = []
    module = _module()
    module[0].register_forward_hook(lambda _, __, out: seen.append(out.dtype))
    (x, y), _ = _digits()

    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        yield x[:16], y[:16]

    for precision in ("32", "bf16", "fp16"):
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module), batches=batches(), forward_only=True, precision=precision
        )
    assert seen == [torch.float32, torch.bfloat16, torch.float16]
    assert all(p.dtype == torch.float32 for p in module.parameters())  # the parameters keep theirs


@pytest.mark.anyio
async def test_fp16_skips_overflowing_steps_and_backs_off_the_scale() -> None:
    (x, y), _ = _digits()
    module = _module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    steps: list[int] = []

    def step() -> None:
        steps.append(1)
        optimizer.step()

    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, 640, 32):
            yield x[i : i + 32], y[i : i + 32]

    scale = LossScale(scale=2.0**40)  # float16 overflows at 65504: the first steps must overflow
    await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module),
        batches=batches(),
        step_optimizer=step,
        precision="fp16",
        loss_scale=scale,
    )
    assert scale.skipped_steps > 0
    assert scale.scale == 2.0 ** (40 - scale.skipped_steps)
    assert len(steps) == 20 - scale.skipped_steps
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_fp16_on_two_ranks_keeps_them_equal_and_refuses_reduce_to_root() -> None:
    (x, y), _ = _digits()
    train = lamploop.tensor_batches(x[:512], y[:512], batch_size=32)
    modules = [_module(), _module()]
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, None) for m in modules],
            lambda params: torch.optim.Adam(params, lr=1e-3),
            2,
            strategy="all_reduce",
            precision="fp16",
        )
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(
        ConfigurationError, match="precision='fp16' needs a strategy that steps on every rank"
    ):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, None) for m in modules],
            lambda params: torch.optim.Adam(params, lr=1e-3),
            1,
            strategy="reduce_to_root",
            precision="fp16",
        )


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(
        ConfigurationError, match=r"precision must be one of \('32', 'bf16', 'fp16'\), got 'fp8'"
    ):
        lamploop.settings.TrainingSettings(precision="fp8")  # type: ignore[arg-type]


def test_the_fp16_loss_scale_is_checkpointed_and_a_resume_ends_alike(tmp_path: Path) -> None:
    (x, y), _ = _digits()

    def run(max_epochs: int, checkpoint_dir: Path | None) -> torch.nn.Module:
        module = _module()
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3),
            train_batches=lamploop.tensor_batches(x[:320], y[:320], batch_size=32),
            max_epochs=max_epochs,
            precision="fp16",
            checkpoint_dir=checkpoint_dir,
            reporters=[],
        )
        return module

    straight = run(3, None)
    run(1, tmp_path)
    saved = load_checkpoint(tmp_path).state.optimizer[LOSS_SCALE_KEY]
    assert saved == {"scale": 2.0**16, "good_steps": 10, "skipped_steps": 0}
    resumed = run(3, tmp_path)
    assert load_checkpoint(tmp_path).state.optimizer[LOSS_SCALE_KEY]["good_steps"] == 30
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
