"""GPU throughput: lamploop on CUDA against a hand-written CUDA loop and DDP with one rank.

    python benchmarks/bench_gpu.py --json bench-results/gpu.json [--quick]

Variants, alternated in one run on the same model, data and optimizer:
hand loop; lamploop ``one_epoch`` with the single-process channel; lamploop over
an NCCL process group of one rank (the multi-rank code path, bucket hooks and all);
``DistributedDataParallel`` with one NCCL rank. Prints a table of steps/s and the
ratios to the hand loop; exits quietly where there is no CUDA device.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import anyio
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lamploop
from lamploop.distributed.process_group import new_process_group
from lamploop.sync.group_channel import ProcessGroupChannel


def mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=Path("bench-results/gpu.json"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return 0
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    steps = 50 if args.quick else 200
    rounds = 3 if args.quick else 7
    base = mlp(4096).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    batches = [
        (torch.randn(256, 1024, device=device), torch.randint(0, 10, (256,), device=device))
        for _ in range(steps)
    ]

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=dist.PrefixStore("ddp", store), rank=0, world_size=1)
    group = new_process_group(store, rank=0, nranks=1, device=device, timeout=60, prefix="lamploop")

    def hand(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(module(x), y).backward()
            opt.step()

    def ddp(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        hand(torch.nn.parallel.DistributedDataParallel(module, device_ids=[0]), opt)

    def stream():
        async def gen():
            for b in batches:
                yield b

        return gen()

    def lamploop_single(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        model = lamploop.SupervisedModel(module)
        anyio.run(lambda: lamploop.one_epoch(model=model, batches=stream(), step_optimizer=opt.step))

    def lamploop_nccl(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        channel = ProcessGroupChannel.of_group(group, rank=0, nranks=1, device=torch.device(device))
        model = lamploop.SupervisedModel(module)
        anyio.run(
            lambda: lamploop.one_epoch(
                model=model, batches=stream(), channel=channel, step_optimizer=opt.step
            )
        )
        channel.close()

    variants = {"hand": hand, "lamploop": lamploop_single, "lamploop-nccl1": lamploop_nccl, "ddp-nccl1": ddp}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):
        order = list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]
        for name in order:
            module = copy.deepcopy(base)
            opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
            torch.cuda.synchronize()
            start = time.perf_counter()
            variants[name](module, opt)
            torch.cuda.synchronize()
            if r > 0:  # round 0 warms up
                times[name].append((time.perf_counter() - start) / steps)
    hand_median = statistics.median(times["hand"])
    rows = []
    name = torch.cuda.get_device_name(0)
    print(f"{name}, MLP {n_params / 1e6:.1f}M params, batch 256, {steps} steps x {rounds} rounds")
    print(f"{'variant':16} {'ms/step':>9} {'steps/s':>9} {'/ hand':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            {
                "variant": name,
                "seconds_per_step": values,
                "median": median,
                "ratio_to_hand": median / hand_median,
            }
        )
        print(f"{name:16} {median * 1e3:9.3f} {1 / median:9.1f} {median / hand_median:8.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"device": torch.cuda.get_device_name(0), "params": n_params, "rows": rows}, indent=2)
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
