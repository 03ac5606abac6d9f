"""Acceptance tests of the pipeline stages (docs/pipeline.md, the ``lamploop.pipeline`` docstrings).

Written from the documentation alone. The promise under test: 2 stages on 2 processes compute
the same as one process training the whole model on the same batches (float64 parameters agree
to 1e-6), for GPipe and 1F1B and for a run resumed from checkpoints; losses are means over every
example; bad inputs are refused with the documented errors, on every rank, before anything runs.

The reference is this file's own one-process loop in plain torch (sum of the batch's cross
entropies / its examples, the same SGD with momentum, the learning rate ``LR * 0.5**epoch`` of
``decrement(every=1, fraction=0.5)``). One 2-process run (tests/workers/acceptance_pipeline_stage.py,
real processes, a real Gloo group on 127.0.0.1) serves every two-stage test: it is started once,
by the module-scoped fixture ``two_stages``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from support import free_port
from torch import nn

from lamploop.errors import (
    BatchError,
    CheckpointError,
    ConfigurationError,
    DistributedError,
    LamploopError,
)
from lamploop.pipeline import (
    PipelineSpec,
    load_stage_checkpoint,
    open_pipeline_group,
    saved_epochs,
    split_sequential,
    stage_checkpoint_dir,
    stage_checkpointer,
    train_pipeline,
)

pytestmark = pytest.mark.timeout(60)

WORKER_PATH = Path(__file__).resolve().parents[1] / "workers" / "acceptance_pipeline_stage.py"
RUN_DEADLINE_S = 45.0
PARAMETER_TOLERANCE = 1e-6  # docs/pipeline.md, "What it computes": "the tests assert 1e-6"
LOSS_TOLERANCE = 1e-9


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location("acceptance_pipeline_stage", WORKER_PATH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _load_worker()  # the model, data and batch order (plain torch), shared with the ranks


# --- the one-process reference, plain torch -------------------------------------------------


def _stage_of(name: str) -> int:
    """The stage holding parameter ``name`` with ``BOUNDARIES == (2,)``: layers 0-1, then 2-4."""
    return 0 if int(name.split(".")[0]) < W.BOUNDARIES[0] else 1


def reference(epochs: int, fraction: float) -> dict[str, Any]:
    """One process trains the whole model on the same batches; lr of epoch e: LR * fraction**e."""
    model = W.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=W.LR, momentum=W.MOMENTUM)
    trace: dict[str, Any] = {
        "train": [],
        "train_mean_of_means": [],
        "valid": [],
        "params": [],
        "first_step": None,
    }
    for epoch in range(epochs):
        for group in optimizer.param_groups:
            group["lr"] = W.LR * fraction**epoch
        loss_sum, examples, batch_means = 0.0, 0, []
        for x, y in W.train_batch_list(epoch):
            optimizer.zero_grad(set_to_none=True)
            summed = F.cross_entropy(model(x), y, reduction="sum")
            (summed / len(y)).backward()
            optimizer.step()
            loss_sum += summed.item()
            examples += len(y)
            batch_means.append(summed.item() / len(y))
            if trace["first_step"] is None:
                trace["first_step"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trace["train"].append(loss_sum / examples)
        trace["train_mean_of_means"].append(sum(batch_means) / len(batch_means))
        with torch.no_grad():
            valid = [
                (F.cross_entropy(model(x), y, reduction="sum").item(), len(y))
                for x, y in W.valid_batch_list()
            ]
        trace["valid"].append(sum(s for s, _ in valid) / sum(n for _, n in valid))
        trace["params"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return trace


@pytest.fixture(scope="module")
def ref_decrement() -> dict[str, Any]:
    return reference(W.EPOCHS, W.DECREMENT_FRACTION)


@pytest.fixture(scope="module")
def ref_noop() -> dict[str, Any]:
    return reference(W.EPOCHS, 1.0)


def _max_difference(got: dict[str, Any], expected: dict[str, torch.Tensor], stage: int | None) -> float:
    """The largest |got - expected| over the parameters of ``stage`` (``None``: all of them)."""
    names = [name for name in expected if stage is None or _stage_of(name) == stage]
    assert names
    assert all(name in got for name in names), (sorted(got), names)
    return max(
        (torch.as_tensor(got[name], dtype=torch.float64) - expected[name]).abs().max().item()
        for name in names
    )


# --- the two-stage run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both ranks' records of every phase, the run's directory and the processes' exit codes."""
    out = tmp_path_factory.mktemp("pipeline-acceptance")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [(out / f"rank-{rank}.log").open("w") for rank in (0, 1)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER_PATH), str(rank), str(port), str(out)],
            stdout=logs[rank],
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        for rank in (0, 1)
    ]
    deadline = time.monotonic() + RUN_DEADLINE_S
    try:
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for log in logs:
            log.close()
    ranks = []
    for rank in (0, 1):
        path = out / f"rank-{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    return {
        "ranks": ranks,
        "dir": out,
        "returncodes": [process.returncode for process in processes],
        "logs": [(out / f"rank-{rank}.log").read_text()[-3000:] for rank in (0, 1)],
    }


