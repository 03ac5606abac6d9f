"""Acceptance tests written from the documentation alone: the concept pages and their neighbours.

Pages: docs/getting-started.md, docs/coming-from-lightning.md, docs/concepts/batch-streams.md,
docs/concepts/schedules.md, docs/distributed.md (with DESIGN.md for context) and the public
docstrings those pages link to.  Each test quotes the sentence it checks.

Every number is compared with a reference written here: a hand-written float64 PyTorch loop
(one optimizer step per step, its gradient the mean over every example of the step on every
rank), schedule formulas typed from the docs' tables, and, for several processes, PyTorch's own
``DistributedDataParallel`` (with ``Join`` for uneven inputs) in two processes of its own.  Ranks
are real ``torch.distributed`` Gloo process groups: threads of this process
(``local_data_parallel_training_loop``, ``local_control``) or processes started by
``fit(world_size=2)`` itself on 127.0.0.1.  What crosses a process is JSON.  Every wait is
bounded (subprocess timeouts, ``anyio.fail_after``, pytest-timeout).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import tomllib
import torch
import torch.nn.functional as F
from support import ROOT, free_port

import lamploop
from lamploop import BatchContext
from lamploop.control import local_control
from lamploop.distributed import (
    drive_distributed_training,
    follow_distributed_training,
    local_data_parallel_training_loop,
)
from lamploop.distributed.launch import launch_env
from lamploop.errors import BatchError, CheckpointError, ConfigurationError, DistributedError
from lamploop.schedules import warmup_cosine, warmup_linear

# ---------------------------------------------------------------------------------------------
# helpers


def sgd(lr: float, **keywords: Any):
    return lambda params: torch.optim.SGD(params, lr=lr, **keywords)


def seeded(make, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return make().double()


def linear_3_1() -> torch.nn.Module:
    return torch.nn.Linear(3, 1)


def planned_factory(x: torch.Tensor, y: torch.Tensor, plan: dict[int, list[slice]]):
    """A batch factory whose rank ``r`` yields ``x[s], y[s]`` for each slice of ``plan[r]``."""

    def factory(context: BatchContext):
        async def stream():
            for part in plan[context.rank]:
                yield x[part], y[part]

        return stream()

    return factory


def cut(sizes: dict[int, list[int]]) -> dict[int, list[slice]]:
    """Consecutive slices of the given sizes, rank 0's first."""
    plan: dict[int, list[slice]] = {}
    start = 0
    for rank in sorted(sizes):
        plan[rank] = []
        for size in sizes[rank]:
            plan[rank].append(slice(start, start + size))
            start += size
    return plan


def step_parts(plan: dict[int, list[slice]], step: int, k: int) -> list[slice]:
    """The slices of optimizer step ``step`` with ``k`` accumulated batches per rank."""
    return [part for rank in sorted(plan) for part in plan[rank][step * k : (step + 1) * k]]


def steps_in(plan: dict[int, list[slice]], k: int) -> int:
    return max(math.ceil(len(parts) / k) for parts in plan.values())


def run_local(replicas, optimizer_factory, max_epochs: int, **keywords: Any) -> lamploop.LoopState:
    async def go() -> lamploop.LoopState:
        with anyio.fail_after(60):
            return await local_data_parallel_training_loop(
                replicas, optimizer_factory, max_epochs, **keywords
            )

    return anyio.run(go)


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def assert_same_params(got: torch.nn.Module | dict, expected: torch.nn.Module | dict, tol: float) -> None:
    got_d = got if isinstance(got, dict) else params_of(got)
    expected_d = expected if isinstance(expected, dict) else params_of(expected)
    assert got_d.keys() == expected_d.keys()
    for name in got_d:
        torch.testing.assert_close(
            got_d[name].double(),
            expected_d[name].double(),
            rtol=tol,
            atol=tol,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def smooth(raws: list[float], a: float) -> list[float]:
    """DESIGN.md: ``smoothed = raw * a + previous_smoothed * (1 - a)``, previous defaulting to raw."""
    out: list[float] = []
    for value in raws:
        out.append(value if not out else value * a + out[-1] * (1 - a))
    return out


def strict_argmin(values: list[float]) -> int:
    """The first epoch whose value is strictly below every earlier one and is the minimum."""
    best = 0
    for index, value in enumerate(values):
        if value < values[best]:
            best = index
    return best


def plateau_reference(
    losses: list[float | None],
    *,
    start_factor: float = 1.0,
    reduce_factor: float = 0.5,
    patience: int = 10,
    threshold: float = 1e-4,
    min_factor: float = 0.0,
) -> list[float]:
    """docs/loop.md's rule: "multiplied by `reduce_factor` after more than `patience` validations
    without `v < best - threshold * abs(best)`; floored at `min_factor`"; the docstring: "the count
    restarts"."""
    factor, best, bad = start_factor, None, 0
    factors = []
    for value in losses:
        if value is not None:
            if best is None or value < best - threshold * abs(best):
                best, bad = value, 0
            else:
                bad += 1
                if bad > patience:
                    factor, bad = max(factor * reduce_factor, min_factor), 0
        factors.append(factor)
    return factors


class RecordingSchedule:
    """Wraps a schedule and records every question it is asked."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked: list[tuple[int, Any, float | None]] = []
        self.needs_validation_loss = getattr(inner, "needs_validation_loss", False)
        if hasattr(inner, "state_type"):
            self.state_type = inner.state_type

    def init(self) -> Any:
        return self.inner.init()

    def learning_rate_factor(self, state: Any, epoch: int, last_validation_loss: float | None):
        self.asked.append((epoch, state, last_validation_loss))
        return self.inner.learning_rate_factor(state, epoch, last_validation_loss)


class RecordingSGD(torch.optim.SGD):
    """An SGD that records every param group's rate as each ``step()`` runs."""

    rates: list[list[float]]

    def step(self, closure=None):
        self.rates.append([group["lr"] for group in self.param_groups])
        return super().step(closure)


def recording_sgd(rates: list[list[float]], **keywords: Any):
    def factory(params):
        optimizer = RecordingSGD(params, **keywords)
        optimizer.rates = rates
        return optimizer

    return factory


def run_bounded(commands: list[list[str]], *, timeout: float, env: dict[str, str], cwd: Path) -> list[dict]:
    """Start every command, wait for all of them within ``timeout`` s; kill the rest after."""
    processes = [
        subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            results.append({"rc": process.returncode, "stdout": stdout, "stderr": stderr})
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    return results


def clean_env() -> dict[str, str]:
    """This environment without any launcher's variables (no torchrun, Slurm or lamploop rank)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC")
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SLURM_", "LAMPLOOP_", *launcher))
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


# =============================================================================================
# getting-started.md


def test_first_fit_returns_the_loop_state_of_a_float64_reference() -> None:
    """getting-started.md: "`fit` returns the final LoopState: the next epoch to run, the learning
    curve (per epoch: the training loss and the validation loss as `(smoothed, raw)`), and the
    best epoch. When training ends, `module` holds the weights of the best validation epoch
    (every epoch is eligible by default"."""
    torch.manual_seed(0)
    x = torch.randn(240, 8, dtype=torch.float64)
    y = (x[:, 0] + x[:, 1] > 0).long()

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    module = seeded(make, 3)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=5e-2),
        train_batches=lamploop.tensor_batches(x[:192], y[:192], batch_size=32, shuffle=False),
        validation_batches=lamploop.tensor_batches(x[192:], y[192:], batch_size=48, shuffle=False),
        max_epochs=6,
        validation_loss_exponential_smoothing_factor=0.5,
        reporters=[],
    )

    reference = seeded(make, 3)
    optimizer = torch.optim.Adam(reference.parameters(), lr=5e-2)
    training, raws, snapshots = [], [], []
    for _ in range(6):
        total = 0.0
        for start in range(0, 192, 32):
            xs, ys = x[start : start + 32], y[start : start + 32]
            optimizer.zero_grad()
            loss = F.cross_entropy(reference(xs), ys)
            total += loss.item() * len(ys)
            loss.backward()
            optimizer.step()
        training.append(total / 192)
        with torch.no_grad():
            raws.append(F.cross_entropy(reference(x[192:]), y[192:]).item())
        snapshots.append(params_of(reference))
    smoothed = smooth(raws, 0.5)

    assert isinstance(state, lamploop.LoopState)
    assert state.epoch == 6
    assert [entry.epoch for entry in state.learning_curve] == list(range(6))
    for entry, train_loss, smooth_loss, raw_loss in zip(
        state.learning_curve, training, smoothed, raws, strict=True
    ):
        assert entry.training_loss == pytest.approx(train_loss, rel=1e-9)
        assert entry.validation_loss[0] == pytest.approx(smooth_loss, rel=1e-9)
        assert entry.validation_loss[1] == pytest.approx(raw_loss, rel=1e-9)
    best = strict_argmin(smoothed)
    assert state.min_validation_epoch == best
    assert state.min_validation_loss == pytest.approx(smoothed[best], rel=1e-9)
    assert state.last_validation_loss == pytest.approx(smoothed[-1], rel=1e-9)
    assert_same_params(module, snapshots[best], 1e-9)


def test_losses_return_sums_and_counts_float64() -> None:
    """getting-started.md: "a loss that returns `(loss sum, example count)` for a batch:
    `cross_entropy_loss` (the default) and `mse_loss` do, and `lamploop.summed(F.l1_loss)` makes
    one of any PyTorch loss that takes `reduction="sum"`"."""
    generator = torch.Generator().manual_seed(5)
    output = torch.randn(7, 3, generator=generator, dtype=torch.float64)
    target = torch.randn(7, 3, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (7,), generator=generator)

    loss_sum, count = lamploop.summed(F.l1_loss)(output, target)
    assert count == 7
    assert float(loss_sum) == pytest.approx((output - target).abs().sum().item(), rel=1e-12)
    loss_sum, count = lamploop.summed(F.smooth_l1_loss)(output, target)
    assert count == 7
    assert float(loss_sum) == pytest.approx(F.smooth_l1_loss(output, target, reduction="sum").item())

    loss_sum, count = lamploop.mse_loss(output[:, :1], target[:, :1])
    assert count == 7
    assert float(loss_sum) == pytest.approx(((output[:, 0] - target[:, 0]) ** 2).sum().item(), rel=1e-12)

    loss_sum, count = lamploop.cross_entropy_loss(output, labels)
    assert count == 7
    by_hand = -torch.log_softmax(output, dim=1)[torch.arange(7), labels].sum().item()
    assert float(loss_sum) == pytest.approx(by_hand, rel=1e-12)

    # "SupervisedModel(module, loss) ... cross_entropy_loss (the default)"
    module = torch.nn.Linear(3, 3).double()
    default = lamploop.SupervisedModel(module)
    assert float(default.loss(output, labels)[0]) == pytest.approx(by_hand, rel=1e-12)


def _checkpointed_run(directory: Path, max_epochs: int, *, resume: bool = True, epochs_asked=None):
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.randint(0, 2, (96,), generator=torch.Generator().manual_seed(2))
    inner = lamploop.tensor_batches(x, y, batch_size=16)

    def train_batches(context: BatchContext):
        if epochs_asked is not None:
            epochs_asked.append(context.epoch)
        return inner(context)

    module = seeded(
        lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)), 0
    )
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.1, momentum=0.9),
        train_batches=train_batches,
        max_epochs=max_epochs,
        checkpoint_dir=directory,
        resume=resume,
        reporters=[],
    )
    return state, module


