"""GPU throughput: lamploop on CUDA against a hand-written CUDA loop and DDP with one rank.

    python benchmarks/bench_gpu.py --json bench-results/gpu.json [--quick]

Variants, alternated in one run on the same model (one seeded copy each), data (one list of
batches on the device, shared) and optimizer (``SGD(lr=1e-3, momentum=0.9)``):

* ``hand``: the plain PyTorch loop, ``opt.zero_grad(set_to_none=True); loss =
  F.cross_entropy(model(x), y); loss.backward(); opt.step()``, the losses read once at the end;
* ``lamploop``: ``one_epoch`` with the single-process channel;
* ``lamploop-nccl1``: ``one_epoch`` over an NCCL process group of one rank (the multi-rank
  code path, bucket hooks and all);
* ``ddp-nccl1``: the hand loop on ``DistributedDataParallel(model, device_ids=[0])``, one
  NCCL rank, DDP's defaults;
* ``ddp-nccl1 tuned``: the same with ``gradient_as_bucket_view=True, static_graph=True``;
* ``lamploop-fsdp1`` (the fsdp section): ``one_epoch`` with :class:`lamploop.sync.FullyShard`
  (one FSDP2 unit per ``Linear`` and the root) over lamploop's NCCL group of one rank;
* ``hand-fsdp1``: the hand loop on ``fully_shard`` per ``Linear`` and on the root, over the
  default NCCL group of one rank (PyTorch's FSDP2 as its docs write it).  With one rank
  nothing is sharded: the pair measures what lamploop's loop adds on top of FSDP2's hooks.

Every variant's model, optimizer and wrapper (DDP, lamploop's channel) are built once, before
any timing, and kept for the whole run (DDP's bucket rebuild after its first iteration falls
in the warm-up round).  A measurement is one epoch over the batches: ``cuda.synchronize``,
``perf_counter``, the epoch, ``cuda.synchronize``, ``perf_counter``, the same for every
variant; lamploop's ``anyio.run`` (one per epoch) is inside its time.  Round 0 warms up;
each later round runs every variant once, in an order rotated from round to round.  Ratios
are taken per round and summarised by median [min-max]: lamploop / hand, lamploop-nccl1 /
ddp-nccl1 and lamploop-nccl1 / ddp-nccl1 tuned.  Exits quietly where there is no CUDA
device; ``--device cpu`` runs the same script on the CPU over Gloo (a check of the script
itself, with a small model: its figures say nothing about GPUs).
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, summarize, write_json

import lamploop
from lamploop.distributed.process_group import new_process_group
from lamploop.errors import ConfigurationError
from lamploop.sync.collectives import Collectives
from lamploop.sync.fsdp import FullyShard, check_fsdp2_api
from lamploop.sync.group_channel import ProcessGroupChannel

Batches = list[tuple[torch.Tensor, torch.Tensor]]
RATIOS = (
    ("lamploop", "hand"),
    ("lamploop-nccl1", "ddp-nccl1"),
    ("lamploop-nccl1", "ddp-nccl1 tuned"),
    ("lamploop-nccl1", "hand"),
    ("ddp-nccl1", "hand"),
    ("lamploop-fsdp1", "hand-fsdp1"),
)


def mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def hand_epoch(module: torch.nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> float:
    """The plain PyTorch epoch (``module`` may be a DDP wrapper); the mean loss, read once."""
    module.train()
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return float(torch.stack(losses).mean())


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_gpu")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a check of the script itself over Gloo (small model; the figures mean nothing)",
    )
    args = parser.parse_args(argv)
    json_path: Path = args.json if args.json is not None else Path("bench-results/gpu.json")
    on_cpu = args.device == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return 0
    device = torch.device("cpu") if on_cpu else torch.device("cuda", 0)
    backend = "gloo" if on_cpu else "nccl"
    sync: Callable[[], None] = (lambda: None) if on_cpu else torch.cuda.synchronize
    torch.manual_seed(0)
    steps = (10 if on_cpu else 50) if args.quick else 200
    rounds = 3 if args.quick else 7
    base = mlp(256 if on_cpu else 4096).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    batches = [
        (torch.randn(256, 1024, device=device), torch.randint(0, 10, (256,), device=device))
        for _ in range(steps)
    ]

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=dist.PrefixStore("ddp", store), rank=0, world_size=1)
    try:  # the process group is destroyed also when a measurement fails
        group = new_process_group(store, rank=0, nranks=1, device=device, timeout=60, prefix="lamploop")
        device_ids = None if on_cpu else [0]

        async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            for batch in batches:
                yield batch

        def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            module = copy.deepcopy(base)
            return module, torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)

        # Everything built here, before any timing; a variant's call is one epoch and nothing else.
        hand_module, hand_opt = fresh()
        single_module, single_opt = fresh()
        single_model = lamploop.SupervisedModel(single_module)
        nccl_module, nccl_opt = fresh()
        nccl_model = lamploop.SupervisedModel(nccl_module)
        channel = ProcessGroupChannel.of_group(group, rank=0, nranks=1, device=device)
        ddp_module, _ = fresh()
        ddp = DistributedDataParallel(ddp_module, device_ids=device_ids)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
        tuned_module, _ = fresh()
        tuned = DistributedDataParallel(
            tuned_module,
            device_ids=device_ids,
            process_group=dist.new_group(backend=backend),
            gradient_as_bucket_view=True,
            static_graph=True,
        )
        tuned_opt = torch.optim.SGD(tuned.parameters(), lr=1e-3, momentum=0.9)
        # The fsdp section: lamploop's FullyShard and PyTorch's FSDP2 by hand, one rank each
        # (left out, with the reason printed, where this torch's FSDP2 lacks what FullyShard needs).
        from torch.distributed.fsdp import fully_shard

        fsdp_variants: dict[str, Callable[[], Any]] = {}
        fsdp_channel: ProcessGroupChannel | None = None
        try:
            check_fsdp2_api("bench_gpu")
        except ConfigurationError as error:
            print(f"the fsdp section is left out: {error}")
        else:
            fsdp_module, _ = fresh()
            fsdp_strategy = FullyShard()
            fsdp_strategy.shard(Collectives(group, rank=0, nranks=1, device=device, timeout=60), fsdp_module)
            fsdp_opt = torch.optim.SGD(fsdp_module.parameters(), lr=1e-3, momentum=0.9)
            fsdp_model = lamploop.SupervisedModel(fsdp_module)
            fsdp_channel = ProcessGroupChannel(
                Collectives(group, rank=0, nranks=1, device=device, timeout=60), fsdp_strategy
            )
            hand_fsdp, _ = fresh()
            for layer in hand_fsdp.modules():
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(hand_fsdp)
            hand_fsdp_opt = torch.optim.SGD(hand_fsdp.parameters(), lr=1e-3, momentum=0.9)
            fsdp_variants = {
                "lamploop-fsdp1": lambda: lamploop_epoch(fsdp_model, fsdp_opt, channel=fsdp_channel),
                "hand-fsdp1": lambda: hand_epoch(hand_fsdp, hand_fsdp_opt, batches),
            }

        def lamploop_epoch(
            model: lamploop.SupervisedModel, opt: torch.optim.Optimizer, **channel_: Any
        ) -> None:
            anyio.run(
                lambda: lamploop.one_epoch(model=model, batches=stream(), step_optimizer=opt.step, **channel_)
            )

        variants: dict[str, Callable[[], Any]] = {
            "hand": lambda: hand_epoch(hand_module, hand_opt, batches),
            "lamploop": lambda: lamploop_epoch(single_model, single_opt),
            "lamploop-nccl1": lambda: lamploop_epoch(nccl_model, nccl_opt, channel=channel),
            "ddp-nccl1": lambda: hand_epoch(ddp, ddp_opt, batches),
            "ddp-nccl1 tuned": lambda: hand_epoch(tuned, tuned_opt, batches),
            **fsdp_variants,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        load_start = list(os.getloadavg())
        for r in range(rounds + 1):
            names = list(variants)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                sync()
                start = time.perf_counter()
                variants[name]()
                sync()
                if r > 0:  # round 0 warms up
                    times[name].append((time.perf_counter() - start) / steps)
        channel.close()
        if fsdp_channel is not None:
            fsdp_channel.close()
        load_end = list(os.getloadavg())

        what = "CPU (a check of the script, not a GPU figure)" if on_cpu else torch.cuda.get_device_name(0)
        print(
            f"{what}, MLP {n_params / 1e6:.1f}M params, batch 256, "
            f"{steps} steps x {rounds} rounds (+1 warm-up)"
        )
        print(f"{'variant':16} {'ms/step':>9} {'steps/s':>9}")
        rows = []
        for name, values in times.items():
            median = statistics.median(values)
            rows.append({"variant": name, "seconds_per_step": values, "median": median})
            print(f"{name:16} {median * 1e3:9.3f} {1 / median:9.1f}")
        ratios = {}
        for ours, peer in RATIOS:
            if ours not in times or peer not in times:
                continue
            s = summarize([a / b for a, b in zip(times[ours], times[peer], strict=True)])
            ratios[f"{ours} / {peer}"] = s
            print(f"{ours} / {peer}: {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}] (per round)")
        print(f"load average {load_start} -> {load_end}")
        write_json(
            json_path,
            {
                "benchmark": "gpu",
                "quick": args.quick,
                "device": what,
                "params": n_params,
                "steps": steps,
                "rounds": rounds,
                "rows": rows,
                "ratios": ratios,
                "load_average": {"start": load_start, "end": load_end},
            },
        )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
