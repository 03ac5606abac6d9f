"""Pipeline parallelism (lamploop.pipeline) on torch.distributed.pipelining.

The acceptance test: a model split into 2 stages on 2 real processes (Gloo on 127.0.0.1)
trains, with micro-batches, exactly as one process trains the whole model (float64, atol
1e-6): losses of every epoch, parameters after every epoch (read back from each stage's
checkpoints), for the GPipe and the 1F1B schedule, and a run resumed from checkpoints.
Then one stage is SIGKILLed mid-run: the other fails with a DistributedError within
seconds, far inside its 60 s timeout; and in another pair, one stage is frozen (SIGSTOP):
the other fails at its 5 s timeout.  The rest runs in this process, on a 1-rank group:
micro-batches and a loss that counts examples otherwise than rows, and the refusals.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file
from support import ROOT, free_port
from workers import pipeline_stage as stage_worker  # tests/ is on sys.path (conftest.py's folder)
from workers import rank as worker

from lamploop.batches import tensor_batches
from lamploop.checkpoint import MODEL_FILE
from lamploop.distributed import drive_distributed_training
from lamploop.errors import BatchError, CheckpointError, ConfigurationError, LamploopError
from lamploop.loop.epoch_driver import ALL_EPOCHS
from lamploop.model import SupervisedModel, cross_entropy_loss
from lamploop.pipeline import (
    PipelineSpec,
    load_stage_checkpoint,
    open_pipeline_group,
    split_sequential,
    stage_checkpoint_dir,
    stage_checkpointer,
    train_pipeline,
)
from lamploop.schedules import decrement
from lamploop.state import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData, converter

ATOL = 1e-6
ROOT = ROOT  # the stage processes import lamploop from here
KILL_TIMEOUT_S = 60.0  # the group's timeout in the kill run: the failure must come long before it
FREEZE_TIMEOUT_S = 5.0  # the group's timeout in the freeze run: the failure comes with it
RUNS = [
    {
        "name": "gpipe",
        "boundaries": [2],
        "n_microbatches": 4,
        "schedule": "gpipe",
        "epochs": 3,
        "checkpoint": "ck",
    },
    {"name": "1f1b", "boundaries": [3], "n_microbatches": 2, "schedule": "1f1b", "epochs": 3},
    {
        "name": "half",
        "boundaries": [2],
        "n_microbatches": 4,
        "schedule": "gpipe",
        "epochs": 2,
        "checkpoint": "ck2",
    },
    {
        "name": "resumed",
        "boundaries": [2],
        "n_microbatches": 4,
        "schedule": "gpipe",
        "epochs": 3,
        "resume": "ck2",
    },
    {
        "name": "long",
        "boundaries": [2],
        "n_microbatches": 2,
        "schedule": "gpipe",
        "epochs": 10_000,
        "progress": True,
    },
]


Pair = tuple[worker.Processes, Path]


def _start_pair(stack: ExitStack, workdir: Path, timeout: float, runs: list[dict[str, Any]]) -> Pair:
    config = {
        "workdir": str(workdir),
        "port": free_port(),
        "world_size": 2,
        "timeout": timeout,
        "join_timeout": 120,
        "runs": runs,
    }
    (workdir / "config.json").write_text(json.dumps(config))
    procs = stack.enter_context(worker.Processes(workdir))
    for rank in (0, 1):
        argv = [sys.executable, str(Path(stage_worker.__file__)), str(workdir / "config.json"), str(rank)]
        procs.start(f"stage{rank}", argv, env=worker.worker_env(PYTHONPATH=str(ROOT)))
    return procs, workdir


@pytest.fixture(scope="module")
def stage_pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """Two pairs of stage processes, started together: ``"kill"`` runs RUNS in turn (the last
    one until a test kills a stage); ``"freeze"`` waits for a ``go`` file, then runs long."""
    frozen_run = {**RUNS[-1], "wait_for": "go"}
    with ExitStack() as stack:
        yield {
            "kill": _start_pair(stack, tmp_path_factory.mktemp("pipeline"), KILL_TIMEOUT_S, RUNS),
            "freeze": _start_pair(stack, tmp_path_factory.mktemp("frozen"), FREEZE_TIMEOUT_S, [frozen_run]),
        }


def _wait_for_progress(procs: worker.Processes, path: Path, at_least: int) -> None:
    deadline = time.monotonic() + 90

    def progress() -> int:
        text = path.read_text().strip() if path.exists() else ""  # read once: the stage rewrites it
        return int(text) if text else -1

    while progress() < at_least:
        procs.check_alive(["stage0", "stage1"])
        assert time.monotonic() < deadline, procs.logs()
        time.sleep(0.05)


def _reference(epochs: int) -> tuple[LoopState, list[dict[str, torch.Tensor]]]:
    """One process training the whole model on the same batches: the state, and the parameters per epoch."""
    model = stage_worker.build_model()
    train, valid = stage_worker.build_data()
    after_epoch: list[dict[str, torch.Tensor]] = []

    async def keep(state: LoopStateWithModelAndOptimizerData, _: object) -> None:
        after_epoch.append({k: v.clone() for k, v in state.model.items()})

    async def run() -> LoopState:
        return await drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=SupervisedModel(model),
            optimizer_factory=stage_worker.optimizer,
            train_batches=train,
            validation_batches=valid,
            max_epochs=epochs,
            checkpoint_state=keep,
        )

    return anyio.run(run), after_epoch


def _assert_same_curve(got: LoopState, want: LoopState) -> None:
    assert got.epoch == want.epoch
    assert len(got.learning_curve) == len(want.learning_curve) == want.epoch
    for g, w in zip(got.learning_curve, want.learning_curve, strict=True):
        assert g.epoch == w.epoch
        assert g.training_loss == pytest.approx(w.training_loss, abs=ATOL, rel=0)
        assert g.validation_loss is not None
        assert w.validation_loss is not None
        assert g.validation_loss == pytest.approx(w.validation_loss, abs=ATOL, rel=0)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, tensor in want.items():
        assert got[name].dtype == torch.float64, (what, name)
        torch.testing.assert_close(got[name], tensor, atol=ATOL, rtol=0, msg=f"{what}: {name}")


def _result(workdir: Path, run: str, rank: int) -> dict[str, Any]:
    return json.loads((workdir / run / f"rank{rank}.json").read_text())


def test_two_stages_on_two_processes_train_like_one_process(stage_pairs: dict[str, Pair]) -> None:
    procs, workdir = stage_pairs["kill"]
    want, want_params = _reference(3)  # meanwhile the stages start and train
    for run in ("gpipe", "1f1b", "half", "resumed"):
        for rank in (0, 1):
            procs.wait_for_file(workdir / run / f"rank{rank}.json", 60, alive=["stage0", "stage1"])
            assert _result(workdir, run, rank)["ok"], _result(workdir, run, rank)
    for run in ("gpipe", "1f1b", "resumed"):
        states = [converter.structure(_result(workdir, run, r)["state"], LoopState) for r in (0, 1)]
        assert states[0] == states[1], run  # every rank computed the same losses and decisions
        _assert_same_curve(states[0], want)
        stages = [load_file(str(workdir / run / f"rank{r}.safetensors")) for r in (0, 1)]
        assert not set(stages[0]) & set(stages[1])  # each rank holds only its own layers
        _assert_close({**stages[0], **stages[1]}, want_params[-1], run)
    assert sorted(load_file(str(workdir / "gpipe" / "rank0.safetensors"))) == ["0.bias", "0.weight"]
    assert sorted(load_file(str(workdir / "1f1b" / "rank1.safetensors"))) == ["4.bias", "4.weight"]
    # Every epoch's parameters, from the stages' own checkpoints (the optimizer state beside them).
    for epoch in (1, 2, 3):
        saved = {}
        for rank in (0, 1):
            path = stage_checkpoint_dir(workdir / "ck", rank) / f"epoch-{epoch:06d}"
            checkpoint = (
                load_stage_checkpoint(workdir / "ck", stage_index=rank, num_stages=2) if epoch == 3 else None
            )
            assert checkpoint is None or checkpoint.path == path  # the newest epoch both stages saved
            model = load_file(str(path / "model.safetensors"))
            optimizer = load_file(str(path / "optimizer.safetensors"))
            assert len(optimizer) == len(model)  # one momentum buffer per parameter of the stage
            saved.update(model)
        _assert_close(saved, want_params[epoch - 1], f"gpipe after epoch {epoch}")


def test_a_stage_killed_mid_run_fails_the_other_within_seconds(stage_pairs: dict[str, Pair]) -> None:
    procs, workdir = stage_pairs["kill"]
    _wait_for_progress(procs, workdir / "long" / "progress-0", 10)
    killed = time.monotonic()
    os.kill(procs.procs["stage1"].pid, signal.SIGKILL)
    code = procs.wait("stage0", timeout=KILL_TIMEOUT_S / 2)
    took = time.monotonic() - killed
    assert code == 1, procs.logs()
    assert took < 15, f"stage 0 took {took:.1f} s to notice"
    result = _result(workdir, "long", 0)
    assert result["type"] == "DistributedError", result
    assert "LamploopError" in result["mro"]
    assert "pipeline stage 0" in result["message"], result["message"]
    assert "another stage died" in result["message"], result["message"]


def test_a_frozen_stage_fails_the_other_at_the_timeout(stage_pairs: dict[str, Pair]) -> None:
    procs, workdir = stage_pairs["freeze"]
    (workdir / "go").write_text("")
    _wait_for_progress(procs, workdir / "long" / "progress-0", 5)
    frozen = time.monotonic()
    os.kill(procs.procs["stage1"].pid, signal.SIGSTOP)  # alive, connections open, silent
    code = procs.wait("stage0", timeout=FREEZE_TIMEOUT_S + 25)
    took = time.monotonic() - frozen
    assert code == 1, procs.logs()
    assert FREEZE_TIMEOUT_S - 1 < took < FREEZE_TIMEOUT_S + 15, (
        f"stage 0 failed {took:.1f} s after the freeze"
    )
    result = _result(workdir, "long", 0)
    assert result["type"] == "DistributedError", result
    assert "did not answer within the group's timeout" in result["message"], result["message"]
    assert "Timed out" in result["message"], result["message"]  # Gloo's timeout, not a closed connection


# -- one process: a pipeline of one stage, and the refusals -------------------------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    with open_pipeline_group(rank=0, world_size=1, host="127.0.0.1", port=free_port(), timeout=10):
        yield


def _double_counting_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Two examples per row: the pipeline's guess (rows) is wrong and must be corrected."""
    loss_sum, rows = cross_entropy_loss(output, target)
    return loss_sum, 2 * rows