def test_checkpoints_keep_the_last_three_safetensors_and_json_and_resume_exactly(tmp_path: Path) -> None:
    """getting-started.md: "With `checkpoint_dir`, `fit` writes a checkpoint after every epoch
    (keeping the last `keep_last=3`) and, when called again, resumes from the latest one";
    "`tensor_batches` ... shuffled by a seeded generator, so that a resumed run sees the same
    batches"; coming-from-lightning.md: "`checkpoint_dir=...`, `resume=True` (the default) |
    safetensors + JSON, no pickle"."""
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir, 2)
    asked: list[int] = []
    resumed, resumed_module = _checkpointed_run(run_dir, 5, epochs_asked=asked)
    assert asked == [2, 3, 4]
    assert resumed.epoch == 5
    kept = sorted(path.name for path in run_dir.iterdir() if path.is_dir())
    assert kept == ["epoch-000003", "epoch-000004", "epoch-000005"]
    assert lamploop.latest_checkpoint(run_dir).name == "epoch-000005"
    for checkpoint in run_dir.iterdir():
        if checkpoint.is_dir():
            suffixes = {path.suffix for path in checkpoint.rglob("*") if path.is_file()}
            assert suffixes <= {".json", ".safetensors"}, (checkpoint.name, suffixes)

    straight, straight_module = _checkpointed_run(tmp_path / "straight", 5)
    assert resumed.learning_curve == straight.learning_curve
    for name, tensor in straight_module.state_dict().items():
        assert torch.equal(resumed_module.state_dict()[name], tensor), name

    # resume=False starts over: every epoch again, from epoch 0
    asked.clear()
    again, _ = _checkpointed_run(run_dir, 2, resume=False, epochs_asked=asked)
    assert asked == [0, 1]
    assert again.learning_curve == straight.learning_curve[:2]


def test_a_flipped_byte_is_caught_by_the_sha256_check(tmp_path: Path) -> None:
    """coming-from-lightning.md: "**No pickle.** Checkpoints are safetensors and JSON, checked by
    sha256 on load"; load_checkpoint: "CheckpointError: the message starts with the file at
    fault"."""
    _checkpointed_run(tmp_path, 1)
    checkpoint = lamploop.latest_checkpoint(tmp_path)
    assert lamploop.load_checkpoint(checkpoint).state.loop_state.epoch == 1
    tensors = sorted(checkpoint.rglob("*.safetensors"))
    assert tensors
    victim = tensors[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as caught:
        lamploop.load_checkpoint(checkpoint)
    assert victim.name in str(caught.value), str(caught.value)


def test_the_default_reporter_prints_the_summary_and_one_line_per_epoch(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """getting-started.md: "By default a `LoggingReporter` prints one line per epoch";
    coming-from-lightning.md: "`lamploop.summarize(module)`; printed at the start of every
    `fit`"."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    parameters = 4 * 5 + 5 + 5 * 2 + 2
    assert lamploop.summarize(module).total_parameters == parameters
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    # the LoggingReporter is the default where stderr is not a terminal (else progress bars)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO):
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=8),
            validation_batches=lamploop.tensor_batches(x, y, batch_size=32),
            max_epochs=3,
        )
    messages = [record.getMessage() for record in caplog.records]
    for epoch in range(3):
        lines = [m for m in messages if re.search(rf"\bepoch {epoch}\b", m) and "loss" in m]
        assert len(lines) == 1, (epoch, messages)
    assert any(re.search(rf"\b{parameters} param", m) for m in messages), messages


def test_import_lamploop_needs_no_extra_and_the_requirements_are_as_documented() -> None:
    """getting-started.md: "lamploop needs Python 3.10 or later and PyTorch 2.2 or later";
    "The extras add optional dependencies; `import lamploop` needs none of them"; the table of
    extras (`demo`, `progress`, `tensorboard`, `prometheus`, `plot`, `reporters` "installs all
    four", `test`, `lint`, `docs`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"].replace(" ", "") == ">=3.10"
    assert any(re.fullmatch(r"torch>=2\.2", req.replace(" ", "")) for req in project["dependencies"])
    extras = project["optional-dependencies"]
    for name in (
        "demo",
        "progress",
        "tensorboard",
        "prometheus",
        "plot",
        "reporters",
        "test",
        "lint",
        "docs",
    ):
        assert name in extras, name
    for name in ("progress", "tensorboard", "prometheus", "plot"):
        assert set(extras[name]) <= set(extras["reporters"]), name

    blocked = ["sklearn", "rich", "tensorboard", "prometheus_client", "matplotlib", "mlflow", "wandb"]
    script = textwrap.dedent(
        f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None  # an import of it raises ImportError
        import lamploop
        import lamploop.distributed, lamploop.schedules, lamploop.batches
        print("imported", lamploop.fit.__name__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported fit" in result.stdout


# =============================================================================================
# coming-from-lightning.md


def test_early_stopping_patience_counts_validations_without_a_new_best() -> None:
    """coming-from-lightning.md: "`early_stopping_patience=3` | counts validations without a new
    best"."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    epochs_run: list[int] = []

    def train_batches(context: BatchContext):
        epochs_run.append(context.epoch)
        return lamploop.tensor_batches(x, y, batch_size=8)(context)

    # lr = 0: the validation loss never improves after epoch 0
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
        optimizer_factory=sgd(0.0),
        train_batches=train_batches,
        validation_batches=lamploop.tensor_batches(x, y, batch_size=16),
        validation_frequency=2,
        max_epochs=20,
        early_stopping_patience=3,
        reporters=[],
    )
    # validations at epochs 0 (best), 2, 4, 6: the third without a new best is epoch 6's
    assert state.epoch == 7
    assert epochs_run == list(range(7))
    assert state.min_validation_epoch == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
def test_clipping_uses_the_norm_of_the_gradient_over_every_rank_float64(strategy: str) -> None:
    """coming-from-lightning.md: "`max_gradient_norm=1.0` | the norm of the gradient summed over
    ranks"; distributed.md: "the gradient is exactly the mean over every example of the step on
    every rank"."""
    generator = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(40, 3, generator=generator, dtype=torch.float64)
    y = 5 * torch.randn(40, 1, generator=generator, dtype=torch.float64)
    plan = cut({0: [4, 5, 3], 1: [6, 7]})
    replicas = [
        (
            lamploop.SupervisedModel(seeded(linear_3_1, 1), lamploop.mse_loss),
            planned_factory(x, y, plan),
            None,
        )
        for _ in range(2)
    ]
    run_local(replicas, sgd(0.1), 2, max_gradient_norm=0.5, strategy=strategy)

    reference = seeded(linear_3_1, 1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    norms = []
    for _ in range(2):
        for step in range(steps_in(plan, 1)):
            parts = step_parts(plan, step, 1)
            xs, ys = torch.cat([x[p] for p in parts]), torch.cat([y[p] for p in parts])
            optimizer.zero_grad()
            F.mse_loss(reference(xs), ys).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item())
            optimizer.step()
    assert min(norms) > 0.5  # every step was clipped: a per-rank norm would give other weights
    assert_same_params(replicas[0][0].module, reference, 1e-10)


# =============================================================================================
# concepts/batch-streams.md


def test_a_stream_of_ones_own_trains_like_a_hand_written_loop() -> None:
    """concepts/batch-streams.md, "A stream of your own": the `noisy_line` factory (verbatim),
    "a factory is any callable `BatchContext -> async iterable`", called "once per epoch on every
    rank with a `BatchContext(epoch, rank, nranks)`"."""
    from lamploop.batches import epoch_seed

    contexts: list[BatchContext] = []

    def noisy_line(context: lamploop.BatchContext) -> lamploop.BatchStream:
        contexts.append(context)
        generator = torch.Generator().manual_seed(epoch_seed(7, context.epoch, context.rank))

        async def stream():
            for _ in range(4):
                x = torch.randn(16, 1, generator=generator, dtype=torch.float64)
                yield x, 3 * x + 0.1 * torch.randn(16, 1, generator=generator, dtype=torch.float64)

        return stream()

    module = seeded(lambda: torch.nn.Linear(1, 1), 0)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.mse_loss),
        optimizer_factory=sgd(0.1),
        train_batches=noisy_line,
        max_epochs=5,
        reporters=[],
    )
    assert [(c.epoch, c.rank, c.nranks) for c in contexts] == [(e, 0, 1) for e in range(5)]

    async def collect(stream):
        return [batch async for batch in stream]

    reference = seeded(lambda: torch.nn.Linear(1, 1), 0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for epoch in range(5):
        total = 0.0
        for x, y in anyio.run(collect, noisy_line(BatchContext(epoch=epoch))):
            optimizer.zero_grad()
            loss = F.mse_loss(reference(x), y)
            total += loss.item()
            loss.backward()
            optimizer.step()
        assert state.learning_curve[epoch].training_loss == pytest.approx(total / 4, rel=1e-10)
    assert_same_params(module, reference, 1e-12)
    assert abs(module.weight.item() - 3) < abs(seeded(lambda: torch.nn.Linear(1, 1), 0).weight.item() - 3)
    # "neighbouring epochs get unrelated streams"
    assert len({epoch_seed(7, e, r) for e in range(4) for r in range(3)}) == 12


def test_a_plain_generator_or_an_empty_batch_is_named_where_it_happens() -> None:
    """concepts/batch-streams.md: "A factory that returns a plain generator, or a batch with no
    examples, is named where it happens" (ConfigurationError pointing at iterable_batches; BatchError
    "epoch 0, batch 0: the batch is empty (0 examples)"), and `iterable_batches(plain)` is the
    fix."""
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))

    def plain(context):
        yield x, y

    async def empty_in_epoch_1_batch_2(context):
        for index in range(3):
            if context.epoch == 1 and index == 2:
                yield x[:0], y[:0]
            else:
                yield x, y

    def fit(**keywords):
        return lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            max_epochs=3,
            reporters=[],
            **keywords,
        )

    for keywords in (
        {"train_batches": plain},
        {"train_batches": lamploop.iterable_batches(plain), "validation_batches": plain},
    ):
        with pytest.raises(ConfigurationError) as caught:
            fit(**keywords)
        assert "generator" in str(caught.value)
        assert "iterable_batches" in str(caught.value)

    with pytest.raises(BatchError) as caught:
        fit(train_batches=empty_in_epoch_1_batch_2)
    assert "epoch 1, batch 2" in str(caught.value)
    assert "empty" in str(caught.value)

    assert fit(train_batches=lamploop.iterable_batches(plain)).epoch == 3


