"""One rank of the pipeline acceptance test (tests/pipeline/test_acceptance_docs_pipeline.py).

``python acceptance_pipeline_stage.py RANK PORT OUT_DIR``: joins a 2-rank Gloo pipeline group
on 127.0.0.1:PORT and runs, in one group, the phases the test asserts on (training with
GPipe and 1F1B, an interrupted and resumed run, refusals of bad inputs, and last a stage that
SIGKILLs itself). After every phase it rewrites ``OUT_DIR/rank-R.json`` with what it saw
(float64 values as JSON numbers, which round-trip exactly).

The model, the data and the batch order are plain torch, defined here so that the test's own
one-process reference (plain torch, no lamploop) trains on exactly the same batches.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

N_TRAIN = 40
N_VALID = 20
TRAIN_SIZES = (16, 16, 8)  # unequal: an example-weighted mean differs from a mean of batch means
VALID_SIZES = (16, 4)
BOUNDARIES = (2,)
LR = 0.3
MOMENTUM = 0.9
DECREMENT_FRACTION = 0.5  # lamploop.schedules.decrement(every=1, fraction=0.5): lr * 0.5**epoch
EPOCHS = 3
GROUP_TIMEOUT_S = 20.0

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def make_model(seed: int = 0, hidden: int = 10, misfit: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, hidden),
        nn.Tanh(),
        nn.Linear(hidden + 1 if misfit else hidden, 10),
        nn.Tanh(),
        nn.Linear(10, 3),
    )
    return model.double()


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(N_TRAIN + N_VALID, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (N_TRAIN + N_VALID,), generator=generator)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def _cut(x: torch.Tensor, y: torch.Tensor, sizes: tuple[int, ...]) -> Batches:
    batches, start = [], 0
    for size in sizes:
        batches.append((x[start : start + size].clone(), y[start : start + size].clone()))
        start += size
    return batches


def train_batch_list(epoch: int, sizes: tuple[int, ...] = TRAIN_SIZES) -> Batches:
    """The training batches of ``epoch``: a permutation that depends on the epoch only."""
    x, y, _, _ = make_data()
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(1000 + epoch))
    return _cut(x[order], y[order], sizes)


def valid_batch_list() -> Batches:
    _, _, x, y = make_data()
    return _cut(x, y, VALID_SIZES)


async def _iterate(batches: Batches) -> Any:
    for batch in batches:
        yield batch


def train_batches(context: Any) -> Any:
    return _iterate(train_batch_list(context.epoch))


def valid_batches(context: Any) -> Any:
    return _iterate(valid_batch_list())


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _tensors(state_dict: Any) -> dict[str, Any]:
    return {name: tensor.detach().tolist() for name, tensor in state_dict.items()}


def _loop_state(state: Any) -> dict[str, Any]:
    return {
        "epoch": state.epoch,
        "last_validation_loss": state.last_validation_loss,
        "min_validation_loss": state.min_validation_loss,
        "min_validation_epoch": state.min_validation_epoch,
        "learning_curve": [
            {
                "epoch": entry.epoch,
                "training_loss": entry.training_loss,
                "validation_loss": list(entry.validation_loss) if entry.validation_loss is not None else None,
            }
            for entry in state.learning_curve
        ],
    }


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    import anyio

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
    from lamploop.schedules import decrement, noop

    results: dict[str, Any] = {"rank": rank}
    out_file = out_dir / f"rank-{rank}.json"

    def save() -> None:
        temporary = out_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(results))
        os.replace(temporary, out_file)

    def run(name: str, **kwargs: Any) -> Any:
        """Train with the common arguments (overridden by ``kwargs``); record the outcome."""
        arguments: dict[str, Any] = {
            "model": make_model(),
            "spec": PipelineSpec(boundaries=BOUNDARIES, n_microbatches=4, schedule="gpipe"),
            "optimizer_factory": _sgd,
            "train_batches": train_batches,
            "validation_batches": valid_batches,
            "max_epochs": EPOCHS,
            "learning_rate_schedule": decrement(every=1, fraction=DECREMENT_FRACTION),
        }
        arguments.update(kwargs)
        record: dict[str, Any] = {}
        started = time.monotonic()
        try:
            state = anyio.run(partial(train_pipeline, **arguments))
        except Exception as error:  # recorded for the test to judge
            record["error"] = type(error).__name__
            record["error_mro"] = [cls.__name__ for cls in type(error).__mro__]
            record["message"] = str(error)
            record["traceback"] = traceback.format_exc()
            record["failed_at"] = time.time()
        else:
            record["state"] = _loop_state(state)
        record["elapsed_s"] = time.monotonic() - started
        model = arguments["model"]
        if isinstance(model, nn.Module):
            with contextlib.suppress(Exception):  # a meta model has no values
                record["model"] = _tensors(model.state_dict())
        results[name] = record
        save()
        return record

    def refused(name: str, call: Any) -> None:
        try:
            call()
        except Exception as error:
            results[name] = {"error": type(error).__name__, "message": str(error)}
        else:
            results[name] = {"error": None}
        save()

    checkpoints_a = out_dir / "checkpoints-gpipe"
    checkpoints_c = out_dir / "checkpoints-resume"
    with open_pipeline_group(
        rank=rank, world_size=2, host="127.0.0.1", port=port, timeout=GROUP_TIMEOUT_S, join_timeout=40.0
    ):
        results["joined"] = True
        save()
        # Trainings compared with the test's float64 one-process reference.
        run("gpipe", checkpoint_state=stage_checkpointer(checkpoints_a, rank, keep_last=None))
        results["gpipe_saved_epochs"] = sorted(saved_epochs(checkpoints_a, rank))
        run(
            "1f1b",
            spec=PipelineSpec(boundaries=BOUNDARIES, n_microbatches=2, schedule="1f1b"),
            return_min_validation_loss_model=range(100),
        )
        # Interrupted after 2 epochs, then resumed from the checkpoints into a model built
        # with other initial parameters (the checkpoint's must win).
        run("resume_first", max_epochs=2, checkpoint_state=stage_checkpointer(checkpoints_c, rank))
        if rank == 1:  # stage 1 as a crash would leave it next to a stage 0 one epoch ahead
            shutil.copytree(stage_checkpoint_dir(checkpoints_c, 1), out_dir / "stage-001-after-2-epochs")
        resumed_model = make_model(seed=99)
        stage = split_sequential(resumed_model, BOUNDARIES)[rank]
        schedule = decrement(every=1, fraction=DECREMENT_FRACTION)
        checkpoint = load_stage_checkpoint(
            checkpoints_c, stage_index=rank, num_stages=2, stage=stage, schedule=schedule
        )
        results["resume_loaded_epoch"] = checkpoint and checkpoint.state.loop_state.epoch
        save()
        if checkpoint is not None:
            run(
                "resume_second",
                model=resumed_model,
                init_state=checkpoint.state,
                learning_rate_schedule_init_state=checkpoint.schedule_state,
                checkpoint_state=stage_checkpointer(checkpoints_c, rank),
            )

        # The same without a learning-rate schedule; stage 1 saves slowly, and stage 0 notes
        # which of stage 1's checkpoints are on disk when it starts the next epoch.
        checkpoints_n = out_dir / "checkpoints-resume-noop"
        save_stage = stage_checkpointer(checkpoints_n, rank)

        async def slow_checkpoint(state: Any, schedule_state: Any) -> None:
            if rank == 1:
                await anyio.sleep(0.3)
            await save_stage(state, schedule_state)

        seen: list[Any] = []

        def watching_batches(context: Any) -> Any:
            async def batches() -> Any:
                for index, batch in enumerate(train_batch_list(context.epoch)):
                    if index == 0:
                        seen.append([context.epoch, sorted(saved_epochs(checkpoints_n, 1))])
                    yield batch

            return batches()

        run(
            "resume_noop_first",
            max_epochs=2,
            learning_rate_schedule=noop(),
            train_batches=watching_batches,
            checkpoint_state=slow_checkpoint,
        )
        results["stage1_epochs_seen_at_epoch_start"] = seen
        resumed_model = make_model(seed=99)
        stage = split_sequential(resumed_model, BOUNDARIES)[rank]
        checkpoint = load_stage_checkpoint(
            checkpoints_n, stage_index=rank, num_stages=2, stage=stage, schedule=noop()
        )
        results["resume_noop_loaded_epoch"] = checkpoint and checkpoint.state.loop_state.epoch
        save()
        if checkpoint is not None:
            run(
                "resume_noop_second",
                model=resumed_model,
                learning_rate_schedule=noop(),
                init_state=checkpoint.state,
                learning_rate_schedule_init_state=checkpoint.schedule_state,
                checkpoint_state=stage_checkpointer(checkpoints_n, rank),
            )

        # Refusals: each should be raised on both ranks before anything is sent.
        class Wrapped(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = make_model()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.body(x)

        run("not_sequential", model=Wrapped())
        run("split_too_far", spec=PipelineSpec(boundaries=(5,), n_microbatches=4))
        run("three_stages_two_ranks", spec=PipelineSpec(boundaries=(1, 2), n_microbatches=4))
        run("layer_misfit", model=make_model(misfit=True))
        run("specs_differ", spec=PipelineSpec(boundaries=BOUNDARIES, n_microbatches=4 if rank == 0 else 2))
        run("models_differ", model=make_model(hidden=10 if rank == 0 else 12))
        run("meta_model", model=make_model().to("meta"))
        odd_sizes = (16, 10, 14)  # batch 1 does not split into 4 micro-batches
        run("odd_batch", train_batches=lambda context: _iterate(train_batch_list(context.epoch, odd_sizes)))

        def nan_batches(context: Any) -> Any:
            batches = train_batch_list(context.epoch)
            batches[1][0][3, 2] = float("nan")
            return _iterate(batches)

        run("nan_loss", train_batches=nan_batches)
        refused(
            "nested_group",
            lambda: open_pipeline_group(
                rank=rank, world_size=2, host="127.0.0.1", port=port + 1, timeout=3.0, join_timeout=3.0
            ).__enter__(),
        )

        # Last: stage 1 dies mid-epoch (SIGKILL); stage 0 should fail at once, not at the timeout.
        def dying_batches(context: Any) -> Any:
            async def batches() -> Any:
                for index, batch in enumerate(train_batch_list(context.epoch)):
                    if rank == 1 and index == 2:
                        (out_dir / "killed-at").write_text(repr(time.time()))
                        os.kill(os.getpid(), signal.SIGKILL)
                    yield batch

            return batches()

        run("kill", train_batches=dying_batches, validation_batches=None)
    results["left_group"] = True
    save()


if __name__ == "__main__":
    main()
