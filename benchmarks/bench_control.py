"""Latency of the control channel: ``broadcast(Train(...))`` until every follower has it.

Usage::

    python benchmarks/bench_control.py --followers 8 --rounds 200 --json bench-results/control.json [--quick]

Set-up.  One process, one event loop (asyncio): a :class:`TcpControlRoot` on 127.0.0.1
and ``--followers`` :class:`TcpControlFollower` tasks, each iterating its commands and
stamping the time (``time.perf_counter``) at which each command comes out of its
iterator.  Default heartbeats (every 1 s) run as in a real job.  The same measurement
is repeated over the in-process channel (:func:`local_control`) for reference.

One round: the root stamps ``t0``, awaits ``broadcast(Train(epoch=i, lr_factor=1.0))``,
then waits until the last follower has received it.  Reported per channel, after
``--warmup`` discarded rounds:

* ``all received``: ``t0`` to the last follower's stamp -- the latency asked about;
* ``broadcast()``: how long the call itself took (it returns once the frames are
  handed to the kernel, not when they arrive);
* ``per follower``: ``t0`` to each follower's stamp, pooled over followers.

Median, 90th and 99th percentiles in microseconds.  Everything shares one core's
event loop, so this measures the channel's own overhead (framing, JSON, the
syscalls, task switches), not a network; across hosts add the network round trip.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, print_table, write_json

from lamploop.control import (
    ControlFollower,
    ControlRoot,
    Rendezvous,
    Stop,
    TcpControlFollower,
    TcpControlRoot,
    Train,
    local_control,
)
from lamploop.modelspec import ModelSpec, TensorSpec

SPEC = ModelSpec(tuple(TensorSpec(f"layer{i}.weight", (256, 256), "float32") for i in range(12)))
TOKEN = "benchmark-token"

Channel = Callable[[int], AbstractAsyncContextManager[tuple[ControlRoot, list[ControlFollower]]]]


@asynccontextmanager
async def tcp_channel(nranks: int) -> AsyncIterator[tuple[ControlRoot, list[ControlFollower]]]:
    async with TcpControlRoot(nranks=nranks, token=TOKEN, model_spec=SPEC, join_timeout=20.0) as root:
        host, port = root.address
        followers: list[ControlFollower] = [
            TcpControlFollower(host=host, port=port, rank=r, nranks=nranks, token=TOKEN, model_spec=SPEC)
            for r in range(1, nranks)
        ]
        yield root, followers


@asynccontextmanager
async def local_channel(nranks: int) -> AsyncIterator[tuple[ControlRoot, list[ControlFollower]]]:
    root, followers = local_control(nranks, join_timeout=20.0)
    async with root:
        yield root, list(followers)


class Stamps:
    """When each follower got the current round's command; an event once all have."""

    def __init__(self, nfollowers: int) -> None:
        self.nfollowers = nfollowers
        self.times: list[float] = []
        self.all_received = anyio.Event()

    def reset(self) -> None:
        self.times = []
        self.all_received = anyio.Event()

    def stamp(self) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == self.nfollowers:
            self.all_received.set()


async def follow(follower: Any, stamps: Stamps) -> None:
    async with follower:
        _, commands = await follower.join()
        async for command in commands:
            if isinstance(command, Train):
                stamps.stamp()


async def measure(channel: Channel, nfollowers: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    stamps = Stamps(nfollowers)
    result: dict[str, list[float]] = {"all_received": [], "broadcast": [], "per_follower": []}
    async with anyio.create_task_group() as tg, channel(nfollowers + 1) as (root, followers):
        for follower in followers:
            tg.start_soon(follow, follower, stamps)
        await root.on_rendezvous_ready(Rendezvous("127.0.0.1", 29500))
        for i in range(warmup + rounds):
            stamps.reset()
            t0 = time.perf_counter()
            await root.broadcast(Train(epoch=i, lr_factor=1.0))
            t1 = time.perf_counter()
            with anyio.fail_after(10):
                await stamps.all_received.wait()
            if i >= warmup:
                result["all_received"].append(max(stamps.times) - t0)
                result["broadcast"].append(t1 - t0)
                result["per_follower"].extend(t - t0 for t in stamps.times)
        await root.broadcast(Stop(reason="benchmark done"))
    return result


def percentiles_us(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "n": len(values),
        "median_us": statistics.median(values) * 1e6,
        "p90_us": cuts[89] * 1e6,
        "p99_us": cuts[98] * 1e6,
        "mean_us": statistics.fmean(values) * 1e6,
        "min_us": min(values) * 1e6,
        "max_us": max(values) * 1e6,
    }


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "control channel latency")
    parser.add_argument("--followers", type=int, default=8, help="number of followers (default 8)")
    parser.add_argument("--rounds", type=int, default=200, help="timed broadcasts (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="discarded broadcasts first (default 20)")
    args = parser.parse_args()
    rounds = min(args.rounds, 50) if args.quick else args.rounds
    if args.followers < 1 or rounds < 2 or args.warmup < 0:
        parser.error("need --followers >= 1, --rounds >= 2 and --warmup >= 0")

    channels: dict[str, Channel] = {"tcp": tcp_channel, "local": local_channel}
    summary: dict[str, dict[str, dict[str, float]]] = {}
    raw: dict[str, dict[str, list[float]]] = {}
    started = time.perf_counter()
    for name, channel in channels.items():
        raw[name] = anyio.run(measure, channel, args.followers, rounds, args.warmup)
        summary[name] = {what: percentiles_us(values) for what, values in raw[name].items()}
    elapsed = time.perf_counter() - started

    print(
        f"control channel, {args.followers} followers, {rounds} rounds (+{args.warmup} warm-up), one process"
    )
    rows = []
    for name in channels:
        for what in ("all_received", "broadcast", "per_follower"):
            s = summary[name][what]
            rows.append(
                [
                    f"{name}: {what}",
                    f"{s['median_us']:.1f}",
                    f"{s['p90_us']:.1f}",
                    f"{s['p99_us']:.1f}",
                    s["n"],
                ]
            )
    print_table(["channel: measure", "median µs", "p90 µs", "p99 µs", "n"], rows)
    print(f"total {elapsed:.1f} s")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "control",
                "quick": args.quick,
                "settings": {"followers": args.followers, "rounds": rounds, "warmup": args.warmup},
                "summary": summary,
                "raw_seconds": raw,
            },
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