@pytest.mark.timeout(60)
def test_a_step_boundary_resume_skips_the_batches_already_trained_on(tmp_path: Path) -> None:
    """concepts/batch-streams.md: "A run resumed at epoch 5, or at step 120 of epoch 5, then sees
    exactly the batches the uninterrupted run saw (a step-boundary resume skips the batches
    already trained on)"."""
    x = torch.linspace(-1, 1, 48, dtype=torch.float64).unsqueeze(1)
    y = torch.randn(48, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    failing = {"on": True}

    def factory(context: BatchContext):
        async def stream():
            order = torch.randperm(48, generator=torch.Generator().manual_seed(100 + context.epoch))
            for index in range(6):
                if failing["on"] and context.epoch == 1 and index == 3:
                    msg = "the disk went away"
                    raise OSError(msg)
                part = order[index * 8 : (index + 1) * 8]
                yield x[part], y[part]

        return stream()

    def run(directory: Path, trained: list[float]):
        module = seeded(lambda: torch.nn.Linear(1, 1), 0)

        def hook(mod, inputs, output):
            if mod.training:
                trained.append(round(float(inputs[0].sum()), 9))

        module.register_forward_hook(hook)
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module, lamploop.mse_loss),
            optimizer_factory=sgd(0.1, momentum=0.9),
            train_batches=factory,
            max_epochs=3,
            checkpoint_dir=directory,
            checkpoint_every_n_steps=2,
            reporters=[],
        )
        return state, module

    with pytest.raises(Exception, match="the disk went away"):
        run(tmp_path / "run", [])
    assert lamploop.latest_checkpoint(tmp_path / "run").name == "epoch-000001-step-000002"
    failing["on"] = False
    resumed_batches: list[float] = []
    resumed, resumed_module = run(tmp_path / "run", resumed_batches)
    straight_batches: list[float] = []
    straight, straight_module = run(tmp_path / "straight", straight_batches)

    assert len(straight_batches) == 18
    assert resumed_batches == straight_batches[8:]  # epoch 1 from its batch 2 on, then epoch 2
    assert resumed.learning_curve == straight.learning_curve
    for name, tensor in straight_module.state_dict().items():
        assert torch.equal(resumed_module.state_dict()[name], tensor), name


@pytest.mark.timeout(60)
def test_a_rank_whose_stream_has_no_batch_at_all_takes_part_float64() -> None:
    """concepts/batch-streams.md: "ranks may have different numbers of batches (a rank that runs
    out takes part with zero examples until every rank has finished, so nothing hangs and
    nothing is dropped)"; "batch `i` goes to rank `i % nranks`" (with 3 ranks and 2 batches,
    rank 2 has none); coming-from-lightning.md: "uneven shares drop nothing"."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (8,), generator=generator)
    vx = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    vy = torch.randint(0, 2, (5,), generator=generator)
    train = lamploop.tensor_batches(x, y, batch_size=4, shuffle=False)
    valid = lamploop.tensor_batches(vx, vy, batch_size=2, shuffle=False)  # 2, 2, 1: one per rank

    def make() -> torch.nn.Module:
        return torch.nn.Linear(3, 2)

    replicas = [(lamploop.SupervisedModel(seeded(make, 1)), train, valid) for _ in range(3)]
    state = run_local(replicas, sgd(0.5), 2, return_min_validation_loss_model=())

    reference = seeded(make, 1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for epoch in range(2):
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        assert state.learning_curve[epoch].training_loss == pytest.approx(loss.item(), rel=1e-12)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            validation = F.cross_entropy(reference(vx), vy).item()
        assert state.learning_curve[epoch].validation_loss[1] == pytest.approx(validation, rel=1e-12)
    assert_same_params(replicas[0][0].module, reference, 1e-12)


# =============================================================================================
# concepts/schedules.md


def test_calling_a_schedule_by_hand_doc_example() -> None:
    """concepts/schedules.md, "Calling one by hand" (verbatim), with the printed state."""
    schedule = lamploop.reduce_lr_on_plateau(patience=1, reduce_factor=0.5)
    state = schedule.init()
    factors = []
    for epoch, validation_loss in enumerate([None, 1.0, 0.9, 0.95, 0.96, 0.97]):
        state, factor = schedule.learning_rate_factor(state, epoch, validation_loss)
        factors.append(factor)
    assert factors == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]
    assert str(state) == "PlateauState(factor=0.5, best=0.9, bad_validations=1)"
    assert schedule.learning_rate_factor(state, 6, 0.8) == schedule.learning_rate_factor(state, 6, 0.8)
    linear = lamploop.linear(start=1.0, end=0.0, max_steps=4)
    assert [linear.learning_rate_factor(None, e, None)[1] for e in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def _cyclic(max_factor: float, period: int):
    def factor(e: int) -> float:
        h = period / 2
        return 1 + (max_factor - 1) * (1 - abs(e % period - h) / h)

    return factor


@pytest.mark.parametrize(
    ("schedule", "formula"),
    [
        (lamploop.noop(), lambda e: 1.0),
        (lamploop.decrement(every=3, fraction=0.5), lambda e: 0.5 ** (e // 3)),
        (lamploop.decrement(every=1, fraction=0.9), lambda e: 0.9**e),
        (lamploop.linear(start=1.0, end=0.5, max_steps=4), lambda e: 1.0 - 0.5 * min(e, 4) / 4),
        (lamploop.linear(start=0.2, end=2.0, max_steps=3), lambda e: 0.2 + 1.8 * min(e, 3) / 3),
        (lamploop.linear(start=1.0, end=-1.0, max_steps=4), lambda e: 1.0 - 2.0 * min(e, 4) / 4),
        (lamploop.step_after(steps=3, factor=0.1), lambda e: 0.1 if e >= 3 else 1.0),
        (lamploop.step_after(steps=0, factor=2.0), lambda e: 2.0),
        (lamploop.cyclic(max_factor=3.0, period_length=4), _cyclic(3.0, 4)),
        (lamploop.cyclic(max_factor=3.0, period_length=5), _cyclic(3.0, 5)),
        (lamploop.cyclic(max_factor=0.5, period_length=6), _cyclic(0.5, 6)),
        (lamploop.from_epoch_count(lambda e: 1 / (1 + e)), lambda e: 1 / (1 + e)),
    ],
    ids=[
        "noop",
        "decrement_3_half",
        "decrement_1",
        "linear_down",
        "linear_up",
        "linear_below_zero",
        "step_after_3",
        "step_after_0",
        "cyclic_4",
        "cyclic_5_odd",
        "cyclic_below_one",
        "from_epoch_count",
    ],
)
def test_built_in_schedules_follow_the_table(schedule: Any, formula) -> None:
    """concepts/schedules.md, the table of built-in schedules, with docs/loop.md's formulas:
    `decrement`: `fraction ** (e // every)`; `linear`: `start + (end - start) * min(e, max_steps)
    / max_steps`; `step_after`: "1, then `factor` from epoch `steps` on"; `cyclic`: "a triangle
    between 1 and `max_factor`", `1 + (max_factor - 1) * (1 - abs(p - h) / h)`;
    `from_epoch_count(f)`: `f(e)`; "Calling it twice with the same arguments gives the same
    answer"."""
    state = schedule.init()
    for epoch in range(13):
        next_state, factor = schedule.learning_rate_factor(state, epoch, None)
        assert factor == pytest.approx(formula(epoch), rel=1e-12, abs=1e-12), epoch
        assert schedule.learning_rate_factor(state, epoch, None) == (next_state, factor)
        state = next_state