@pytest.mark.parametrize("loss", [cross_entropy_loss, _double_counting_loss])
def test_one_stage_with_micro_batches_equals_one_process(one_rank: None, loss: Any) -> None:
    train, valid = stage_worker.build_data()
    model = stage_worker.build_model()

    async def pipeline() -> LoopState:
        return await train_pipeline(
            model=model,
            spec=PipelineSpec((), n_microbatches=4),
            optimizer_factory=stage_worker.optimizer,
            train_batches=train,
            validation_batches=valid,
            max_epochs=3,
            loss=loss,
            learning_rate_schedule=decrement(every=1, fraction=0.5),
            return_min_validation_loss_model=ALL_EPOCHS,
        )

    reference = stage_worker.build_model()

    async def one_process() -> LoopState:
        return await drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=SupervisedModel(reference, loss),
            optimizer_factory=stage_worker.optimizer,
            train_batches=train,
            validation_batches=valid,
            max_epochs=3,
            learning_rate_schedule=decrement(every=1, fraction=0.5),
            return_min_validation_loss_model=ALL_EPOCHS,
        )

    got, want = anyio.run(pipeline), anyio.run(one_process)
    _assert_same_curve(got, want)
    assert [e.learning_rate_factor for e in got.learning_curve] == [1.0, 0.5, 0.25]
    assert got.min_validation_epoch == want.min_validation_epoch
    assert want.min_validation_epoch is not None
    _assert_close(model.state_dict(), reference.state_dict(), "one stage")  # both hold the best epoch's