def _phase(run: dict[str, Any], rank: int, name: str) -> dict[str, Any]:
    record = run["ranks"][rank].get(name)
    assert record is not None, f"rank {rank} has no record of {name!r}; its log:\n{run['logs'][rank]}"
    return record


def _trained(run: dict[str, Any], rank: int, name: str) -> dict[str, Any]:
    record = _phase(run, rank, name)
    assert "error" not in record, f"rank {rank}, {name}: {record.get('traceback')}"
    return record


def test_the_run_joined_and_ended_as_planned(two_stages: dict[str, Any]) -> None:
    """Rank 0 left the group normally; rank 1 SIGKILLed itself in the last phase."""
    assert two_stages["ranks"][0].get("joined"), two_stages["logs"][0]
    assert two_stages["ranks"][1].get("joined"), two_stages["logs"][1]
    assert two_stages["returncodes"][0] == 0, two_stages["logs"][0]
    assert two_stages["ranks"][0].get("left_group") is True
    assert two_stages["returncodes"][1] == -9, two_stages["logs"][1]


# --- what it computes -----------------------------------------------------------------------


def test_gpipe_two_stages_equal_one_process_in_float64(
    two_stages: dict[str, Any], ref_decrement: dict[str, Any]
) -> None:
    """docs/pipeline.md, "What it computes": the same as one process on the same batches."""
    for rank in (0, 1):
        record = _trained(two_stages, rank, "gpipe")
        assert _max_difference(record["model"], ref_decrement["params"][-1], stage=rank) < PARAMETER_TOLERANCE
        assert record["state"]["epoch"] == W.EPOCHS


def test_1f1b_two_stages_equal_one_process_and_keep_the_best_epoch(
    two_stages: dict[str, Any], ref_decrement: dict[str, Any]
) -> None:
    """1F1B (2 micro-batches), every epoch eligible: the stage ends with the best epoch's parameters."""
    best = min(range(W.EPOCHS), key=lambda epoch: ref_decrement["valid"][epoch])
    assert best != W.EPOCHS - 1, (
        "the reference must not be best at its last epoch, or this test proves nothing"
    )
    assert (
        _max_difference(ref_decrement["params"][best], ref_decrement["params"][-1], stage=None) > 1e-3
    )  # the best and the last parameters are told apart
    for rank in (0, 1):
        record = _trained(two_stages, rank, "1f1b")
        assert (
            _max_difference(record["model"], ref_decrement["params"][best], stage=rank) < PARAMETER_TOLERANCE
        )
        assert record["state"]["min_validation_epoch"] == best
        assert record["state"]["min_validation_loss"] == pytest.approx(
            ref_decrement["valid"][best], abs=LOSS_TOLERANCE
        )
        training = [entry["training_loss"] for entry in record["state"]["learning_curve"]]
        assert training == pytest.approx(ref_decrement["train"], abs=LOSS_TOLERANCE)


