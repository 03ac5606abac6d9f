"""Where a streamed sample's time goes: CPU per sample, per stage, on both ends of the transport.

For each producer (``BlockingProducer``, ``AsyncProducer``) and sample size (1 KiB and
64 KiB of float32 plus a scalar label), a producer process sends N samples to a
``SampleReceiver`` in this process, whose FIFO buffer a consumer drains in batches of 32
(``get_batch`` and ``stack_samples``, what ``buffer_batches``' collate does;
no model).  Each case runs ``--repeats`` times plainly, then once under cProfile:

1. **plain**: each process's CPU time (``time.process_time``, every thread) over the stream,
   per sample, and the samples per second the consumer drew (medians over the repeats);
2. **profiled** (both processes; for the blocking producer both its threads), timed by each
   thread's CPU clock (``time.thread_time``: waiting is not counted): each function's own time
   goes to the stage its name says, or else to its callers' stages (split as the callers'
   shares of its time).  The stages' shares then split the plain runs' CPU time.  cProfile
   slows Python calls down several-fold, and the stream with them: the batches it sees are
   smaller and the acknowledgements and loop iterations per sample more frequent than in the
   plain runs, so the shares of ``loop``, ``acks``/``ack`` and ``hand over`` are upper
   estimates, those of the bulk work (encoding, copying) lower ones.

The stages, producer side: ``encode`` (the tensors to safetensors bytes), ``hand over``
(numbering and keeping a sample for the connection, and for the blocking producer moving it
from the simulation's thread to the event loop's), ``frame`` (gathering kept samples into a
frame), ``send`` (the socket writes), ``acks`` (reading the receiver's acknowledgements),
``loop`` (the event loop and whatever else).  Receiver side: ``receive`` (the socket reads and
cutting the bytes into frames), ``decode`` (a frame's header and its samples' tensors, and the
check that they match the stream's), ``put`` (the samples into the buffer), ``ack``,
``draw`` (the consumer's ``get_batch`` and ``stack``), ``loop``.

    python benchmarks/profile_streaming.py [--count-scale 1.0] [--only blocking,async] [--json PATH]
    python benchmarks/profile_streaming.py --lamploop /tmp/old   # another copy of the package (before/after)
    python benchmarks/profile_streaming.py --own-thread   # SampleReceiver(own_thread=True): plain runs only

Each row also gives the CPU of the consumer's thread alone (``time.thread_time`` around the
drain): with the receiver on its own thread, what is left on the thread that would train.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PRODUCER_STAGES = ("encode", "hand over", "frame", "send", "acks", "loop")
RECEIVER_STAGES = ("receive", "decode", "put", "ack", "draw", "loop")

Rule = tuple[str, str, frozenset[str]]  # (stage, file name ending, function names; empty: any)


def _rule(stage: str, file: str, *names: str) -> Rule:
    return (stage, file, frozenset(names))


PRODUCER_RULES = [
    _rule("encode", "tensor_bytes.py"),
    _rule("frame", "outbox.py", "batch", "batch_parts", "record_sent", "frame_full"),
    _rule("frame", "wire.py", "samples_frame", "samples_frame_parts", "_samples_body", "_header", "_frame"),
    _rule("frame", "wire.py", "samples_frame_bytes"),
    _rule("frame", "frames.py", "frame", "frame_parts"),
    _rule("acks", "producer_connection.py", "_read"),
    _rule("acks", "outbox.py", "acknowledge", "take_welcome", "trim"),
    _rule("acks", "selector_events.py", "_read_ready", "_read_ready__data_received"),
    _rule("send", "producer_connection.py", "_write", "_send"),
    _rule("send", "scatter.py"),
    _rule("send", "selector_events.py", "_write_ready", "write", "_write_send"),
    _rule(
        "hand over",
        "producer.py",  # async_producer.py and blocking_producer.py
        "send",
        "send_many",
        "_submit",
        "_submit_many",
        "_keep",
        "_settle",
        "_collect",
        "_keep_chunk",
        "_poke",
        "_set_wake",
        "flush",
    ),
    _rule("hand over", "outbox.py"),  # keep, keep_run, has_room, fitting, check_size, ...
    _rule("hand over", "from_thread.py"),
    _rule("hand over", "futures/_base.py"),  # the portal's futures
]
RECEIVER_RULES = [
    _rule("decode", "tensor_bytes.py"),
    _rule("decode", "wire.py", "decode_body", "_decode_samples"),
    _rule("decode", "receiver.py", "_check_samples"),
    _rule("decode", "receiver_session.py", "check_samples"),
    _rule("receive", "wire.py", "receive", "feed", "_take", "_check_order"),
    _rule("receive", "frames.py", "feed", "_take", "_take_body"),
    _rule("receive", "connection.py", "receive_item", "_feed"),
    _rule("receive", "selector_events.py", "_read_ready", "_read_ready__data_received"),
    _rule("put", "receiver.py", "_put_batch"),
    _rule("put", "receiver_session.py", "put_batch"),
    _rule("ack", "receiver.py", "_ack", "_ack_soon"),
    _rule("ack", "receiver_session.py", "_ack", "_ack_soon"),
    _rule("ack", "selector_events.py", "write", "_write_ready", "_write_send"),
    _rule("draw", "profile_streaming.py", "_draw"),
]


def stage_shares(stats: pstats.Stats, rules: list[Rule]) -> dict[str, float]:
    """Each stage's share of the profiled CPU time (fractions summing to 1)."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    memo: dict[Any, dict[str, float]] = {}

    def named(func: tuple[str, int, str]) -> str | None:
        file, _, name = func
        return next(
            (
                stage
                for stage, ending, names in rules
                if file.endswith(ending) and (not names or name in names)
            ),
            None,
        )

    def weights(func: Any, seen: frozenset[Any]) -> dict[str, float]:
        if func in memo:
            return memo[func]
        stage = named(func)
        result: dict[str, float] = {}
        if stage is not None:
            result[stage] = 1.0
        else:
            callers = table.get(func, (0, 0, 0.0, 0.0, {}))[4]
            edges = [(caller, edge) for caller, edge in callers.items() if caller not in seen]
            by_time = sum(edge[3] for _, edge in edges) > 0
            total = sum(edge[3] if by_time else edge[1] for _, edge in edges)
            if total <= 0:
                result["loop"] = 1.0
            for caller, edge in edges if total > 0 else ():
                share = (edge[3] if by_time else edge[1]) / total
                for caller_stage, weight in weights(caller, seen | {func}).items():
                    result[caller_stage] = result.get(caller_stage, 0.0) + share * weight
        if not seen:
            memo[func] = result
        return result

    times: dict[str, float] = {}
    for func, (_, _, own, _, _) in table.items():
        for stage, weight in weights(func, frozenset()).items():
            times[stage] = times.get(stage, 0.0) + own * weight
    total = sum(times.values()) or 1.0
    return {stage: seconds / total for stage, seconds in times.items()}