def _train(model: torch.nn.Module, spec: PipelineSpec, batch_size: int = 12, **kwargs: Any) -> LoopState:
    x = torch.randn(24, stage_worker.FEATURES, dtype=torch.float64)
    y = torch.randint(0, stage_worker.CLASSES, (24,))

    async def run() -> LoopState:
        return await train_pipeline(
            model=model,
            spec=spec,
            optimizer_factory=stage_worker.optimizer,
            train_batches=tensor_batches(x, y, batch_size=batch_size),
            max_epochs=1,
            **kwargs,
        )

    return anyio.run(run)


def test_a_batch_that_does_not_split_into_equal_micro_batches_is_refused(one_rank: None) -> None:
    with pytest.raises(
        BatchError, match=r"epoch 0, batch 2: 4 examples do not split into 5 equal micro-batches"
    ):
        _train(stage_worker.build_model(), PipelineSpec((), n_microbatches=5), batch_size=10)  # 10, 10, 4


def test_a_spec_of_more_stages_than_ranks_is_refused(one_rank: None) -> None:
    with pytest.raises(ConfigurationError, match=r"the spec has 2 stages but the process group has 1 ranks"):
        _train(stage_worker.build_model(), PipelineSpec((2,)))


def test_a_model_that_does_not_fit_its_input_is_refused_naming_the_stage(one_rank: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(stage_worker.FEATURES, 5), torch.nn.Linear(7, 3)).double()
    with pytest.raises(
        ConfigurationError, match=r"pipeline stage 0 \(layers 0\.\.1\) fails on a micro-batch of shape"
    ):
        _train(model, PipelineSpec(()))