@pytest.mark.parametrize("phase", ["gpipe", "1f1b"])
def test_losses_are_means_over_every_example(
    two_stages: dict[str, Any], ref_decrement: dict[str, Any], phase: str
) -> None:
    """The training and validation losses are (loss sum) / (examples), not means of batch means."""
    # The batches differ in size (16, 16, 8 and 16, 4), so the two kinds of mean differ.
    for epoch in range(W.EPOCHS):
        assert abs(ref_decrement["train"][epoch] - ref_decrement["train_mean_of_means"][epoch]) > 1e-4
    for rank in (0, 1):
        curve = _trained(two_stages, rank, phase)["state"]["learning_curve"]
        assert len(curve) == W.EPOCHS
        assert [entry["training_loss"] for entry in curve] == pytest.approx(
            ref_decrement["train"], abs=LOSS_TOLERANCE
        )
        raw_validation = [entry["validation_loss"][1] for entry in curve]
        assert raw_validation == pytest.approx(ref_decrement["valid"], abs=LOSS_TOLERANCE)
        # smoothing factor 1.0 (the default): the smoothed loss is the raw one
        assert [entry["validation_loss"][0] for entry in curve] == pytest.approx(
            raw_validation, abs=LOSS_TOLERANCE
        )


@pytest.mark.parametrize("phase", ["gpipe", "1f1b", "resume_second", "resume_noop_second"])
def test_every_rank_returns_the_same_loop_state(two_stages: dict[str, Any], phase: str) -> None:
    assert _trained(two_stages, 0, phase)["state"] == _trained(two_stages, 1, phase)["state"]


def test_each_rank_trains_its_stage_and_leaves_the_other_layers_alone(two_stages: dict[str, Any]) -> None:
    """``model``: "this rank trains its stage's layers in place and leaves the others alone"."""
    initial = W.make_model().state_dict()
    for rank in (0, 1):
        model = _trained(two_stages, rank, "gpipe")["model"]
        assert _max_difference(model, initial, stage=1 - rank) == 0.0
        assert _max_difference(model, initial, stage=rank) > 1e-3


# --- checkpoints and resume -----------------------------------------------------------------


def test_every_stage_saves_a_checkpoint_after_every_epoch(two_stages: dict[str, Any]) -> None:
    for rank in (0, 1):
        assert two_stages["ranks"][rank]["gpipe_saved_epochs"] == [1, 2, 3]
        assert saved_epochs(two_stages["dir"] / "checkpoints-gpipe", rank) == {1, 2, 3}
        assert stage_checkpoint_dir(two_stages["dir"] / "checkpoints-gpipe", rank).name == f"stage-{rank:03d}"


def test_when_a_rank_goes_on_every_stage_has_saved_that_epoch(two_stages: dict[str, Any]) -> None:
    """ "After each epoch's checkpoints the ranks wait for each other" (stage 1 saved 0.3 s late)."""
    seen = two_stages["ranks"][0]["stage1_epochs_seen_at_epoch_start"]
    assert [epoch for epoch, _ in seen] == [0, 1]
    assert seen[1][1] == [1], seen


def test_resume_without_schedule_trains_on_as_one_process(
    two_stages: dict[str, Any], ref_noop: dict[str, Any]
) -> None:
    """Stopped after 2 epochs, resumed (into a model with other initial values) for the 3rd."""
    for rank in (0, 1):
        assert two_stages["ranks"][rank]["resume_noop_loaded_epoch"] == 2
        first = _trained(two_stages, rank, "resume_noop_first")
        assert _max_difference(first["model"], ref_noop["params"][1], stage=rank) < PARAMETER_TOLERANCE
        record = _trained(two_stages, rank, "resume_noop_second")
        assert _max_difference(record["model"], ref_noop["params"][-1], stage=rank) < PARAMETER_TOLERANCE
        curve = record["state"]["learning_curve"]
        assert [entry["training_loss"] for entry in curve] == pytest.approx(
            ref_noop["train"], abs=LOSS_TOLERANCE
        )
        assert record["state"]["epoch"] == W.EPOCHS


