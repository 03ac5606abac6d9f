"""Acceptance tests of docs/how-to/resume.md, docs/how-to/multi-node.md, docs/how-to/char-gpt.md,
docs/index.md, docs/api/checkpoint.md and docs/api/batches.md (the docstrings they render), and
of the examples' documented programs, written from the documentation alone.

Each test quotes the sentence it checks. Correct means equal to something computed apart from
lamploop (an uninterrupted run of the same seed, a float64 loop written here, hashlib, numpy).
Worker processes: tests/workers/howto_resume_worker.py (results as JSON, tests/workers/records.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import logging
import math
import os
import pickle
import random
import re
import runpy
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
import torch
from support import free_port, stopped_by, wait_until
from workers import howto_resume_worker as worker
from workers import warm_start
from workers.records import load_record

import lamploop
from lamploop import BatchContext
from lamploop.batches import dataloader_batches, epoch_seed, iterable_batches, tensor_batches
from lamploop.checkpoint import (
    Checkpointer,
    RngStates,
    checkpoint_name,
    extra_file,
    restore_optimizer_state,
    save_checkpoint,
    verify_checkpoint,
)
from lamploop.checkpoint.extras import rank_extra_name
from lamploop.distributed.launch import launch_env, slurm_first_host
from lamploop.errors import (
    CheckpointError,
    ConfigurationError,
    DistributedError,
    HandshakeError,
    PeerLostError,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WORKER = Path(worker.__file__)
CHAR_GPT = EXAMPLES / "char_gpt"


def _doc_blocks(page: str) -> list[str]:
    """The runnable ```python blocks of a docs page (those marked test="skip" left out)."""
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _kill_group(proc: Any) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=20)


def _small_fit(directory: Path | None, max_epochs: int, **keywords: Any) -> tuple[Any, torch.nn.Module]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, generator=g), torch.randint(0, 2, (32,), generator=g)
    torch.manual_seed(1)
    module = torch.nn.Linear(3, 2)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.01),
        train_batches=tensor_batches(x, y, batch_size=8),
        max_epochs=max_epochs,
        checkpoint_dir=directory,
        reporters=[],
        **keywords,
    )
    return state, module


# --------------------------------------------------------------------------------------------
# docs/index.md
# --------------------------------------------------------------------------------------------


def test_index_example_runs_as_written() -> None:
    """index.md: the first `fit` ("state = lamploop.fit(...) ... assert state is not None and
    state.epoch == 3"), run as written; its learning curve has the three epochs, each validated."""
    (block,) = _doc_blocks("index.md")
    namespace: dict[str, Any] = {"__name__": "index_md"}
    exec(compile(block, "docs/index.md", "exec"), namespace)
    state = namespace["state"]
    assert [entry.epoch for entry in state.learning_curve] == [0, 1, 2]
    assert all(entry.validation_loss is not None for entry in state.learning_curve)
    raw = [entry.validation_loss[1] for entry in state.learning_curve]
    assert state.min_validation_epoch == int(np.argmin(raw))  # smoothing factor 1.0: raw losses


# --------------------------------------------------------------------------------------------
# docs/how-to/resume.md: the page's own recipes
# --------------------------------------------------------------------------------------------


def test_step_checkpoint_recipe_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resume.md, "Checkpoints inside epochs": "`epoch-000001-step-000003/` is epoch 1 after its
    3rd optimizer step ... a run resumed from it skips the batches already trained on and ends
    exactly as the uninterrupted run" (the page's block, run as written: it asserts the names,
    the position and the bitwise parameters itself)."""
    monkeypatch.chdir(tmp_path)
    block = _doc_blocks("how-to/resume.md")[0]
    assert "checkpoint_every_n_steps=3" in block
    exec(compile(block, "docs/how-to/resume.md", "exec"), {"__name__": "resume_md"})


def test_which_checkpoint_recipe_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resume.md, "Which checkpoint is loaded": the block prints `epoch-000002` ("print(
    checkpoint.path.name)  # epoch-000002") and asserts the loop state, the position and the
    saved weights itself."""
    monkeypatch.chdir(tmp_path)
    block = _doc_blocks("how-to/resume.md")[1]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "docs/how-to/resume.md", "exec"), {"__name__": "resume_md"})
    assert out.getvalue().strip() == "epoch-000002"


def test_keep_last_default_three_none_all_and_latest(tmp_path: Path) -> None:
    """resume.md: "After every epoch `fit` writes a checkpoint there: `epoch-000001/`,
    `epoch-000002/`, ..., named after the epoch the run *resumes* at, plus a `latest` file naming
    the newest. `keep_last=3` (the default) keeps the three most recently saved; `keep_last=None`
    keeps all." and "`lamploop.latest_checkpoint(directory)` is the checkpoint `latest` names (or
    `None` before the first save)"."""
    default, everything = tmp_path / "default", tmp_path / "all"
    default.mkdir()
    assert lamploop.latest_checkpoint(default) is None
    _small_fit(default, 5)
    assert sorted(p.name for p in default.iterdir()) == [
        "epoch-000003",
        "epoch-000004",
        "epoch-000005",
        "latest",
    ]
    assert (default / "latest").read_text().strip() == "epoch-000005"
    assert lamploop.latest_checkpoint(default) == default / "epoch-000005"
    for epoch in (3, 4, 5):  # named after the epoch it resumes at: `epoch` epochs are done
        loop_state = lamploop.load_checkpoint(default / f"epoch-{epoch:06d}").state.loop_state
        assert loop_state.epoch == epoch
        assert [e.epoch for e in loop_state.learning_curve] == list(range(epoch))
    _small_fit(everything, 5, keep_last=None)
    assert sorted(p.name for p in everything.iterdir()) == [f"epoch-{e:06d}" for e in range(1, 6)] + [
        "latest"
    ]


def _plateau_keywords() -> dict[str, Any]:
    return {
        "learning_rate_schedule": lamploop.reduce_lr_on_plateau(patience=0, threshold=0.5),
        "validation_loss_exponential_smoothing_factor": 0.5,
    }


def test_called_again_resumes_bitwise_and_max_epochs_counts_all(tmp_path: Path) -> None:
    """resume.md: "Called again with the same directory, `fit` loads the latest checkpoint (the
    model, the optimizer, the best model, the schedule's state, the RNG states, the learning
    curve) and goes on. `max_epochs` counts epochs in all, so the same call finishes the run, and
    a larger `max_epochs` trains more." and "the resumed run ends with the same parameters as one
    that was never interrupted (bitwise, on the CPU)". Dropout, momentum, a plateau schedule
    and smoothing make every part of the state matter."""
    straight_state, straight = worker.train(None, max_epochs=3, **_plateau_keywords())
    run = tmp_path / "run"
    first_state, _ = worker.train(run, max_epochs=1, **_plateau_keywords())
    assert [e.epoch for e in first_state.learning_curve] == [0]
    resumed_state, resumed = worker.train(run, max_epochs=3, **_plateau_keywords())
    assert [e.epoch for e in resumed_state.learning_curve] == [0, 1, 2]
    assert resumed_state == straight_state
    assert _same_tensors(_state_dict(resumed), _state_dict(straight))
    assert any(e.learning_rate_factor != 1.0 for e in straight_state.learning_curve)  # the schedule acted
    saved = json.loads((run / "epoch-000003" / "checkpoint.json").read_text())["saved_at_unix_ns"]

    again_state, again = worker.train(run, max_epochs=3, **_plateau_keywords())  # the same call
    assert again_state == straight_state
    assert _same_tensors(_state_dict(again), _state_dict(straight))
    assert json.loads((run / "epoch-000003" / "checkpoint.json").read_text())["saved_at_unix_ns"] == saved
    assert sorted(p.name for p in run.iterdir()) == ["epoch-000001", "epoch-000002", "epoch-000003", "latest"]


def test_resume_false_starts_from_epoch_zero(tmp_path: Path) -> None:
    """resume.md: "`resume=False` ignores the checkpoints that are there and starts from epoch 0."
    The result is the fresh run's, bitwise, and `latest` then names the new run's checkpoint."""
    run = tmp_path / "run"
    _small_fit(run, 3)
    fresh_state, fresh = _small_fit(None, 1)
    state, module = _small_fit(run, 1, resume=False)
    assert [e.epoch for e in state.learning_curve] == [0]
    assert state == fresh_state
    assert _same_tensors(_state_dict(module), _state_dict(fresh))
    assert (run / "latest").read_text().strip() == "epoch-000001"


@pytest.mark.parametrize("keyword", [{"checkpoint_every_n_steps": 2}, {"checkpoint_every_seconds": 1.0}])
def test_in_epoch_checkpoints_need_a_checkpoint_dir(keyword: dict[str, Any]) -> None:
    """resume.md: "`checkpoint_every_n_steps=N` or `checkpoint_every_seconds=T` also writes a
    checkpoint at a step boundary inside the epoch (they need a `checkpoint_dir`)": without one,
    a ConfigurationError that names the keyword and `checkpoint_dir`."""
    with pytest.raises(ConfigurationError) as caught:
        _small_fit(None, 1, **keyword)
    message = str(caught.value)
    assert next(iter(keyword)) in message
    assert "checkpoint_dir" in message


def test_checkpoint_every_seconds_writes_step_checkpoints_that_resume_exactly(tmp_path: Path) -> None:
    """resume.md: "`checkpoint_every_seconds=T` also writes a checkpoint at a step boundary inside
    the epoch ... a run resumed from it skips the batches already trained on and ends exactly as
    the uninterrupted run." Batches that take 30 ms to come and T = 0.1 s."""
    x, y = worker.data()

    def run(directory: Path | None, **keywords: Any) -> tuple[Any, torch.nn.Module]:
        inner = tensor_batches(x, y, batch_size=4, seed=3)

        def slow(context: BatchContext) -> Any:
            async def stream() -> Any:
                async for batch in inner(context):
                    await anyio.sleep(0.03)
                    yield batch

            return stream()

        module = worker.make_module()
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            train_batches=slow,
            max_epochs=2,
            checkpoint_dir=directory,
            reporters=[],
            **keywords,
        )
        return state, module

    full = tmp_path / "full"
    straight_state, straight = run(full, keep_last=None, checkpoint_every_seconds=0.1)
    steps = sorted(p.name for p in full.iterdir() if re.fullmatch(r"epoch-000001-step-\d{6}", p.name))
    assert steps, sorted(p.name for p in full.iterdir())
    middle = steps[len(steps) // 2]
    checkpoint = lamploop.load_checkpoint(full / middle)
    assert checkpoint.position is not None
    assert (checkpoint.position.epoch, checkpoint.position.steps_done) == (1, int(middle[-6:]))
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(full / middle, crashed / middle)
    resumed_state, resumed = run(crashed)
    assert resumed_state == straight_state
    assert _same_tensors(_state_dict(resumed), _state_dict(straight))


def test_step_checkpoint_records_the_sums_so_far_float64(tmp_path: Path) -> None:
    """resume.md: a step checkpoint "records where every rank stood (steps done, loss and example
    sums so far, every rank's RNG state)". Compared with a float64 SGD loop written here: after
    3 steps of 4 examples, the sums of the 3 batches' summed cross entropies and 12 examples, and
    the model of that moment."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(20, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (20,), generator=g)
    factory = tensor_batches(x, y, batch_size=4, seed=9)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(4)
        return torch.nn.Linear(3, 2).double()

    module = fresh()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.5),
        train_batches=factory,
        max_epochs=1,
        checkpoint_dir=tmp_path,
        keep_last=None,
        checkpoint_every_n_steps=3,
        reporters=[],
    )
    position = lamploop.load_checkpoint(tmp_path / "epoch-000000-step-000003")
    assert position.position is not None

    async def batches() -> list[Any]:
        return [batch async for batch in factory(BatchContext(0))]

    reference = fresh()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.5)
    loss_sum, count = 0.0, 0
    for features, target in anyio.run(batches)[:3]:
        loss = torch.nn.functional.cross_entropy(reference(features), target, reduction="sum")
        loss_sum, count = loss_sum + loss.item(), count + len(target)
        (loss / len(target)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert position.position.steps_done == 3
    assert tuple(position.position.example_counts) == (count,)
    assert position.position.loss_sums[0] == pytest.approx(loss_sum, rel=1e-12)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(position.state.model[name], tensor, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------
# resume.md: "Stopping on purpose", with real signals
# --------------------------------------------------------------------------------------------


def _start_fit_worker(tmp_path: Path, name: str, step_seconds: float) -> tuple[Any, Path, Path, Path]:
    out, record, ready = tmp_path / name, tmp_path / f"{name}.json", tmp_path / f"{name}.ready"
    argv = [sys.executable, str(WORKER), "fit", str(out), str(record), "--ready", str(ready)]
    argv += ["--step-seconds", str(step_seconds)]
    proc = warm_start.popen(argv, env=_env(), stdout=subprocess.DEVNULL, stderr=tmp_path / f"{name}.err")
    return proc, out, record, ready


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigterm_checkpoints_the_step_and_fit_resumes_there(tmp_path: Path) -> None:
    """resume.md: "SIGTERM or SIGINT ... asks every rank to stop after the step in progress. With
    a `checkpoint_dir`, `fit` writes a checkpoint at that step boundary and raises
    `lamploop.errors.TrainingInterrupted` (`.epoch`, `.steps_done`, `.reason`); calling `fit`
    again resumes at that step." A real SIGTERM lands in epoch 1's 4th step (2 s long); the run
    resumed from its checkpoint ends bitwise as the uninterrupted run of the same seed."""
    proc, out, record, ready = _start_fit_worker(tmp_path, "term", step_seconds=2.0)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=60, what="epoch 1's 4th step")
        assert proc.poll() is None, (tmp_path / "term.err").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "term.err").read_text()
    finally:
        _kill_group(proc)
    result = load_record(record)
    assert result["outcome"] == "interrupted", result
    assert (result["epoch"], result["steps_done"], result["reason"]) == (1, 4, "SIGTERM")
    assert (out / "epoch-000001-step-000004").is_dir()
    assert lamploop.latest_checkpoint(out) == out / "epoch-000001-step-000004"

    resumed_state, resumed = worker.train(out)
    straight_state, straight = worker.train(None)
    assert resumed_state == straight_state
    assert _same_tensors(_state_dict(resumed), _state_dict(straight))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_second_signal_stops_as_the_computing_operation_returns(tmp_path: Path) -> None:
    """resume.md: "A second signal stops at once, losing the work since the last checkpoint: at
    once where the run waits (...), and as the operation in progress returns where a step
    computes (a forward or backward pass of torch on the training thread cannot be interrupted;
    the stop comes when it returns)." SIGINT twice (0.3 s apart) in a 5-s forward: the run ends
    as that forward returns, and writes no checkpoint at its boundary.  (The page promised "at
    once" alone, which no thread running torch can keep; it was made exact.)"""
    proc, out, record, ready = _start_fit_worker(tmp_path, "double", step_seconds=5.0)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=60, what="epoch 1's 4th step")
        assert proc.poll() is None, (tmp_path / "double.err").read_text()
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        second = time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        _kill_group(proc)
    result = load_record(record)
    assert not any("step" in p.name for p in out.iterdir()), sorted(p.name for p in out.iterdir())
    step_ended = float(Path(f"{ready}.done").read_text())
    ended = result["ended_at"]
    assert (result["outcome"], result["reason"]) == ("interrupted", "SIGINT"), result
    assert "at once" in result.get("message", ""), result
    assert ended - step_ended < 2.5, (
        f"fit ended {ended - second:.2f} s after the second SIGINT, the forward in progress "
        f"{step_ended - second:.2f} s after it: {result['outcome']}: {result.get('message')}"
    )


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_lamploop_command_exit_status_on_signal(tmp_path: Path, sig: signal.Signals, status: int) -> None:
    """resume.md: "The `lamploop` command exits with 130 (SIGINT) or 143 (SIGTERM) then." The
    demo, stopped by a real signal after its first checkpoint, exits with that status, says how it
    stopped in its last line and leaves the checkpoint it names."""
    out = tmp_path / "demo"
    code = "import sys; sys.argv[0] = 'lamploop'; from lamploop.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "demo", "--world-size", "1", "--epochs", "500", "--out", str(out)]
    proc = warm_start.popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(
            lambda: (out / "epoch-000001").is_dir() or proc.poll() is not None,
            timeout=60,
            what="a checkpoint",
        )
        assert proc.poll() is None
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    assert proc.returncode == status, output[-2000:]
    last = output.strip().splitlines()[-1]
    how = stopped_by(sig.name, last)
    assert how is not None, last
    if how == "step":
        epoch, step = map(int, re.search(r"at epoch (\d+) after step (\d+)", last).groups())
        assert (out / checkpoint_name(epoch, step)).is_dir()


# --------------------------------------------------------------------------------------------
# resume.md "Which checkpoint is loaded" and the checkpoint API (docs/api/checkpoint.md)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def three_checkpoints(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    _small_fit(run, 3)
    return run


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-8])


def _remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "file", "says"),
    [
        (_flip, "model.safetensors", "sha256"),
        (_truncate, "optimizer.safetensors", "size"),
        (_remove, "rng.safetensors", "missing"),
    ],
)
def test_invalid_latest_names_the_file_and_falls_back_with_a_warning(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture, damage: Any, file: str, says: str
) -> None:
    """resume.md: "Loading validates everything (format version, every file's size and sha256
    ...) and raises `lamploop.errors.CheckpointError` naming the file at fault; if the one `latest`
    names is missing or invalid, the most recently saved valid one is loaded instead, with a
    warning." The fallback holds the weights of epoch 2's own checkpoint."""
    bad = three_checkpoints / "epoch-000003" / file
    expected = lamploop.load_checkpoint(three_checkpoints / "epoch-000002").state.model
    damage(bad)
    with pytest.raises(CheckpointError) as caught:
        lamploop.load_checkpoint(three_checkpoints / "epoch-000003")
    assert str(caught.value).startswith(str(bad))
    assert says in str(caught.value)
    with caplog.at_level(logging.WARNING):
        checkpoint = lamploop.load_checkpoint(three_checkpoints)
    assert checkpoint.path == three_checkpoints / "epoch-000002"
    assert _same_tensors(dict(checkpoint.state.model), dict(expected))
    assert any(r.levelno == logging.WARNING and "epoch-000003" in r.getMessage() for r in caplog.records)


def test_latest_naming_a_missing_directory_falls_back(
    three_checkpoints: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """resume.md: "if the one `latest` names is missing ..., the most recently saved valid one is
    loaded instead, with a warning"; `fit` resumes from it (the learning curve goes on from 3)."""
    (three_checkpoints / "latest").write_text("epoch-000009\n")
    with caplog.at_level(logging.WARNING):
        checkpoint = lamploop.load_checkpoint(three_checkpoints)
    assert checkpoint.path.name == "epoch-000003"
    assert any("epoch-000009" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    state, _ = _small_fit(three_checkpoints, 4)
    assert [e.epoch for e in state.learning_curve] == [0, 1, 2, 3]
    assert state.learning_curve[:3] == checkpoint.state.loop_state.learning_curve


def test_copied_checkpoints_without_latest_take_the_most_recently_saved(tmp_path: Path) -> None:
    """resume.md: "(The copied directory has no `latest` file; `load_checkpoint` and `fit` then
    take the most recently saved complete checkpoint.)" Saved second, epoch 1 wins over epoch 3,
    which has the larger name."""
    source = tmp_path / "source"

    def state(epoch: int, value: float) -> lamploop.LoopStateWithModelAndOptimizerData:
        loop_state = lamploop.LoopState(
            epoch=epoch,
            last_validation_loss=None,
            min_validation_loss=None,
            min_validation_epoch=None,
            learning_curve=(),
        )
        return lamploop.LoopStateWithModelAndOptimizerData(
            loop_state, {"w": torch.full((2,), value)}, {"state": {}, "param_groups": []}, {}
        )

    save_checkpoint(source, state(3, 3.0), keep_last=None)
    time.sleep(0.01)
    save_checkpoint(source, state(1, 1.0), keep_last=None)
    copied = tmp_path / "copied"
    copied.mkdir()
    for name in ("epoch-000003", "epoch-000001"):
        shutil.copytree(source / name, copied / name)
    assert lamploop.latest_checkpoint(copied) == copied / "epoch-000001"
    assert torch.equal(lamploop.load_checkpoint(copied).state.model["w"], torch.full((2,), 1.0))


def test_newer_format_version_is_refused_naming_the_descriptor(three_checkpoints: Path) -> None:
    """resume.md: "Loading validates everything (format version, ...) and raises
    `lamploop.errors.CheckpointError` naming the file at fault" (api: "a format version newer than
    FORMAT_VERSION")."""
    descriptor = three_checkpoints / "epoch-000003" / "checkpoint.json"
    data = json.loads(descriptor.read_text())
    data["format_version"] = lamploop.checkpoint.FORMAT_VERSION + 1
    descriptor.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as caught:
        lamploop.load_checkpoint(three_checkpoints / "epoch-000003")
    assert str(caught.value).startswith(str(descriptor))
    assert str(lamploop.checkpoint.FORMAT_VERSION + 1) in str(caught.value)


def test_tensors_are_checked_against_the_model(three_checkpoints: Path) -> None:
    """resume.md: "Loading validates everything (... the tensors against the model)"; api: "a
    model that does not fit" is a CheckpointError that names the file and the tensor."""
    with pytest.raises(CheckpointError) as caught:
        lamploop.load_checkpoint(three_checkpoints, model=torch.nn.Linear(3, 5))
    message = str(caught.value)
    assert "model.safetensors" in message
    assert "'weight'" in message
    assert "(5, 3)" in message


def test_descriptor_records_size_and_sha256_of_every_file(three_checkpoints: Path) -> None:
    """api/checkpoint.md: "checkpoint.json  the descriptor: format version, loop state, ... and the
    sha256 and size of every file below"; every safetensors file is listed, with hashlib's
    digest and the size on disk."""
    directory = three_checkpoints / "epoch-000003"
    files = json.loads((directory / "checkpoint.json").read_text())["files"]
    on_disk = sorted(p.name for p in directory.iterdir() if p.name != "checkpoint.json")
    assert sorted(files) == on_disk
    assert {"model.safetensors", "best_model.safetensors", "optimizer.safetensors", "rng.safetensors"} <= set(
        files
    )
    for name, entry in files.items():
        data = (directory / name).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), name
        assert entry["size"] == len(data), name


def test_checkpoints_are_json_and_safetensors_never_pickle(
    three_checkpoints: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume.md: "Checkpoints are safetensors and JSON, never pickle, so loading one cannot run
    code." Every file is JSON or safetensors, and loading works with pickle and torch.load gone."""
    for directory in three_checkpoints.glob("epoch-*"):
        for path in directory.iterdir():
            assert path.suffix in {".json", ".safetensors"}, path
            data = path.read_bytes()
            if path.suffix == ".json":
                json.loads(data)
            else:  # an 8-byte little-endian header length, a JSON header, the raw tensor bytes
                size = int.from_bytes(data[:8], "little")
                assert isinstance(json.loads(data[8 : 8 + size]), dict), path

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpickling during load_checkpoint")

    for target, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    checkpoint = lamploop.load_checkpoint(three_checkpoints, model=torch.nn.Linear(3, 2))
    assert checkpoint.state.loop_state.epoch == 3


def test_restore_rng_sets_torch_numpy_and_python_generators(tmp_path: Path) -> None:
    """api/checkpoint.md: `rng.safetensors` holds "the torch (CPU and CUDA), numpy and Python RNG
    states"; `load_checkpoint(..., restore_rng=True)`: "also set the torch, numpy and Python RNGs
    to the saved states". The draws after loading repeat those after saving."""
    _, module = _small_fit(None, 1)
    torch.manual_seed(4)
    random.seed(4)
    np.random.seed(4)
    loop_state = lamploop.LoopState(
        epoch=1,
        last_validation_loss=None,
        min_validation_loss=None,
        min_validation_epoch=None,
        learning_curve=(),
    )
    data = lamploop.LoopStateWithModelAndOptimizerData(
        loop_state, module.state_dict(), {"state": {}, "param_groups": []}, {}
    )
    save_checkpoint(tmp_path, data)
    after_save = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    lamploop.load_checkpoint(tmp_path, restore_rng=True)
    after_load = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(after_save[0], after_load[0])
    assert after_save[1:] == after_load[1:]
    states = RngStates.capture()
    drawn = torch.rand(3)
    states.restore()
    assert torch.equal(torch.rand(3), drawn)


def _refusals() -> list[Any]:
    optimizer = torch.optim.SGD(
        [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9
    )
    smaller = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    loop_state = lamploop.LoopState(
        epoch=1,
        last_validation_loss=None,
        min_validation_loss=None,
        min_validation_epoch=None,
        learning_curve=(),
    )
    listed = lamploop.LoopStateWithModelAndOptimizerData(loop_state, {"w": [1, 2]}, {}, {})
    return [
        pytest.param(lambda d: checkpoint_name(-1), ConfigurationError, "epoch", id="checkpoint_name-epoch"),
        pytest.param(lambda d: checkpoint_name(2, -3), ConfigurationError, "step", id="checkpoint_name-step"),
        pytest.param(
            lambda d: Checkpointer(d, keep_last=0), ConfigurationError, "keep_last", id="keep_last-0"
        ),
        pytest.param(
            lambda d: Checkpointer(d / "file.txt"), ConfigurationError, "file.txt", id="directory-is-a-file"
        ),
        pytest.param(
            lambda d: restore_optimizer_state(smaller, optimizer.state_dict()),
            CheckpointError,
            "parameter",
            id="optimizer-misfit",
        ),
        pytest.param(lambda d: save_checkpoint(d / "x", listed), CheckpointError, "'w'", id="non-tensor"),
        pytest.param(
            lambda d: save_checkpoint(d / "x", "state"), ConfigurationError, "state", id="not-a-state"
        ),
        pytest.param(lambda d: lamploop.load_checkpoint(42), ConfigurationError, "path", id="path-int"),
        pytest.param(
            lambda d: lamploop.load_checkpoint(d / "nothing"), CheckpointError, "nothing", id="no-directory"
        ),
        pytest.param(
            lambda d: lamploop.load_checkpoint(d, restore_rng="yes"),
            ConfigurationError,
            "restore_rng",
            id="restore_rng",
        ),
        pytest.param(lambda d: extra_file("../x"), ConfigurationError, "../x", id="extra-name-path"),
        pytest.param(lambda d: extra_file(".hidden"), ConfigurationError, ".hidden", id="extra-name-dot"),
    ]


@pytest.mark.parametrize(("call", "error", "named"), _refusals())
def test_checkpoint_api_refusals_name_what_was_wrong(
    tmp_path: Path, call: Any, error: type, named: str
) -> None:
    """api/checkpoint.md, the Raises sections: `checkpoint_name` ("ConfigurationError: `epoch` or
    `step` is not an int >= 0"), `Checkpointer` ("`keep_last` is not `None` or an int >= 1 ... or
    `directory` ... is a file"), `restore_optimizer_state` ("CheckpointError: the saved state has
    another number of ... parameters"), `save_checkpoint` ("a non-tensor in a state dict";
    "`state` is not a LoopStateWithModelAndOptimizerData"), `load_checkpoint` ("`path` not a
    path", "a missing directory", "`restore_rng` not a bool") and `extra_file` (a name "not
    starting with `.`", that "stays in its checkpoint's directory")."""
    (tmp_path / "file.txt").write_text("not a directory")
    with pytest.raises(error) as caught:
        call(tmp_path)
    assert named in str(caught.value)


def test_checkpoint_names_and_extra_names() -> None:
    """api/checkpoint.md: "`epoch-000006` (the start of epoch 6), or `epoch-000005-step-000120`
    (epoch 5 after its 120th step)"; "`extra-<name>.safetensors`"; rank_extra_name: "`name` on
    rank 0, else `name.rank<r>`"."""
    assert checkpoint_name(6) == "epoch-000006"
    assert checkpoint_name(5, 120) == "epoch-000005-step-000120"
    assert extra_file("buffer_1.a-b") == "extra-buffer_1.a-b.safetensors"
    assert rank_extra_name("stream", 0) == "stream"
    assert rank_extra_name("stream", 3) == "stream.rank3"


def test_failed_save_leaves_the_previous_checkpoint(
    three_checkpoints: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """api/checkpoint.md: "A crash at any moment leaves either the old or the new checkpoint, never
    a half-written one under a checkpoint name"; save_checkpoint: "OSError: writing, fsyncing or
    renaming failed (the previous checkpoint and `latest` are then left as they were)". An fsync
    that fails (EIO) in the middle of the save."""
    before = sorted(p.name for p in three_checkpoints.iterdir())
    state = lamploop.load_checkpoint(three_checkpoints).state
    later = attrs.evolve(state, loop_state=attrs.evolve(state.loop_state, epoch=4))
    real_fsync, calls = os.fsync, []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) > 2:
            raise OSError(5, "injected I/O error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(three_checkpoints, later)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(p.name for p in three_checkpoints.iterdir() if not p.name.startswith(".")) == before
    assert (three_checkpoints / "latest").read_text().strip() == "epoch-000003"
    assert lamploop.load_checkpoint(three_checkpoints).path.name == "epoch-000003"


def test_verify_checkpoint_reports_every_bad_file(three_checkpoints: Path) -> None:
    """api/checkpoint.md, verify_checkpoint: "`report.ok` is false when anything is wrong, and
    `report.problems` names each bad file", and the report is "on the one load_checkpoint would
    load: the one `latest` names if valid, else the most recently saved valid one"."""
    assert verify_checkpoint(three_checkpoints).ok
    _flip(three_checkpoints / "epoch-000003" / "best_model.safetensors")
    _truncate(three_checkpoints / "epoch-000001" / "model.safetensors")
    report = verify_checkpoint(three_checkpoints)
    assert not report.ok
    assert report.path == three_checkpoints / "epoch-000002"
    assert any(
        p.startswith(str(three_checkpoints / "epoch-000003" / "best_model.safetensors"))
        for p in report.problems
    )
    assert any(
        p.startswith(str(three_checkpoints / "epoch-000001" / "model.safetensors")) for p in report.problems
    )


def test_a_cancelled_checkpointer_call_still_finishes_its_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """api/checkpoint.md, Checkpointer: "If the awaiting task is cancelled, the save in progress
    still finishes (a checkpoint is never abandoned half-written)." Each fsync takes 0.1 s; the
    caller gives up after 0.15 s; the checkpoint is complete and valid."""
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.1)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    loop_state = lamploop.LoopState(
        epoch=1,
        last_validation_loss=None,
        min_validation_loss=None,
        min_validation_epoch=None,
        learning_curve=(),
    )
    data = lamploop.LoopStateWithModelAndOptimizerData(
        loop_state, {"w": torch.arange(3.0)}, {"state": {}, "param_groups": []}, {}
    )

    async def give_up() -> bool:
        with anyio.move_on_after(0.15) as scope:
            await Checkpointer(tmp_path)(data, None)
        return scope.cancelled_caught

    anyio.run(give_up)
    wait_until(lambda: (tmp_path / "latest").exists(), timeout=20, what="the save to finish")
    monkeypatch.setattr(os, "fsync", real_fsync)
    checkpoint = lamploop.load_checkpoint(tmp_path)
    assert checkpoint.path.name == "epoch-000001"
    assert torch.equal(checkpoint.state.model["w"], torch.arange(3.0))


class _Counter:
    """A checkpoint extra: a count of the training passes, and what it was loaded with."""

    def __init__(self) -> None:
        self.count = torch.zeros(1)
        self.loaded: list[Any] = []

    def state_dict(self) -> tuple[dict[str, torch.Tensor], Any]:
        return {"count": self.count.clone()}, {"passes": int(self.count.item())}

    def load_state_dict(self, tensors: Any, meta: Any) -> None:
        self.loaded.append((tensors["count"].item(), meta))
        self.count = tensors["count"].clone()


def test_checkpoint_extras_are_saved_and_restored_before_training(tmp_path: Path) -> None:
    """api/checkpoint.md (extras): the Checkpointer "writes the tensors of extra `name` to
    `extra-<name>.safetensors` (listed with its sha256 and size in `checkpoint.json` like every
    other file) and its `meta` into `checkpoint.json` under "extras""; fit restores them "on
    resume before training starts"."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))

    def run(extra: _Counter, max_epochs: int) -> None:
        inner = tensor_batches(x, y, batch_size=8)
        seen: list[Any] = []

        def counting(context: BatchContext) -> Any:
            seen.append(list(extra.loaded))  # what was restored when the pass starts
            extra.count += 1
            return inner(context)

        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=counting,
            max_epochs=max_epochs,
            checkpoint_dir=tmp_path,
            checkpoint_extras={"counter": extra},
            reporters=[],
        )
        extra.seen = seen  # type: ignore[attr-defined]

    first = _Counter()
    run(first, 2)
    directory = tmp_path / "epoch-000002"
    descriptor = json.loads((directory / "checkpoint.json").read_text())
    data = (directory / "extra-counter.safetensors").read_bytes()
    assert descriptor["files"]["extra-counter.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert descriptor["extras"]["counter"] == {"passes": 2}
    second = _Counter()
    run(second, 3)
    assert second.loaded == [(2.0, {"passes": 2})]
    assert second.seen[0] == [(2.0, {"passes": 2})]  # type: ignore[attr-defined]
    assert second.count.item() == 3.0


# --------------------------------------------------------------------------------------------
# resume.md "Resuming by hand" (and the checkpoint module's "Resuming::" recipe)
# --------------------------------------------------------------------------------------------

_X64 = torch.randn(40, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
_Y64 = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))
_PLATEAU = lamploop.reduce_lr_on_plateau(patience=0, threshold=0.05)


def _dropout_model() -> lamploop.SupervisedModel:
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)).double()
    return lamploop.SupervisedModel(module)


async def _drive(model: lamploop.SupervisedModel, max_epochs: int, **keywords: Any) -> Any:
    return await lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=model,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        train_batches=tensor_batches(_X64[:32], _Y64[:32], batch_size=4),
        validation_batches=tensor_batches(_X64[32:], _Y64[32:], batch_size=4, shuffle=False),
        max_epochs=max_epochs,
        learning_rate_schedule=_PLATEAU,
        **keywords,
    )


def test_resume_by_hand_with_drive_distributed_training(tmp_path: Path) -> None:
    """resume.md, "Resuming by hand": "the drivers take what `load_checkpoint` returns:
    `drive_distributed_training(..., init_state=checkpoint.state,
    learning_rate_schedule_init_state=checkpoint.schedule_state)` (and `init_position` and
    `init_rank_rngs` for a step checkpoint), and `Checkpointer(directory, keep_last=...)` is the
    callback that writes them." From an epoch checkpoint and from a step checkpoint, the run
    ends bitwise as the uninterrupted one (dropout, momentum, plateau schedule)."""
    straight_model = _dropout_model()
    straight = anyio.run(lambda: _drive(straight_model, 4))
    checkpointer = Checkpointer(tmp_path, keep_last=None)
    anyio.run(
        lambda: _drive(
            _dropout_model(),
            2,
            checkpoint_state=checkpointer,
            checkpoint_position=checkpointer.save_position,
            checkpoint_every_n_steps=3,
        )
    )
    for name in ("epoch-000002", "epoch-000001-step-000006"):
        model = _dropout_model()  # "Build the model and the optimizer as for a fresh run", then load
        checkpoint = lamploop.load_checkpoint(
            tmp_path / name, schedule=_PLATEAU, model=model.module, restore_rng=True
        )
        step = {}
        if checkpoint.position is not None:
            step = {"init_position": checkpoint.position, "init_rank_rngs": checkpoint.rank_rngs}
        resumed = anyio.run(
            lambda model=model, checkpoint=checkpoint, step=step: _drive(
                model,
                4,
                init_state=checkpoint.state,
                learning_rate_schedule_init_state=checkpoint.schedule_state,
                **step,
            )
        )
        assert resumed == straight, name
        assert _same_tensors(_state_dict(model.module), _state_dict(straight_model.module)), name


def test_resume_with_epochs_alone_as_the_checkpoint_module_says(tmp_path: Path) -> None:
    """api/checkpoint.md, "Resuming::": "checkpoint = load_checkpoint(root, schedule=schedule,
    model=model, restore_rng=True); model.load_state_dict(checkpoint.state.model);
    restore_optimizer_state(optimizer, checkpoint); await epochs(...,
    init_state=checkpoint.state.loop_state, learning_rate_schedule=schedule,
    learning_rate_schedule_init_state=checkpoint.schedule_state, ...)" (resume.md: "With
    `epochs` alone you load the tensors yourself"): bitwise the uninterrupted loop."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(6)
        module = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.Dropout(0.2), torch.nn.Linear(6, 3)
        ).double()
        return module, torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)

    async def loop(
        module: Any, optimizer: Any, max_epochs: int, root: Path | None, checkpoint: Any = None
    ) -> Any:
        base = [group["lr"] for group in optimizer.param_groups]

        async def train_epoch(factor: float) -> float:
            for group, lr in zip(optimizer.param_groups, base, strict=True):
                group["lr"] = lr * factor
            module.train()
            loss = torch.nn.functional.cross_entropy(module(_X64[:32]), _Y64[:32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.item()

        async def validation_epoch() -> float:
            module.eval()
            with torch.no_grad():
                return torch.nn.functional.cross_entropy(module(_X64[32:]), _Y64[32:]).item()

        async def nothing() -> None:
            pass

        checkpointer = Checkpointer(root) if root is not None else None

        async def checkpoint_state(loop_state: Any, schedule_state: Any) -> None:
            if checkpointer is not None:
                data = lamploop.LoopStateWithModelAndOptimizerData(
                    loop_state, module.state_dict(), optimizer.state_dict(), {}
                )
                await checkpointer(data, schedule_state)

        return await lamploop.epochs(
            max_epochs=max_epochs,
            train_epoch=train_epoch,
            validation_epoch=validation_epoch,
            save_min_validation_loss_model=nothing,
            checkpoint_state=checkpoint_state,
            learning_rate_schedule=_PLATEAU,
            init_state=None if checkpoint is None else checkpoint.state.loop_state,
            learning_rate_schedule_init_state=None if checkpoint is None else checkpoint.schedule_state,
        )

    straight_module, straight_optimizer = make()
    straight = anyio.run(loop, straight_module, straight_optimizer, 5, None)
    module, optimizer = make()
    anyio.run(loop, module, optimizer, 2, tmp_path)
    module, optimizer = make()
    checkpoint = lamploop.load_checkpoint(tmp_path, schedule=_PLATEAU, model=module, restore_rng=True)
    module.load_state_dict(checkpoint.state.model)
    restore_optimizer_state(optimizer, checkpoint)
    resumed = anyio.run(loop, module, optimizer, 5, None, checkpoint)
    assert resumed == straight
    assert any(e.learning_rate_factor != 1.0 for e in straight.learning_curve[2:])
    assert _same_tensors(_state_dict(module), _state_dict(straight_module))


# --------------------------------------------------------------------------------------------
# docs/api/batches.md
# --------------------------------------------------------------------------------------------


async def _collect(stream: Any) -> list[Any]:
    return [batch async for batch in stream]


def _flat(lists: list[list[int]]) -> list[int]:
    return [value for values in lists for value in values]


def _targets(factory: Any, context: BatchContext) -> list[list[int]]:
    return [target.tolist() for _, target in anyio.run(_collect, factory(context))]


def test_tensor_batches_deal_batch_i_to_rank_i_mod_nranks() -> None:
    """api/batches.md, tensor_batches: "Each epoch the examples are permuted by a generator seeded
    from `(seed, epoch)` (or kept in order when `shuffle` is false) and cut into batches of
    `batch_size`; batch `i` goes to rank `i % nranks`. Every rank sees a disjoint part and the
    ranks together see every example once." (and the module: the order is "a pure function of
    (seed, epoch, rank)")."""
    x, y = torch.arange(11.0)[:, None], torch.arange(11)
    factory = tensor_batches(x, y, batch_size=3, seed=5)
    one = _targets(factory, BatchContext(0))
    assert sorted(_flat(one)) == list(range(11))
    assert [len(b) for b in one] == [3, 3, 3, 2]
    assert _targets(tensor_batches(x, y, batch_size=3, seed=5), BatchContext(0)) == one  # pure
    assert _targets(factory, BatchContext(1)) != one  # another epoch, another order
    assert _targets(tensor_batches(x, y, batch_size=3, seed=6), BatchContext(0)) != one
    for nranks in (2, 3):
        shares = [_targets(factory, BatchContext(0, rank, nranks)) for rank in range(nranks)]
        for rank, share in enumerate(shares):
            assert share == one[rank::nranks]
    assert _targets(tensor_batches(x, y, batch_size=4, shuffle=False), BatchContext(3)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10],
    ]
    assert _targets(tensor_batches(x, y, batch_size=4, shuffle=False, drop_last=True), BatchContext(0)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


@pytest.mark.parametrize(
    ("arguments", "keywords", "named"),
    [
        ((torch.zeros(4, 2), torch.zeros(3)), {"batch_size": 2}, "rows"),
        ((torch.zeros(0, 2), torch.zeros(0)), {"batch_size": 2}, "no examples"),
        (([1, 2], torch.zeros(2)), {"batch_size": 1}, "tensor"),
        ((torch.zeros(4, 2), torch.zeros(4)), {"batch_size": 0}, "batch_size"),
        ((torch.zeros(4, 2), torch.zeros(4)), {"batch_size": 2, "seed": -1}, "seed"),
        ((torch.zeros(4, 2), torch.zeros(4)), {"batch_size": 2, "shuffle": "yes"}, "shuffle"),
        ((torch.zeros(4, 2), torch.zeros(4)), {"batch_size": 2, "drop_last": 1}, "drop_last"),
    ],
)
def test_tensor_batches_refusals(arguments: tuple, keywords: dict, named: str) -> None:
    """api/batches.md, tensor_batches: "ConfigurationError: the tensors differ in length, are empty
    or not tensors with a batch dimension, `batch_size` is not an int >= 1, `seed` not an int
    >= 0, or `shuffle` / `drop_last` not a bool"; errors.md: "Each message names the offending
    value"."""
    with pytest.raises(ConfigurationError) as caught:
        tensor_batches(*arguments, **keywords)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: BatchContext(-1), "epoch"),
        (lambda: BatchContext(0, rank=0, nranks=0), "nranks"),
        (lambda: BatchContext(0, rank=2, nranks=2), "rank"),
        (lambda: epoch_seed(-3, 1), "-3"),
        (lambda: epoch_seed(1, -7), "-7"),
        (lambda: iterable_batches([(torch.zeros(1, 1), torch.zeros(1))]), "got list"),
    ],
)
def test_batch_context_epoch_seed_and_iterable_batches_refusals(call: Any, named: str) -> None:
    """api/batches.md: BatchContext "ConfigurationError: `epoch < 0`, `nranks < 1` or `rank` not
    in `0..nranks-1`"; epoch_seed "a seed or part that is not an int >= 0 (naming it)";
    iterable_batches "`make` is not callable (e.g. the list of batches itself)"."""
    with pytest.raises(ConfigurationError) as caught:
        call()
    assert named in str(caught.value)


def test_epoch_seed_and_iterable_batches() -> None:
    """api/batches.md: epoch_seed is "A 63-bit seed mixed from `seed` and `parts` (epoch, rank...)";
    iterable_batches "Adapt[s] a factory of plain (synchronous) iterables of batches"."""
    seeds = {epoch_seed(s, e, r) for s in range(3) for e in range(3) for r in range(3)}
    assert len(seeds) == 27
    assert all(0 <= s < 2**63 for s in seeds)
    assert epoch_seed(1, 2) == epoch_seed(1, 2)
    batches = [(torch.full((2, 1), float(i)), torch.tensor([i, i])) for i in range(3)]
    contexts: list[BatchContext] = []

    def make(context: BatchContext) -> Any:
        contexts.append(context)
        return iter(batches[context.rank :: context.nranks])

    got = anyio.run(_collect, iterable_batches(make)(BatchContext(4, 1, 2)))
    assert contexts == [BatchContext(4, 1, 2)]
    assert [t.tolist() for _, t in got] == [[1, 1]]


def test_dataloader_batches_ranks_share_the_seeded_sampler_order() -> None:
    """api/batches.md, dataloader_batches: "a sampler with a `generator` attribute (RandomSampler
    ...) gets one seeded from `(seed, epoch)`"; "with `nranks > 1`, rank `r` takes every
    `nranks`-th index of the sampler's order starting at `r` ... in a loader with the same batch
    size", "so that they together see every example exactly once per epoch"."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(10.0)[:, None], torch.arange(10))
    factory = dataloader_batches(DataLoader(data, batch_size=2, shuffle=True), seed=4)
    order = _flat(_targets(factory, BatchContext(0)))
    assert sorted(order) == list(range(10))
    assert _flat(_targets(factory, BatchContext(0))) == order  # pure in (seed, epoch)
    assert _flat(_targets(factory, BatchContext(1))) != order
    again = dataloader_batches(DataLoader(data, batch_size=2, shuffle=True), seed=4)
    assert _flat(_targets(again, BatchContext(0))) == order
    for nranks in (2, 3):
        for rank in range(nranks):
            share = _targets(factory, BatchContext(0, rank, nranks))
            assert _flat(share) == order[rank::nranks]
            assert all(len(b) <= 2 for b in share)


def test_dataloader_batches_refusals() -> None:
    """api/batches.md, dataloader_batches: "ConfigurationError: `loader` is neither, a factory
    returned something else, a sharding sampler disagrees with the context, or one loader over an
    `IterableDataset` is asked for several ranks"."""
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

    data = TensorDataset(torch.arange(8.0)[:, None], torch.arange(8))

    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter([(torch.zeros(1), torch.tensor(0))])

    with pytest.raises(ConfigurationError):
        dataloader_batches([1, 2, 3])  # type: ignore[arg-type]
    wrong = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ConfigurationError) as caught:
        anyio.run(_collect, dataloader_batches(wrong)(BatchContext(0, 1, 2)))
    assert "rank" in str(caught.value)
    with pytest.raises(ConfigurationError) as caught:
        anyio.run(_collect, dataloader_batches(DataLoader(Stream()))(BatchContext(0, 0, 2)))
    assert "IterableDataset" in str(caught.value)
    with pytest.raises(ConfigurationError):
        anyio.run(_collect, dataloader_batches(lambda context: [1, 2])(BatchContext(0)))


class _Ending:
    """An EndingBatchStream: its batches, then `source_ended` once they are all read."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.ended = False

    @property
    def source_ended(self) -> bool:
        return self.ended

    async def __aiter__(self) -> Any:
        for batch in self.batches:
            yield batch
        self.ended = True


def test_an_epoch_without_batches_whose_source_ended_ends_the_run() -> None:
    """api/batches.md, EndingBatchStream: "`source_ended` is `True` once no batch will ever come
    again ... A training epoch in which no rank had a batch and whose stream says so ends the run
    (StreamExhausted) instead of failing with "the batch streams were empty"" (errors:
    StreamExhausted is "Raised by `lamploop.one_epoch` instead of a plain BatchError")."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    assert lamploop.batches.source_ended(_Ending([])) is False
    assert lamploop.batches.source_ended(object()) is False
    model = lamploop.SupervisedModel(torch.nn.Linear(3, 2))
    with pytest.raises(lamploop.errors.StreamExhausted):
        anyio.run(
            lambda: lamploop.one_epoch(model=model, batches=_Ending([]), step_optimizer=lambda: None, epoch=0)
        )
    with pytest.raises(lamploop.errors.BatchError) as caught:
        anyio.run(
            lambda: lamploop.one_epoch(
                model=model, batches=_AsyncList([]), step_optimizer=lambda: None, epoch=0
            )
        )
    assert not isinstance(caught.value, lamploop.errors.StreamExhausted)
    state = lamploop.fit(
        model=model,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lambda context: _Ending(batches if context.epoch < 2 else []),
        max_epochs=5,
        reporters=[],
    )
    assert [entry.epoch for entry in state.learning_curve] == [0, 1]


class _AsyncList:
    """A plain batch stream (not an EndingBatchStream)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    async def __aiter__(self) -> Any:
        for batch in self.batches:
            yield batch


# --------------------------------------------------------------------------------------------
# docs/how-to/multi-node.md
# --------------------------------------------------------------------------------------------


def _spec(*shapes: tuple[int, int], dtype: torch.dtype = torch.float32, names: str = "ab") -> Any:
    module = torch.nn.Module()
    for name, (inputs, outputs) in zip(names, shapes, strict=True):
        setattr(module, name, torch.nn.Linear(inputs, outputs).to(dtype))
    return lamploop.model_spec(module)


async def _meet(
    follower_spec: Any, follower_token: str, *, root_delay: float = 0.0, join_timeout: float = 10.0
) -> dict[str, Any]:
    """A root and a follower of multi-node.md's by-hand channel, in this process."""
    port, out = free_port(), {}
    root_spec = _spec((3, 4), (4, 2))

    async def follower() -> None:
        try:
            async with lamploop.TcpControlFollower(
                host="127.0.0.1",
                port=port,
                rank=1,
                nranks=2,
                token=follower_token,
                model_spec=follower_spec,
                connect_timeout=10,
            ) as control:
                rendezvous, _ = await control.join()
                out["follower"] = rendezvous
        except Exception as error:
            out["follower"] = error

    rendezvous = lamploop.control.Rendezvous(host="127.0.0.1", port=4321)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(follower)
            await anyio.sleep(root_delay)
            try:
                async with lamploop.TcpControlRoot(
                    port=port, nranks=2, token="the-token", model_spec=root_spec, join_timeout=join_timeout
                ) as root:
                    await root.on_rendezvous_ready(rendezvous)
                    out["root"] = rendezvous
            except Exception as error:
                out["root"] = error
    return out


@pytest.mark.parametrize(
    ("follower_spec", "tensor"),
    [
        (_spec((3, 4), (4, 5)), "b.weight"),
        (_spec((3, 4), (4, 2), dtype=torch.float64), "a.weight"),
        (_spec((3, 4), (4, 2), names="ac"), "b.weight"),
    ],
    ids=["shape", "dtype", "name"],
)
def test_handshake_refuses_another_model_naming_the_first_different_tensor(
    follower_spec: Any, tensor: str
) -> None:
    """multi-node.md: "the control channel's handshake compares the parameter names, shapes and
    dtypes (`lamploop.model_spec(module)`) and refuses a rank whose model differs, naming the
    first different tensor"."""
    out = anyio.run(_meet, follower_spec, "the-token")
    assert isinstance(out["follower"], HandshakeError), out
    assert isinstance(out["root"], HandshakeError), out
    for error in (out["follower"], out["root"]):
        assert f"'{tensor}'" in str(error)
        assert "differs" in str(error)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_root_join_timeout_names_missing_ranks_and_the_refused_token() -> None:
    """multi-node.md: "The root waits `join_timeout` (60 s) for all of them, then fails naming the
    ranks that are missing and quoting the last refused connections (a rank started with the wrong
    token shows up there)." With join_timeout=2 s."""
    started = time.monotonic()
    out = anyio.run(lambda: _meet(_spec((3, 4), (4, 2)), "wrong-token", join_timeout=2.0))
    assert isinstance(out["root"], HandshakeError), out
    message = str(out["root"])
    assert "missing ranks [1]" in message
    assert "token" in message
    assert "refused" in message
    assert 1.5 < time.monotonic() - started < 20
    assert isinstance(out["follower"], HandshakeError)
    assert "token" in str(out["follower"])


def test_followers_may_start_first() -> None:
    """multi-node.md: "Followers may start first: they retry connecting for `connect_timeout`
    (60 s)." The follower starts 1.5 s before the root listens and still receives the root's
    rendezvous."""
    out = anyio.run(lambda: _meet(_spec((3, 4), (4, 2)), "the-token", root_delay=1.5))
    assert out["root"] == lamploop.control.Rendezvous(host="127.0.0.1", port=4321)
    assert out["follower"] == out["root"]


@pytest.mark.parametrize(
    ("extra", "host", "port"),
    [
        ({"SLURM_JOB_NODELIST": "node[07-09,12],gpu[1-2]", "SLURM_JOB_ID": "123456"}, "node07", 23456),
        ({"SLURM_JOB_NODELIST": "gpu3", "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9"}, "gpu3", 29511),
        ({"SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9", "SLURM_JOB_ID": "40001"}, "10.9.9.9", 20001),
        (
            {"LAMPLOOP_ROOT_ADDR": "10.1.1.1", "LAMPLOOP_CONTROL_PORT": "4242", "SLURM_JOB_NODELIST": "a1"},
            "10.1.1.1",
            4242,
        ),
    ],
)
def test_slurm_root_address_and_control_port(extra: dict[str, str], host: str, port: int) -> None:
    """multi-node.md, Slurm: "lamploop reads `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID`.
    The root's address is `LAMPLOOP_ROOT_ADDR` if set, else the first host of
    `SLURM_JOB_NODELIST` ..., else `SLURM_LAUNCH_NODE_IPADDR`. The control port is
    `LAMPLOOP_CONTROL_PORT` if set, else `20000 + SLURM_JOB_ID % 20000` ..., else 29511.\""""
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "LAMPLOOP_TOKEN": "t", **extra}
    launched = launch_env(env)
    assert launched is not None
    assert (launched.launcher, launched.rank, launched.world_size, launched.local_rank) == ("slurm", 3, 8, 1)
    assert (launched.root_host, launched.control_port) == (host, port)
    if "SLURM_JOB_ID" in extra and "LAMPLOOP_CONTROL_PORT" not in extra:
        assert port == 20000 + int(extra["SLURM_JOB_ID"]) % 20000
    assert slurm_first_host("node[01-03,07],gpu[1-2]") == "node01"


def test_slurm_requires_a_token() -> None:
    """multi-node.md: "`LAMPLOOP_TOKEN` is required under Slurm." Without it, a ConfigurationError
    that names the variable."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n1"}
    with pytest.raises(ConfigurationError) as caught:
        launch_env(env)
    assert "LAMPLOOP_TOKEN" in str(caught.value)


def test_torchrun_variables_and_fixed_control_port() -> None:
    """multi-node.md, torchrun: "lamploop reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`
    and `MASTER_PORT`. ... Setting `LAMPLOOP_CONTROL_PORT` fixes the port instead.\""""
    env = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500",
    }
    launched = launch_env(env)
    assert launched is not None
    assert (launched.launcher, launched.rank, launched.world_size, launched.local_rank) == (
        "torchrun",
        2,
        4,
        0,
    )
    assert launched.root_host == "10.0.0.5"
    assert launched.control_port is None  # rank 0 picks a free port and publishes it
    fixed = launch_env({**env, "LAMPLOOP_CONTROL_PORT": "31000"})
    assert fixed is not None
    assert fixed.control_port == 31000


def _this_machines_address() -> str:
    """The address of the interface that routes off this machine (not a loopback one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        address = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no address but a loopback one")
    return address


def test_torchrun_store_off_loopback_without_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """multi-node.md: "without it, rank 0 makes a fresh token and publishes it in torchrun's store
    only when that store is on a loopback address (one machine), or when
    `LAMPLOOP_PUBLISH_TOKEN=1` says the network is trusted ...; otherwise it refuses to start and
    says so." Rank 0 of a torchrun launch whose MASTER_ADDR is this machine's address off
    loopback."""
    for name in ("LAMPLOOP_TOKEN", "LAMPLOOP_PUBLISH_TOKEN", "LAMPLOOP_CONTROL_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": _this_machines_address(),
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as caught:
        _small_fit(None, 1, device="cpu")
    message = str(caught.value)
    assert "LAMPLOOP_TOKEN" in message
    assert "LAMPLOOP_PUBLISH_TOKEN" in message


def _start_follower(tmp_path: Path, port: int, token: str, *extra: str) -> tuple[Any, Path]:
    record = tmp_path / f"follower-{port}.json"
    argv = [sys.executable, str(WORKER), "follower", str(port), str(record), *extra]
    proc = warm_start.popen(
        argv, env=_env(LAMPLOOP_TOKEN=token), stdout=subprocess.DEVNULL, stderr=tmp_path / "follower.err"
    )
    return proc, record


def _reference_two_ranks(
    initial: torch.nn.Module, factory: Any, epochs: int, lr: float = 0.1
) -> dict[str, torch.Tensor]:
    """Plain float64 SGD from rank 0's initial weights: each step the mean loss over rank 0's and
    rank 1's batch of that step (tensor_batches deals batch i to rank i % 2)."""
    reference = initial.double()
    for epoch in range(epochs):
        shares = [anyio.run(_collect, factory(BatchContext(epoch, rank, 2))) for rank in range(2)]
        for (x0, y0), (x1, y1) in zip(*shares, strict=True):
            features, target = torch.cat([x0, x1]).double(), torch.cat([y0, y1])
            loss = torch.nn.functional.cross_entropy(reference(features), target)
            reference.zero_grad()
            loss.backward()
            with torch.no_grad():
                for parameter in reference.parameters():
                    parameter -= lr * parameter.grad
    return reference.state_dict()


async def _tcp_root(port: int, token: str, model: Any, max_epochs: int, **keywords: Any) -> Any:
    async with lamploop.TcpControlRoot(
        port=port, nranks=2, token=token, model_spec=lamploop.model_spec(model.module)
    ) as control:
        return await lamploop.drive_distributed_training(
            nranks=2,
            device="cpu",
            control=control,
            model=model,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=worker.tcp_batches(keywords.pop("batch_sleep", 0.0)),
            validation_batches=None,
            max_epochs=max_epochs,
            **keywords,
        )


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_by_hand_tcp_ranks_train_as_one_batch_of_both(tmp_path: Path) -> None:
    """multi-node.md, "By hand: lamploop's own TCP control channel": a root running
    `drive_distributed_training` over a `TcpControlRoot` and a follower process running
    `follow_distributed_training` over a `TcpControlFollower` (token from the environment); "the
    root's weights are then broadcast, so the initial weights may differ" (the follower seeds its
    model differently). Both ranks end with the parameters of a float64 loop over the union of
    each step's two batches, and the follower's equal the root's."""
    port, token = free_port(), secrets.token_hex(16)
    proc, record = _start_follower(tmp_path, port, token)
    try:
        model = worker.tcp_model(seed=0)
        state = anyio.run(lambda: _tcp_root(port, token, model, 2))
        assert proc.wait(timeout=60) == 0, (tmp_path / "follower.err").read_text()
    finally:
        _kill_group(proc)
    assert [e.epoch for e in state.learning_curve] == [0, 1]
    result = load_record(record)
    assert result["outcome"] == "done", result
    assert _same_tensors(result["params"], _state_dict(model.module))
    x, y = worker.data()
    factory = tensor_batches(x.float(), y, batch_size=4, seed=1)
    for name, tensor in _reference_two_ranks(worker.tcp_model(seed=0).module, factory, 2).items():
        torch.testing.assert_close(model.module.state_dict()[name].double(), tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "freezes"])
def test_a_lost_rank_ends_the_root_with_peer_lost_error_naming_it(
    tmp_path: Path, how: signal.Signals
) -> None:
    """multi-node.md: "A rank that dies, freezes or is cut off ends every other rank within the
    heartbeat timeout (4 s by default) with `lamploop.errors.PeerLostError`, whose `.rank` names
    it". The follower process is SIGKILLed (dies) or SIGSTOPped (freezes) after the first epoch;
    the root uses the default heartbeat settings."""
    port, token = free_port(), secrets.token_hex(16)
    proc, _ = _start_follower(tmp_path, port, token, "--batch-sleep", "0.05")
    when: dict[str, float] = {}

    async def after_epoch(state: Any, schedule_state: Any) -> None:
        if "signalled" not in when:
            proc.send_signal(how)
            when["signalled"] = time.monotonic()

    try:
        with pytest.raises(PeerLostError) as caught:
            anyio.run(
                lambda: _tcp_root(
                    port, token, worker.tcp_model(0), 200, batch_sleep=0.05, checkpoint_state=after_epoch
                )
            )
        detected = time.monotonic() - when["signalled"]
    finally:
        _kill_group(proc)
    assert caught.value.rank == 1
    assert detected < 10.0 + 1.0, f"detected after {detected:.1f} s"


def test_default_heartbeat_timeout_is_the_documented_four_seconds() -> None:
    """multi-node.md, "A lost rank": "A rank that dies, freezes or is cut off ends every other
    rank within the heartbeat timeout (4 s by default, ...)". The defaults of the page's by-hand
    channel (`TcpControlRoot`, `TcpControlFollower`) and of its script's `fit`.  (The page said
    10 s, the default before issue 21.)"""
    defaults = {
        callable_.__name__: inspect.signature(callable_).parameters["heartbeat_timeout"].default
        for callable_ in (lamploop.TcpControlRoot, lamploop.TcpControlFollower, lamploop.fit)
    }
    assert defaults == {"TcpControlRoot": 4.0, "TcpControlFollower": 4.0, "fit": 4.0}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_asking_for_another_strategy_fails_the_run_at_start(tmp_path: Path) -> None:
    """multi-node.md: "the same per-rank settings (`lamploop.TrainingSettings.EVERY_RANK`: ...
    strategy ...): the same script gives them, and a rank that asks for another strategy fails the
    run at start" (before any epoch: the root's checkpoint callback is never called)."""
    assert "strategy" in lamploop.TrainingSettings.EVERY_RANK
    port, token = free_port(), secrets.token_hex(16)
    proc, record = _start_follower(tmp_path, port, token, "--strategy", "reduce_to_root")
    epochs: list[Any] = []

    async def after_epoch(state: Any, schedule_state: Any) -> None:
        epochs.append(state)

    try:
        with pytest.raises(DistributedError) as caught:
            anyio.run(lambda: _tcp_root(port, token, worker.tcp_model(0), 2, checkpoint_state=after_epoch))
        proc.wait(timeout=60)
    finally:
        _kill_group(proc)
    assert epochs == []
    assert "strategy" in str(caught.value)
    assert "reduce_to_root" in str(caught.value)
    result = load_record(record)
    assert result["outcome"] != "done"
    assert "strategy" in result["message"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torchrun_restart_resumes_from_the_latest_checkpoint(tmp_path: Path) -> None:
    """multi-node.md: "lamploop reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
    `MASTER_PORT`. Rank 0 opens the control channel ... and publishes the port in torchrun's own
    store ... (under a key of the current restart, so `--max-restarts N` works: a restarted job
    resumes from the latest checkpoint by itself)"; "without [LAMPLOOP_TOKEN], rank 0 makes a
    fresh token and publishes it in torchrun's store only when that store is on a loopback
    address"; "Only rank 0 checkpoints, reports and gets the state back; the others return
    `None`." Rank 1 dies as epoch 2 starts; the restarted job trains epochs 2 and 3 only and ends
    with the parameters of a float64 loop over 4 uninterrupted epochs."""
    out, records = tmp_path / "run", tmp_path / "records"
    records.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--nproc-per-node", "2", "--max-restarts", "1", "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(free_port()), str(WORKER), "torchrun", str(out), str(records)]
    env = {k: v for k, v in _env().items() if not k.startswith("LAMPLOOP_")}
    log = tmp_path / "torchrun.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout=85)
        finally:
            _kill_group(proc)
    assert status == 0, log.read_text()[-3000:]
    assert sorted(p.name for p in records.iterdir() if p.suffix == ".json") == [
        "rank0-restart1.json",
        "rank1-restart1.json",
    ]
    root, follower = (load_record(records / f"rank{r}-restart1.json") for r in range(2))
    assert root["state_is_none"] is False
    assert root["epochs"] == list(range(worker.TORCHRUN_EPOCHS))
    assert follower["state_is_none"] is True
    assert root["trained"] == [2, 3], root["trained"]
    assert follower["trained"] == [2, 3], follower["trained"]
    assert (out / "latest").read_text().strip() == "epoch-000004"
    x, y = worker.torchrun_data()
    factory = tensor_batches(x, y, batch_size=8, seed=2)
    reference = _reference_two_ranks(worker.torchrun_model(0), factory, worker.TORCHRUN_EPOCHS)
    for name, tensor in reference.items():
        torch.testing.assert_close(root["params"][name].double(), tensor, rtol=1e-5, atol=1e-6)
    assert _same_tensors(root["params"], follower["params"])


# --------------------------------------------------------------------------------------------
# docs/how-to/char-gpt.md and examples/char_gpt/README.md
# --------------------------------------------------------------------------------------------


def _char_gpt(*args: str, timeout: float = 80) -> subprocess.CompletedProcess[str]:
    return warm_start.run(
        [sys.executable, str(CHAR_GPT / "train.py"), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_char_gpt_command_line_checkpoints_and_resumes(tmp_path: Path) -> None:
    """char-gpt.md: "Each epoch prints its training and validation loss in nats per character
    (chance is ln(vocabulary), about 4.6); the run ends with a sample of generated text.
    Checkpoints go to `--out` ... after every epoch, and every N steps with `--checkpoint-every N`;
    the same command resumes from the latest one" (`--epochs 12`: "again: resumes at epoch 10,
    trains 2 more"); README: "a sample of generated text that begins with `def `". Shrunk with
    `--steps-per-epoch 3`."""
    out = tmp_path / "out"
    common = ["--quick", "--precision", "32", "--device", "cpu", "--steps-per-epoch", "3", "--sample", "24"]
    first = _char_gpt(*common, "--epochs", "1", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    epoch0 = re.findall(r"^epoch 0: train loss (\d+\.\d+), validation loss (\d+\.\d+)$", first.stdout, re.M)
    assert len(epoch0) == 1, first.stdout
    vocabulary = int(re.search(r"vocabulary (\d+)", first.stdout).group(1))
    chance = float(re.search(r"ln\(vocab\) = (\d+\.\d+)", first.stdout).group(1))
    assert chance == pytest.approx(math.log(vocabulary), abs=0.005)
    assert 0 < float(epoch0[0][0]) < math.log(vocabulary) + 0.5  # per character, about chance at first
    sample = first.stdout.split("nats is chance):\n", 1)[1]
    assert sample.startswith("def ")
    assert sorted(p.name for p in out.iterdir()) == ["epoch-000001", "latest"]

    second = _char_gpt(*common, "--epochs", "2", "--checkpoint-every", "2", "--out", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    lines = re.findall(
        r"^epoch (\d): train loss (\d+\.\d+), validation loss (\d+\.\d+)$", second.stdout, re.M
    )
    assert [line[0] for line in lines] == ["0", "1"]
    assert lines[0][1:] == epoch0[0]  # epoch 0 came from the checkpoint, not trained again
    names = sorted(p.name for p in out.iterdir())
    assert "epoch-000002" in names
    assert "epoch-000001-step-000002" in names  # --checkpoint-every 2, in the resumed epoch 1
    assert not any(n.startswith("epoch-000000-step") for n in names)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_char_gpt_help_lists_the_documented_flags() -> None:
    """char-gpt.md: "`--precision bf16` (the default) ..., `32` turns that off; `--device auto`
    (the default) ... `--help` lists the rest" (README: `--ranks`, `--out`, `--epochs`,
    `--checkpoint-every N`, `--no-resume`)."""
    result = _char_gpt("--help", timeout=50)
    assert result.returncode == 0, result.stderr
    for flag in ("--quick", "--ranks", "--precision", "--device", "--out", "--epochs", "--checkpoint-every"):
        assert flag in result.stdout, flag
    assert "--no-resume" in result.stdout
    assert re.search(r"\{32,bf16,fp16\}", result.stdout)


def _char_gpt_module() -> dict[str, Any]:
    """examples/char_gpt/train.py's names, and its corpus.py's and gpt.py's."""
    sys.path.insert(0, str(CHAR_GPT))
    try:
        namespace = runpy.run_path(str(CHAR_GPT / "train.py"), run_name="char_gpt_train")
        corpus = importlib.import_module("corpus")
        gpt = importlib.import_module("gpt")
    finally:
        sys.path.remove(str(CHAR_GPT))
    return {**namespace, "draw_batch": corpus.draw_batch, "token_loss": gpt.token_loss}


@pytest.fixture(scope="module")
def char_gpt() -> dict[str, Any]:
    namespace = _char_gpt_module()
    config = attrs.evolve(namespace["QUICK"], steps_per_epoch=3, validation_batches=2, epochs=2)
    corpus = namespace["load_corpus"](config.max_chars)
    return {"ns": namespace, "config": config, "corpus": corpus}


def test_char_gpt_token_loss_is_a_per_character_sum_float64(char_gpt: dict[str, Any]) -> None:
    """char-gpt.md: "`token_loss` returns the cross entropy **summed** over the batch's characters
    and their number: each character is an example"; checked against a float64 cross entropy
    computed here, character by character."""
    token_loss = char_gpt["ns"]["token_loss"]
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(3, 5, 7, generator=g), torch.randint(0, 7, (3, 5), generator=g)
    total, count = token_loss(logits, targets)
    expected = 0.0
    for b in range(3):
        for t in range(5):
            row = logits[b, t].double()
            expected += (torch.logsumexp(row, 0) - row[targets[b, t]]).item()
    assert count == 15
    assert float(total) == pytest.approx(expected, rel=1e-6)


def test_char_gpt_batches_are_pure_and_dealt_per_step(char_gpt: dict[str, Any]) -> None:
    """char-gpt.md: "`training_batches` draws random windows as nanoGPT's `get_batch` does, from a
    generator seeded with (seed, epoch): the batches are a pure function of (seed, epoch, rank)
    ... With two ranks each step trains on one batch per rank." Windows of the text, targets
    shifted by one; two ranks' batches of step k are the 2k-th and (2k+1)-th draws."""
    corpus = char_gpt["corpus"]
    make = char_gpt["ns"]["training_batches"]
    factory = make(corpus.train, block_size=8, batch_size=3, steps_per_epoch=4, seed=7)
    one = anyio.run(_collect, factory(BatchContext(2)))
    assert len(one) == 4
    assert all(
        torch.equal(a[0], b[0])
        for a, b in zip(one, anyio.run(_collect, factory(BatchContext(2))), strict=True)
    )
    data = corpus.train.tolist()
    for x, y in one:
        for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
            start = next(
                i for i in range(len(data) - 8) if data[i : i + 8] == row_x and data[i + 1 : i + 9] == row_y
            )
            assert start >= 0
    generator = torch.Generator().manual_seed(epoch_seed(7, 2))
    draws = [char_gpt["ns"]["draw_batch"](corpus.train, 8, 3, generator) for _ in range(8)]
    for rank in range(2):
        share = anyio.run(_collect, factory(BatchContext(2, rank, 2)))
        assert len(share) == 4
        assert all(torch.equal(s[0], d[0]) for s, d in zip(share, draws[rank::2], strict=True))


def test_char_gpt_resume_is_bitwise_with_dropout_and_keeps_the_tie(
    tmp_path: Path, char_gpt: dict[str, Any]
) -> None:
    """char-gpt.md: "a run stopped after an epoch and resumed ends with bitwise the parameters and
    learning curve of the uninterrupted run (dropout is on, so the restored RNG states matter)";
    "The weight tying (`wte.weight is lm_head.weight`) needs nothing: the checkpoint ... restores
    the tie"; README: "`--no-resume` starts over" (`train(..., resume=False)`)."""
    train, config, corpus = char_gpt["ns"]["train"], char_gpt["config"], char_gpt["corpus"]
    assert config.dropout > 0
    keywords = {"reporters": [], "device": "cpu"}
    straight, straight_state = train(config, corpus, out=None, **keywords)
    out = tmp_path / "run"
    train(config, corpus, out=out, max_epochs=1, **keywords)
    resumed, resumed_state = train(config, corpus, out=out, **keywords)
    assert resumed.wte.weight is resumed.lm_head.weight
    assert resumed_state.learning_curve == straight_state.learning_curve
    assert _same_tensors(_state_dict(resumed), _state_dict(straight))
    _, over_state = train(config, corpus, out=out, max_epochs=1, resume=False, **keywords)
    assert [e.epoch for e in over_state.learning_curve] == [0]
    assert over_state.learning_curve[0] == straight_state.learning_curve[0]


def test_char_gpt_checkpoint_stores_the_tied_matrix_under_both_names(
    tmp_path: Path, char_gpt: dict[str, Any]
) -> None:
    """char-gpt.md: "The weight tying (`wte.weight is lm_head.weight`) needs nothing: the
    checkpoint stores the shared matrix under both names (a safetensors file has no aliases ...)
    and loading it into the model keeps the tie." The safetensors header of model.safetensors is
    read here.  (The page said "once", which safetensors cannot do; it was corrected.)"""
    train, config, corpus = char_gpt["ns"]["train"], char_gpt["config"], char_gpt["corpus"]
    model, _ = train(config, corpus, out=tmp_path, max_epochs=1, reporters=[], device="cpu")
    assert model.wte.weight is model.lm_head.weight
    data = (tmp_path / "epoch-000001" / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    shape = list(model.wte.weight.shape)
    ranges = {
        tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__" and v["shape"] == shape
    }
    names = sorted(k for k, v in header.items() if k != "__metadata__" and v["shape"] == shape)
    assert names == ["lm_head.weight", "wte.weight"], names
    assert len(ranges) == 2, ranges
    body = data[8 + int.from_bytes(data[:8], "little") :]
    first, second = (body[slice(*header[name]["data_offsets"])] for name in names)
    assert first == second  # the same matrix, twice
    model.load_state_dict(model.state_dict())  # loading by name into the tied model
    assert model.wte.weight is model.lm_head.weight


# --------------------------------------------------------------------------------------------
# examples/two_processes.py and examples/digits_epochs.py
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_processes_example(tmp_path: Path) -> None:
    """examples/two_processes.py: "Rank 0 listens on a free port with a fresh token, starts this
    script again as rank 1 ..., drives 3 epochs and checks the losses went down." It prints the
    three epochs' training losses, decreasing, and the best epoch among them, and exits 0."""
    result = warm_start.run(
        [sys.executable, str(EXAMPLES / "two_processes.py")],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=85,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    found = re.search(r"training loss per epoch: \[([^\]]*)\]; best epoch (\d+)", result.stdout)
    assert found, result.stdout
    losses = [float(v) for v in found.group(1).split(",")]
    assert len(losses) == 3
    assert losses[-1] < losses[0]
    assert int(found.group(2)) in (0, 1, 2)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_digits_epochs_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/digits_epochs.py: "`epochs` drives, `one_epoch` trains and validates, a
    `Checkpointer` writes each epoch, and the best model (lowest smoothed validation loss) is
    restored at the end." Its `main`, run here: 20 epochs printed, `keep_last=2` checkpoints left,
    the printed best epoch is the argmin of the smoothing recomputed here from the raw losses
    (factor 0.5), and the accuracy it prints is over 0.9."""
    namespace = runpy.run_path(str(EXAMPLES / "digits_epochs.py"), run_name="digits_epochs")
    anyio.run(namespace["main"], str(tmp_path))
    printed = capsys.readouterr().out
    assert len(re.findall(r"^epoch \d+: ", printed, re.M)) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-000019", "epoch-000020", "latest"]
    curve = lamploop.load_checkpoint(tmp_path).state.loop_state.learning_curve
    smoothed: list[float] = []
    for entry in curve:
        raw = entry.validation_loss[1]
        smoothed.append(raw if not smoothed else raw * 0.5 + smoothed[-1] * 0.5)
        assert entry.validation_loss[0] == pytest.approx(smoothed[-1], rel=1e-12)
    found = re.search(r"best epoch (\d+); validation accuracy (\d\.\d+)", printed)
    assert found, printed
    assert int(found.group(1)) == int(np.argmin(smoothed))
    assert float(found.group(2)) > 0.9
