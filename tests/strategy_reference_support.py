"""References for tests/sync/test_strategy_references.py that lamploop did not write: PyTorch's own.

Two parts:

- the pure builders both sides share (imported by the test, and by the worker below): the
  digits data, the MLP 64-64-10 with seeded initial weights, and the batch plan (which
  examples each rank gets at each step of each epoch);
- a worker, run as ``python tests/strategy_reference_support.py RUNDIR RANK`` in two
  processes, that joins a real Gloo process group (``init_process_group``) and runs the
  jobs of ``RUNDIR/jobs.json`` with PyTorch's ``DistributedDataParallel`` and its
  communication hooks (``powerSGD_hook``, ``bf16_compress_hook``, ``fp16_compress_hook``)
  or with ``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``.  It never imports
  lamploop.  Each job writes ``RUNDIR/<name>.rank<r>.safetensors`` (tensors) and
  ``RUNDIR/<name>.rank<r>.json`` (numbers); ``RUNDIR/done.rank<r>`` when all are done;
  ``RUNDIR/failed.rank<r>`` (a traceback) if one fails.  Nothing is pickled.

lamploop's example weighting (one step's gradient is that of the mean loss over every
example of every rank of the step) is given to DDP by its loss: each rank backpropagates
``loss_sum * world_size / N_step``, which DDP's average over ranks turns into
``sum_r loss_sum_r / N_step``.  A rank with no batch in a step takes part with an empty
batch (zero gradients), as lamploop's uneven-stream rule says.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN, HIDDEN, CLASSES = 64, 64, 10
BATCH = 32
RENDEZVOUS_TIMEOUT_S = 90.0
DTYPES = {"float64": torch.float64, "float32": torch.float32}


# --- the shared builders -------------------------------------------------------------------------


@functools.cache
def _digits64() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    features = torch.tensor(x / 16.0, dtype=torch.float64)
    target = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(target), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(target))
    return features[order[:cut]], target[order[:cut]], features[order[cut:]], target[order[cut:]]


def digits(
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_valid, y_valid)``: seeded 80/20 split (1437/360) of the digits, pixels / 16."""
    x, y, xv, yv = _digits64()
    return x.to(dtype), y.clone(), xv.to(dtype), yv.clone()


def mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """MLP 64-64-10 with ReLU, initialised like ``nn.Linear`` (U(+-1/sqrt(fan_in))) from its own generator."""
    module = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (module[0], module[2]):
            bound = 1.0 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                p.copy_((torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound)
    return module


def rank_batches(
    n: int, epoch: int, rank: int, nranks: int, seed: int, batch_size: int = BATCH
) -> list[torch.Tensor]:
    """Rank ``rank``'s example indices, batch by batch: a permutation seeded by ``(seed, epoch)``
    cut into batches of ``batch_size`` (the last one shorter), batch ``i`` dealt to rank ``i % nranks``."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    batches = list(torch.split(order, batch_size))
    return batches[rank::nranks]


def step_plan(n: int, epoch: int, nranks: int, seed: int, k: int = 1) -> list[list[list[torch.Tensor]]]:
    """``plan[s][r]``: rank ``r``'s (up to ``k``) batches of step ``s``; ``[]`` once its stream is done."""
    per_rank = [rank_batches(n, epoch, r, nranks, seed) for r in range(nranks)]
    steps = max(math.ceil(len(b) / k) for b in per_rank)
    return [[per_rank[r][s * k : (s + 1) * k] for r in range(nranks)] for s in range(steps)]


def accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).double().mean())


# --- the worker ----------------------------------------------------------------------------------


def _join(rundir: Path, rank: int) -> None:
    """Rank 0 opens a store on a free port and writes it to ``port``; rank 1 waits for that file."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    port_file = rundir / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)
        tmp = rundir / "port.tmp"
        tmp.write_text(str(store.port))
        tmp.rename(port_file)
    else:
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never wrote its port")
            time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), 2, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)


def _register_hook(ddp: Any, job: dict[str, Any]) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    hook = job.get("hook", "none")
    if hook == "none":
        return None
    if hook == "bf16":
        # DDP refuses bf16_compress_hook by name unless CUDA 11+ and NCCL 2.10+ are there; the
        # same hook, called from a function of another name, runs over Gloo on the CPU.
        # (No annotations: DDP accepts a hook's only when they are dist.GradBucket and Future.)
        def gloo_bf16_compress_hook(process_group, bucket):
            return default_hooks.bf16_compress_hook(process_group, bucket)

        ddp.register_comm_hook(None, gloo_bf16_compress_hook)
        return None
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if hook == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=job["powersgd_rank"],
            start_powerSGD_iter=2,  # the smallest PyTorch allows with error feedback and warm start
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            orthogonalization_epsilon=0,
            random_seed=0,
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return state
    raise ValueError(hook)


def _step_backward(
    ddp: Any, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], total: int, world: int
) -> tuple[float, int]:
    """One step's backward passes on this rank: ``no_sync`` for all but the last; an empty batch if none."""
    if not batches:
        batches = [torch.zeros(0, dtype=torch.int64)]
    loss_sum, count = 0.0, 0
    for i, idx in enumerate(batches):
        loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx], reduction="sum")
        weighted = loss * (world / max(total, 1))
        if i < len(batches) - 1:
            with ddp.no_sync():
                weighted.backward()
        else:
            weighted.backward()
        loss_sum += float(loss)
        count += len(idx)
    return loss_sum, count


