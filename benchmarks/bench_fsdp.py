"""The sharded strategy on CPU (Gloo): model-state bytes per rank, and time per step.

    python benchmarks/bench_fsdp.py --json bench-results/fsdp.json [--quick] [--nranks 2 3]
    python benchmarks/bench_fsdp.py --width 2048 --depth 8     # ~1 GB of float32 params + Adam state

The script starts ``--nranks`` worker processes (itself again, ``--worker RANK``; nothing
pickled: rank 0 writes a JSON file), ``torch.set_num_threads(1)`` each, on 127.0.0.1.

Memory.  A deep MLP (``--depth`` square ``Linear(width, width)`` layers with ReLU, float32),
``Adam``, two steps of :func:`lamploop.one_epoch` with ``strategy`` :class:`lamploop.sync.FullyShard`
(one FSDP unit per layer) and with ``all_reduce``, each on a fresh model.  Counted on every
rank by :func:`lamploop.sync.fsdp.local_bytes` (the bytes of the tensors' storage this rank
holds: a DTensor's local shard, a flat gradient bucket once): the parameters and the
gradients right before the optimizer step, the optimizer state after it.  What this leaves
out: FSDP's transient all-gathered parameters of the unit being computed (one unit at a time,
with ``reshard_after_forward``) and all_reduce's bucket copies in flight; activations are
the same for both.  The figure is the largest rank's sum, fsdp / all_reduce.

Time.  A smaller MLP (width 256, depth 4, batch 64 per rank, ``SGD(momentum=0.9)``), three
contenders built once and kept: ``lamploop-fsdp`` (``one_epoch`` over the steps),
``hand-fsdp`` (PyTorch's FSDP2 in a loop written here from its docs: ``fully_shard`` per
layer and on the root over the default group, ``loss.backward(); opt.step();
opt.zero_grad()``) and ``lamploop-all_reduce``.  Each round runs each contender once over
the same batches, in an order rotated from round to round, timed on every rank between two
barriers (rank 0's times are reported); round 0 warms up.  Ratios are per round and
summarised by median [min-max].  The load average is printed before and after: on a shared
2-core machine the spread is the neighbours' as much as ours.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, summarize, write_json

import lamploop
from lamploop.distributed.process_group import new_process_group
from lamploop.sync.all_reduce import AllReduce
from lamploop.sync.collectives import Collectives
from lamploop.sync.fsdp import FullyShard, local_bytes
from lamploop.sync.group_channel import ProcessGroupChannel

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def deep_mlp(width: int, depth: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _stream(batches: Batches) -> Callable[[], AsyncIterator[tuple[torch.Tensor, torch.Tensor]]]:
    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in batches:
            yield batch

    return stream


def _memory(collectives: Collectives, width: int, depth: int, fsdp: bool) -> dict[str, int]:
    """Bytes of parameters, gradients (before the step) and optimizer state (after it), this rank."""
    module = deep_mlp(width, depth)
    strategy = FullyShard() if fsdp else AllReduce()
    if isinstance(strategy, FullyShard):
        strategy.shard(collectives, module)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    channel = ProcessGroupChannel(collectives, strategy)
    seen: dict[str, int] = {}

    def step() -> None:
        params = list(module.parameters())
        seen["parameters"] = local_bytes(params)
        seen["gradients"] = local_bytes([p.grad for p in params])
        optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        seen["optimizer"] = local_bytes(state)

    generator = torch.Generator().manual_seed(collectives.rank)
    batches = [(torch.randn(8, width, generator=generator), torch.randn(8, width, generator=generator))] * 2
    model = lamploop.SupervisedModel(module, lamploop.mse_loss)
    anyio.run(
        lambda: lamploop.one_epoch(
            model=model, batches=_stream(batches)(), channel=channel, step_optimizer=step
        )
    )
    channel.close()
    return seen


def _hand_epoch(module: torch.nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> None:
    module.train()
    for x, y in batches:
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _speed(collectives: Collectives, steps: int, rounds: int) -> dict[str, list[float]]:
    width, depth, batch = 256, 4, 64
    generator = torch.Generator().manual_seed(100 + collectives.rank)
    batches = [
        (
            torch.randn(batch, width, generator=generator),
            torch.randint(0, width, (batch,), generator=generator),
        )
        for _ in range(steps)
    ]

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    ours = deep_mlp(width, depth)
    FullyShard().shard(collectives, ours)
    ours_opt = sgd(ours.parameters())
    ours_model = lamploop.SupervisedModel(ours, lamploop.cross_entropy_loss)
    ours_channel = ProcessGroupChannel(collectives, FullyShard())

    from torch.distributed.fsdp import fully_shard

    hand = deep_mlp(width, depth)
    for layer in hand:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(hand)
    hand_opt = sgd(hand.parameters())

    replicated = deep_mlp(width, depth)
    replicated_opt = sgd(replicated.parameters())
    replicated_model = lamploop.SupervisedModel(replicated, lamploop.cross_entropy_loss)
    replicated_channel = ProcessGroupChannel(collectives, AllReduce())

    def lamploop_epoch(model: lamploop.SupervisedModel, opt: torch.optim.Optimizer, channel: Any) -> None:
        anyio.run(
            lambda: lamploop.one_epoch(
                model=model, batches=_stream(batches)(), channel=channel, step_optimizer=opt.step
            )
        )

    variants: dict[str, Callable[[], None]] = {
        "lamploop-fsdp": lambda: lamploop_epoch(ours_model, ours_opt, ours_channel),
        "hand-fsdp": lambda: _hand_epoch(hand, hand_opt, batches),
        "lamploop-all_reduce": lambda: lamploop_epoch(replicated_model, replicated_opt, replicated_channel),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):
        names = list(variants)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            dist.barrier()
            if r > 0:  # round 0 warms up
                times[name].append((time.perf_counter() - start) / steps)
    ours_channel.close()
    replicated_channel.close()
    return times


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank, nranks = args.worker, args.nranks[0]
    store = dist.TCPStore(
        "127.0.0.1", args.port, nranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    cpu = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.PrefixStore("hand", store), rank=rank, world_size=nranks)
    group = new_process_group(store, rank=rank, nranks=nranks, device=cpu, timeout=300, prefix="lamploop")
    collectives = Collectives(group, rank=rank, nranks=nranks, device=cpu, timeout=300)
    result: dict[str, Any] = {"nranks": nranks}
    for name, fsdp in (("fsdp", True), ("all_reduce", False)):
        mine = _memory(collectives, args.width, args.depth, fsdp)
        everyone = collectives.gather_json(mine, "memory figures")
        result[f"memory_{name}"] = everyone
    if not args.memory_only:
        result["times"] = _speed(collectives, args.steps, args.rounds)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()
    # Gloo's threads may still free work objects while the interpreter finalizes, which aborts
    # the process now and then (SIGABRT, "terminate called without an active exception"; see
    # lamploop.sync.abandon): the results are written, leave without finalizing.
    sys.stdout.flush()
    os._exit(0)


def _launch(nranks: int, args: argparse.Namespace, out: Path, memory_only: bool) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "--nranks", str(nranks), "--port", str(port), "--out", str(out),
        "--width", str(args.width), "--depth", str(args.depth),
        "--steps", str(args.steps), "--rounds", str(args.rounds),
    ]  # fmt: skip
    if memory_only:
        common.append("--memory-only")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(rank), *common], env=env)
        for rank in range(nranks)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=1800)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    if any(proc.returncode != 0 for proc in procs):
        msg = f"a worker of the {nranks}-rank run failed: {[p.returncode for p in procs]}"
        raise RuntimeError(msg)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _memory_row(result: dict[str, Any]) -> dict[str, Any]:
    def largest(rows: list[dict[str, int]]) -> int:
        return max(sum(row.values()) for row in rows)

    fsdp, replicated = largest(result["memory_fsdp"]), largest(result["memory_all_reduce"])
    return {
        "nranks": result["nranks"],
        "fsdp_bytes": fsdp,
        "all_reduce_bytes": replicated,
        "ratio": fsdp / replicated,
    }


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_fsdp")
    parser.add_argument("--nranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (10 if args.quick else 30)
    args.rounds = args.rounds or (3 if args.quick else 9)
    if args.worker is not None:
        worker(args)
        return 0
    load_start = list(os.getloadavg())
    memory, speed = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for i, nranks in enumerate(args.nranks):
            # Time only at the first world size (2 ranks by default): the 2-core machine has no
            # room for more processes than that without timing the scheduler.
            result = _launch(nranks, args, Path(scratch) / f"r{nranks}.json", memory_only=i > 0)
            memory.append(_memory_row(result))
            if "times" in result:
                speed = {"nranks": nranks, "times": result["times"]}
    load_end = list(os.getloadavg())
    params = sum(p.numel() for p in deep_mlp(args.width, args.depth).parameters())
    print(
        f"memory: MLP {args.depth} x Linear({args.width}, {args.width}), "
        f"{params / 1e6:.1f}M float32 params, Adam"
    )
    print(f"{'ranks':>5} {'fsdp MB/rank':>13} {'all_reduce MB/rank':>19} {'ratio':>7}")
    for row in memory:
        print(
            f"{row['nranks']:>5} {row['fsdp_bytes'] / 1e6:13.1f} "
            f"{row['all_reduce_bytes'] / 1e6:19.1f} {row['ratio']:7.3f}"
        )
    ratios = {}
    if speed:
        times = speed["times"]
        print(
            f"time per step, {speed['nranks']} ranks, MLP 4 x 256, batch 64, "
            f"{args.steps} steps x {args.rounds} rounds"
        )
        for name, values in times.items():
            print(f"{name:20} {statistics.median(values) * 1e3:8.2f} ms/step (median)")
        for ours, peer in (("lamploop-fsdp", "hand-fsdp"), ("lamploop-fsdp", "lamploop-all_reduce")):
            s = summarize([a / b for a, b in zip(times[ours], times[peer], strict=True)])
            ratios[f"{ours} / {peer}"] = s
            print(f"{ours} / {peer}: {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}] (per round)")
    print(f"load average {load_start} -> {load_end}")
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "fsdp",
                "quick": args.quick,
                "params": params,
                "memory": memory,
                "speed": speed,
                "ratios": ratios,
                "load_average": {"start": load_start, "end": load_end},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
