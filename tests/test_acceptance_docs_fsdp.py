"""Acceptance tests of the ``fsdp`` strategy written from the documentation only (not the source).

Each test quotes the page it checks: docs/strategies.md ("Fully sharded: fsdp"), docs/checkpoints.md
("Sharded checkpoints"), docs/architecture.md ("Adding a setting"), docs/cli.md (``lamploop
inspect``) and the drivers' docstrings.  The references are written here: one process training a
float64 MLP with Adam on every optimizer step's examples of every rank (docs/strategies.md: "the
gradient of a step is that of the mean loss over every example of every rank"), to ``1e-10``
(the tolerance docs/strategies.md states for its own check).  Real processes (``fit`` starts its
ranks by running the worker's command line again), real sockets, real files.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support import ROOT, WORKERS, free_port
from workers import acceptance_fsdp as data
from workers import warm_start

import lamploop
from lamploop.checkpoint import Checkpointer, load_checkpoint, save_checkpoint, verify_checkpoint
from lamploop.distributed import local_data_parallel_training_loop
from lamploop.errors import CheckpointError, ConfigurationError, LamploopError

TOLERANCE = 1e-10
WORKER = WORKERS / "acceptance_fsdp.py"
PICKLE_MAGIC = 0x80
"""The first byte of every pickle since protocol 2 (torch.save's zip files start with ``PK``)."""
SHARD_INDEX = "sharded.json"
STEP = "epoch-000001-step-000002"
"""A step-boundary checkpoint where both ranks have batches left in the epoch."""
TAIL = "epoch-000001-step-000004"
"""A step-boundary checkpoint after rank 1's stream ended (the last step is rank 0's alone)."""
LAMPLOOP_COMMAND = Path(sys.executable).parent / "lamploop"
"""The ``lamploop`` command the package installs beside this interpreter (docs/cli.md)."""


# --------------------------------------------------------------------------------------------
# the reference: one process, float64, every step's examples of every rank


@attrs.frozen
class Reference:
    """What one-process training on the union of the ranks' steps gives after each epoch."""

    after_epoch: list[dict[str, torch.Tensor]]  # parameters after epoch e
    best_after_epoch: list[dict[str, torch.Tensor] | None]  # the best model known after epoch e
    best_epoch: int
    training_losses: list[float]
    validation_losses: list[float]
    adam_state: list[dict[str, torch.Tensor]]  # after the last epoch, per parameter in order


def _says(error: object, *words: str) -> None:
    """``error``'s message contains every one of ``words``."""
    text = str(error)
    missing = [word for word in words if word not in text]
    assert not missing, f"{missing} not in {text!r}"


def _clone(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


@pytest.fixture(scope="module")
def reference() -> Reference:
    net = data.module()
    optimizer = data.optimizer(net.parameters())
    after, best_after, training, validation = [], [], [], []
    best: dict[str, torch.Tensor] | None = None
    best_loss, best_epoch = float("inf"), -1
    for epoch in range(data.MAX_EPOCHS):
        loss_sum, count = 0.0, 0
        for x, y in data.steps_of(epoch):
            optimizer.zero_grad()
            summed = torch.nn.functional.cross_entropy(net(x), y, reduction="sum")
            (summed / len(y)).backward()
            optimizer.step()
            loss_sum, count = loss_sum + summed.item(), count + len(y)
        training.append(loss_sum / count)
        with torch.no_grad():
            vx, vy = data.validation_set()
            loss = torch.nn.functional.cross_entropy(net(vx), vy, reduction="sum").item() / len(vy)
        validation.append(loss)
        if epoch in data.ELIGIBLE and loss < best_loss:
            best, best_loss, best_epoch = _clone(net), loss, epoch
        after.append(_clone(net))
        best_after.append(best)
    adam = [optimizer.state[p] for p in net.parameters()]
    return Reference(
        after_epoch=after,
        best_after_epoch=best_after,
        best_epoch=best_epoch,
        training_losses=training,
        validation_losses=validation,
        adam_state=[{k: torch.as_tensor(v).clone() for k, v in s.items()} for s in adam],
    )


def _assert_close(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str
) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: tensor names {sorted(actual)} != {sorted(expected)}"
    for name, value in expected.items():
        got = torch.as_tensor(actual[name])
        assert (got.shape, got.dtype) == (value.shape, value.dtype), f"{what}: {name} {got.shape} {got.dtype}"
        difference = (got - value).abs().max().item()
        assert difference <= TOLERANCE, f"{what}: {name} differs by {difference:.3g}"


def _assert_curve(curve: list[dict[str, Any]], reference: Reference) -> None:
    assert [entry["epoch"] for entry in curve] == list(range(data.MAX_EPOCHS))
    for entry, training, validation in zip(
        curve, reference.training_losses, reference.validation_losses, strict=True
    ):
        assert abs(entry["training_loss"] - training) <= TOLERANCE, (entry, training)
        assert entry["validation_loss"] is not None
        assert abs(entry["validation_loss"][1] - validation) <= TOLERANCE, (entry, validation)


# --------------------------------------------------------------------------------------------
# the runs (each once per module)


@attrs.define
class Launched:
    """A worker process started now, its output in a file, waited for (bounded) when needed."""

    arguments: list[str]
    process: Any  # a subprocess.Popen or a warm_start.WarmProcess
    log: Path
    out: Path

    def wait(self, timeout: float = 150) -> tuple[int, str]:
        """The exit status and the output; kills the process (and fails) past ``timeout`` s."""
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            msg = f"{self.arguments}: still running after {timeout:g} s\n{self.log.read_text()[-6000:]}"
            raise AssertionError(msg) from None
        return status, self.log.read_text(errors="replace")

    def result(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Waits for a successful run; its ``result.json`` and the module it wrote."""
        status, output = self.wait()
        assert status == 0, f"{self.arguments}: exit {status}\n{output[-12000:]}"
        return json.loads((self.out / "result.json").read_text()), load_file(self.out / "model.safetensors")


def _launch(out: Path, *arguments: str) -> Launched:
    """``python tests/workers/acceptance_fsdp.py MODE OUT ...`` (``fit`` starts its other ranks)."""
    out.mkdir(parents=True)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAMPLOOP_")}
    log = out.parent / f"{out.name}.log"
    command = [arguments[0], str(out), *arguments[1:]]
    log.write_bytes(b"")
    process = warm_start.popen(
        [sys.executable, str(WORKER), *command],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=environment,
    )
    return Launched(command, process, log, out)


def _resumable_copy(run: Path, name: str, into: Path) -> Path:
    """A run directory holding only ``run/name`` and a ``latest`` naming it."""
    into.mkdir(parents=True)
    shutil.copytree(run / name, into / name)
    (into / "latest").write_text(name + "\n")
    return into


@attrs.frozen
class Runs:
    """The module's multi-process runs; those after the first run side by side in the background."""

    checkpoints: Path  # the 2-rank fit's run directory
    result: dict[str, Any]
    model: dict[str, torch.Tensor]
    drivers: tuple[Launched, Launched]  # root, follower
    drivers_checkpoints: Path
    three_ranks: Launched  # fit at 3 ranks from the 2-rank epoch-000002
    three_ranks_checkpoints: Path
    step: Launched  # fit at 2 ranks from epoch-000001-step-000002
    tail: Launched  # fit at 2 ranks from epoch-000001-step-000004


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """``fit(strategy="fsdp", world_size=2)``, 3 epochs, checkpoints every epoch and every 2 steps
    (keep_last=None); beside it the drivers' run, and after it the resumes from its checkpoints."""
    base = tmp_path_factory.mktemp("fsdp")
    port, token = free_port(), secrets.token_hex(16)
    follower = _launch(base / "follower", "follow", str(port), token)
    root = _launch(base / "drive", "drive", str(port), token, str(base / "drive-run"))
    started = [follower, root]
    try:
        fit = _launch(base / "fit-2", "fit", "2", str(base / "run"))
        started.append(fit)
        result, model = fit.result()
        three = _resumable_copy(base / "run", "epoch-000002", base / "three-run")
        resumes = [
            _launch(base / "fit-3", "fit", "3", str(three)),
            _launch(base / "step", "fit", "2", str(_resumable_copy(base / "run", STEP, base / "step-run"))),
            _launch(base / "tail", "fit", "2", str(_resumable_copy(base / "run", TAIL, base / "tail-run"))),
        ]
        started += resumes
        yield Runs(
            base / "run", result, model, (root, follower), base / "drive-run", resumes[0], three, *resumes[1:]
        )
    finally:
        for launched in started:
            if launched.process.poll() is None:
                launched.process.kill()
                launched.process.wait(timeout=10)


class _Counted:
    """A batch factory that counts its calls: a refusal "up front" never asks for a batch."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, context: lamploop.BatchContext) -> AsyncIterator[Any]:
        self.calls += 1
        return data.train_factory(context)


def _inspect(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LAMPLOOP_COMMAND), "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


# --------------------------------------------------------------------------------------------
# 1. fit(strategy="fsdp", world_size=2) trains what one process trains (docs/strategies.md)


def test_fit_fsdp_on_two_ranks_equals_one_process_on_every_ranks_examples(
    runs: Runs, reference: Reference
) -> None:
    """strategies.md: the gradient of a step is that of the mean loss over every example of every
    rank; accumulation, uneven streams and metrics as elsewhere; "# module now holds the best
    validation epoch's model, whole, on rank 0"."""
    result, model = runs.result, runs.model
    assert reference.best_epoch == 1
    assert reference.best_epoch != data.MAX_EPOCHS - 1
    assert result["epoch"] == data.MAX_EPOCHS
    assert result["min_validation_epoch"] == reference.best_epoch
    _assert_curve(result["curve"], reference)
    best = reference.best_after_epoch[-1]
    assert best is not None
    _assert_close(model, best, "the module after fit (the best model)")


def test_fit_fsdp_releases_the_modules_storage_during_the_run_and_gives_it_back(
    runs: Runs,
) -> None:
    """strategies.md: "Your module keeps its parameter objects, but their storage is released for
    the run (each .data is an empty tensor)"; after the run "your module gets its storage back"."""
    result, model = runs.result, runs.model
    assert result["storage_during_run"] == [0] * data.MAX_EPOCHS  # seen from on_epoch on rank 0
    assert result["same_parameter_objects"] is True
    assert sum(t.numel() for t in model.values()) == 161  # 6*13 + 13 + 13*5 + 5, whole again


# --------------------------------------------------------------------------------------------
# 2. its checkpoints on disk (docs/checkpoints.md "Sharded checkpoints")


def _no_pickle_anywhere(root: Path) -> None:
    """Every file is safetensors (an 8-byte header length, then a JSON header: its first byte may
    be 0x80 by chance, so it is parsed instead), JSON or the ``latest`` line; no other file starts
    with pickle's 0x80 or a zip's ``PK`` (torch.save)."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        content = path.read_bytes()
        if path.suffix == ".safetensors":
            length = int.from_bytes(content[:8], "little")
            assert content[8:9] == b"{", f"{path}: not a safetensors header"
            json.loads(content[8 : 8 + length])
            with safe_open(path, framework="pt") as handle:
                list(handle.keys())
            continue
        assert content[:1] != bytes([PICKLE_MAGIC]), f"{path} starts with pickle's magic byte"
        assert content[:2] != b"PK", f"{path} is a zip archive (torch.save)"
        if path.suffix == ".json":
            json.loads(content)
        else:
            assert path.name == "latest", f"{path}: a file the docs do not list"
            assert content.decode().strip().startswith("epoch-"), path


def test_fsdp_checkpoint_layout_is_the_documented_one(
    runs: Runs,
) -> None:
    """checkpoints.md "A run with strategy="fsdp"": the ordinary directory (descriptor, every rank's
    RNG states, the latest pointer) with empty model/best/optimizer files, one shard file per rank
    and the index; "sharded.json": format, format_version 1, world_size, files with sha256 and
    size, tensors with their shards covering the rows exactly once; no pickle."""
    import hashlib

    run = runs.checkpoints
    names = sorted(p.name for p in run.iterdir())
    steps = [f"epoch-{e:06d}-step-{k:06d}" for e in range(data.MAX_EPOCHS) for k in (2, 4)]
    assert names == sorted(["epoch-000001", "epoch-000002", "epoch-000003", "latest", *steps])
    assert (run / "latest").read_text().strip() == "epoch-000003"
    assert not [p for p in run.iterdir() if p.name.startswith(".lamploop-tmp")]
    _no_pickle_anywhere(run)
    for directory in sorted(p for p in run.iterdir() if p.is_dir()):
        files = sorted(p.name for p in directory.iterdir())
        assert files == [
            "best_model.safetensors",
            "checkpoint.json",
            "model.safetensors",
            "optimizer.safetensors",
            "rng-rank1.safetensors",
            "rng.safetensors",
            "shard-rank00000-of-00002.safetensors",
            "shard-rank00001-of-00002.safetensors",
            SHARD_INDEX,
        ], directory
        for empty in ("model.safetensors", "best_model.safetensors", "optimizer.safetensors"):
            with safe_open(directory / empty, framework="pt") as handle:
                assert list(handle.keys()) == [], f"{directory / empty} holds tensors"
        descriptor = json.loads((directory / "checkpoint.json").read_text())
        assert descriptor["format_version"] == 2
        assert descriptor["loop_state"]["epoch"] == int(directory.name.split("-")[1])
        if "-step-" in directory.name:  # checkpoints.md: the position at a step boundary
            assert descriptor["position"]["steps_done"] == int(directory.name.split("-")[3])
        else:
            assert descriptor["position"] is None
        index = json.loads((directory / SHARD_INDEX).read_text())
        assert index["format"] == "lamploop-sharded"
        assert index["format_version"] == 1
        assert index["world_size"] == 2
        assert sorted(index["files"]) == [f for f in files if f.startswith("shard-")]
        for name, record in index["files"].items():
            content = (directory / name).read_bytes()
            assert record["size"] == len(content)
            assert record["sha256"] == hashlib.sha256(content).hexdigest()
        kinds = {key.split("/")[0] for key in index["tensors"]}
        # best_model "a file without tensors before the first" best: none inside epoch 0.
        has_best = descriptor["loop_state"]["min_validation_epoch"] is not None
        assert kinds == ({"model", "optimizer", "best"} if has_best else {"model", "optimizer"}), kinds
        assert index["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for key, tensor in index["tensors"].items():
            if not tensor["shape"]:  # a scalar (Adam's step): "rank 0's whole"
                assert [s["rank"] for s in tensor["shards"]] == [0], (key, tensor)
                continue
            rows = tensor["shape"][0]
            covered = sorted((s["offset"], s["offset"] + s["rows"]) for s in tensor["shards"])
            start = 0
            for begin, end in covered:
                assert begin == start, f"{key}: rows {covered} do not cover [0, {rows}) once"
                start = end
            assert start == rows, f"{key}: rows {covered} do not cover [0, {rows})"
        # Each shard file holds the documented names; a sharded parameter is cut over both ranks.
        for rank in (0, 1):
            with safe_open(
                directory / f"shard-rank{rank:05d}-of-00002.safetensors", framework="pt"
            ) as handle:
                keys = set(handle.keys())
            assert "model/0.weight" in keys, (rank, sorted(keys))
            assert ("best/0.weight" in keys) == has_best, (rank, sorted(keys))
            assert any(k.startswith("optimizer/0.weight/") for k in keys), (rank, sorted(keys))
        assert [s["rows"] for s in index["tensors"]["model/0.weight"]["shards"]] == [7, 6]


def test_fsdp_checkpoints_load_whole_in_one_process_and_verify(runs: Runs, reference: Reference) -> None:
    """checkpoints.md: "load_checkpoint ... reads such a checkpoint whole in one process: state.model,
    state.optimizer ... and state.best_model are the full tensors"; "verify_checkpoint checks the
    descriptor's files and the index's"."""
    run = runs.checkpoints
    report = verify_checkpoint(run)
    assert report.ok, report.problems
    for epoch in range(1, data.MAX_EPOCHS + 1):
        checkpoint = load_checkpoint(run / f"epoch-{epoch:06d}", model=data.module())
        assert checkpoint.state.loop_state.epoch == epoch
        _assert_close(checkpoint.state.model, reference.after_epoch[epoch - 1], f"epoch-{epoch:06d} model")
        best = reference.best_after_epoch[epoch - 1]
        assert best is not None
        _assert_close(checkpoint.state.best_model, best, f"epoch-{epoch:06d} best model")
    # The last one's Adam state, whole: the moments of every parameter, as one process has them.
    latest = load_checkpoint(run, model=data.module())
    assert latest.path.name == "epoch-000003"
    resumed = data.module()
    optimizer = data.optimizer(resumed.parameters())
    optimizer.load_state_dict(dict(latest.state.optimizer))  # restore_optimizer_state's core
    for parameter, expected in zip(resumed.parameters(), reference.adam_state, strict=True):
        state = optimizer.state[parameter]
        for key in ("exp_avg", "exp_avg_sq"):
            difference = (state[key] - expected[key]).abs().max().item()
            assert difference <= TOLERANCE, f"Adam {key} differs by {difference:.3g}"
        assert float(state["step"]) == float(expected["step"])


def test_lamploop_inspect_reads_the_sharded_run_and_a_one_process_copy(runs: Runs, tmp_path: Path) -> None:
    """checkpoints.md: "verify_checkpoint and lamploop inspect check such a directory too";
    strategies.md: "lamploop inspect lists the shard files and checks them"; the whole state read in
    one process is what save_checkpoint needs "for an ordinary checkpoint that lamploop inspect ...
    read[s]"; cli.md: exit status 0 when every file is intact."""
    run = runs.checkpoints
    sharded = _inspect(run)
    assert sharded.returncode == 0, sharded.stdout + sharded.stderr
    for name in ("shard-rank00000-of-00002.safetensors", "shard-rank00001-of-00002.safetensors", SHARD_INDEX):
        assert name in sharded.stdout, f"inspect does not list {name}:\n{sharded.stdout}"

    whole = load_checkpoint(run, model=data.module())
    ordinary = tmp_path / "ordinary"
    written = save_checkpoint(ordinary, whole.state, schedule_state=whole.schedule_state)
    assert written.name == "epoch-000003"
    assert not list(written.glob("shard-*"))
    assert not (written / SHARD_INDEX).exists()
    _no_pickle_anywhere(ordinary)
    assert sum(t.numel() for t in load_file(written / "model.safetensors").values()) == 161
    report = _inspect(ordinary)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "161 values" in report.stdout, report.stdout
    assert "epoch-000003" in report.stdout


def test_a_changed_shard_file_is_named_by_verify_load_and_inspect(runs: Runs, tmp_path: Path) -> None:
    """checkpoints.md "Validated": "Loading checks every shard file's size and sha256 first"; a
    checkpoint directory named explicitly "loads or raises" CheckpointError starting with the file
    at fault; cli.md: inspect names a bad file on stderr and exits 1."""
    run = runs.checkpoints
    copy = _resumable_copy(run, "epoch-000003", tmp_path / "copy")
    shard = copy / "epoch-000003" / "shard-rank00001-of-00002.safetensors"
    content = bytearray(shard.read_bytes())
    content[-3] ^= 0x01  # one bit of a tensor's bytes
    shard.write_bytes(bytes(content))
    report = verify_checkpoint(copy / "epoch-000003")
    assert not report.ok
    assert any(shard.name in str(problem) for problem in report.problems), report.problems
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(copy / "epoch-000003", model=data.module())
    assert shard.name in str(caught.value), str(caught.value)
    assert "sha256 mismatch" in str(caught.value), str(caught.value)
    inspected = _inspect(copy)
    assert inspected.returncode == 1, inspected.stdout + inspected.stderr
    assert shard.name in inspected.stderr, inspected.stderr


def test_a_changed_shard_files_load_error_starts_with_that_file(runs: Runs, tmp_path: Path) -> None:
    """checkpoints.md "Validated": CheckpointError "with a message that starts with the file at fault"."""
    run = runs.checkpoints
    copy = _resumable_copy(run, "epoch-000003", tmp_path / "copy")
    shard = copy / "epoch-000003" / "shard-rank00000-of-00002.safetensors"
    content = bytearray(shard.read_bytes())
    content[-3] ^= 0x01
    shard.write_bytes(bytes(content))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(copy / "epoch-000003", model=data.module())
    assert str(caught.value).startswith(f"{shard}: sha256 mismatch"), str(caught.value)


# --------------------------------------------------------------------------------------------
# 3. resharding: an epoch-end checkpoint of 2 ranks resumes on 1 and on 3 (strategies.md)


def test_the_two_rank_checkpoint_resumes_on_one_rank(
    runs: Runs, reference: Reference, tmp_path: Path
) -> None:
    """strategies.md: "They reshard: an epoch-end checkpoint resumes at any number of ranks, one
    included"; "With one rank, fsdp trains the model unsharded"; checkpoints.md: "fit(resume=True)
    on one rank" reads it whole."""
    run = runs.checkpoints
    copy = _resumable_copy(run, "epoch-000002", tmp_path / "one")
    net = data.module()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(net),
        optimizer_factory=data.optimizer,
        train_batches=data.train_factory,
        validation_batches=data.valid_factory,
        max_epochs=data.MAX_EPOCHS,
        return_min_validation_loss_model=data.ELIGIBLE,
        accumulate_gradient_over_n_batches=data.ACCUMULATE,
        device="cpu",
        world_size=1,
        strategy="fsdp",
        checkpoint_dir=copy,
        keep_last=None,
        reporters=[],
    )
    assert state is not None
    assert state.epoch == data.MAX_EPOCHS
    curve = [
        {"epoch": e.epoch, "training_loss": e.training_loss, "validation_loss": e.validation_loss}
        for e in state.learning_curve
    ]
    _assert_curve(curve, reference)
    best = reference.best_after_epoch[-1]
    assert best is not None
    _assert_close(_clone(net), best, "the module after the 1-rank resume (the best model)")
    last = load_checkpoint(copy, model=data.module())
    assert last.path.name == "epoch-000003"
    _assert_close(last.state.model, reference.after_epoch[-1], "the 1-rank resume's epoch-000003 model")
    report = verify_checkpoint(copy)  # what lamploop inspect prints (cli.md)
    assert report.ok, report.problems


def test_the_two_rank_checkpoint_resumes_on_three_ranks(runs: Runs, reference: Reference) -> None:
    """checkpoints.md "Resharding": "an epoch-end checkpoint written by 2 ranks resumes on 3"; the
    13 rows are cut 5/5/3 there (FSDP2 cuts dim 0 as ``torch.chunk`` does) instead of 7/6."""
    result, model = runs.three_ranks.result()
    _assert_curve(result["curve"], reference)
    best = reference.best_after_epoch[-1]
    assert best is not None
    _assert_close(model, best, "the module after the 3-rank resume (the best model)")
    written = runs.three_ranks_checkpoints / "epoch-000003"
    index = json.loads((written / SHARD_INDEX).read_text())
    assert index["world_size"] == 3
    assert sorted(index["files"]) == [f"shard-rank{r:05d}-of-00003.safetensors" for r in range(3)]
    assert [s["rows"] for s in index["tensors"]["model/0.weight"]["shards"]] == [5, 5, 3]
    _assert_close(load_checkpoint(written).state.model, reference.after_epoch[-1], "3-rank epoch-000003")


def test_a_step_boundary_checkpoint_resumes_bitwise_at_its_own_world_size(runs: Runs) -> None:
    """strategies.md: checkpoints "at step boundaries (checkpoint_every_*...)"; "a run resumed from
    its step-boundary checkpoint inside epoch 1 ends bitwise equal to the uninterrupted one"."""
    result, resumed = runs.step.result()
    assert result["curve"] == runs.result["curve"]
    for key, value in runs.model.items():
        assert torch.equal(resumed[key], value), f"{key} differs after resuming from {STEP}"


def test_a_step_boundary_checkpoint_after_a_ranks_stream_ended_resumes_bitwise(runs: Runs) -> None:
    """strategies.md: step-boundary checkpoints resume (bitwise, at their world size), and uneven
    streams are handled with a stand-in; here the checkpoint lies in the uneven tail of epoch 1."""
    status, output = runs.tail.wait()
    assert status == 0, output[-600:]
    result, resumed = runs.tail.result()
    assert result["curve"] == runs.result["curve"]
    assert all(torch.equal(resumed[key], value) for key, value in runs.model.items())


def test_a_step_boundary_checkpoint_is_refused_at_another_world_size(runs: Runs, tmp_path: Path) -> None:
    """strategies.md "Limits": "A step-boundary checkpoint resumes at the world size that wrote it
    only"; fit raises a LamploopError (its docstring), before training: nothing new is written."""
    run = runs.checkpoints
    name = STEP
    copy = _resumable_copy(run, name, tmp_path / "step")
    batches = _Counted()
    with pytest.raises(LamploopError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(data.module()),
            optimizer_factory=data.optimizer,
            train_batches=batches,
            max_epochs=data.MAX_EPOCHS,
            accumulate_gradient_over_n_batches=data.ACCUMULATE,
            device="cpu",
            world_size=1,
            strategy="fsdp",
            checkpoint_dir=copy,
            reporters=[],
        )
    message = str(caught.value)
    _says(message, "2", "1")
    assert "rank" in message or "world size" in message, message
    assert sorted(p.name for p in copy.iterdir()) == sorted(["latest", name])
    assert batches.calls == 0


# --------------------------------------------------------------------------------------------
# 4. the drivers with settings=TrainingSettings(strategy="fsdp") (strategies.md, architecture.md)


def test_the_drivers_train_fsdp_from_a_settings_object(runs: Runs, reference: Reference) -> None:
    """strategies.md: "drive_distributed_training / follow_distributed_training take it as
    settings=TrainingSettings(strategy="fsdp") (every rank alike)"; checkpoints through
    ``checkpoint_position=checkpointer.save_position`` ("every rank writes")."""
    root, follower = runs.drivers
    result, model = root.result()
    status, output = follower.wait()
    assert status == 0, output[-6000:]
    _assert_curve(result["curve"], reference)
    best = reference.best_after_epoch[-1]
    assert best is not None
    _assert_close(model, best, "the root's module after the drivers' run")
    checkpoints = runs.drivers_checkpoints
    written = checkpoints / "epoch-000003"
    assert (checkpoints / "latest").read_text().strip() == "epoch-000003"
    assert (written / SHARD_INDEX).exists()
    assert (written / "shard-rank00001-of-00002.safetensors").exists()
    _assert_close(
        load_checkpoint(written).state.model, reference.after_epoch[-1], "the drivers' epoch-000003"
    )


# --------------------------------------------------------------------------------------------
# 5. what fsdp refuses up front (strategies.md "Refused up front, with a ConfigurationError ...")


def _fit_refused(tmp_path: Path, **arguments: Any) -> tuple[BaseException | None, int]:
    """``fit(world_size=2, strategy="fsdp", ...)`` on a thread, bounded; rank 1 is a command that
    exits at once, so a run that is not refused before it launches fails another way."""
    batches = _Counted()
    caught: list[BaseException] = []

    def target() -> None:
        try:
            lamploop.fit(
                model=lamploop.SupervisedModel(data.module()),
                optimizer_factory=data.optimizer,
                train_batches=batches,
                max_epochs=1,
                device="cpu",
                world_size=2,
                strategy="fsdp",
                launch_command=[sys.executable, "-c", "pass"],
                checkpoint_dir=tmp_path / "refused",
                reporters=[],
                **arguments,
            )
        except BaseException as error:
            caught.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "fit did not refuse within 30 s"
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    return (caught[0] if caught else None), batches.calls


def test_fit_refuses_fp16_with_fsdp_before_training(tmp_path: Path) -> None:
    """strategies.md: precision="fp16" refused up front, "a ConfigurationError naming the setting
    and why" (each rank holds only its shard: the ranks could skip different steps)."""
    error, calls = _fit_refused(tmp_path, precision="fp16")
    assert isinstance(error, ConfigurationError), repr(error)
    _says(error, "fp16", "fsdp")
    assert calls == 0


def test_fit_refuses_averaging_with_fsdp_before_training(tmp_path: Path) -> None:
    """strategies.md: ``averaging`` refused up front (the average is of the whole model on the root)."""
    error, calls = _fit_refused(tmp_path, averaging=lamploop.ema(0.9))
    assert isinstance(error, ConfigurationError), repr(error)
    _says(error, "averaging", "fsdp")
    assert calls == 0


def _drive_no_follower(*, in_process: bool = False, **arguments: Any) -> BaseException | None:
    """The root of 2 ranks over TCP whose follower never comes: a refusal up front is raised at
    once; a call that is not refused waits for the follower until the root's join timeout (3 s).
    ``in_process``: over ``lamploop.local_control`` instead."""
    batches = _Counted()
    net = data.module()

    async def drive(control: Any) -> None:
        with anyio.fail_after(30):
            await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(net),
                optimizer_factory=data.optimizer,
                train_batches=batches,
                validation_batches=None,
                max_epochs=1,
                **arguments,
            )

    async def run() -> None:
        if in_process:
            root, followers = lamploop.local_control(2, join_timeout=3)
            try:
                await drive(root)
            finally:
                await followers[0].aclose()
                await root.aclose()
            return
        async with lamploop.TcpControlRoot(
            port=0, nranks=2, token=secrets.token_hex(16), model_spec=lamploop.model_spec(net), join_timeout=2
        ) as control:
            await drive(control)

    try:
        anyio.run(run)
    except Exception as error:
        assert batches.calls == 0
        return error
    return None


def test_the_root_refuses_fp16_and_averaging_but_not_bf16_before_anyone_joins() -> None:
    """strategies.md: fp16 and averaging refused up front; ""bf16" is accepted"."""
    for refused, named in (
        (lamploop.TrainingSettings(strategy="fsdp", precision="fp16"), "fp16"),
        (lamploop.TrainingSettings(strategy="fsdp", averaging=lamploop.ema(0.9)), "averaging"),
    ):
        error = _drive_no_follower(settings=refused)
        assert isinstance(error, ConfigurationError), (named, repr(error))
        _says(error, named, "fsdp")
    accepted = _drive_no_follower(settings=lamploop.TrainingSettings(strategy="fsdp", precision="bf16"))
    assert accepted is not None  # the follower never came
    assert not isinstance(accepted, ConfigurationError), repr(accepted)


def test_the_root_refuses_a_checkpointer_as_checkpoint_state_with_fsdp(tmp_path: Path) -> None:
    """strategies.md: refused up front: "drive_distributed_training(checkpoint_state=a Checkpointer)
    (pass checkpoint_position=checkpointer.save_position: every rank writes)"."""
    error = _drive_no_follower(
        settings=lamploop.TrainingSettings(strategy="fsdp"), checkpoint_state=Checkpointer(tmp_path / "ck")
    )
    assert isinstance(error, ConfigurationError), repr(error)
    _says(error, "checkpoint_state", "checkpoint_position")
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_local_data_parallel_training_loop_refuses_fsdp() -> None:
    """strategies.md: local_data_parallel_training_loop refused up front ("its ranks are threads of
    one process; FSDP2 shards over one process per rank")."""
    batches = _Counted()
    replicas = [(lamploop.SupervisedModel(data.module()), batches, None) for _ in range(2)]

    async def run() -> None:
        with anyio.fail_after(30):
            await local_data_parallel_training_loop(
                replicas, data.optimizer, 1, settings=lamploop.TrainingSettings(strategy="fsdp")
            )

    with pytest.raises(ConfigurationError) as caught:
        anyio.run(run)
    assert "fsdp" in str(caught.value)
    assert "local_data_parallel_training_loop" in str(caught.value)
    assert batches.calls == 0


def test_the_root_over_an_in_process_channel_names_the_channel_when_it_refuses_fsdp() -> None:
    """The same refusal as local_data_parallel_training_loop's, reached through the drivers with an
    in-process control channel: the message should name what the caller did."""
    error = _drive_no_follower(in_process=True, settings=lamploop.TrainingSettings(strategy="fsdp"))
    assert isinstance(error, ConfigurationError), repr(error)
    assert "local_data_parallel_training_loop" not in str(error), str(error)
    assert "local_control" in str(error) or "in-process" in str(error), str(error)


# --------------------------------------------------------------------------------------------
# 6. the settings object on the drivers (architecture.md "Adding a setting", the docstrings)


def test_fsdp_given_both_ways_or_an_unknown_keyword_is_a_configuration_error() -> None:
    """The drivers' docstrings: "ConfigurationError: ... an unknown keyword, or a setting given both
    as a keyword and in settings="; architecture.md: a new setting goes in settings=, not a keyword."""
    both = _drive_no_follower(settings=lamploop.TrainingSettings(strategy="fsdp"), strategy="fsdp")
    assert isinstance(both, ConfigurationError), repr(both)
    _says(both, "strategy", "drive_distributed_training")
    unknown = _drive_no_follower(settings=lamploop.TrainingSettings(strategy="fsdp"), fsdp_units=2)
    assert isinstance(unknown, ConfigurationError), repr(unknown)
    assert "fsdp_units" in str(unknown), str(unknown)

    async def follow(**arguments: Any) -> None:
        root, followers = lamploop.local_control(2, join_timeout=3)
        try:
            with anyio.fail_after(30):
                await lamploop.follow_distributed_training(
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=followers[0],
                    model=lamploop.SupervisedModel(data.module()),
                    train_batches=data.train_factory,
                    validation_batches=None,
                    optimizer_factory=data.optimizer,
                    **arguments,
                )
        finally:
            await followers[0].aclose()
            await root.aclose()

    with pytest.raises(ConfigurationError) as caught:
        anyio.run(lambda: follow(settings=lamploop.TrainingSettings(strategy="fsdp"), strategy="fsdp"))
    assert "strategy" in str(caught.value)
    assert "follow_distributed_training" in str(caught.value)
    with pytest.raises(ConfigurationError) as unknown_follow:
        anyio.run(
            lambda: follow(settings=lamploop.TrainingSettings(strategy="fsdp"), reshard_after_forward=False)
        )
    assert "reshard_after_forward" in str(unknown_follow.value)


def test_a_setting_out_of_range_names_the_field() -> None:
    """TrainingSettings' docstring: "ConfigurationError: a value is out of range; the message names
    the argument"."""
    with pytest.raises(ConfigurationError) as caught:
        lamploop.TrainingSettings(strategy="fsdp", precision="fp8")  # type: ignore[arg-type]
    assert "precision" in str(caught.value)
    with pytest.raises(ConfigurationError) as bad_count:
        lamploop.TrainingSettings(strategy="fsdp", accumulate_gradient_over_n_batches=0)
    assert "accumulate_gradient_over_n_batches" in str(bad_count.value)