@pytest.mark.parametrize(
    "keywords",
    [
        {"patience": 0},
        {"patience": 2, "threshold": 0.05},
        {"patience": 1, "reduce_factor": 0.3, "min_factor": 0.05},
        {"patience": 0, "start_factor": 0.8, "threshold": 0.1, "min_factor": 0.2},
        {},
    ],
    ids=["patience0", "threshold", "min_factor", "start_factor_negative_losses", "defaults"],
)
def test_reduce_lr_on_plateau_follows_the_documented_rule(keywords: dict) -> None:
    """docs/loop.md (linked from the table): "multiplied by `reduce_factor` after more than
    `patience` validations without `v < best - threshold * abs(best)`; floored at `min_factor`";
    the docstring: "the count restarts"; "it never reaches 0 by itself, so this schedule does
    not stop training"."""
    rng = random.Random(str(sorted(keywords.items())))
    negative = "start_factor" in keywords
    for _ in range(20):
        losses: list[float | None] = [None]
        value = -1.0 if negative else 1.0
        for _ in range(40):
            value += rng.uniform(-0.12, 0.08) * (1 if not negative else -1) * rng.choice([1, -1, 1])
            losses.append(value if rng.random() > 0.1 else None)
        expected = plateau_reference(losses, **keywords)
        schedule = lamploop.reduce_lr_on_plateau(**keywords)
        state = schedule.init()
        got = []
        for epoch, loss in enumerate(losses):
            state, factor = schedule.learning_rate_factor(state, epoch, loss)
            got.append(factor)
        assert got == pytest.approx(expected, rel=1e-12), (losses, got, expected)
        assert min(got) > 0


def test_a_schedule_of_ones_own_doc_example(tmp_path: Path) -> None:
    """concepts/schedules.md, "A schedule of your own" (verbatim): "the state travels through the
    checkpoint as JSON and comes back typed"."""

    @attrs.frozen
    class WarmupState:
        best: float | None = None
        factor: float = 1.0

    @attrs.frozen
    class WarmupThenHalve:
        warmup: int
        needs_validation_loss = True

        def init(self) -> WarmupState:
            return WarmupState()

        def learning_rate_factor(self, state, epoch, last_validation_loss):
            if epoch < self.warmup:
                return state, (epoch + 1) / self.warmup
            if last_validation_loss is None:
                return state, state.factor
            if state.best is not None and last_validation_loss > state.best:
                state = attrs.evolve(state, factor=state.factor / 2)
            best = last_validation_loss if state.best is None else min(state.best, last_validation_loss)
            return attrs.evolve(state, best=best), state.factor

    schedule = WarmupThenHalve(warmup=2)
    state = schedule.init()
    factors = []
    for epoch, loss in enumerate([None, 1.0, 0.8, 0.9, 0.7]):
        state, factor = schedule.learning_rate_factor(state, epoch, loss)
        factors.append(factor)
    assert factors == [0.5, 1.0, 1.0, 0.5, 0.5]
    assert state == WarmupState(best=0.7, factor=0.5)

    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=64, shuffle=False),
        max_epochs=3,
        learning_rate_schedule=schedule,
        checkpoint_dir=tmp_path,
        reporters=[],
    )
    checkpoint = lamploop.load_checkpoint(tmp_path, schedule=schedule)
    assert isinstance(checkpoint.schedule_state, WarmupState)
    factors = [entry.learning_rate_factor for entry in checkpoint.state.loop_state.learning_curve]
    assert factors[:2] == [0.5, 1.0]

    # "Give it needs_validation_loss = True if it reads the loss (the loop then checks there is a
    # validation stream)"
    with pytest.raises(ConfigurationError, match="WarmupThenHalve"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=16),
            max_epochs=3,
            learning_rate_schedule=schedule,
            reporters=[],
        )


@attrs.frozen
class _CountState:
    calls: int = 0
    last: float | None = None


class _Counting:
    """A plain class (no attrs, no needs_validation_loss) whose init() is None but whose states
    are `_CountState`s: read back through its `state_type`."""

    state_type = _CountState

    def init(self) -> None:
        return None

    def learning_rate_factor(self, state, epoch, last_validation_loss):
        calls = 0 if state is None else state.calls
        return _CountState(calls=calls + 1, last=last_validation_loss), 1.0 / (1 + calls)


def test_state_type_reads_the_state_back_and_a_resumed_run_asks_what_the_uninterrupted_one_asked(
    tmp_path: Path,
) -> None:
    """concepts/schedules.md: "Any object with `init` and `learning_rate_factor` will do"; "it is
    read back as the type of `init()`'s value (or of a `state_type` attribute, if the schedule
    has one)"; "a checkpoint stores the state as JSON, and a resumed run asks the schedule
    exactly what the uninterrupted run asked"; "`epochs` asks for epoch `e`'s factor just
    before epoch `e` runs (and once more when it stops)"."""
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))

    def run(directory: Path, max_epochs: int, schedule: RecordingSchedule):
        module = seeded(lambda: torch.nn.Linear(4, 2), 0)
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=sgd(0.3),
            train_batches=lamploop.tensor_batches(x.double(), y, batch_size=8),
            validation_batches=lamploop.tensor_batches(x.double(), y, batch_size=32),
            max_epochs=max_epochs,
            learning_rate_schedule=schedule,
            validation_loss_exponential_smoothing_factor=0.5,
            checkpoint_dir=directory,
            reporters=[],
        )
        return state, module

    first = RecordingSchedule(_Counting())
    run(tmp_path / "run", 2, first)
    assert [asked[0] for asked in first.asked] == [0, 1, 2]  # once more when it stops
    checkpoint = lamploop.load_checkpoint(tmp_path / "run", schedule=_Counting())
    assert checkpoint.schedule_state == first.asked[2][1]
    assert isinstance(checkpoint.schedule_state, _CountState)

    second = RecordingSchedule(_Counting())
    resumed, resumed_module = run(tmp_path / "run", 4, second)
    straight_schedule = RecordingSchedule(_Counting())
    straight, straight_module = run(tmp_path / "straight", 4, straight_schedule)

    assert [asked[0] for asked in straight_schedule.asked] == [0, 1, 2, 3, 4]
    # the resumed run's questions are the uninterrupted run's from epoch 2 on
    assert second.asked == straight_schedule.asked[2:]
    assert first.asked[:2] == straight_schedule.asked[:2]
    smoothed = [entry.validation_loss[0] for entry in straight.learning_curve]
    assert [asked[2] for asked in straight_schedule.asked] == [None, *smoothed]
    assert [entry.learning_rate_factor for entry in straight.learning_curve] == [1, 1 / 2, 1 / 3, 1 / 4]
    assert resumed.learning_curve == straight.learning_curve
    for name, tensor in straight_module.state_dict().items():
        assert torch.equal(resumed_module.state_dict()[name], tensor), name


def test_the_factor_multiplies_every_param_groups_base_rate_float64() -> None:
    """concepts/schedules.md: "every param group's learning rate for that epoch is its base
    learning rate times the factor"; "**A factor <= 0 ends training**"; "with end=0, the factor
    of epoch 4 is 0: training stops after 4 epochs"; epochs asks "once more when it stops"."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(24, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (24,), generator=generator)

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))

    module = seeded(make, 7)
    rates: list[list[float]] = []

    def groups(params):
        params = list(params)
        optimizer = RecordingSGD(
            [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.1, momentum=0.5
        )
        optimizer.rates = rates
        return optimizer

    schedule = RecordingSchedule(lamploop.linear(start=1.0, end=0.0, max_steps=4))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=groups,
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
        max_epochs=10,
        learning_rate_schedule=schedule,
        reporters=[],
    )
    assert state.epoch == 4
    assert [asked[0] for asked in schedule.asked] == [0, 1, 2, 3, 4]
    factors = [1.0, 0.75, 0.5, 0.25]
    assert [entry.learning_rate_factor for entry in state.learning_curve] == factors
    expected_rates = [[0.1 * f, 0.02 * f] for f in factors for _ in range(3)]
    assert len(rates) == len(expected_rates)
    for got, expected in zip(rates, expected_rates, strict=True):
        assert got == pytest.approx(expected, rel=1e-12)

    reference = seeded(make, 7)
    params = list(reference.parameters())
    optimizer = torch.optim.SGD(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.1, momentum=0.5
    )
    for factor in factors:
        optimizer.param_groups[0]["lr"] = 0.1 * factor
        optimizer.param_groups[1]["lr"] = 0.02 * factor
        for start in range(0, 24, 8):
            optimizer.zero_grad()
            F.cross_entropy(reference(x[start : start + 8]), y[start : start + 8]).backward()
            optimizer.step()
    assert_same_params(module, reference, 1e-12)


@pytest.mark.parametrize(
    ("schedule", "epochs_run"),
    [
        (lamploop.decrement(every=2, fraction=0.0), 2),
        (lamploop.linear(start=0.0, end=1.0, max_steps=3), 0),
        (lamploop.step_after(steps=2, factor=-1.0), 2),
        (lamploop.from_epoch_count(lambda e: 1.0 if e < 3 else 0.0), 3),
        (lamploop.from_epoch_count(lambda e: 1), 5),
    ],
    ids=["decrement_to_zero", "linear_from_zero", "step_after_negative", "from_epoch_count_zero", "int_one"],
)
def test_a_factor_at_or_below_zero_ends_training_before_that_epoch(schedule: Any, epochs_run: int) -> None:
    """concepts/schedules.md: "**A factor <= 0 ends training**: that is how a schedule stops
    early"; getting-started.md: the state's `epoch` is "the next epoch to run"; fit: the model
    "ends holding ... the last one" (untouched when no epoch ran)."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    module = torch.nn.Linear(3, 2)
    before = params_of(module)
    asked: list[int] = []

    def train_batches(context: BatchContext):
        asked.append(context.epoch)
        return lamploop.tensor_batches(x, y, batch_size=8)(context)

    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.1),
        train_batches=train_batches,
        max_epochs=5,
        learning_rate_schedule=schedule,
        reporters=[],
    )
    assert state.epoch == epochs_run
    assert len(state.learning_curve) == epochs_run
    assert asked == list(range(epochs_run))
    unchanged = all(torch.equal(before[name], tensor) for name, tensor in module.state_dict().items())
    assert unchanged == (epochs_run == 0)


