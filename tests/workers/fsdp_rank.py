"""One rank of tests/sync/test_fsdp.py: ``python tests/workers/fsdp_rank.py RUNDIR RANK NRANKS``.

Joins two process groups over one store on 127.0.0.1 (port in ``RUNDIR/jobs.json``): lamploop's
own (a Gloo group object, as the drivers make it) and torch's default group
(``init_process_group``), then runs the jobs of ``RUNDIR/jobs.json`` in order:

- ``lamploop``: :class:`lamploop.sync.FullyShard` through :func:`lamploop.one_epoch`, the
  batches of :func:`plan`; may save a sharded checkpoint (``save``) or start from one (``load``);
  ``param_dtype`` / ``reduce_dtype``: the strategy's mixed precision (``hand`` takes them too,
  as FSDP2's ``MixedPrecisionPolicy``);
- ``hand``: PyTorch's FSDP2 in a training loop written here from torch's docs, without
  lamploop (the reference): each rank backpropagates ``loss_sum * R / N_step`` (FSDP2
  averages over ranks), a rank without a batch in a micro-batch position an empty batch;
- ``load_only``: shard a fresh model, load a checkpoint, write its parameters.

Each job writes rank 0's full parameters to ``RUNDIR/<name>.safetensors`` (``full_tensor()``),
``RUNDIR/done.rank<r>`` when all jobs are done, ``RUNDIR/failed.rank<r>`` with a traceback if
one fails.  Nothing is pickled.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN, HIDDEN, CLASSES, BATCH = 8, 13, 5, 6


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(n, IN, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (n,), generator=generator)


def mlp(seed: int = 0) -> nn.Sequential:
    """8-13-5 (odd sizes: uneven shards), float64, seeded."""
    generator = torch.Generator().manual_seed(seed)
    module = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float64) - 0.5)
    return module


def plan(n: int, epoch: int, nranks: int, k: int, batch: int = BATCH) -> list[list[list[torch.Tensor]]]:
    """``plan[s][r]``: rank r's (up to k) index batches of step s; batch i goes to rank i % nranks."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(100 + epoch))
    per_rank = [list(torch.split(order, batch))[r::nranks] for r in range(nranks)]
    steps = max(math.ceil(len(b) / k) for b in per_rank)
    return [[per_rank[r][s * k : (s + 1) * k] for r in range(nranks)] for s in range(steps)]