def test_resume_with_a_learning_rate_schedule_trains_on_as_the_uninterrupted_run(
    two_stages: dict[str, Any], ref_decrement: dict[str, Any]
) -> None:
    """docs/pipeline.md, "Checkpoints": "A resumed run trains on exactly as the uninterrupted one"."""
    for rank in (0, 1):
        assert two_stages["ranks"][rank]["resume_loaded_epoch"] == 2
        first = _trained(two_stages, rank, "resume_first")
        assert _max_difference(first["model"], ref_decrement["params"][1], stage=rank) < PARAMETER_TOLERANCE
        resumed = _trained(two_stages, rank, "resume_second")
        uninterrupted = _trained(two_stages, rank, "gpipe")

        def losses(record: dict[str, Any]) -> list[float]:
            return [
                value
                for entry in record["state"]["learning_curve"]
                for value in (entry["training_loss"], *entry["validation_loss"])
            ]

        assert losses(resumed) == pytest.approx(losses(uninterrupted), abs=LOSS_TOLERANCE)
        assert (
            _max_difference(resumed["model"], ref_decrement["params"][-1], stage=rank) < PARAMETER_TOLERANCE
        )


def test_load_resumes_at_the_newest_epoch_every_stage_saved(
    two_stages: dict[str, Any], ref_decrement: dict[str, Any], tmp_path: Path
) -> None:
    """Stage 0 saved epochs 1-3, stage 1 only 1-2 (as after a crash mid-save): both resume at 2."""
    shutil.copytree(
        stage_checkpoint_dir(two_stages["dir"] / "checkpoints-gpipe", 0), stage_checkpoint_dir(tmp_path, 0)
    )
    shutil.copytree(two_stages["dir"] / "stage-001-after-2-epochs", stage_checkpoint_dir(tmp_path, 1))
    assert saved_epochs(tmp_path, 0) == {1, 2, 3}
    assert saved_epochs(tmp_path, 1) == {1, 2}
    for rank in (0, 1):
        stage = split_sequential(W.make_model(seed=5), W.BOUNDARIES)[rank]
        checkpoint = load_stage_checkpoint(tmp_path, stage_index=rank, num_stages=2, stage=stage)
        assert checkpoint is not None
        assert checkpoint.state.loop_state.epoch == 2
        model = {name: tensor.tolist() for name, tensor in checkpoint.state.model.items()}
        assert _max_difference(model, ref_decrement["params"][1], stage=rank) < PARAMETER_TOLERANCE


def test_stage_checkpoint_refusals(two_stages: dict[str, Any], tmp_path: Path) -> None:
    directory = two_stages["dir"] / "checkpoints-gpipe"
    stages = split_sequential(W.make_model(), W.BOUNDARIES)
    with pytest.raises(CheckpointError):  # stage 0's checkpoint does not fit stage 1
        load_stage_checkpoint(directory, stage_index=0, num_stages=2, stage=stages[1])
    with pytest.raises(ConfigurationError):
        load_stage_checkpoint(directory, stage_index=2, num_stages=2)
    with pytest.raises(ConfigurationError):
        stage_checkpointer(tmp_path, 0, keep_last=1)
    assert load_stage_checkpoint(tmp_path / "empty", stage_index=0, num_stages=2, stage=stages[0]) is None


# --- refusals on every rank -----------------------------------------------------------------

INITIAL_MODEL_PHASES = {"split_too_far", "three_stages_two_ranks", "specs_differ"}