def test_a_schedule_that_reads_the_loss_is_refused_without_validation() -> None:
    """concepts/schedules.md: "`reduce_lr_on_plateau` reads the validation loss, so `epochs` (and
    `fit`) refuse to start without a validation stream; its `validation_frequency` must be the
    one `epochs` runs with"."""
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    batches = lamploop.tensor_batches(x, y, batch_size=8)
    started: list[int] = []

    def train_batches(context: BatchContext):
        started.append(context.epoch)
        return batches(context)

    cases = [
        ({"learning_rate_schedule": lamploop.reduce_lr_on_plateau()}, ["ReduceLrOnPlateau", "validation"]),
        (
            {
                "learning_rate_schedule": lamploop.reduce_lr_on_plateau(),
                "validation_batches": batches,
                "validation_frequency": 2,
            },
            ["validation_frequency"],
        ),
    ]
    for keywords, named in cases:
        with pytest.raises(ConfigurationError) as caught:
            lamploop.fit(
                model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
                optimizer_factory=sgd(0.1),
                train_batches=train_batches,
                max_epochs=2,
                reporters=[],
                **keywords,
            )
        for name in named:
            assert name in str(caught.value), str(caught.value)
    # agreeing frequencies are fine
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
        optimizer_factory=sgd(0.1),
        train_batches=train_batches,
        validation_batches=batches,
        validation_frequency=2,
        learning_rate_schedule=lamploop.reduce_lr_on_plateau(validation_frequency=2),
        max_epochs=2,
        reporters=[],
    )
    assert started == [0, 1]

    # and the drivers alike
    replicas = [(lamploop.SupervisedModel(torch.nn.Linear(2, 2)), train_batches, None) for _ in range(2)]
    with pytest.raises(ConfigurationError, match="validation"):
        run_local(replicas, sgd(0.1), 2, learning_rate_schedule=lamploop.reduce_lr_on_plateau())
    assert started == [0, 1]


@pytest.mark.timeout(60)
def test_a_plateau_schedule_over_two_ranks_reads_the_global_smoothed_validation_loss() -> None:
    """concepts/schedules.md: `reduce_lr_on_plateau` "reads the validation loss" and the factor
    multiplies the base learning rate; distributed.md: the root sends `Train(epoch, lr_factor)`;
    DESIGN.md: the validation loss is "the mean over all examples of all ranks", smoothed; the
    best model ends in the first replica."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(32, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.3 * torch.randn(
        32, 1, generator=generator, dtype=torch.float64
    )
    vx = torch.randn(11, 3, generator=generator, dtype=torch.float64)
    vy = vx @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    train_plan = cut({0: [5, 5, 6], 1: [8, 8]})
    valid_plan = cut({0: [3, 4], 1: [4]})
    replicas = [
        (
            lamploop.SupervisedModel(seeded(linear_3_1, 2 + rank), lamploop.mse_loss),
            planned_factory(x, y, train_plan),
            planned_factory(vx, vy, valid_plan),
        )
        for rank in range(2)
    ]
    schedule = lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5, threshold=0.0)
    base_lr, a, epochs = 0.9, 0.7, 7
    state = run_local(
        replicas,
        sgd(base_lr),
        epochs,
        learning_rate_schedule=schedule,
        validation_loss_exponential_smoothing_factor=a,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
    )

    reference = seeded(linear_3_1, 2)  # the root's initial weights
    optimizer = torch.optim.SGD(reference.parameters(), lr=base_lr)
    raws: list[float] = []
    factors: list[float] = []
    snapshots = []
    for epoch in range(epochs):
        factor = plateau_reference([None, *smooth(raws, a)], patience=0, threshold=0.0)[epoch]
        factors.append(factor)
        optimizer.param_groups[0]["lr"] = base_lr * factor
        for step in range(steps_in(train_plan, 1)):
            parts = step_parts(train_plan, step, 1)
            xs, ys = torch.cat([x[p] for p in parts]), torch.cat([y[p] for p in parts])
            optimizer.zero_grad()
            F.mse_loss(reference(xs), ys).backward()
            optimizer.step()
        with torch.no_grad():
            raws.append(F.mse_loss(reference(vx), vy).item())
        snapshots.append(params_of(reference))
    assert min(factors) < 1.0, "the reference never reduced the rate: the test would prove nothing"
    assert [entry.learning_rate_factor for entry in state.learning_curve] == pytest.approx(factors, rel=1e-12)
    for entry, raw, smoothed in zip(state.learning_curve, raws, smooth(raws, a), strict=True):
        assert entry.validation_loss[1] == pytest.approx(raw, rel=1e-9)
        assert entry.validation_loss[0] == pytest.approx(smoothed, rel=1e-9)
    best = strict_argmin(smooth(raws, a))
    assert state.min_validation_epoch == best
    assert_same_params(replicas[0][0].module, snapshots[best], 1e-9)


def test_step_schedules_doc_example_and_formulas() -> None:
    """concepts/schedules.md, "Per-step factors": `warmup_linear(warmup_steps=2, total_steps=6,
    steps_per_epoch=3)` gives `[0.5, 1.0, 1.0, 0.75, 0.5, 0.25]`; "they count
    `epoch * steps_per_epoch + step`"; `warmup_cosine`: "Linear warm-up, then a half cosine from
    1 down to `final` at `total_steps` (and after)"."""
    schedule = warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3)
    assert [round(schedule.factor(e, s), 3) for e in range(2) for s in range(3)] == [
        0.5,
        1.0,
        1.0,
        0.75,
        0.5,
        0.25,
    ]
    assert schedule.factor(2, 0) == pytest.approx(0.0, abs=1e-12)
    assert schedule.factor(5, 2) == pytest.approx(0.0, abs=1e-12)

    warmup, total, per_epoch, final = 3, 17, 4, 0.1
    cosine = warmup_cosine(warmup_steps=warmup, total_steps=total, steps_per_epoch=per_epoch, final=final)
    linear = warmup_linear(warmup_steps=warmup, total_steps=total, steps_per_epoch=per_epoch, final=final)
    for epoch in range(6):
        for step in range(per_epoch):
            g = epoch * per_epoch + step
            if g < warmup:
                expected_cos = expected_lin = (g + 1) / warmup
            else:
                progress = min(g - warmup, total - warmup) / (total - warmup)
                expected_cos = final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
                expected_lin = final + (1 - final) * (1 - progress)
            assert cosine.factor(epoch, step) == pytest.approx(expected_cos, rel=1e-9, abs=1e-12), g
            assert linear.factor(epoch, step) == pytest.approx(expected_lin, rel=1e-9, abs=1e-12), g

    with pytest.raises(ConfigurationError):
        warmup_linear(warmup_steps=7, total_steps=6, steps_per_epoch=3)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: lamploop.decrement(every=0, fraction=0.5), "every"),
        (lambda: lamploop.decrement(every=2, fraction=1.5), "fraction"),
        (lambda: lamploop.linear(start=math.nan, end=0.0, max_steps=3), "start"),
        (lambda: lamploop.linear(start=1.0, end=math.inf, max_steps=3), "end"),
        (lambda: lamploop.linear(start=1.0, end=0.0, max_steps=0), "max_steps"),
        (lambda: lamploop.step_after(steps=-1, factor=0.5), "steps"),
        (lambda: lamploop.cyclic(max_factor=0.0, period_length=4), "max_factor"),
        (lambda: lamploop.cyclic(max_factor=2.0, period_length=1), "period_length"),
        (lambda: lamploop.reduce_lr_on_plateau(patience=-1), "patience"),
        (lambda: lamploop.reduce_lr_on_plateau(reduce_factor=1.5), "reduce_factor"),
    ],
    ids=[
        "decrement_every",
        "decrement_fraction",
        "linear_start_nan",
        "linear_end_inf",
        "linear_max_steps",
        "step_after_negative",
        "cyclic_max_factor",
        "cyclic_period",
        "plateau_patience",
        "plateau_reduce_factor",
    ],
)
def test_a_schedule_out_of_range_is_a_configuration_error_naming_the_argument(make, named: str) -> None:
    """The API of the schedules the concept page tabulates: "Raises: ConfigurationError" naming the
    value out of range."""
    with pytest.raises(ConfigurationError) as caught:
        make()
    assert named in str(caught.value), str(caught.value)