PRODUCER = r"""
import cProfile, json, os, pstats, sys, time
import anyio, torch
sys.path.insert(0, sys.argv[8])  # this script's folder
from profile_streaming import PRODUCER_RULES, stage_shares

kind, host, port, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
count, floats, profiled = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
tensor = torch.arange(floats, dtype=torch.float32)
labels = [torch.tensor(0), torch.tensor(1)]
options = {"name": "bench", "token": token}  # the defaults, as a simulation code gets them
profiles = [cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)]  # CPU, not waits


def blocking():
    from lamploop.streaming.producer import BlockingProducer

    with BlockingProducer((host, port), **options) as producer:
        began, cpu = time.perf_counter(), time.process_time()
        if profiled:
            producer._portal.call(profiles[1].enable)  # the event loop's thread
            profiles[0].enable()
        for i in range(count):
            producer.send({"x": tensor, "y": labels[i % 2]})
        if profiled:
            profiles[0].disable()
            producer._portal.call(profiles[1].disable)
    return time.perf_counter() - began, time.process_time() - cpu


def asynchronous():
    from lamploop.streaming.producer import AsyncProducer

    async def main():
        async with AsyncProducer((host, port), **options) as producer:
            began, cpu = time.perf_counter(), time.process_time()
            if profiled:
                profiles[0].enable()
            for i in range(count):
                await producer.send({"x": tensor, "y": labels[i % 2]})
        if profiled:
            profiles[0].disable()
        return time.perf_counter() - began, time.process_time() - cpu

    return anyio.run(main)


wall, cpu = blocking() if kind == "blocking" else asynchronous()
shares = {}
if profiled:
    stats = pstats.Stats(profiles[0])
    if kind == "blocking":
        stats.add(profiles[1])
    shares = stage_shares(stats, PRODUCER_RULES)
    if os.environ.get("PROFILE_STREAMING_DUMP"):  # the producer's profile, for pstats
        stats.dump_stats(os.environ["PROFILE_STREAMING_DUMP"])
print(json.dumps({"wall": wall, "cpu": cpu, "shares": shares}), flush=True)
"""


