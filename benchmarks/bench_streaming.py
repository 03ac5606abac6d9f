"""Streaming throughput: ingestion against a raw socket, training fed live, online against offline.

Three measurements, each alternating the contenders inside the same run:

1. **Ingestion.**  A producer process sends N samples (1 KiB and 64 KiB of float32 and a
   label) to a ``SampleReceiver`` in this process, whose FIFO buffer a training loop (the
   154-parameter model, one step per batch of 32, one torch thread) drains meanwhile: samples
   per second, with ``BlockingProducer`` (what simulation codes use) and with
   ``AsyncProducer``, both with their default settings (``--resend-window N``: another
   window).  Baseline: a process that writes the same bytes (each sample's safetensors
   encoding, length-prefixed, framed once before the clock starts and sent with one
   ``sendall`` each) to a plain socket, read here with ``recv_into`` into one preallocated
   buffer and nothing else: the limit of the machine's loopback.  The three run in turn, the
   order rotating every round (B A R, A R B, R B A).  Both sides are timed alike: the clock
   starts when the first delivery is whole (lamploop: the first ``put`` into the buffer, a
   frame of one or more samples; raw: the first sample's last byte) and stops at the end
   (lamploop: every sample trained on and the producer done; raw: the sender's end of
   stream); the rate counts only the samples delivered after the clock started.  Targets:
   BlockingProducer >= 0.9 AsyncProducer; lamploop >= 0.5 raw at 64 KiB and >= 0.2 raw at
   1 KiB.  A fourth contender, ``async drained``, is ``AsyncProducer`` with the buffer drained
   by ``get_batch`` and ``torch.stack`` alone (no model): the raw socket trains nothing, and
   the small model's step (some 20 µs of CPU per 1 KiB sample on a slow core, on the
   receiver's thread) would otherwise be counted against the transport.  Two more,
   ``async rows drained`` and ``blocking rows drained``, drained alike, come from a simulation
   that makes its samples 64 at a time and hands each batch over with ``send_rows``.
2. **Training while ingesting.**  Steps per second of the 1M-parameter MLP (batches of 64,
   64 KiB samples of 16384 floats cut to its 512 inputs) drawn from a buffer fed live over
   TCP by one ``BlockingProducer`` process, against the same steps drawn from a buffer filled
   beforehand in memory.  Target: >= 0.9.  Three times: with torch's default threads, with one
   thread (both sides), and with one thread and the receiver on a thread of its own
   (``SampleReceiver(own_thread=True)``: receiving and decoding off the training's thread).
   Beside the rate, the CPU each side used per step (this process's, the
   producer's): what the cores must supply for the live run to keep up.
3. **Online against offline** (the heat-equation example, ``examples/streaming_heat``):
   the same simulations (3 processes) either stream their samples to the training
   (``BlockingProducer``, a FIRO buffer reading each sample twice) or write them to files
   (one safetensors file each), which the same training then reads with a torch
   ``DataLoader`` (each sample twice, shuffled), as studies of online training measure the
   offline way.  Reported: the time from the simulations' start to the end, the samples
   trained per second of training (offline: once the files are written), and the time from
   the simulations' start to a validation loss both runs reach (the worse of their two final
   losses, unless ``--target-loss``).

    python benchmarks/bench_streaming.py [--quick] [--json PATH] [--target-loss L] [--resend-window N]
        [--only ingest,train,heat]

``--compare DIR`` measures this code against another copy of the package (``DIR/lamploop``, a
copy of the tree before a change) in the same run: each measurement of 1. and 2. (one thread)
runs in a fresh process of its own, importing one version or the other, the versions and the
contenders alternating within every round; it reports each version's ratios (median
[min-max]) and this code's rate over the other's, per contender.  In the same rounds, this
code alone also runs ``AsyncProducer`` ingestion (1 and 64 KiB) and training fed live with
``SampleReceiver(own_thread=True)``, against the same raw and in-memory runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, print_table, summarize, write_json

import lamploop
from lamploop.streaming import FifoBuffer, FiroBuffer, Sample, buffer_batches, stack_samples
from lamploop.streaming.receiver import SampleReceiver

ROOT = Path(__file__).resolve().parent.parent
HEAT = ROOT / "examples" / "streaming_heat"

PRODUCER = """
import json, sys, time, anyio, torch
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
kind, host, port, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
count, floats = int(sys.argv[5]), int(sys.argv[6])
options = {"resend_window": int(sys.argv[7])} if sys.argv[7] != "default" else {}
tensor = torch.arange(floats, dtype=torch.float32)
labels = [torch.tensor(0), torch.tensor(1)]
# "... rows": a simulation that makes its samples 64 at a time hands each batch over as columns.
rows_x = torch.stack([tensor] * 64)
rows_y = torch.arange(64) % 2
cpu = time.process_time()
if kind == "blocking":
    with BlockingProducer((host, port), name="bench", token=token, **options) as producer:
        cpu = time.process_time()
        for i in range(count):
            producer.send({"x": tensor, "y": labels[i % 2]})