# =============================================================================================
# distributed.md


@pytest.mark.timeout(60)
def test_local_data_parallel_doc_example_followers_start_from_the_roots_state() -> None:
    """distributed.md: the `local_data_parallel_training_loop` example (two `Linear(4, 2)` made one
    after the other, so with different weights); "followers always start from the root's
    state"; "The trained model ends in the *first* model"; "every rank builds its own
    process-group *object* over the store (never the global default group"; "Nobody sets
    `MASTER_ADDR`/`MASTER_PORT`"."""
    torch.manual_seed(0)
    x, y = torch.randn(128, 4, dtype=torch.float64), torch.randint(0, 2, (128,))
    batches = lamploop.tensor_batches(x, y, batch_size=16, shuffle=False)
    replicas = [
        (lamploop.SupervisedModel(torch.nn.Linear(4, 2).double()), batches, batches),
        (lamploop.SupervisedModel(torch.nn.Linear(4, 2).double()), batches, batches),
    ]
    first, second = replicas[0][0].module, replicas[1][0].module
    assert not torch.equal(first.weight, second.weight)
    initial = params_of(first)
    master = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    state = anyio.run(
        lambda: local_data_parallel_training_loop(
            replicas,
            lambda params: torch.optim.SGD(params, lr=0.1),
            2,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        )
    )
    assert state.epoch == 2
    assert state.min_validation_epoch is not None
    assert not torch.distributed.is_initialized()
    assert {name: os.environ.get(name) for name in master} == master

    reference = torch.nn.Linear(4, 2).double()
    reference.load_state_dict(initial)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    raws, snapshots = [], []
    for _ in range(2):
        # batch i is rank i % 2's: step s is batches 2s and 2s+1, examples 32s .. 32s+31
        for start in range(0, 128, 32):
            optimizer.zero_grad()
            F.cross_entropy(reference(x[start : start + 32]), y[start : start + 32]).backward()
            optimizer.step()
        with torch.no_grad():
            raws.append(F.cross_entropy(reference(x), y).item())
        snapshots.append(params_of(reference))
    assert [entry.validation_loss[1] for entry in state.learning_curve] == pytest.approx(raws, rel=1e-12)
    assert state.min_validation_epoch == strict_argmin(raws)
    assert_same_params(first, snapshots[state.min_validation_epoch], 1e-12)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("strategy", "tolerance"),
    [("all_reduce", 1e-12), ("reduce_to_root", 1e-12), ("all_reduce_bf16", 2e-2), ("all_reduce_fp16", 2e-3)],
)
@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
def test_uneven_steps_train_like_the_mean_over_every_example_of_the_step(
    strategy: str, tolerance: float, k: int
) -> None:
    """distributed.md: "a rank whose stream is exhausted keeps taking part with zero examples until
    the sum over ranks is zero, so uneven streams neither hang nor drop examples, and the
    gradient is exactly the mean over every example of the step on every rank"; the per-step
    count's correction: `expected` is "the previous step's count in the same pass, and `1` at a
    pass's first step", and every strategy that does not reduce linearly (fp16) "is handed the
    step's exact units" (steps of 8, 6, 6 and 4 examples, then 7, 8 and 6: the guess misses)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(40, 1, dtype=torch.float64, generator=generator)
    plan = cut({0: [2, 5, 3, 4], 1: [6, 1, 3]})
    replicas = [
        (
            lamploop.SupervisedModel(seeded(linear_3_1, 1), lamploop.mse_loss),
            planned_factory(x, y, plan),
            None,
        )
        for _ in range(2)
    ]
    state = run_local(
        replicas, sgd(0.1, momentum=0.9), 2, accumulate_gradient_over_n_batches=k, strategy=strategy
    )

    reference = seeded(linear_3_1, 1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        total, count = 0.0, 0
        for step in range(steps_in(plan, k)):
            parts = step_parts(plan, step, k)
            xs, ys = torch.cat([x[p] for p in parts]), torch.cat([y[p] for p in parts])
            optimizer.zero_grad()
            loss = F.mse_loss(reference(xs), ys, reduction="sum")
            total, count = total + loss.item(), count + len(ys)
            (loss / len(ys)).backward()
            optimizer.step()
        if tolerance < 1e-6:
            assert state.learning_curve[epoch].training_loss == pytest.approx(total / count, rel=1e-12)
    assert_same_params(replicas[0][0].module, reference, tolerance)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["all_reduce", "all_reduce_fp16"])
@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
def test_each_rank_backpropagates_its_loss_sum_over_the_documented_guess(strategy: str, k: int) -> None:
    """distributed.md: "Each rank backpropagates `loss_sum / expected`, with `expected` a guess of
    the step's global example count that every rank makes alike: the previous step's count in
    the same pass, and `1` at a pass's first step"; for a strategy that does not reduce linearly
    (fp16) the loop "backpropagates the last batch with the true count".  Seen by a hook on a
    parameter (lr = 0 keeps the weights, so each batch's gradient is computed here by hand)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(40, 1, dtype=torch.float64, generator=generator)
    plan = cut({0: [2, 5, 3, 4], 1: [6, 1, 3]})
    seen: dict[int, list[float]] = {0: [], 1: []}
    replicas = []
    for rank in range(2):
        module = seeded(linear_3_1, 1)
        module.bias.register_hook(lambda grad, rank=rank: seen[rank].append(grad.item()))
        replicas.append(
            (lamploop.SupervisedModel(module, lamploop.mse_loss), planned_factory(x, y, plan), None)
        )
    run_local(replicas, sgd(0.0), 1, accumulate_gradient_over_n_batches=k, strategy=strategy)

    reference = seeded(linear_3_1, 1)

    def bias_grad_of_sum(part: slice) -> float:
        reference.zero_grad()
        F.mse_loss(reference(x[part]), y[part], reduction="sum").backward()
        return reference.bias.grad.item()

    counts = [
        sum(part.stop - part.start for part in step_parts(plan, step, k)) for step in range(steps_in(plan, k))
    ]
    for rank in (0, 1):
        expected = []
        for index, part in enumerate(plan[rank]):
            step = index // k
            last_of_step = index % k == k - 1 or index == len(plan[rank]) - 1
            guess = 1 if step == 0 else counts[step - 1]
            divisor = counts[step] if (strategy == "all_reduce_fp16" and last_of_step) else guess
            expected.append(bias_grad_of_sum(part) / divisor)
        assert seen[rank] == pytest.approx(expected, rel=1e-9), (rank, seen[rank], expected)


@pytest.mark.timeout(60)
def test_buffers_are_averaged_at_a_step_boundary_that_checkpoints() -> None:
    """distributed.md: buffers "are made alike on every rank at the end of each training pass and
    at every step boundary that checkpoints or stops: floating buffers become their mean over
    the ranks"; "checkpoints every N steps are: both runs average there"."""
    generator = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(40, 3, dtype=torch.float64, generator=generator) + 1
    y = torch.randn(40, 1, dtype=torch.float64, generator=generator)
    plan = cut({0: [4, 5, 3, 4], 1: [6, 7, 2]})
    factory = planned_factory(x, y, plan)

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))

    models = [lamploop.SupervisedModel(seeded(make, seed), lamploop.mse_loss) for seed in (1, 2)]
    saved: list[tuple[int, int, torch.Tensor]] = []

    async def position(state, schedule_state, where, rank_rngs) -> None:
        saved.append((where.epoch, where.steps_done, state.model["0.running_mean"].clone()))

    async def at_epoch_end(state, schedule_state) -> None:
        return None

    async def go() -> None:
        with anyio.fail_after(60):
            root, (follower,) = local_control(2)

            async def follow() -> None:
                async with follower:
                    await follow_distributed_training(
                        rank=1,
                        nranks=2,
                        device="cpu",
                        control=follower,
                        model=models[1],
                        train_batches=factory,
                        validation_batches=None,
                        optimizer_factory=sgd(0.1),
                    )

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(follow)
                async with root:
                    await drive_distributed_training(
                        nranks=2,
                        device="cpu",
                        control=root,
                        model=models[0],
                        optimizer_factory=sgd(0.1),
                        train_batches=factory,
                        validation_batches=None,
                        max_epochs=1,
                        checkpoint_state=at_epoch_end,
                        checkpoint_position=position,
                        checkpoint_every_n_steps=2,
                    )

    anyio.run(go)

    def running(
        mean: torch.Tensor, var: torch.Tensor, parts: list[slice]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = torch.nn.BatchNorm1d(3).double()
        norm.running_mean.copy_(mean)
        norm.running_var.copy_(var)
        for part in parts:
            norm(x[part])
        return norm.running_mean.clone(), norm.running_var.clone()

    start = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    halves = [running(*start, plan[rank][:2]) for rank in (0, 1)]
    at_step_2 = ((halves[0][0] + halves[1][0]) / 2, (halves[0][1] + halves[1][1]) / 2)
    ends = [running(*at_step_2, plan[rank][2:]) for rank in (0, 1)]
    at_end = (ends[0][0] + ends[1][0]) / 2

    step_2 = [mean for epoch, steps, mean in saved if (epoch, steps) == (0, 2)]
    assert len(step_2) == 1, saved
    torch.testing.assert_close(step_2[0], at_step_2[0], rtol=1e-12, atol=1e-12)
    for model in models:
        torch.testing.assert_close(model.module[0].running_mean, at_end, rtol=1e-12, atol=1e-12)


class _RecordingRoot:
    """A control root that records every command the driver broadcasts (and delegates the rest)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: list[Any] = []

    async def __aenter__(self) -> _RecordingRoot:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self.inner.__aexit__(*exc_info)

    async def broadcast(self, command: Any) -> Any:
        self.sent.append(command)
        return await self.inner.broadcast(command)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.timeout(60)
def test_the_control_channel_carries_one_command_per_epoch() -> None:
    """distributed.md: the control channel "carries the rendezvous and one command per epoch:
    `Train(epoch, lr_factor)`, `Valid(epoch)`, `Stop(reason)`"; "One epoch's messages": Train,
    then Valid, and Stop "after the last epoch"; the factor is the schedule's."""
    from lamploop.control import Stop, Train, Valid

    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    batches = lamploop.tensor_batches(x, y, batch_size=4)

    async def go() -> list[Any]:
        with anyio.fail_after(60):
            root, (follower,) = local_control(2)
            recording = _RecordingRoot(root)

            async def follow() -> None:
                async with follower:
                    await follow_distributed_training(
                        rank=1,
                        nranks=2,
                        device="cpu",
                        control=follower,
                        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
                        train_batches=batches,
                        validation_batches=batches,
                        optimizer_factory=sgd(0.1),
                    )

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(follow)
                async with recording:
                    await drive_distributed_training(
                        nranks=2,
                        device="cpu",
                        control=recording,
                        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
                        optimizer_factory=sgd(0.1),
                        train_batches=batches,
                        validation_batches=batches,
                        max_epochs=4,
                        validation_frequency=2,
                        learning_rate_schedule=lamploop.linear(start=1.0, end=0.5, max_steps=2),
                    )
            return recording.sent

    sent = anyio.run(go)
    assert sent[:-1] == [
        Train(epoch=0, lr_factor=1.0),
        Valid(epoch=0),
        Train(epoch=1, lr_factor=0.75),
        Train(epoch=2, lr_factor=0.5),
        Valid(epoch=2),
        Train(epoch=3, lr_factor=0.5),
    ]
    assert isinstance(sent[-1], Stop)


def _drive_and_follow(
    *, follower_optimizer: bool, root_strategy: str = "auto", follower_strategy: str = "auto"
):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(24, 3, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 2, (24,), generator=generator)
    batches = lamploop.tensor_batches(x, y, batch_size=4, shuffle=False)
    calls: list[list[torch.nn.Parameter]] = []

    def adam(params):
        params = list(params)
        calls.append(params)
        return torch.optim.Adam(params, lr=0.05)

    models = [lamploop.SupervisedModel(seeded(lambda: torch.nn.Linear(3, 2), seed)) for seed in (0, 1)]
    outcome: dict[str, Any] = {}

    async def go() -> None:
        with anyio.fail_after(60):
            root, (follower,) = local_control(2)

            async def follow() -> None:
                try:
                    async with follower:
                        await follow_distributed_training(
                            rank=1,
                            nranks=2,
                            device="cpu",
                            control=follower,
                            model=models[1],
                            train_batches=batches,
                            validation_batches=None,
                            optimizer_factory=adam if follower_optimizer else None,
                            strategy=follower_strategy,
                        )
                except Exception as error:
                    outcome["follower"] = error

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(follow)
                try:
                    async with root:
                        outcome["state"] = await drive_distributed_training(
                            nranks=2,
                            device="cpu",
                            control=root,
                            model=models[0],
                            optimizer_factory=adam,
                            train_batches=batches,
                            validation_batches=None,
                            max_epochs=2,
                            strategy=root_strategy,
                        )
                except Exception as error:
                    outcome["root"] = error

    anyio.run(go)
    return outcome, models, calls, (x, y)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("follower_optimizer", [False, True], ids=["follower_without", "follower_with"])
def test_auto_strategy_is_chosen_by_who_has_an_optimizer_and_logged_on_the_root(
    follower_optimizer: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """distributed.md: "`strategy="auto"`: the ranks count at start how many of them have an
    optimizer, and use `"all_reduce"` when all do, else lamp's `"reduce_to_root"` ... The choice
    is logged on the root"; reduce_to_root: "only rank 0 steps; optimizer state only there",
    "followers need nothing but the model", parameters "broadcast from rank 0 ... after each
    step"; getting-started.md: "`optimizer_factory` is called with the parameters on every rank
    that steps"."""
    with caplog.at_level(logging.INFO):
        outcome, models, calls, (x, y) = _drive_and_follow(follower_optimizer=follower_optimizer)
    assert set(outcome) == {"state"}, outcome
    chosen = "all_reduce" if follower_optimizer else "reduce_to_root"
    other = "reduce_to_root" if follower_optimizer else "all_reduce"
    logged = [r.getMessage() for r in caplog.records if "auto" in r.getMessage() and chosen in r.getMessage()]
    assert logged, [r.getMessage() for r in caplog.records]
    assert not any(other in message for message in logged), logged
    assert len(calls) == (2 if follower_optimizer else 1)
    called_with = sorted(tuple(id(p) for p in params) for params in calls)
    stepping = models if follower_optimizer else models[:1]
    assert called_with == sorted(tuple(id(p) for p in m.module.parameters()) for m in stepping)

    reference = seeded(lambda: torch.nn.Linear(3, 2), 0)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for _ in range(2):
        for start in range(0, 24, 8):  # batches 2s (rank 0) and 2s+1 (rank 1)
            optimizer.zero_grad()
            F.cross_entropy(reference(x[start : start + 8]), y[start : start + 8]).backward()
            optimizer.step()
    assert_same_params(models[0].module, reference, 1e-10)
    assert_same_params(models[1].module, models[0].module, 0.0)


@pytest.mark.timeout(60)
def test_ranks_that_ask_for_different_strategies_fail_on_every_rank_at_start() -> None:
    """distributed.md: "Every rank must ask for the same strategy; a mismatch fails on every rank
    with `DistributedError` at start"."""
    outcome, _models, _, _ = _drive_and_follow(
        follower_optimizer=True, root_strategy="all_reduce", follower_strategy="reduce_to_root"
    )
    assert isinstance(outcome.get("root"), DistributedError), outcome
    assert isinstance(outcome.get("follower"), DistributedError), outcome
    for side in ("root", "follower"):
        assert "reduce_to_root" in str(outcome[side])
        assert "all_reduce" in str(outcome[side])


def test_strategies_are_registered_by_name() -> None:
    """distributed.md: "`lamploop.strategy_names()` lists them"; coming-from-lightning.md names
    `"all_reduce_fp16"`, `"powersgd4"`, `"local_sgd8"`, `"diloco8"`; an unknown name is refused
    before anything starts."""
    names = set(lamploop.strategy_names())
    assert {"all_reduce", "reduce_to_root", "all_reduce_bf16", "all_reduce_fp16", "powersgd4"} <= names
    assert {"local_sgd8", "diloco8"} <= names
    with pytest.raises(ConfigurationError, match="ring_of_fire"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(
                torch.randn(4, 2), torch.zeros(4, dtype=torch.long), batch_size=2
            ),
            max_epochs=1,
            strategy="ring_of_fire",
            reporters=[],
        )


@pytest.mark.timeout(60)
def test_batchnorm_buffers_become_the_mean_over_ranks_and_the_roots_count() -> None:
    """distributed.md: "Buffers such as BatchNorm running statistics are made alike on every rank
    at the end of each training pass ...: floating buffers become their mean over the ranks (for
    BatchNorm's running mean, the running mean of every rank's batches), integer buffers
    (`num_batches_tracked`) the root's"; "Within an epoch each rank normalises with its own
    statistics"; "the root's parameters and buffers are broadcast" at start."""
    generator = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(40, 3, dtype=torch.float64, generator=generator) + 1
    y = torch.randn(40, 1, dtype=torch.float64, generator=generator)
    plan = cut({0: [4, 5, 3], 1: [6, 7]})

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))

    replicas = [
        (
            lamploop.SupervisedModel(seeded(make, 1 + rank), lamploop.mse_loss),
            planned_factory(x, y, plan),
            None,
        )
        for rank in range(2)
    ]
    with torch.no_grad():
        replicas[1][0].module[0].running_mean.fill_(5.0)  # not the root's: replaced at start
        replicas[1][0].module[0].running_var.fill_(9.0)
    run_local(replicas, sgd(0.1), 2)

    # the reference: BatchNorm first, so its statistics depend on the data only
    running_mean = torch.zeros(3, dtype=torch.float64)
    running_var = torch.ones(3, dtype=torch.float64)
    for _ in range(2):
        per_rank = []
        for rank in (0, 1):
            norm = torch.nn.BatchNorm1d(3).double()
            norm.running_mean.copy_(running_mean)
            norm.running_var.copy_(running_var)
            for part in plan[rank]:
                norm(x[part])
            per_rank.append((norm.running_mean.clone(), norm.running_var.clone()))
        running_mean = (per_rank[0][0] + per_rank[1][0]) / 2
        running_var = (per_rank[0][1] + per_rank[1][1]) / 2
    for module in (replicas[0][0].module, replicas[1][0].module):
        torch.testing.assert_close(module[0].running_mean, running_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(module[0].running_var, running_var, rtol=1e-12, atol=1e-12)
        assert int(module[0].num_batches_tracked) == 2 * len(plan[0])  # the root's count


@pytest.mark.parametrize(
    ("nodelist", "root_host"),
    [
        ("gpu[12-15]", "gpu12"),
        ("gpu[012-015]", "gpu012"),
        ("gpu[3,5-7]", "gpu3"),
        ("node7,node8", "node7"),
        ("rack1-node[1-2]", "rack1-node1"),
        ("a[1-2],b[3-4]", "a1"),
    ],
)
@pytest.mark.parametrize(("job_id", "port"), [("19999", 39999), ("20000", 20000), ("40001", 20001)])
def test_slurm_root_is_the_first_host_and_the_port_comes_from_the_job_id(
    nodelist: str, root_host: str, job_id: str, port: int
) -> None:
    """distributed.md, Slurm: "the root is ... the first host of `SLURM_JOB_NODELIST` (`gpu[12-15]`
    -> `gpu12`...)"; "The control port is `LAMPLOOP_CONTROL_PORT`, else `20000 + SLURM_JOB_ID %
    20000`"."""
    env = launch_env(
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_JOB_ID": job_id,
            "LAMPLOOP_TOKEN": "secret",
        }
    )
    assert env is not None
    assert (env.launcher, env.rank, env.world_size, env.root_host, env.control_port) == (
        "slurm",
        1,
        4,
        root_host,
        port,
    )