def run_case(kind: str, floats: int, count: int, profiled: bool, own_thread: bool = False) -> dict[str, Any]:
    """One stream of ``count`` samples: CPU seconds and wall per side (and stage shares if profiled),
    and the CPU of the consumer's thread (``own_thread``: the receiver on a thread of its own)."""
    import anyio
    import torch

    from lamploop.streaming import FifoBuffer, stack_samples
    from lamploop.streaming.receiver import SampleReceiver

    collate = stack_samples()  # buffer_batches' default

    torch.set_num_threads(1)
    first: list[float] = []

    class Timed(FifoBuffer):
        """The buffer, noting when its first samples arrived (the clock starts there).  A buffer
        itself, not a sink in front of one: a receiver on a thread of its own fills only those."""

        async def put(self, sample: Any) -> None:
            if not first:
                first.extend((time.perf_counter(), time.process_time(), 1))
            await super().put(sample)

        def try_put_many(self, samples: Any) -> int:
            taken = int(super().try_put_many(samples))
            if not first and taken:
                first.extend((time.perf_counter(), time.process_time(), taken))
            return taken

    async def _draw(buffer: Any, count: int) -> None:
        drawn = 0
        while drawn < count:
            batch = await buffer.get_batch(min(32, count - drawn))
            collate(batch)
            drawn += len(batch)

    async def main(scratch: str) -> dict[str, Any]:
        token = secrets.token_hex(16)
        buffer = Timed(capacity=1024, watermark=32, seed=0)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        profile = cProfile.Profile(time.thread_time)  # CPU, not waits
        options: dict[str, Any] = {"own_thread": True} if own_thread else {}
        async with SampleReceiver(buffer, token=token, expected_producers=["bench"], **options) as receiver:
            host, port = receiver.address
            here = str(HERE)
            arguments = [
                kind,
                host,
                str(port),
                token,
                str(count),
                str(floats),
                "1" if profiled else "0",
                here,
            ]
            result: dict[str, Any] = {}

            async def produce() -> None:
                # cwd: a folder without a lamploop package (``-c`` puts the cwd first on sys.path)
                done = await anyio.run_process(
                    [sys.executable, "-c", PRODUCER, *arguments], env=env, check=True, cwd=scratch
                )
                result["producer"] = json.loads(done.stdout.decode().strip().splitlines()[-1])

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                if profiled:
                    profile.enable()
                thread_cpu = time.thread_time()  # the consumer's thread (waiting costs none)
                try:
                    await _draw(buffer, count)
                finally:
                    if profiled:
                        profile.disable()
                ended, cpu_end = time.perf_counter(), time.process_time()
                thread_cpu = time.thread_time() - thread_cpu
            began, cpu_began, before = first
            result["receiver"] = {
                "wall": ended - began,
                "cpu": cpu_end - cpu_began,
                "samples": count - before,
                "consumer_thread_cpu": thread_cpu,
                "shares": stage_shares(pstats.Stats(profile), RECEIVER_RULES) if profiled else {},
            }
            return result

    with tempfile.TemporaryDirectory() as scratch:
        return anyio.run(main, scratch)


