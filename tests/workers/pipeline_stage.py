"""One pipeline stage in its own process, for tests/pipeline/test_pipeline.py.

    python tests/workers/pipeline_stage.py CONFIG.json RANK

``CONFIG.json``: ``{"workdir", "port", "world_size", "timeout", "join_timeout", "runs": [run, ...]}``.  The
process joins the pipeline's process group once (rank 0 hosts the store on 127.0.0.1:port)
and trains the runs in turn.  A run's keys: ``name``, ``boundaries``, ``n_microbatches``,
``schedule``, ``epochs``, and optionally ``checkpoint`` (save every epoch into
``<workdir>/<checkpoint>``), ``resume`` (start from ``<workdir>/<resume>``'s newest common
checkpoint), ``progress`` (write the number of batches trained so far to
``<workdir>/<name>/progress-<rank>`` after each one) and ``wait_for`` (start only once
``<workdir>/<wait_for>`` exists; at most 120 s).

Each rank writes ``<workdir>/<name>/rank<r>.json`` (``{"ok": true, "state": LoopState}`` or
the error's type, class names and message) and ``rank<r>.safetensors`` (its stage's
parameters at the end).  A failed run ends the process with status 1.  Nothing is pickled:
torch's ``send_object_list`` and ``recv_object_list`` (which pipelining's dynamic shape
inference would use) are replaced by a tripwire that fails the run.

The data and model builders are imported by the test for its one-process reference.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from lamploop.batches import BatchContext, BatchStream, BatchStreamFactory, tensor_batches
from lamploop.pipeline import (
    PipelineSpec,
    load_stage_checkpoint,
    open_pipeline_group,
    split_sequential,
    stage_checkpointer,
    train_pipeline,
)
from lamploop.state import converter

FEATURES, CLASSES = 6, 4


def build_model(seed: int = 0) -> torch.nn.Sequential:
    """Five layers in float64: cut at 2 or 3 into two stages."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 12),
        torch.nn.ReLU(),
        torch.nn.Linear(12, CLASSES),
    ).double()


def build_data(seed: int = 1) -> tuple[BatchStreamFactory, BatchStreamFactory]:
    """Training: 56 examples in batches of 12 (the last one of 8); validation: 20 in 8, 8, 4."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(76, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (76,), generator=generator)
    train = tensor_batches(x[:56], y[:56], batch_size=12, seed=seed)
    valid = tensor_batches(x[56:], y[56:], batch_size=8, shuffle=False)
    return train, valid


def optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def _counted(factory: BatchStreamFactory, path: Path) -> BatchStreamFactory:
    """The same batches; the count trained so far written to ``path`` after each."""
    done = [0]

    def counted(context: BatchContext) -> BatchStream:
        async def stream() -> AsyncIterator[Any]:
            async for batch in factory(context):
                yield batch
                done[0] += 1
                path.write_text(str(done[0]))  # noqa: ASYNC240 (a few bytes, for the test to poll)

        return stream()

    return counted


async def _run(run: dict[str, Any], workdir: Path, rank: int, world_size: int) -> None:
    out = workdir / run["name"]
    out.mkdir(parents=True, exist_ok=True)
    if run.get("wait_for"):
        with anyio.fail_after(120):
            while not (workdir / run["wait_for"]).exists():  # noqa: ASYNC110 (a file from the test)
                await anyio.sleep(0.05)
    spec = PipelineSpec(tuple(run["boundaries"]), run["n_microbatches"], run["schedule"])
    model = build_model()
    train, valid = build_data()
    if run.get("progress"):
        train = _counted(train, out / f"progress-{rank}")
    stage = split_sequential(model, spec.boundaries)[rank]
    init, schedule_state = None, None
    if run.get("resume"):
        checkpoint = load_stage_checkpoint(
            workdir / run["resume"], stage_index=rank, num_stages=world_size, stage=stage
        )
        assert checkpoint is not None
        init, schedule_state = checkpoint.state, checkpoint.schedule_state
    saver = (
        stage_checkpointer(workdir / run["checkpoint"], rank, keep_last=None)
        if run.get("checkpoint")
        else None
    )
    try:
        state = await train_pipeline(
            model=model,
            spec=spec,
            optimizer_factory=optimizer,
            train_batches=train,
            validation_batches=valid,
            max_epochs=run["epochs"],
            return_min_validation_loss_model=(),
            init_state=init,
            learning_rate_schedule_init_state=schedule_state,
            checkpoint_state=saver,
        )
    except Exception as exc:
        result = {
            "ok": False,
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
        _write_json(out / f"rank{rank}.json", result)
        raise
    save_file(
        {k: v.contiguous() for k, v in stage.state_dict().items()}, str(out / f"rank{rank}.safetensors")
    )
    _write_json(out / f"rank{rank}.json", {"ok": True, "state": converter.unstructure(state)})


def _write_json(path: Path, value: object) -> None:
    """Write atomically: the test polls for the file and reads it as soon as it exists."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _pickled(*args: object, **kwargs: object) -> None:
    msg = "a pickled message between stages (send_object_list / recv_object_list)"
    raise AssertionError(msg)


def main(argv: list[str]) -> int:
    dist.send_object_list = dist.recv_object_list = _pickled  # type: ignore[assignment]
    config_path, rank_text = argv
    config = json.loads(Path(config_path).read_text())
    rank, world_size = int(rank_text), int(config["world_size"])
    workdir = Path(config["workdir"])
    torch.set_num_threads(1)
    with open_pipeline_group(
        rank=rank,
        world_size=world_size,
        host="127.0.0.1",
        port=config["port"],
        timeout=config["timeout"],
        join_timeout=config["join_timeout"],
    ):
        for run in config["runs"]:
            anyio.run(functools.partial(_run, run, workdir, rank, world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