@pytest.mark.parametrize(
    ("phase", "error", "pattern"),
    [
        ("not_sequential", ConfigurationError, r"Sequential"),
        ("split_too_far", ConfigurationError, r"\b5\b"),
        ("three_stages_two_ranks", ConfigurationError, r"\b3\b.*\b2\b|\b2\b.*\b3\b"),
        ("layer_misfit", ConfigurationError, r"stage 1"),
        ("specs_differ", ConfigurationError, r"."),
        ("models_differ", ConfigurationError, r"."),
        ("meta_model", ConfigurationError, r"CPU"),
        ("nested_group", ConfigurationError, r"."),
    ],
)
def test_bad_inputs_are_refused_on_every_rank_before_training(
    two_stages: dict[str, Any], phase: str, error: type[LamploopError], pattern: str
) -> None:
    initial = W.make_model().state_dict()
    for rank in (0, 1):
        record = _phase(two_stages, rank, phase)
        assert record["error"] == error.__name__, record
        assert re.search(pattern, record["message"]), record["message"]
        if "elapsed_s" in record:  # at once, not after the group's timeout
            assert record["elapsed_s"] < 5.0
        if phase in INITIAL_MODEL_PHASES or (phase == "models_differ" and rank == 0):
            assert _max_difference(record["model"], initial, stage=None) == 0.0


def test_a_batch_that_does_not_split_is_a_batch_error_naming_epoch_and_batch(
    two_stages: dict[str, Any],
) -> None:
    """Batches of 16, 10, 14 with 4 micro-batches: the second batch is refused, on both ranks."""
    for rank in (0, 1):
        record = _phase(two_stages, rank, "odd_batch")
        assert record["error"] == BatchError.__name__, record
        match = re.search(r"epoch (\d+), batch (\d+)", record["message"])
        assert match, record["message"]
        assert int(match.group(1)) == 0  # epochs count from 0 in lamploop (LoopState.epoch)
        assert int(match.group(2)) in (1, 2)  # the second batch, counted from 0 or from 1
        assert record["elapsed_s"] < 5.0


def test_a_nan_loss_stops_every_rank_before_the_optimizer_steps(
    two_stages: dict[str, Any], ref_decrement: dict[str, Any]
) -> None:
    """A NaN in the second batch: every stage keeps the parameters after the first step."""
    for rank in (0, 1):
        record = _phase(two_stages, rank, "nan_loss")
        assert record["error"] == "NonFiniteLossError", record
        assert "FloatingPointError" in record["error_mro"]
        assert _max_difference(record["model"], ref_decrement["first_step"], stage=rank) < PARAMETER_TOLERANCE
        assert all(
            math.isfinite(value)
            for values in record["model"].values()
            for value in torch.tensor(values).flatten()
        )


def test_a_stage_that_dies_fails_its_neighbour_at_once(two_stages: dict[str, Any]) -> None:
    """docs/pipeline.md, "Never a hang": a SIGKILLed stage's neighbour fails with a DistributedError
    at once (the group's timeout is 20 s here)."""
    record = _phase(two_stages, 0, "kill")
    assert record["error"] == DistributedError.__name__, record
    assert re.match(
        r"pipeline stage 0: epoch \d+, batch \d+: "
        r"another stage died, or did not answer within the group's timeout",
        record["message"],
    ), record["message"]
    killed_at = float((two_stages["dir"] / "killed-at").read_text())
    assert record["failed_at"] - killed_at < 5.0 < W.GROUP_TIMEOUT_S