def measure(kind: str, floats: int, count: int, repeats: int, own_thread: bool = False) -> dict[str, Any]:
    """CPU per sample (median of ``repeats`` plain runs) split by one profiled run's shares
    (``own_thread``: no profiled run, cProfile sees only the consumer's thread)."""
    runs = [run_case(kind, floats, count, profiled=False, own_thread=own_thread) for _ in range(repeats)]
    profiled = (
        run_case(kind, floats, count, profiled=True)
        if not own_thread
        else {"producer": {"shares": {}}, "receiver": {"shares": {}}}
    )

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    producer_cpu = median([r["producer"]["cpu"] / count for r in runs])
    receiver_cpu = median([r["receiver"]["cpu"] / r["receiver"]["samples"] for r in runs])
    rate = median([r["receiver"]["samples"] / r["receiver"]["wall"] for r in runs])
    shares = {side: profiled[side]["shares"] for side in ("producer", "receiver")}
    return {
        "samples_per_s": rate,
        "producer_us": producer_cpu * 1e6,
        "receiver_us": receiver_cpu * 1e6,
        "consumer_thread_us": median([r["receiver"]["consumer_thread_cpu"] / count for r in runs]) * 1e6,
        "producer_stages_us": {
            s: producer_cpu * 1e6 * shares["producer"].get(s, 0.0) for s in PRODUCER_STAGES
        },
        "receiver_stages_us": {
            s: receiver_cpu * 1e6 * shares["receiver"].get(s, 0.0) for s in RECEIVER_STAGES
        },
        "runs": runs,
        "profiled": profiled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures to PATH")
    parser.add_argument("--count-scale", type=float, default=1.0, help="scale the sample counts")
    parser.add_argument("--repeats", type=int, default=3, help="plain runs per case (median)")
    parser.add_argument("--only", default="blocking,async", help="producers to measure")
    parser.add_argument("--sizes", default="1,64", help="sample sizes in KiB (1 and/or 64)")
    parser.add_argument("--lamploop", type=Path, help="import lamploop from this folder (a copy, to compare)")
    parser.add_argument(
        "--own-thread",
        action="store_true",
        help="the receiver on a thread of its own (SampleReceiver(own_thread=True)); no stage split",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.lamploop.resolve() if args.lamploop else ROOT))
    load_start = os.getloadavg()
    cases: dict[str, Any] = {}
    header = (
        "| producer | sample | samples/s | producer CPU µs/sample: "
        + " / ".join(PRODUCER_STAGES)
        + " = total | receiver CPU µs/sample: "
        + " / ".join(RECEIVER_STAGES)
        + " = total | consumer's thread CPU µs/sample |"
    )
    lines = [header, "| --- | --- | ---: | ---: | ---: | ---: |"]
    for size in args.sizes.split(","):
        floats, count = {"1": (256, 20_000), "64": (16_384, 4_000)}[size.strip()]
        count = max(int(count * args.count_scale), 200)
        for kind in args.only.split(","):
            name = {"blocking": "BlockingProducer", "async": "AsyncProducer"}[kind.strip()]
            result = measure(kind.strip(), floats, count, args.repeats, own_thread=args.own_thread)
            cases[f"{name} {size} KiB"] = result
            producer = " / ".join(f"{v:.1f}" for v in result["producer_stages_us"].values())
            receiver = " / ".join(f"{v:.1f}" for v in result["receiver_stages_us"].values())
            totals = result["producer_us"], result["receiver_us"]
            lines.append(
                f"| {name} | {size} KiB | {result['samples_per_s']:,.0f} | "
                f"{producer or '-'} = **{totals[0]:.1f}** | {receiver or '-'} = **{totals[1]:.1f}** | "
                f"{result['consumer_thread_us']:.1f} |"
            )
            print(lines[-1], flush=True)
    load_end = os.getloadavg()
    print()
    print("\n".join(lines))
    start, end = (" ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end))
    print(f"\nload average (1, 5, 15 min): {start} at the start, {end} at the end")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {"load_average_start": load_start, "load_average_end": load_end, "cases": cases}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