def _ddp_job(job: dict[str, Any], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """DDP (with an optional comm hook) on lamploop's batch plan and example weighting."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dtype = DTYPES[job["dtype"]]
    x, y, xv, yv = digits(dtype)
    n = job.get("subset", len(y))
    x, y = x[:n], y[:n]
    module = mlp(dtype, job["model_seed"])
    ddp = DistributedDataParallel(module)
    _register_hook(ddp, job)
    opt = torch.optim.SGD(ddp.parameters(), lr=job["lr"], momentum=job["momentum"])
    losses, accuracies = [], []
    for epoch in range(job["epochs"]):
        sums = torch.zeros(2, dtype=torch.float64)
        for step in step_plan(n, epoch, 2, job["data_seed"], job.get("k", 1)):
            total = sum(len(idx) for batches in step for idx in batches)
            opt.zero_grad(set_to_none=False)
            loss_sum, count = _step_backward(ddp, x, y, step[rank], total, 2)
            opt.step()
            sums += torch.tensor([loss_sum, count], dtype=torch.float64)
        dist.all_reduce(sums)
        losses.append(float(sums[0] / sums[1]))
        accuracies.append(accuracy(module, xv, yv))
    tensors = {f"p{i}": p.detach().clone().contiguous() for i, p in enumerate(module.parameters())}
    return tensors, {"losses": losses, "accuracies": accuracies}


def _replay_job(
    job: dict[str, Any], rank: int, rundir: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Teacher-forced: at every step load lamploop's parameters of that step; DDP's reduced gradients."""
    from safetensors.torch import load_file
    from torch.nn.parallel import DistributedDataParallel

    dtype = DTYPES[job["dtype"]]
    x, y, _, _ = digits(dtype)
    n = len(y)
    params = load_file(str(rundir / job["params_file"]))
    module = mlp(dtype, job["model_seed"])
    ddp = DistributedDataParallel(module)
    _register_hook(ddp, job)
    out: dict[str, torch.Tensor] = {}
    plan = step_plan(n, job["epoch"], 2, job["data_seed"])
    for s, step in enumerate(plan[: job["steps"]]):
        with torch.no_grad():
            for i, p in enumerate(module.parameters()):
                p.copy_(params[f"step{s}.p{i}"])
        for p in module.parameters():
            p.grad = None
        total = sum(len(idx) for batches in step for idx in batches)
        _step_backward(ddp, x, y, step[rank], total, 2)
        for i, p in enumerate(module.parameters()):
            assert p.grad is not None
            out[f"step{s}.g{i}"] = p.grad.detach().clone()
    return out, {}


def _post_local_sgd_job(job: dict[str, Any], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every rank trains its own model on its own batches (its own mean loss), ``PostLocalSGDOptimizer``
    with ``PeriodicModelAverager(period=H, warmup_steps=H - 1)`` averages after every H-th step."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    dtype = DTYPES[job["dtype"]]
    x, y, _, _ = digits(dtype)
    n = job["subset"]
    module = mlp(dtype, job["model_seed"])
    period = job["period"]
    averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
    opt = PostLocalSGDOptimizer(
        optim=torch.optim.SGD(module.parameters(), lr=job["lr"], momentum=job["momentum"]), averager=averager
    )
    for epoch in range(job["epochs"]):
        for step in step_plan(n, epoch, 2, job["data_seed"]):
            (idx,) = step[rank]  # the plan of this job has every rank step alike
            opt.zero_grad()
            nn.functional.cross_entropy(module(x[idx]), y[idx]).backward()
            opt.step()
    tensors = {f"p{i}": p.detach().clone().contiguous() for i, p in enumerate(module.parameters())}
    return tensors, {}


def main(rundir: Path, rank: int) -> None:
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    try:
        jobs = json.loads((rundir / "jobs.json").read_text())
        _join(rundir, rank)
        for job in jobs:
            kind = job["kind"]
            if kind == "ddp":
                tensors, numbers = _ddp_job(job, rank)
            elif kind == "replay":
                tensors, numbers = _replay_job(job, rank, rundir)
            elif kind == "post_local_sgd":
                tensors, numbers = _post_local_sgd_job(job, rank)
            else:
                raise ValueError(kind)
            save_file(tensors, str(rundir / f"{job['name']}.rank{rank}.safetensors"))
            (rundir / f"{job['name']}.rank{rank}.json").write_text(json.dumps(numbers))
        (rundir / f"done.rank{rank}").write_text("ok")
    except BaseException:
        (rundir / f"failed.rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_references(rundir: Path, jobs: list[dict[str, Any]], timeout: float = 240.0) -> Path:
    """Run ``jobs`` in two worker processes (a real 2-rank Gloo group), every wait bounded; ``rundir``."""
    import subprocess

    from workers import warm_start

    rundir.mkdir(parents=True, exist_ok=True)
    (rundir / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        warm_start.popen(
            [sys.executable, __file__, str(rundir), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            failed = rundir / f"failed.rank{rank}"
            detail = failed.read_text() if failed.exists() else outputs[rank][-4000:]
            msg = f"reference worker rank {rank} exited with {proc.returncode}:\n{detail}"
            raise RuntimeError(msg)
    return rundir


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