elif kind == "blocking rows":
    with BlockingProducer((host, port), name="bench", token=token, **options) as producer:
        cpu = time.process_time()
        for start in range(0, count, 64):
            n = min(64, count - start)
            producer.send_rows({"x": rows_x[:n], "y": rows_y[:n]})
elif kind == "async rows":
    async def main():
        global cpu
        async with AsyncProducer((host, port), name="bench", token=token, **options) as producer:
            cpu = time.process_time()
            for start in range(0, count, 64):
                n = min(64, count - start)
                await producer.send_rows({"x": rows_x[:n], "y": rows_y[:n]})
    anyio.run(main)
else:
    async def main():
        global cpu
        async with AsyncProducer((host, port), name="bench", token=token, **options) as producer:
            cpu = time.process_time()
            for i in range(count):
                await producer.send({"x": tensor, "y": labels[i % 2]})
    anyio.run(main)
print(json.dumps({"cpu": time.process_time() - cpu}), flush=True)
"""

RAW = """
import socket, struct, sys, torch
from safetensors.torch import save
host, port, count, floats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tensor = torch.arange(floats, dtype=torch.float32)
payloads = [save({"x": tensor, "y": torch.tensor(i % 2)}) for i in range(min(count, 64))]
frames = [struct.pack(">I", len(body)) + body for body in payloads]
with socket.create_connection((host, port)) as s:
    for i in range(count):
        s.sendall(frames[i % len(frames)])
"""


class FirstPut(FifoBuffer):
    """A FIFO buffer that notes when the first delivery arrived and how many samples it held
    (the producer's start-up, importing torch, is not the transport's cost; the samples of that
    first delivery arrived before the clock started).  A buffer itself, not a sink in front of
    one, so that a receiver on a thread of its own (``own_thread=True``) may fill it."""

    first: float | None = None
    first_count = 0

    async def put(self, sample: Sample) -> None:
        if self.first is None:
            self.first, self.first_count = time.perf_counter(), 1
        await super().put(sample)

    def try_put_many(self, samples: Sequence[Sample]) -> int:
        now = time.perf_counter() if self.first is None else 0.0
        taken = int(super().try_put_many(samples))
        if self.first is None:  # the samples it did not take come again later, after the clock started
            self.first, self.first_count = now, taken
        return taken


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` (``None``: unchanged) inside the block."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


RESEND_WINDOW = "default"
"""The producers' ``resend_window`` (``--resend-window``; "default": theirs, 64)."""


def _producer_command(kind: str, host: str, port: int, token: str, count: int, floats: int) -> list[str]:
    return [
        sys.executable,
        "-c",
        PRODUCER,
        kind,
        host,
        str(port),
        token,
        str(count),
        str(floats),
        RESEND_WINDOW,
    ]


# -- 1. ingestion --


def ingest_lamploop(
    kind: str, count: int, floats: int, own_thread: bool = False, train: bool = True
) -> float:
    """Samples per second through producer -> receiver -> buffer, drained by a training loop
    (``own_thread``: the receiver on a thread of its own; ``train=False``: drained by
    ``get_batch`` and ``torch.stack`` alone, no model: the transport's own rate)."""
    with torch_threads(1):
        return anyio.run(_ingest_lamploop, kind, count, floats, own_thread, train)