# ---------------------------------------------------------------------------------------------
# distributed.md: fit(world_size=2) in real processes against torch's own DDP

_COMMON = """
import torch

G = torch.Generator().manual_seed(11)
X = torch.randn(28, 5, generator=G, dtype=torch.float64)
Y = torch.randint(0, 3, (28,), generator=G)
VX = torch.randn(9, 5, generator=G, dtype=torch.float64)
VY = torch.randint(0, 3, (9,), generator=G)
EPOCHS = 3
BASE_LR = 0.2


def factor(epoch):  # lamploop.linear(start=1.0, end=0.5, max_steps=2), by hand
    return 1.0 - 0.5 * min(epoch, 2) / 2


def make(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def train_indices(epoch, rank, nranks):
    # 7 batches of 4, a pure function of the epoch; batch i for rank i % nranks: 4 and 3 batches
    order = torch.randperm(28, generator=torch.Generator().manual_seed(1000 + epoch))
    return [order[i : i + 4] for i in range(0, 28, 4)][rank::nranks]


def valid_indices(rank, nranks):
    return [torch.arange(i, min(i + 2, 9)) for i in range(0, 9, 2)][rank::nranks]
"""

_FIT_RANK = """
import json, logging, os, sys
from pathlib import Path

import torch
import lamploop
from common import *

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
out = Path(sys.argv[1])
rank = int(os.environ.get("LAMPLOOP_RANK", "0"))
module = make(100 + rank)  # different on every rank: the root's must win
contexts = []


def train(context):
    contexts.append([context.epoch, context.rank, context.nranks])

    async def stream():
        for idx in train_indices(context.epoch, context.rank, context.nranks):
            yield X[idx], Y[idx]

    return stream()


def valid(context):
    async def stream():
        for idx in valid_indices(context.rank, context.nranks):
            yield VX[idx], VY[idx]

    return stream()


NAMES = ("LAMPLOOP_RANK", "LAMPLOOP_WORLD_SIZE", "LAMPLOOP_CONTROL", "LAMPLOOP_TOKEN")
env = {k: os.environ.get(k) for k in NAMES}
state = lamploop.fit(
    model=lamploop.SupervisedModel(module),
    optimizer_factory=lambda params: torch.optim.SGD(params, lr=BASE_LR, weight_decay=0.01),
    train_batches=train,
    validation_batches=valid,
    max_epochs=EPOCHS,
    world_size=2,
    device="cpu",
    learning_rate_schedule=lamploop.linear(start=1.0, end=0.5, max_steps=2),
    validation_loss_exponential_smoothing_factor=0.6,
    reporters=[],
)
record = {
    "rank": rank,
    "contexts": contexts,
    "returned_none": state is None,
    "env": env,
    "default_group": torch.distributed.is_initialized(),
    "master_addr": os.environ.get("MASTER_ADDR"),
    "params": {k: v.tolist() for k, v in module.state_dict().items()},
}
if state is not None:
    record["curve"] = [
        [e.epoch, e.training_loss, list(e.validation_loss), e.learning_rate_factor]
        for e in state.learning_curve
    ]
    record["best"] = state.min_validation_epoch
    record["epoch"] = state.epoch
(out / f"fit-rank{rank}.json").write_text(json.dumps(record))
"""

