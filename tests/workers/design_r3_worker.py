"""A rank of tests/test_acceptance_design_contract_r3.py in a process of its own.

Usage::

    python design_r3_worker.py follow SPEC OUT   # rank 1 over TCP control + Gloo (all_reduce, Adam)
    python design_r3_worker.py root SPEC OUT     # rank 0 of a long, slow run, killed by the test
    python design_r3_worker.py ddp SPEC OUT RANK # the reference: torch DDP over Gloo, no lamploop

``SPEC`` is a JSON file the test writes (ports, token, data seed, slices); the data are made
here from the seed exactly as the test makes them.  ``OUT`` receives what this process ended
with: ``OUT`` (JSON) and ``OUT.safetensors`` (the final parameters).  Written from DESIGN.md and
the docs alone; the test holds the references the results are compared with.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch
from safetensors.torch import save_file

import lamploop
from lamploop.control import TcpControlFollower, TcpControlRoot
from lamploop.modelspec import model_spec


def data(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, generator=generator, dtype=torch.float64).to(dtype)
    y = torch.randn(64, 1, generator=generator, dtype=torch.float64).to(dtype)
    return x, y


def squared_error(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DESIGN.md section 1: "SupervisedModel: module + loss -> (loss sum, example count)"."""
    return ((output - target) ** 2).sum(), int(target.shape[0])


def module_from(spec: dict[str, Any], dtype: torch.dtype) -> torch.nn.Linear:
    module = torch.nn.Linear(3, 1, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([spec["weight"]], dtype=dtype))
        module.bias.copy_(torch.tensor(spec["bias"], dtype=dtype))
    return module


def factory(x: torch.Tensor, y: torch.Tensor, per_rank: list[list[list[int]]], sleep: float = 0.0):
    def make(context: lamploop.BatchContext):
        return [(x[a:b], y[a:b]) for a, b in per_rank[context.rank]]

    if not sleep:
        return lamploop.iterable_batches(make)

    async def slow(context: lamploop.BatchContext):
        for batch in make(context):
            await anyio.sleep(sleep)
            yield batch

    return slow


def write(out: str, result: dict[str, Any], module: torch.nn.Module) -> None:
    save_file(
        {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}, out + ".safetensors"
    )
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)


async def follow(spec: dict[str, Any], out: str) -> None:
    dtype = getattr(torch, spec["dtype"])
    x, y = data(spec["seed"], dtype)
    # not the root's initial values, on purpose: followers start from the root's parameters
    module = module_from({"weight": [3.0, 2.0, 1.0], "bias": [-1.0]}, dtype)
    result: dict[str, Any] = {}
    try:
        async with TcpControlFollower(
            host="127.0.0.1",
            port=spec["port"],
            rank=1,
            nranks=2,
            token=spec["token"],
            model_spec=model_spec(module),
        ) as control:
            returned = await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(module, squared_error),
                train_batches=factory(x, y, spec["train"]),
                validation_batches=factory(x, y, spec["valid"]),
                accumulate_gradient_over_n_batches=spec["k"],
                optimizer_factory=lambda params: torch.optim.Adam(params, lr=spec["lr"]),
            )
            result["returned_none"] = returned is None
    except BaseException as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = "".join(traceback.format_exception(error))
    write(out, result, module)


async def root(spec: dict[str, Any], out: str) -> None:
    """A root that trains slowly for long, so that the test can kill it in the middle."""
    x, y = data(spec["seed"], torch.float64)
    module = module_from({"weight": [0.5, -0.25, 0.125], "bias": [0.0625]}, torch.float64)
    marker = Path(out + ".training")

    def train(context: lamploop.BatchContext):
        if context.epoch >= 1 and not marker.exists():
            marker.write_text("training")
        return factory(x, y, spec["train"], sleep=0.2)(context)

    async with TcpControlRoot(
        port=spec["port"], nranks=2, token=spec["token"], model_spec=model_spec(module)
    ) as control:
        await lamploop.drive_distributed_training(
            nranks=2,
            device="cpu",
            control=control,
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
            train_batches=train,
            validation_batches=None,
            max_epochs=10_000,
        )


def ddp(spec: dict[str, Any], out: str, rank: int) -> None:
    """The reference the test compares lamploop with: DistributedDataParallel over Gloo, Adam,
    every param group's lr = base * the epoch's factor, k batches accumulated per step (no_sync
    for all but the last), validation summed over both ranks.  Each rank's step has as many
    examples as the other's, so DDP's average of the ranks' mean gradients is the global mean."""
    import datetime
    from contextlib import nullcontext

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dtype = getattr(torch, spec["dtype"])
    x, y = data(spec["seed"], dtype)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['ddp_port']}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        # rank 1 starts elsewhere: DDP broadcasts rank 0's parameters, as lamploop's root does
        start = (
            {"weight": [0.5, -0.25, 0.125], "bias": [0.0625]}
            if rank == 0
            else {"weight": [3.0, 2.0, 1.0], "bias": [-1.0]}
        )
        module = module_from(start, dtype)
        model = DistributedDataParallel(module)
        optimizer = torch.optim.Adam(model.parameters(), lr=spec["lr"])
        k = spec["k"]
        train = [(x[a:b], y[a:b]) for a, b in spec["train"][rank]]
        valid = [(x[a:b], y[a:b]) for a, b in spec["valid"][rank]]
        curve = []
        for factor in spec["factors"]:
            for group in optimizer.param_groups:
                group["lr"] = spec["lr"] * factor
            loss_sum, count = 0.0, 0
            for first in range(0, len(train), k):
                step = train[first : first + k]
                n_local = sum(int(target.shape[0]) for _, target in step)
                optimizer.zero_grad()
                for j, (features, target) in enumerate(step):
                    context = model.no_sync() if j < len(step) - 1 else nullcontext()
                    with context:
                        loss = ((model(features) - target) ** 2).sum()
                        (loss / n_local).backward()
                    loss_sum += float(loss.detach())
                    count += int(target.shape[0])
                optimizer.step()
            totals = torch.tensor([loss_sum, count], dtype=torch.float64)
            dist.all_reduce(totals)
            with torch.no_grad():
                v = sum(float(((module(f) - t) ** 2).sum()) for f, t in valid)
            valid_totals = torch.tensor([v, sum(int(t.shape[0]) for _, t in valid)], dtype=torch.float64)
            dist.all_reduce(valid_totals)
            curve.append([float(totals[0] / totals[1]), float(valid_totals[0] / valid_totals[1])])
        write(out, {"curve": curve}, module)
    finally:
        dist.destroy_process_group()


def main() -> None:
    mode, spec_path, out = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    started = time.monotonic()
    if mode == "follow":
        anyio.run(follow, spec, out)
    elif mode == "root":
        anyio.run(root, spec, out)
    elif mode == "ddp":
        ddp(spec, out, int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(f"{mode} done in {time.monotonic() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