async def _ingest_lamploop(kind: str, count: int, floats: int, own_thread: bool, train: bool) -> float:
    token = secrets.token_hex(16)
    buffer = sink = FirstPut(capacity=1024, watermark=32, seed=0)
    options: dict[str, Any] = {"own_thread": True} if own_thread else {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    async with (
        SampleReceiver(sink, token=token, expected_producers=["bench"], **options) as receiver,
        anyio.create_task_group() as tg,
    ):
        command = _producer_command(kind, *receiver.address, token, count, floats)
        tg.start_soon(partial(anyio.run_process, command, check=True, cwd=tempfile.gettempdir()))
        collate = stack_samples()
        trained = 0
        while trained < count:
            batch = await buffer.get_batch(min(32, count - trained))
            x, y = collate(batch)  # what buffer_batches does with each batch
            if train:
                loss = torch.nn.functional.cross_entropy(model(x[:, :16]), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            trained += len(batch)
        await receiver.wait_all_done()
        ended = time.perf_counter()
        assert sink.first is not None
        return (count - sink.first_count) / (ended - sink.first)


def ingest_raw(count: int, floats: int) -> float:
    """Samples per second of the same bytes over a plain socket, only received (``recv_into``
    one preallocated buffer: no allocation per read)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        command = [sys.executable, "-c", RAW, "127.0.0.1", str(port), str(count), str(floats)]
        sender = subprocess.Popen(command, cwd=tempfile.gettempdir())
        connection, _ = server.accept()
        with connection:
            view = memoryview(bytearray(1 << 20))
            # The first sample, whole (its 4-byte length, then its body): the clock starts after it.
            got = 0
            while got < 4:
                got += _received(connection.recv_into(view[got:4]))
            first = 4 + struct.unpack(">I", view[:4])[0]
            while got < first:
                got += _received(connection.recv_into(view, min(first - got, len(view))))
            began = time.perf_counter()
            while connection.recv_into(view):
                pass
            ended = time.perf_counter()
        sender.wait(timeout=120)
        return (count - 1) / (ended - began)


def _received(n: int) -> int:
    if n == 0:
        msg = "the raw sender closed before its first sample was whole"
        raise RuntimeError(msg)
    return n


def _rounds(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """``rounds`` measurements of each contender, the order rotating every round."""
    names = list(contenders)
    results: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            results[name].append(contenders[name]())
    return results


def _pairs(ours: Callable[[], Any], baseline: Callable[[], Any], pairs: int) -> tuple[list[Any], list[Any]]:
    """``pairs`` measurements of each, alternating which goes first (AB, BA, ...)."""
    a, b = [], []
    for i in range(pairs):
        if i % 2:
            b.append(baseline())
            a.append(ours())
        else:
            a.append(ours())
            b.append(baseline())
    return a, b


# -- 2. training while ingesting --


def train_steps(
    live: bool, steps: int, threads: int | None = None, own_thread: bool = False
) -> dict[str, float]:
    """Steps/s of the 1M MLP drawing batches of 64 from a buffer fed live over TCP, or filled
    before; and the CPU seconds per step of this process and (live) of the producer's.
    ``own_thread``: the receiver on a thread of its own."""
    with torch_threads(threads):
        return anyio.run(_train_steps, live, steps, own_thread)


async def _train_steps(live: bool, steps: int, own_thread: bool = False) -> dict[str, float]:
    count = steps * 64
    token = secrets.token_hex(16)
    buffer = FifoBuffer(capacity=count if not live else 2048, watermark=64, seed=0)
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    tensor = torch.arange(16384, dtype=torch.float32)
    producer: dict[str, float] = {}

    def collate(samples: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.stack([s.tensors["x"][:512] for s in samples]) / 16384
        return x, torch.stack([s.tensors["y"] for s in samples])

    async def serve(receiver: SampleReceiver, *, task_status: Any) -> None:
        async with receiver, anyio.create_task_group() as tg:
            command = _producer_command("blocking", *receiver.address, token, count, 16384)

            async def produce() -> None:
                done = await anyio.run_process(command, check=True, cwd=tempfile.gettempdir())
                producer.update(json.loads(done.stdout.decode().strip().splitlines()[-1]))

            tg.start_soon(produce)
            task_status.started()
            await receiver.wait_all_done()
            buffer.close()

    async with anyio.create_task_group() as tg:
        if live:
            options: dict[str, Any] = (
                {"own_thread": True} if own_thread else {}
            )  # (a version before it has none)
            receiver = SampleReceiver(buffer, token=token, expected_producers=["bench"], **options)
            await tg.start(serve, receiver)
            while buffer.received < 256:  # noqa: ASYNC110 (no event for a count; the producer is starting)
                await anyio.sleep(0.01)
        else:
            for i in range(count):
                buffer.try_put(Sample("bench", i, {"x": tensor, "y": torch.tensor(i % 2)}))
            buffer.close()
        stream = buffer_batches(buffer, batch_size=64, batches_per_epoch=steps, collate=collate)
        model = lamploop.SupervisedModel(module, lamploop.cross_entropy_loss)
        began, cpu = time.perf_counter(), time.process_time()
        await lamploop.one_epoch(
            model=model,
            batches=stream(lamploop.BatchContext(epoch=0, rank=0, nranks=1)),
            step_optimizer=optimizer.step,
        )
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    return {
        "steps_per_s": steps / elapsed,
        "trainer_cpu_per_step": cpu / steps,
        "producer_cpu_per_step": producer.get("cpu", 0.0) / steps,
    }


# -- 3. online against offline (the heat example) --


def _heat() -> Any:
    """The example's training script, as a module (its folder is not a package)."""
    sys.path.insert(0, str(HEAT))
    import train as heat_train  # the example's module, found on the path set above

    return heat_train


async def heat_online(producers: int, samples: int, epoch_batches: int) -> dict[str, Any]:
    """The example's training fed live by its simulations (one rank): the validation curve in time."""
    heat = _heat()
    x_valid, y_valid = heat.held_out()
    token = secrets.token_hex(16)
    names = [f"sim-{i}" for i in range(producers)]
    buffer = FiroBuffer(capacity=256, watermark=64, seed=0, max_reads=2)
    curve: list[tuple[float, float]] = []
    env = {**os.environ, heat.TOKEN_VARIABLE: token, "PYTHONPATH": str(ROOT)}
    async with (
        SampleReceiver(buffer, token=token, expected_producers=names) as receiver,
        anyio.create_task_group() as tg,
    ):
        began = time.perf_counter()
        for i, name in enumerate(names):
            host, port = receiver.address
            command = [sys.executable, str(HEAT / "simulate.py"), host, str(port), name, str(samples), str(i)]
            tg.start_soon(partial(anyio.run_process, command, env=env, check=True, cwd=tempfile.gettempdir()))

        async def end_of_stream() -> None:
            await receiver.wait_all_done()
            buffer.close()

        tg.start_soon(end_of_stream)
        first_batch: list[float] = []

        def on_epoch(state: lamploop.LoopState) -> None:
            loss = state.learning_curve[-1].validation_loss
            assert loss is not None
            curve.append((time.perf_counter() - began, loss[1]))

        def collate(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not first_batch:
                first_batch.append(time.perf_counter() - began)
            return torch.stack([s.tensors["x"] for s in batch]), torch.stack([s.tensors["y"] for s in batch])

        await lamploop.fit_async(
            model=lamploop.SupervisedModel(heat.surrogate(), lamploop.mse_loss),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=3e-3),
            train_batches=buffer_batches(
                buffer, batch_size=32, batches_per_epoch=epoch_batches, collate=collate
            ),
            validation_batches=lamploop.tensor_batches(x_valid, y_valid, batch_size=50, shuffle=False),
            max_epochs=10**6,
            reporters=[],
            on_epoch=on_epoch,
        )
        total = time.perf_counter() - began
    return {
        "curve": curve,
        "total_s": total,
        "reads": buffer.read_total,
        "training_s": total - first_batch[0],
        "samples_per_s": buffer.read_total / (total - first_batch[0]),
    }


async def heat_offline(producers: int, samples: int, epoch_batches: int) -> dict[str, Any]:
    """The same simulations writing files, then the same training reading them with a DataLoader."""
    heat = _heat()
    x_valid, y_valid = heat.held_out()
    names = [f"sim-{i}" for i in range(producers)]
    curve: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "samples"
        began = time.perf_counter()
        await heat.write_simulations(folder, names, samples)
        written = time.perf_counter() - began
        batches, epochs = heat.file_batches(folder, batch_size=32, batches_per_epoch=epoch_batches, reads=2)

        def on_epoch(state: lamploop.LoopState) -> None:
            loss = state.learning_curve[-1].validation_loss
            assert loss is not None
            curve.append((time.perf_counter() - began, loss[1]))

        await lamploop.fit_async(
            model=lamploop.SupervisedModel(heat.surrogate(), lamploop.mse_loss),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=3e-3),
            train_batches=batches,
            validation_batches=lamploop.tensor_batches(x_valid, y_valid, batch_size=50, shuffle=False),
            max_epochs=epochs,
            reporters=[],
            on_epoch=on_epoch,
        )
        total = time.perf_counter() - began
    reads = 2 * producers * samples
    return {
        "curve": curve,
        "total_s": total,
        "written_s": written,
        "reads": reads,
        "training_s": total - written,
        "samples_per_s": reads / (total - written),
    }


def _time_to(curve: Sequence[Sequence[float]], target: float) -> float:
    """When the validation loss first reached ``target`` (inf if never)."""
    return next((t for t, loss in curve if loss <= target), math.inf)


def _heat_pairs(pairs: int, producers: int, samples: int, epoch_batches: int) -> tuple[list[Any], list[Any]]:
    with torch_threads(1):
        return _pairs(
            partial(anyio.run, heat_online, producers, samples, epoch_batches),
            partial(anyio.run, heat_offline, producers, samples, epoch_batches),
            pairs,
        )


# -- before and after: each measurement in a process of its own --

CHILD = "--child-measure"


def _child(spec: str) -> None:
    """One measurement (``kind,floats,count`` or ``train,live|thread|memory,steps``), printed as JSON;
    a kind with ``-thread``, and ``train,thread``: the receiver on a thread of its own; with
    ``-drained``: drained without a model."""
    kind, first, second = spec.split(",")
    if kind == "train":
        result: Any = train_steps(first != "memory", int(second), 1, own_thread=first == "thread")
    elif kind == "raw":
        result = ingest_raw(int(second), int(first))
    else:
        producer, *options = kind.split("-")
        result = ingest_lamploop(
            producer, int(second), int(first), own_thread="thread" in options, train="drained" not in options
        )
    print(json.dumps(result), flush=True)


def _measure_in(version: Path | None, spec: str) -> Any:
    """``_child(spec)`` in a new process importing lamploop from ``version`` (None: this tree)."""
    env = dict(os.environ)
    if version is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(version), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, CHILD, spec], env=env, capture_output=True, check=True, timeout=600
    )
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def compare(other: Path, rounds: int, steps: int) -> tuple[list[list[str]], dict[str, Any]]:
    """This code against ``other`` (see the module), alternated within every round."""
    versions: dict[str, Path | None] = {"after": None, "before": other}
    specs = {
        "blocking 1 KiB": "blocking,256,20000",
        "async 1 KiB": "async,256,20000",
        "raw 1 KiB": "raw,256,20000",
        "blocking 64 KiB": "blocking,16384,4000",
        "async 64 KiB": "async,16384,4000",
        "raw 64 KiB": "raw,16384,4000",
        "train live": f"train,live,{steps}",
        "train memory": f"train,memory,{steps}",
    }
    # Only this tree has SampleReceiver(own_thread=True): measured in the same rounds, against
    # the same raw and in-memory runs.
    own_thread = {
        "async 1 KiB, receiver thread": "async-thread,256,20000",
        "async 64 KiB, receiver thread": "async-thread,16384,4000",
        "train live, receiver thread": f"train,thread,{steps}",
    }
    runs: dict[str, dict[str, list[Any]]] = {v: {name: [] for name in specs} for v in versions}
    runs["after"].update({name: [] for name in own_thread})
    specs_of = {"after": {**specs, **own_thread}, "before": specs}
    order = [(v, name) for name in specs for v in versions] + [("after", name) for name in own_thread]
    for i in range(rounds):
        shift = (i * 3) % len(order)
        for version, name in order[shift:] + order[:shift]:
            runs[version][name].append(_measure_in(versions[version], specs_of[version][name]))
    rows = []
    rate = {
        v: {n: [r["steps_per_s"] if n.startswith("train") else r for r in runs[v][n]] for n in specs_of[v]}
        for v in versions
    }
    ratios = [
        ("1 KiB blocking/async", "blocking 1 KiB", "async 1 KiB", 0.9),
        ("1 KiB async/raw", "async 1 KiB", "raw 1 KiB", 0.2),
        ("1 KiB blocking/raw", "blocking 1 KiB", "raw 1 KiB", 0.2),
        ("64 KiB blocking/async", "blocking 64 KiB", "async 64 KiB", 0.9),
        ("64 KiB async/raw", "async 64 KiB", "raw 64 KiB", 0.5),
        ("64 KiB blocking/raw", "blocking 64 KiB", "raw 64 KiB", 0.5),
        ("1M MLP, 1 thread: live/memory", "train live", "train memory", 0.9),
    ]
    for label, a, b, target in ratios:
        cells = {v: _ratio(rate[v][a], rate[v][b]) for v in versions}
        rows.append(
            [
                label,
                _cell(cells["before"]),
                _cell(cells["after"]),
                f">= {target}: {_verdict(cells['after'], target)}",
            ]
        )
    for label, a, b, target in (
        ("1 KiB async (receiver thread)/raw", "async 1 KiB, receiver thread", "raw 1 KiB", 0.2),
        ("64 KiB async (receiver thread)/raw", "async 64 KiB, receiver thread", "raw 64 KiB", 0.5),
        (
            "1M MLP, 1 thread: live (receiver thread)/memory",
            "train live, receiver thread",
            "train memory",
            0.9,
        ),
        ("  live: receiver thread / trainer's loop", "train live, receiver thread", "train live", 1.0),
    ):
        cell = _ratio(rate["after"][a], rate["after"][b])
        rows.append([label, "", _cell(cell), f">= {target}: {_verdict(cell, target)}"])
    for name in specs:
        if not name.startswith("raw"):
            rows.append(
                [
                    f"  {name}: after/before rate",
                    "",
                    _cell(_ratio(rate["after"][name], rate["before"][name])),
                    "",
                ]
            )
    for v in versions:
        live = runs[v]["train live"]
        cpu = " / ".join(
            f"{1e3 * summarize([r[key] for r in live])['median']:.2f}"
            for key in ("trainer_cpu_per_step", "producer_cpu_per_step")
        )
        memory = 1e3 * summarize([r["trainer_cpu_per_step"] for r in runs[v]["train memory"]])["median"]
        rows.append(
            [
                f"  {v}: CPU ms/step trainer live / producer; trainer from memory",
                "",
                f"{cpu}; {memory:.2f}",
                "",
            ]
        )
    live = runs["after"]["train live, receiver thread"]
    cpu = " / ".join(
        f"{1e3 * summarize([r[key] for r in live])['median']:.2f}"
        for key in ("trainer_cpu_per_step", "producer_cpu_per_step")
    )
    rows.append(["  after, receiver thread: CPU ms/step trainer's process live / producer", "", cpu, ""])
    return rows, {"runs": runs}