# --- one process: spec, split and a one-stage run ---------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        {"boundaries": (2, 1)},
        {"boundaries": (2, 2)},
        {"boundaries": (0,)},
        {"boundaries": (-1,)},
        {"boundaries": (1.5,)},
        {"boundaries": ("2",)},
        {"boundaries": (2,), "n_microbatches": 0},
        {"boundaries": (2,), "n_microbatches": 2.0},
        {"boundaries": (2,), "schedule": "interleaved"},
        {"boundaries": (2,), "n_microbatches": 1, "schedule": "1f1b"},
        {"boundaries": (1, 2, 3), "n_microbatches": 3, "schedule": "1f1b"},
    ],
)
def test_pipeline_spec_refuses_bad_specs(arguments: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        PipelineSpec(**arguments)


def test_pipeline_spec_accepts_what_the_docs_allow() -> None:
    assert PipelineSpec(boundaries=(2,), n_microbatches=4, schedule="1f1b").num_stages == 2
    assert PipelineSpec(boundaries=(1, 2, 3), n_microbatches=4, schedule="1f1b").num_stages == 4
    spec = PipelineSpec(boundaries=())
    assert (spec.num_stages, spec.n_microbatches, spec.schedule) == (1, 1, "gpipe")


def test_split_sequential_shares_the_layers_and_keeps_their_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    first, second = split_sequential(model, (2,))
    assert list(first.state_dict()) == ["0.weight", "0.bias"]
    assert list(second.state_dict()) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert first[0] is model[0]
    assert second[0] is model[2]
    x = torch.randn(5, 8)
    assert torch.equal(second(first(x)), model(x))


@pytest.mark.parametrize(
    ("model", "boundaries"),
    [
        (nn.Linear(2, 2), (1,)),
        (nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]), (1,)),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), (3,)),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), (0,)),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), (2, 1)),
    ],
)
def test_split_sequential_refuses_what_does_not_fit(model: nn.Module, boundaries: tuple[int, ...]) -> None:
    with pytest.raises(ConfigurationError):
        split_sequential(model, boundaries)


def _train_one_stage(**overrides: Any) -> Callable[[], Any]:
    arguments: dict[str, Any] = {
        "model": W.make_model(),
        "spec": PipelineSpec(boundaries=(), n_microbatches=4),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=W.LR, momentum=W.MOMENTUM),
        "train_batches": W.train_batches,
        "max_epochs": 2,
    }
    arguments.update(overrides)
    return partial(train_pipeline, **arguments)


def test_train_pipeline_without_a_process_group_is_a_configuration_error() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("this process already has a default process group")
    with pytest.raises(ConfigurationError):
        anyio.run(_train_one_stage())


@pytest.mark.timeout(30)
def test_one_stage_on_one_rank_equals_one_process(ref_noop: dict[str, Any]) -> None:
    """docs/pipeline.md: "The same code runs on one rank, with a spec of one stage"."""
    if torch.distributed.is_initialized():
        pytest.skip("this process already has a default process group")
    model = W.make_model()
    with open_pipeline_group(rank=0, world_size=1, host="127.0.0.1", port=free_port(), timeout=30):
        state = anyio.run(_train_one_stage(model=model))
    assert not torch.distributed.is_initialized()  # "Leaving the block destroys the group"
    assert state.epoch == 2
    assert len(state.learning_curve) == 2
    assert [entry.training_loss for entry in state.learning_curve] == pytest.approx(
        ref_noop["train"][:2], abs=LOSS_TOLERANCE
    )
    got = {name: tensor.tolist() for name, tensor in model.state_dict().items()}
    assert _max_difference(got, ref_noop["params"][1], stage=None) < PARAMETER_TOLERANCE


@pytest.mark.timeout(30)
def test_a_two_stage_spec_on_one_rank_is_refused() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("this process already has a default process group")
    with (
        open_pipeline_group(rank=0, world_size=1, host="127.0.0.1", port=free_port(), timeout=30),
        pytest.raises(ConfigurationError),
    ):
        anyio.run(_train_one_stage(spec=PipelineSpec(boundaries=(2,), n_microbatches=4)))


@pytest.mark.timeout(30)
def test_joining_waits_at_most_join_timeout() -> None:
    """Rank 0 of 2, alone: a DistributedError after ``join_timeout``, not a hang."""
    if torch.distributed.is_initialized():
        pytest.skip("this process already has a default process group")
    started = time.monotonic()
    with (
        pytest.raises(DistributedError),
        open_pipeline_group(
            rank=0, world_size=2, host="127.0.0.1", port=free_port(), timeout=2, join_timeout=2
        ),
    ):
        pass
    assert time.monotonic() - started < 15.0
    assert not torch.distributed.is_initialized()