def test_a_model_that_is_not_sequential_is_refused(one_rank: None) -> None:
    with pytest.raises(ConfigurationError, match=r"must be a torch\.nn\.Sequential"):
        _train(torch.nn.Linear(stage_worker.FEATURES, 3).double(), PipelineSpec(()))


def test_init_state_of_another_stage_is_refused(one_rank: None) -> None:
    wrong = LoopStateWithModelAndOptimizerData(
        loop_state=LoopState(epoch=1), model={"9.weight": torch.zeros(1)}, optimizer={}
    )
    with pytest.raises(CheckpointError, match="init_state does not fit stage 0"):
        _train(stage_worker.build_model(), PipelineSpec(()), init_state=wrong)


def test_training_outside_a_pipeline_group_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="no process group; run it inside `with open_pipeline_group"):
        _train(stage_worker.build_model(), PipelineSpec(()))


def test_a_second_group_in_one_process_and_bad_ranks_are_refused(one_rank: None) -> None:
    second = open_pipeline_group(rank=0, world_size=1, host="127.0.0.1", port=free_port())
    with pytest.raises(ConfigurationError, match="already has a default process group"), second:
        pass
    bad_rank = open_pipeline_group(rank=2, world_size=2, host="127.0.0.1", port=free_port())
    with pytest.raises(ConfigurationError, match=r"rank must be in 0\.\.1, got 2"), bad_rank:
        pass


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"boundaries": (0,)}, r"boundaries must be >= 1"),
        ({"boundaries": (3, 2)}, r"boundaries must strictly increase"),
        ({"boundaries": (2, 2)}, r"boundaries must strictly increase"),
        ({"boundaries": ("2",)}, r"boundaries must be ints"),
        ({"boundaries": 2}, r"boundaries must be a sequence"),
        ({"boundaries": (2,), "n_microbatches": 0}, r"n_microbatches must be an int >= 1, got 0"),
        ({"boundaries": (2,), "n_microbatches": 2.0}, r"n_microbatches must be an int >= 1, got 2.0"),
        ({"boundaries": (2,), "schedule": "zb"}, r"schedule must be one of \('gpipe', '1f1b'\), got 'zb'"),
        (
            {"boundaries": (2, 3), "n_microbatches": 2, "schedule": "1f1b"},
            r"needs n_microbatches >= the number",
        ),
    ],
)
def test_bad_specs_are_refused(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PipelineSpec(**arguments)


def test_split_sequential_shares_the_layers_and_checks_the_boundaries() -> None:
    model = stage_worker.build_model()
    first, second = split_sequential(model, [2])
    assert first[0] is model[0]
    assert second[2] is model[4]
    assert [*first.state_dict(), *second.state_dict()] == list(model.state_dict())
    with pytest.raises(ConfigurationError, match=r"boundary 5 is out of range for a Sequential of 5 layers"):
        split_sequential(model, [2, 5])
    with pytest.raises(ConfigurationError, match=r"must be a torch\.nn\.Sequential"):
        split_sequential(torch.nn.Linear(2, 2), [1])


def test_stage_checkpoints_round_trip_at_the_newest_epoch_every_stage_saved(tmp_path: Path) -> None:
    stages = split_sequential(stage_worker.build_model(), [2])
    optimizers = [stage_worker.optimizer(s.parameters()) for s in stages]
    for stage, optimizer in zip(stages, optimizers, strict=True):  # some momentum to save
        stage(torch.ones(3, stage[0].in_features, dtype=torch.float64)).sum().backward()
        optimizer.step()

    def state(rank: int, epoch: int) -> LoopStateWithModelAndOptimizerData:
        curve = tuple(LearningCurveEntry(epoch=e, training_loss=1.0 / (e + 1)) for e in range(epoch))
        return LoopStateWithModelAndOptimizerData(
            loop_state=LoopState(epoch=epoch, learning_curve=curve),
            model={k: v + epoch for k, v in stages[rank].state_dict().items()},
            optimizer=optimizers[rank].state_dict(),
        )

    async def save(rank: int, epochs: list[int]) -> None:
        saver = stage_checkpointer(tmp_path, rank)
        for epoch in epochs:
            await saver(state(rank, epoch), None)

    anyio.run(save, 0, [1, 2])  # stage 0 one epoch ahead: it saved epoch 2, stage 1 did not
    anyio.run(save, 1, [1])
    for rank in (0, 1):
        checkpoint = load_stage_checkpoint(tmp_path, stage_index=rank, num_stages=2, stage=stages[rank])
        assert checkpoint is not None
        assert checkpoint.state.loop_state == state(rank, 1).loop_state
        _assert_close(dict(checkpoint.state.model), dict(state(rank, 1).model), f"stage {rank}")
        restored = stage_worker.optimizer(stages[rank].parameters())
        restored.load_state_dict(dict(checkpoint.state.optimizer))
        for saved, kept in zip(restored.state.values(), optimizers[rank].state.values(), strict=True):
            torch.testing.assert_close(saved["momentum_buffer"], kept["momentum_buffer"], atol=0, rtol=0)
    with pytest.raises(CheckpointError, match="does not fit the given model"):
        load_stage_checkpoint(tmp_path, stage_index=0, num_stages=2, stage=stages[1])
    assert load_stage_checkpoint(tmp_path / "none", stage_index=0, num_stages=2) is None
    with pytest.raises(ConfigurationError, match=r"stage_index must be in 0\.\.1, got 2"):
        load_stage_checkpoint(tmp_path, stage_index=2, num_stages=2)
    with pytest.raises(ConfigurationError, match="keep_last must be None or an int >= 2"):
        stage_checkpointer(tmp_path, 0, keep_last=1)
    # A corrupt checkpoint at the common epoch is refused, naming the file, not passed over for
    # an older epoch: each stage would fall back alone (docs/pipeline.md).
    model_file = tmp_path / "stage-001" / "epoch-000001" / MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=MODEL_FILE):
        load_stage_checkpoint(tmp_path, stage_index=1, num_stages=2, stage=stages[1])


def test_every_pipeline_error_is_a_lamploop_error() -> None:
    assert issubclass(ConfigurationError, LamploopError)
    assert issubclass(BatchError, LamploopError)