# -- the report --


def _verdict(ratio: dict[str, float], target: float) -> str:
    """met / missed / inconclusive (the range of the ratios straddles the target)."""
    if ratio["min"] >= target:
        return "met"
    if ratio["max"] < target:
        return "missed"
    return "inconclusive"


def _cell(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]"


def _ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    return summarize([x / y for x, y in zip(a, b, strict=True)])


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_streaming")
    parser.add_argument("--target-loss", type=float, help="online/offline: the validation loss to reach")
    parser.add_argument("--only", default="ingest,train,heat", help="which measurements (comma-separated)")
    parser.add_argument("--resend-window", type=int, help="the producers' resend_window (default: theirs)")
    parser.add_argument(
        "--compare", type=Path, metavar="DIR", help="against DIR/lamploop, alternated (module)"
    )
    parser.add_argument(CHILD, metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_measure:
        _child(args.child_measure)
        return 0
    if args.compare:
        load_start = list(os.getloadavg())
        table, compared = compare(args.compare, 3 if args.quick else 5, 20 if args.quick else 60)
        print_table(["ratio", f"before ({args.compare})", "after (this tree)", "target"], table)
        start, end = (" ".join(f"{x:.2f}" for x in load) for load in (load_start, list(os.getloadavg())))
        print(f"\nload average (1, 5, 15 min): {start} at the start, {end} at the end")
        if args.json:
            write_json(args.json, {**compared, "load_average": [load_start, list(os.getloadavg())]})
        return 0
    global RESEND_WINDOW  # a setting of this script's run
    RESEND_WINDOW = "default" if args.resend_window is None else str(args.resend_window)
    only = set(args.only.split(","))
    rounds = 3 if args.quick else 7
    load_start = list(os.getloadavg())
    results: dict[str, Any] = {"load_average_start": load_start, "resend_window": RESEND_WINDOW}
    rows: list[list[str]] = []
    for label, floats, count, raw_target in (("1 KiB", 256, 20_000, 0.2), ("64 KiB", 16_384, 4_000, 0.5)):
        if "ingest" not in only:
            break
        count = count // 4 if args.quick else count
        rates = _rounds(
            {
                "blocking": partial(ingest_lamploop, "blocking", count, floats),
                "async": partial(ingest_lamploop, "async", count, floats),
                "raw": partial(ingest_raw, count, floats),
                "async drained": partial(ingest_lamploop, "async", count, floats, train=False),
                "async rows drained": partial(ingest_lamploop, "async rows", count, floats, train=False),
                "blocking rows drained": partial(
                    ingest_lamploop, "blocking rows", count, floats, train=False
                ),
            },
            rounds,
        )
        ratios = {
            "blocking/async": (_ratio(rates["blocking"], rates["async"]), 0.9),
            "async/raw": (_ratio(rates["async"], rates["raw"]), raw_target),
            "blocking/raw": (_ratio(rates["blocking"], rates["raw"]), raw_target),
            # The raw socket only reads; drained without a model, lamploop's side does no more
            # than the transport's work (receive, decode, put, ack, draw and stack).
            "async drained/raw": (_ratio(rates["async drained"], rates["raw"]), raw_target),
            # A simulation that makes its samples a batch at a time: send_rows.
            "async rows drained/raw": (_ratio(rates["async rows drained"], rates["raw"]), raw_target),
            "blocking rows drained/raw": (_ratio(rates["blocking rows drained"], rates["raw"]), raw_target),
            "blocking rows drained/async rows drained": (
                _ratio(rates["blocking rows drained"], rates["async rows drained"]),
                0.9,
            ),
        }
        results[f"ingest {label}"] = {
            "samples_per_s": rates,
            "ratios": {name: {**ratio, "target": target} for name, (ratio, target) in ratios.items()},
        }
        medians = {name: summarize(values)["median"] for name, values in rates.items()}
        for name, (ratio, target) in ratios.items():
            a, b = name.split("/")
            rows.append(
                [
                    f"ingest {label} ({count} samples): {name}",
                    f"{medians[a]:,.0f} / {medians[b]:,.0f} samples/s",
                    _cell(ratio),
                    f">= {target}: {_verdict(ratio, target)}",
                ]
            )
    steps = 20 if args.quick else 60
    pairs = 3 if args.quick else 5
    for key, threads, own_thread in (
        ("training", None, False),
        ("training, 1 thread", 1, False),
        ("training, 1 thread, receiver on its own thread", 1, True),
    ):
        if "train" not in only:
            break
        live, memory = _pairs(
            partial(train_steps, True, steps, threads, own_thread=own_thread),
            partial(train_steps, False, steps, threads),
            pairs,
        )
        ratio = _ratio([r["steps_per_s"] for r in live], [r["steps_per_s"] for r in memory])
        accounting = {
            "trainer_cpu_ms_per_step_live": 1e3
            * summarize([r["trainer_cpu_per_step"] for r in live])["median"],
            "trainer_cpu_ms_per_step_memory": 1e3
            * summarize([r["trainer_cpu_per_step"] for r in memory])["median"],
            "producer_cpu_ms_per_step": 1e3 * summarize([r["producer_cpu_per_step"] for r in live])["median"],
            "memory_ms_per_step": 1e3 / summarize([r["steps_per_s"] for r in memory])["median"],
        }
        # At 0.9 of the in-memory rate, the live run's CPU per step must fit in the cores available.
        budget = accounting["memory_ms_per_step"] / 0.9
        cores = (accounting["trainer_cpu_ms_per_step_live"] + accounting["producer_cpu_ms_per_step"]) / budget
        accounting["cores_needed_for_0.9"] = cores
        results[key] = {"live": live, "memory": memory, "ratio": ratio, "cpu": accounting}
        threads_used = threads or torch.get_num_threads()
        rows.append(
            [
                f"train 1M MLP, 64 KiB samples ({steps} steps, {threads_used} thr."
                f"{', receiver thread' if own_thread else ''}): live/memory",
                f"{summarize([r['steps_per_s'] for r in live])['median']:.1f} / "
                f"{summarize([r['steps_per_s'] for r in memory])['median']:.1f} steps/s",
                _cell(ratio),
                f">= 0.9: {_verdict(ratio, 0.9)}",
            ]
        )
        rows.append(
            [
                "  CPU ms per step: trainer live / trainer in memory / producer",
                " / ".join(
                    f"{accounting[key]:.2f}"
                    for key in (
                        "trainer_cpu_ms_per_step_live",
                        "trainer_cpu_ms_per_step_memory",
                        "producer_cpu_ms_per_step",
                    )
                ),
                f"{cores:.2f} cores for 0.9",
                "",
            ]
        )
    if "heat" in only:
        producers, samples, epoch_batches = 3, (300 if args.quick else 1500), 5
        heat_pairs = 1 if args.quick else 3
        online, offline = _heat_pairs(heat_pairs, producers, samples, epoch_batches)
        reached = []
        for on, off in zip(online, offline, strict=True):
            target = args.target_loss or max(on["curve"][-1][1], off["curve"][-1][1])
            reached.append((target, _time_to(on["curve"], target), _time_to(off["curve"], target)))
        results["online vs offline"] = {"online": online, "offline": offline, "time_to_target": reached}
        on_total = summarize([r["total_s"] for r in online])
        off_total = summarize([r["total_s"] for r in offline])
        rows.append(
            [
                f"heat example, {producers} x {samples} samples: end to end, online / offline",
                f"{on_total['median']:.1f} s / {off_total['median']:.1f} s "
                f"(files written in {summarize([r['written_s'] for r in offline])['median']:.1f} s)",
                _cell(_ratio([r["total_s"] for r in offline], [r["total_s"] for r in online])),
                "offline / online time",
            ]
        )
        rows.append(
            [
                "  samples trained per s of training, online / offline",
                f"{summarize([r['samples_per_s'] for r in online])['median']:,.0f} / "
                f"{summarize([r['samples_per_s'] for r in offline])['median']:,.0f}",
                _cell(_ratio([r["samples_per_s"] for r in online], [r["samples_per_s"] for r in offline])),
                "online / offline rate",
            ]
        )
        rows.append(
            [
                "  time to validation loss L (from the simulations' start), online / offline",
                "; ".join(f"L={t:.4f}: {a:.1f} s / {b:.1f} s" for t, a, b in reached),
                _cell(summarize([b / a for _, a, b in reached])),
                "offline / online time",
            ]
        )
    load_end = list(os.getloadavg())
    results["load_average_end"] = load_end
    print(
        f"lamploop {lamploop.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"{rounds} rounds (ingest), {pairs} pairs (training)"
    )
    print_table(["case", "figures (medians)", "ratio median [min-max]", "target"], rows)
    start, end = (" ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end))
    print(f"\nload average (1, 5, 15 min): {start} at the start, {end} at the end (over 2 on 2 cores: noisy)")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