_DDP_RANK = """
import json, sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from common import *

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
)
module = make(100 + rank)
ddp = DistributedDataParallel(module)  # broadcasts rank 0's parameters
optimizer = torch.optim.SGD(ddp.parameters(), lr=BASE_LR, weight_decay=0.01)
training, validation, snapshots = [], [], []
for epoch in range(EPOCHS):
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * factor(epoch)
    total = torch.zeros(2, dtype=torch.float64)
    # uneven inputs: a rank that ran out shadows the all-reduce; the mean is over the ranks left
    with Join([ddp], divide_by_initial_world_size=False):
        for idx in train_indices(epoch, rank, 2):
            optimizer.zero_grad()
            output = ddp(X[idx])
            F.cross_entropy(output, Y[idx]).backward()
            optimizer.step()
            loss_sum = F.cross_entropy(output.detach(), Y[idx], reduction="sum").item()
            total += torch.tensor([loss_sum, len(idx)], dtype=torch.float64)
    dist.all_reduce(total)
    training.append((total[0] / total[1]).item())
    with torch.no_grad():
        validation.append(F.cross_entropy(module(VX), VY).item())
    snapshots.append({k: v.tolist() for k, v in module.state_dict().items()})
if rank == 0:
    record = {"training": training, "validation": validation, "snapshots": snapshots}
    (out / "ddp.json").write_text(json.dumps(record))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fit_world_size_2_with_uneven_streams_equals_torch_ddp_with_join(tmp_path: Path) -> None:
    """distributed.md: "`fit(..., world_size=2)` started without a launcher becomes rank 0, opens a
    TCP control channel on 127.0.0.1 with a fresh random token and runs *the same command line*
    again for ranks 1..n-1 (`LAMPLOOP_RANK`, `LAMPLOOP_WORLD_SIZE`, `LAMPLOOP_CONTROL`,
    `LAMPLOOP_TOKEN` set)"; "uneven streams neither hang nor drop examples, and the gradient is
    exactly the mean over every example of the step"; "`all_reduce` ... same pattern as
    `DistributedDataParallel`"; "followers always start from the root's state"; "The choice is
    logged on the root"; "never the global default group"; the root sends `Train(epoch,
    lr_factor)`; batch-streams.md: the factory is "called once per epoch on every rank with a
    `BatchContext(epoch, rank, nranks)`".  The reference: torch's DistributedDataParallel in two
    processes of its own, with `Join(divide_by_initial_world_size=False)` for the rank that runs
    out (equal batch sizes, so DDP's mean of the ranks' means is the mean over the step)."""
    (tmp_path / "common.py").write_text(_COMMON)
    (tmp_path / "fit_rank.py").write_text(_FIT_RANK)
    (tmp_path / "ddp_rank.py").write_text(_DDP_RANK)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    port = free_port()
    results = run_bounded(
        [
            [sys.executable, str(tmp_path / "ddp_rank.py"), "0", str(port), str(tmp_path)],
            [sys.executable, str(tmp_path / "ddp_rank.py"), "1", str(port), str(tmp_path)],
            [sys.executable, str(tmp_path / "fit_rank.py"), str(tmp_path)],
        ],
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    for result in results:
        assert result["rc"] == 0, result["stderr"][-4000:]
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    root = json.loads((tmp_path / "fit-rank0.json").read_text())
    follower = json.loads((tmp_path / "fit-rank1.json").read_text())

    # the launch
    assert root["returned_none"] is False
    assert follower["returned_none"] is True
    assert root["env"] == {
        "LAMPLOOP_RANK": None,
        "LAMPLOOP_WORLD_SIZE": None,
        "LAMPLOOP_CONTROL": None,
        "LAMPLOOP_TOKEN": None,
    }
    assert follower["env"]["LAMPLOOP_RANK"] == "1"
    assert follower["env"]["LAMPLOOP_WORLD_SIZE"] == "2"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", follower["env"]["LAMPLOOP_CONTROL"] or "")
    assert len(follower["env"]["LAMPLOOP_TOKEN"] or "") >= 16
    assert root["contexts"] == [[e, 0, 2] for e in range(3)]
    assert follower["contexts"] == [[e, 1, 2] for e in range(3)]
    for record in (root, follower):
        assert record["default_group"] is False
        assert record["master_addr"] is None
    assert re.search(r"\bauto\b.*\ball_reduce\b", results[2]["stderr"]), results[2]["stderr"][-3000:]

    # the numbers
    assert root["epoch"] == 3
    assert [entry[3] for entry in root["curve"]] == [1.0, 0.75, 0.5]
    for entry, train_loss, raw in zip(root["curve"], ddp["training"], ddp["validation"], strict=True):
        assert entry[1] == pytest.approx(train_loss, rel=1e-10)
        assert entry[2][1] == pytest.approx(raw, rel=1e-10)
    smoothed = smooth(ddp["validation"], 0.6)
    assert [entry[2][0] for entry in root["curve"]] == pytest.approx(smoothed, rel=1e-10)
    best = strict_argmin(smoothed)
    assert root["best"] == best

    def tensors(record: dict) -> dict[str, torch.Tensor]:
        return {name: torch.tensor(value, dtype=torch.float64) for name, value in record.items()}

    assert_same_params(tensors(root["params"]), tensors(ddp["snapshots"][best]), 1e-10)
    # the follower trained in step with the root to the last epoch (the best model is the root's)
    assert_same_params(tensors(follower["params"]), tensors(ddp["snapshots"][-1]), 1e-10)