def optimizer_for(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone().contiguous()
    return out


def _lamploop_job(job: dict[str, Any], rank: int, nranks: int, collectives: Any, rundir: Path) -> nn.Module:
    import anyio

    import lamploop
    from lamploop.checkpoint.sharded import load_sharded, save_sharded
    from lamploop.sync.fsdp import FullyShard
    from lamploop.sync.group_channel import ProcessGroupChannel

    x, y = data(job["n"])
    module = mlp()
    strategy = FullyShard(
        reshard_after_forward=job.get("reshard", True),
        param_dtype=job.get("param_dtype"),
        reduce_dtype=job.get("reduce_dtype"),
    )
    strategy.shard(collectives, module)
    optimizer = optimizer_for(job["optimizer"], module.parameters())
    first_epoch = 0
    if "load" in job:
        meta = load_sharded(rundir / job["load"], module=module, optimizer=optimizer)
        first_epoch = int(meta["epoch"])
    channel = ProcessGroupChannel(collectives, strategy)
    model = lamploop.SupervisedModel(module, lamploop.cross_entropy_loss)

    async def stream(epoch: int) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in plan(job["n"], epoch, nranks, job["k"], job.get("batch", BATCH)):
            for idx in step[rank]:
                yield x[idx], y[idx]

    async def train(epoch: int) -> float:
        return await lamploop.one_epoch(
            model=model,
            batches=stream(epoch),
            channel=channel,
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=job["k"],
            epoch=epoch,
            max_gradient_norm=job.get("clip"),
        )

    for epoch in range(first_epoch, job["epochs"]):
        anyio.run(train, epoch)
        if job.get("save_at") == epoch + 1:
            save_sharded(
                rundir / job["save"],
                collectives=collectives,
                module=module,
                optimizer=optimizer,
                epoch=epoch + 1,
                meta={"epoch": epoch + 1},
            )
    if job.get("validate"):  # uneven streams: one rank runs stand-in forwards
        loss = anyio.run(
            lambda: lamploop.one_epoch(model=model, batches=stream(0), channel=channel, forward_only=True)
        )
        (rundir / f"{job['name']}.rank{rank}.json").write_text(json.dumps({"validation_loss": loss}))
    return module


def _no_batch_job(job: dict[str, Any], rank: int, nranks: int, collectives: Any, rundir: Path) -> None:
    """Only rank 0 has a batch: every rank must raise, none may wait for the others."""
    import anyio

    import lamploop
    from lamploop.errors import BatchError
    from lamploop.sync.fsdp import FullyShard
    from lamploop.sync.group_channel import ProcessGroupChannel

    x, y = data(BATCH)
    module = mlp()
    strategy = FullyShard()
    strategy.shard(collectives, module)
    optimizer = optimizer_for("sgd", module.parameters())
    channel = ProcessGroupChannel(collectives, strategy)

    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        if rank == 0:
            yield x, y

    model = lamploop.SupervisedModel(module, lamploop.cross_entropy_loss)
    try:
        anyio.run(
            lambda: lamploop.one_epoch(
                model=model, batches=stream(), channel=channel, step_optimizer=optimizer.step
            )
        )
    except BatchError as error:
        message = f"{type(error).__name__}: {error} (every rank: {error.detected_by_every_rank})"
    else:
        message = "no error"
    (rundir / f"{job['name']}.rank{rank}.txt").write_text(message)


def _hand_job(job: dict[str, Any], rank: int, nranks: int) -> nn.Module:
    """PyTorch's FSDP2 on the default group, written from its docs: the reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {None: None, "bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}
    policy = MixedPrecisionPolicy(
        param_dtype=dtypes[job.get("param_dtype")], reduce_dtype=dtypes[job.get("reduce_dtype")]
    )
    x, y = data(job["n"])
    module = mlp()
    for layer in (module[0], module[2]):
        fully_shard(layer, reshard_after_forward=job.get("reshard", True), mp_policy=policy)
    fully_shard(module, reshard_after_forward=job.get("reshard", True), mp_policy=policy)
    optimizer = optimizer_for(job["optimizer"], module.parameters())
    for epoch in range(job["epochs"]):
        for step in plan(job["n"], epoch, nranks, job["k"], job.get("batch", BATCH)):
            total = sum(len(idx) for batches in step for idx in batches)
            positions = max(len(batches) for batches in step)
            for j in range(positions):
                idx = step[rank][j] if j < len(step[rank]) else torch.zeros(0, dtype=torch.int64)
                loss_sum = nn.functional.cross_entropy(module(x[idx]), y[idx], reduction="sum")
                (loss_sum * nranks / total).backward()
            if job.get("clip") is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), job["clip"])
            optimizer.step()
            optimizer.zero_grad()
    return module


def _load_only_job(job: dict[str, Any], collectives: Any, rundir: Path) -> nn.Module:
    from lamploop.checkpoint.sharded import load_sharded
    from lamploop.sync.fsdp import FullyShard

    latest = rundir / job["load"] / "latest"
    deadline = time.monotonic() + 150  # another run writes it
    while not latest.exists():
        if time.monotonic() > deadline:
            msg = f"{latest} did not appear within 150 s"
            raise TimeoutError(msg)
        time.sleep(0.1)
    module = mlp(seed=99)  # other values: the load must overwrite every one
    FullyShard().shard(collectives, module)
    optimizer = optimizer_for(job["optimizer"], module.parameters())
    load_sharded(rundir / job["load"], module=module, optimizer=optimizer)
    return module


def main(rundir: Path, rank: int, nranks: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lamploop.distributed.process_group import new_process_group
    from lamploop.sync.collectives import Collectives

    torch.set_num_threads(1)
    try:
        spec = json.loads((rundir / "jobs.json").read_text())
        store = dist.TCPStore(
            "127.0.0.1", spec["port"], nranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
        )
        cpu = torch.device("cpu")
        group = new_process_group(store, rank=rank, nranks=nranks, device=cpu, timeout=60, prefix="lamploop")
        collectives = Collectives(group, rank=rank, nranks=nranks, device=cpu, timeout=60)
        if any(job["kind"] == "hand" for job in spec["jobs"]):
            dist.init_process_group(
                "gloo", store=dist.PrefixStore("hand", store), rank=rank, world_size=nranks
            )
        for job in spec["jobs"]:
            if job["kind"] == "no_batch":
                _no_batch_job(job, rank, nranks, collectives, rundir)
                continue
            if job["kind"] == "lamploop":
                module = _lamploop_job(job, rank, nranks, collectives, rundir)
            elif job["kind"] == "hand":
                module = _hand_job(job, rank, nranks)
            else:
                module = _load_only_job(job, collectives, rundir)
            full = _full(module)
            if rank == 0:
                save_file(full, str(rundir / f"{job['name']}.safetensors"))
        (rundir / f"done.rank{rank}").write_text("ok")
    except BaseException:
        (rundir / f"failed.rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    # The results are on disk: leave without finalizing the interpreter, where Gloo's threads
    # freeing work objects now and then abort the process (see lamploop.sync.abandon).
    os._exit(0)
