"""Runs the scenarios of tests/test_acceptance_leaks.py and writes what each left behind.

``python -X dev -W error::ResourceWarning leaks_worker.py GROUP OUT_DIR [ARG]``: every scenario
of GROUP runs twice in this process, a warm-up (torch's pools, gloo's, imports) and the measured
run, each measured run between two snapshots of the process: its open file descriptors, its
Python threads, its native threads (``/proc/self/task``), its child processes (``/proc/*/stat``)
and the TCP ports it listens on (``/proc/net/tcp*``, by socket inode). The record
(``OUT_DIR/GROUP.json``, rewritten whole after every scenario) holds both snapshots, how the run
ended, and what else the scenario checked (a port bindable again, files left in a checkpoint
directory). Markers on stderr (``@@@ begin NAME`` / ``@@@ end NAME``) cut the process's stderr
into scenarios, for the test to look for warnings in each.

A rank that ``fit(world_size=2)`` starts runs this script again, with ``LAMPLOOP_RANK`` set:
it reads the fit it is to join from ``LEAKS_FIT`` (which rank 0 sets before each call) and
makes that one call.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

import lamploop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.workers.records import write_whole

NOTES: dict[str, Any] = {}
"""What the scenario in progress noted so far: kept when it ends by an exception too."""
TEMPORARY_MARKS = (".lamploop-tmp", ".tmp", ".part", "tmp-", "~")


# --------------------------------------------------------------------------- measuring


def _children(pid: int) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(f"{entry} {fields[0]} {stat[stat.find('(') + 1 : stat.rfind(')')]}")
    return sorted(found)


def _listening(fds: dict[int, str]) -> list[int]:
    inodes = {target[8:-1] for target in fds.values() if target.startswith("socket:[")}
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _comm(task: str) -> str:
    try:
        return Path(f"/proc/self/task/{task}/comm").read_text().strip()
    except OSError:
        return "?"


def snapshot() -> dict[str, Any]:
    gc.collect()
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return {
        "fds": {str(fd): target for fd, target in sorted(fds.items())},
        "threads": sorted(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate()),
        "native_threads": len(os.listdir("/proc/self/task")),
        "native_thread_names": sorted(_comm(task) for task in os.listdir("/proc/self/task")),
        "children": _children(os.getpid()),
        "listening": _listening(fds),
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "sigint": repr(signal.getsignal(signal.SIGINT)),
    }


def settled(before: dict[str, Any], grace: float = 2.0) -> dict[str, Any]:
    """The snapshot once it matches ``before``, or after ``grace`` s: what is still there then."""
    deadline = time.monotonic() + grace
    while True:
        after = snapshot()
        # native_threads too: a joined thread leaves threading.enumerate() before its OS thread
        # has exited (CI run 23 counted one such thread still there).
        keys = ("fds", "threads", "native_threads", "children", "listening")
        same = all(after[key] == before[key] for key in keys)
        if same or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def temporaries(directory: Path) -> list[str]:
    if not directory.exists():
        return []
    return sorted(
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if any(mark in path.name for mark in TEMPORARY_MARKS)
    )


def bindable(port: int | None) -> bool | None:
    """Whether a server (``SO_REUSEADDR``, as asyncio's and http.server's set it) can listen on
    ``port`` of 127.0.0.1 now; a plain ``bind`` may still fail on the closed connections'
    TIME_WAIT."""
    if not port:
        return None
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


# --------------------------------------------------------------------------- running


class Recorder:
    def __init__(self, group: str, out: Path) -> None:
        self.path = out / f"{group}.json"
        self.out = out
        self.results: dict[str, Any] = {}

    def scenario(
        self, name: str, run: Callable[[Path], dict[str, Any] | None], *, warm_up: bool = True
    ) -> None:
        print(f"@@@ begin {name} {time.monotonic():.3f}", file=sys.stderr, flush=True)
        result: dict[str, Any] = {}
        try:
            if warm_up:
                self._once(name, "warm", run)
            before = snapshot()
            result = self._once(name, "run", run)
            after = settled(before)
            result.update(before=before, after=after)
        except BaseException as error:  # the record says so; the test fails on it
            result["worker_error"] = "".join(traceback.format_exception(error))
        print(f"@@@ end {name} {time.monotonic():.3f}", file=sys.stderr, flush=True)
        self.results[name] = result
        write_whole(self.path, json.dumps(self.results, indent=1))

    def _once(self, name: str, phase: str, run: Callable[[Path], dict[str, Any] | None]) -> dict[str, Any]:
        directory = self.out / name / phase
        directory.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        NOTES.clear()
        try:
            NOTES.update(run(directory) or {})
            outcome = "returned"
        except BaseException as error:
            outcome = f"{type(error).__name__}: {str(error)[:300]}"
        extra = dict(NOTES, outcome=outcome, seconds=round(time.monotonic() - started, 3))
        return extra


# --------------------------------------------------------------------------- fit on one rank

torch.manual_seed(0)
X = torch.randn(96, 4)
Y = (X[:, 0] > 0).long()


def batches(
    *, fail_at: tuple[int, int] | None = None, signal_at: tuple[int, int] | None = None, delay: float = 0.0
) -> lamploop.BatchStreamFactory:
    base = lamploop.tensor_batches(X[:64], Y[:64], batch_size=16)

    def factory(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            step = 0
            async for batch in base(context):
                failing_rank = int(os.environ.get("LEAKS_FAIL_RANK", "0"))
                if fail_at == (context.epoch, step) and context.rank == failing_rank:
                    raise RuntimeError(f"leaks: the batch stream failed at epoch {context.epoch} step {step}")
                if signal_at == (context.epoch, step):
                    os.kill(os.getpid(), signal.SIGTERM)
                if delay:
                    await anyio.sleep(delay)
                yield batch
                step += 1

        return stream()

    return factory


VALIDATION = lamploop.tensor_batches(X[64:], Y[64:], batch_size=32, shuffle=False)


def fit(directory: Path | None, **options: Any) -> lamploop.LoopState | None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    lr = options.pop("lr", 0.1)
    arguments: dict[str, Any] = {
        "model": lamploop.SupervisedModel(module),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=lr),
        "train_batches": options.pop("train_batches", None) or batches(),
        "validation_batches": VALIDATION,
        "max_epochs": 3,
        "device": "cpu",
        "checkpoint_dir": directory,
    }
    arguments.update(options)
    return lamploop.fit(**arguments)


def fit_record(directory: Path, **options: Any) -> dict[str, Any]:
    checkpoints = directory / "checkpoints"
    record = NOTES
    try:
        state = fit(checkpoints, **options)
        record["epoch"] = None if state is None else state.epoch
    finally:
        record["temporaries"] = temporaries(checkpoints)
    return record


def reporters_of(directory: Path, kinds: list[str], record: dict[str, Any]) -> list[Any]:
    from lamploop.reporting import (
        LoggingReporter,
        MetricsFileReporter,
        ProgressReporter,
        PrometheusReporter,
    )

    made: list[Any] = []
    for kind in kinds:
        if kind == "logging":
            made.append(LoggingReporter())
        elif kind == "csv":
            made.append(MetricsFileReporter(directory / "curve.csv"))
        elif kind == "jsonl":
            made.append(MetricsFileReporter(directory / "curve.jsonl"))
        elif kind == "progress":
            made.append(ProgressReporter(io.StringIO(), terminal=False))
        elif kind == "progress_live":
            made.append(ProgressReporter(io.StringIO(), terminal=True, refresh_per_second=20))
        elif kind == "prometheus":
            prometheus = PrometheusReporter(port=0)
            record["prometheus"] = prometheus
            made.append(prometheus)
    return made


def with_reporters(kinds: list[str], **options: Any) -> Callable[[Path], dict[str, Any]]:
    def run(directory: Path) -> dict[str, Any]:
        holder: dict[str, Any] = {}
        made = reporters_of(directory, kinds, holder)
        record = NOTES
        try:
            fit_record(directory, reporters=made, **options)
        finally:
            prometheus = holder.get("prometheus")
            if prometheus is not None:
                record["prometheus_port"] = prometheus.port
                record["prometheus_port_bindable"] = bindable(prometheus.port)
        return record

    return run


def group_fit(recorder: Recorder) -> None:
    every = ["logging", "csv", "jsonl", "progress", "progress_live", "prometheus"]
    recorder.scenario("fit_normal", lambda d: fit_record(d))
    # The scenarios after the first warm up only what they add (a reporter's own machinery).
    recorder.scenario(
        "fit_no_checkpoints", lambda d: {"epoch": getattr(fit(None), "epoch", None)}, warm_up=False
    )
    recorder.scenario(
        "fit_batch_stream_fails",
        lambda d: fit_record(d, train_batches=batches(fail_at=(1, 2))),
        warm_up=False,
    )
    recorder.scenario(
        "fit_early_stopping",
        lambda d: fit_record(d, lr=0.0, max_epochs=20, early_stopping_patience=1),
        warm_up=False,
    )
    recorder.scenario("fit_sigterm", lambda d: fit_record(d, train_batches=batches(signal_at=(1, 1))))
    for kind in every:
        recorder.scenario(
            f"fit_reporter_{kind}", with_reporters([kind]), warm_up=kind in ("progress_live", "prometheus")
        )
    failing = batches(fail_at=(1, 2))
    recorder.scenario(
        "fit_reporters_batch_stream_fails", with_reporters(every, train_batches=failing), warm_up=False
    )
    stopping = batches(signal_at=(1, 1))
    recorder.scenario("fit_reporters_sigterm", with_reporters(every, train_batches=stopping), warm_up=False)


# --------------------------------------------------------------------------- fit(world_size=2)

WORLD_FITS: dict[str, dict[str, Any]] = {
    "normal": {},
    "rank1_fails": {"fail_at": (1, 1), "fail_rank": 1},
    "rank0_fails": {"fail_at": (1, 1), "fail_rank": 0},
}


def world_fit(mode: str, directory: Path | None) -> lamploop.LoopState | None:
    spec = WORLD_FITS[mode]
    os.environ["LEAKS_FAIL_RANK"] = str(spec.get("fail_rank", 0))
    return fit(
        directory,
        world_size=2,
        train_batches=batches(fail_at=spec.get("fail_at")),
        heartbeat_timeout=4.0,
        reporters=[],
    )


def world_scenario(mode: str) -> Callable[[Path], dict[str, Any]]:
    def run(directory: Path) -> dict[str, Any]:
        checkpoints = directory / "checkpoints"
        os.environ["LEAKS_FIT"] = json.dumps([mode, str(checkpoints)])
        try:
            world_fit(mode, checkpoints)
        finally:
            os.environ.pop("LEAKS_FIT", None)
            NOTES["temporaries"] = temporaries(checkpoints)
        return NOTES

    return run


def group_world2(recorder: Recorder) -> None:
    recorder.scenario("world2_normal", world_scenario("normal"))
    recorder.scenario("world2_rank1_fails", world_scenario("rank1_fails"), warm_up=False)
    recorder.scenario("world2_rank0_fails", world_scenario("rank0_fails"), warm_up=False)


def follower() -> None:
    mode, directory = json.loads(os.environ["LEAKS_FIT"])
    with contextlib.suppress(Exception):
        world_fit(mode, Path(directory))


# --------------------------------------------------------------------------- the TCP control channel


def control(fail: bool) -> Callable[[Path], dict[str, Any]]:
    from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot, Train, Valid
    from lamploop.modelspec import ModelSpec, TensorSpec

    spec = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"),))
    token = "leaks-token"

    async def follow(follower: Any, failing: bool) -> None:
        async with follower:
            _, commands = await follower.join()
            async for command in commands:
                if failing and isinstance(command, Train):
                    raise RuntimeError("leaks: follower 2 failed")

    async def main() -> dict[str, Any]:
        record = NOTES
        with anyio.fail_after(20):
            try:
                async with anyio.create_task_group() as tg:
                    root = TcpControlRoot(nranks=3, token=token, model_spec=spec, heartbeat_timeout=2.0)
                    async with root:
                        host, port = root.address
                        record["port"] = port
                        for rank in (1, 2):
                            follower = TcpControlFollower(
                                host=host, port=port, rank=rank, nranks=3, token=token, model_spec=spec
                            )
                            tg.start_soon(follow, follower, fail and rank == 2)
                        await root.on_rendezvous_ready(Rendezvous(host="127.0.0.1", port=29500))
                        for epoch in range(3):
                            await root.broadcast(Train(epoch=epoch, lr_factor=1.0))
                            await anyio.sleep(0.05)
                            await root.broadcast(Valid(epoch=epoch))
                        await root.broadcast(Stop(reason="done"))
            finally:
                record["port_bindable"] = bindable(record.get("port"))
        return record

    return lambda directory: anyio.run(main)


# --------------------------------------------------------------------------- streaming


def streaming(producer_kind: str, how: str, own_thread: bool) -> Callable[[Path], dict[str, Any]]:
    from lamploop.streaming import FifoBuffer
    from lamploop.streaming.producer import AsyncProducer, BlockingProducer
    from lamploop.streaming.receiver import SampleReceiver

    token = secrets.token_hex(8)
    count = 200

    def blocking(address: tuple[str, int], receiver_gone: anyio.Event | None) -> None:
        with BlockingProducer(
            address, name="sim", token=token, reconnect_timeout=0.5, ack_timeout=1.0
        ) as producer:
            for i in range(count):
                producer.send({"x": torch.full((4,), float(i))})
                if how == "producer_gone" and i == count // 2:
                    producer.flush()
                    time.sleep(0.1)  # some samples reached the receiver
                    raise RuntimeError("leaks: the producer failed mid-stream")
            if how == "receiver_gone":
                producer.flush()
                while True:  # the receiver is going: the producer must fail within its timeouts
                    producer.send({"x": torch.zeros(4)})
                    time.sleep(0.005)

    async def asynchronous(address: tuple[str, int]) -> None:
        async with AsyncProducer(
            address, name="sim", token=token, reconnect_timeout=0.5, ack_timeout=1.0
        ) as producer:
            for i in range(count):
                await producer.send({"x": torch.full((4,), float(i))})
                if how == "producer_gone" and i == count // 2:
                    await anyio.sleep(0.1)  # some samples reached the receiver
                    raise RuntimeError("leaks: the producer failed mid-stream")
            if how == "receiver_gone":
                while True:
                    await producer.send({"x": torch.zeros(4)})
                    await anyio.sleep(0.005)

    async def produce(address: tuple[str, int], record: dict[str, Any]) -> None:
        try:
            if producer_kind == "blocking":
                await anyio.to_thread.run_sync(blocking, address, None, abandon_on_cancel=False)
            else:
                await asynchronous(address)
            record["producer"] = "returned"
        except Exception as error:
            record["producer"] = f"{type(error).__name__}: {str(error)[:200]}"

    async def main() -> dict[str, Any]:
        record = NOTES
        buffer = FifoBuffer(capacity=4096, watermark=1, seed=0)
        with anyio.fail_after(20):
            if how == "receiver_gone":
                async with (
                    anyio.create_task_group() as tg,
                    SampleReceiver(
                        buffer, token=token, expected_producers=["sim"], own_thread=own_thread
                    ) as receiver,
                ):
                    address = receiver.address
                    record["port"] = address[1]
                    tg.start_soon(produce, address, record)
                    with anyio.fail_after(10):
                        while buffer.received < count // 2:  # noqa: ASYNC110
                            await anyio.sleep(0.01)
                    # the receiver is gone; the producer keeps sending until it fails
            else:
                async with SampleReceiver(
                    buffer, token=token, expected_producers=["sim"], own_thread=own_thread
                ) as receiver:
                    address = receiver.address
                    record["port"] = address[1]
                    await produce(address, record)
                    if how == "normal":
                        await receiver.wait_all_done()
                    else:
                        await anyio.sleep(0.2)
            record["received"] = buffer.received
            buffer.close()
        record["port_bindable"] = bindable(record.get("port"))
        return record

    return lambda directory: anyio.run(main)


# --------------------------------------------------------------------------- federated


def federated(node_gone: bool) -> Callable[[Path], dict[str, Any]]:
    from lamploop.federated import (
        AggregatorSettings,
        ModelDescription,
        NodeSettings,
        OptimizerConfig,
        TrainingPlan,
        approve_plan,
        mlp,
        run_aggregator,
        run_node,
    )
    from lamploop.modelspec import model_spec

    options: dict[str, Any] = {"sizes": [4, 8, 2], "seed": 3}
    plan = TrainingPlan(
        name="leaks-plan",
        model=ModelDescription("mlp", options, model_spec(mlp(options))),
        optimizer=OptimizerConfig("sgd", learning_rate=0.1),
        local_epochs=None,
        local_steps=2,
    )
    token = "leaks-federated"

    def node_batches(gone: anyio.Event | None) -> lamploop.BatchStreamFactory:
        base = lamploop.tensor_batches(X[:64], Y[:64], batch_size=16)

        def factory(context: lamploop.BatchContext) -> Any:
            async def stream() -> Any:
                async for batch in base(context):
                    if gone is not None and context.epoch >= 1:
                        gone.set()
                        await anyio.sleep_forever()
                    yield batch

            return stream()

        return factory

    async def main(directory: Path) -> dict[str, Any]:
        record = NOTES
        record["nodes"] = {}
        allow = directory / "allow.json"
        approve_plan(plan, allow)
        listening: list[int] = []
        ready = anyio.Event()

        def on_listening(port: int) -> None:
            listening.append(port)
            ready.set()

        async def aggregator() -> None:
            try:
                result = await run_aggregator(
                    plan=plan,
                    initial_model=mlp(options),
                    token=token,
                    settings=AggregatorSettings(
                        rounds=3,
                        min_nodes=1,
                        expected_nodes=2,
                        join_timeout=10,
                        round_timeout=10,
                        checkpoint_dir=directory / "aggregator",
                    ),
                    on_listening=on_listening,
                )
                record["aggregator"] = f"returned {len(result.rounds)} rounds"
            except Exception as error:
                record["aggregator"] = f"{type(error).__name__}: {str(error)[:200]}"

        async def node(name: str, gone: anyio.Event | None) -> None:
            try:
                await run_node(
                    name=name,
                    host="127.0.0.1",
                    port=listening[0],
                    token=token,
                    allow_list=allow,
                    train_batches=node_batches(gone),
                    validation_batches=VALIDATION,
                    settings=NodeSettings(connect_timeout=10, idle_timeout=10),
                )
                record["nodes"][name] = "returned"
            except Exception as error:
                record["nodes"][name] = f"{type(error).__name__}: {str(error)[:200]}"

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(aggregator)
                await ready.wait()
                tg.start_soon(node, "node-0", None)
                if node_gone:
                    gone = anyio.Event()
                    async with anyio.create_task_group() as doomed:
                        doomed.start_soon(node, "node-1", gone)
                        await gone.wait()
                        doomed.cancel_scope.cancel()  # node-1 is gone mid-round: its task, its socket
                    record["nodes"]["node-1"] = "cancelled mid-round"
                else:
                    tg.start_soon(node, "node-1", None)
        record["port"] = listening[0] if listening else None
        record["port_bindable"] = bindable(record["port"])
        record["temporaries"] = temporaries(directory / "aggregator")
        return record

    return lambda directory: anyio.run(main, directory)


def group_net(recorder: Recorder) -> None:
    recorder.scenario("control_normal", control(fail=False))
    recorder.scenario("control_follower_fails", control(fail=True), warm_up=False)
    for own_thread in (False, True):
        suffix = "_own_thread" if own_thread else ""
        for kind in ("async", "blocking"):
            for how in ("normal", "producer_gone", "receiver_gone"):
                recorder.scenario(
                    f"stream_{kind}_{how}{suffix}", streaming(kind, how, own_thread), warm_up=how == "normal"
                )
    recorder.scenario("federated_normal", federated(node_gone=False))
    recorder.scenario("federated_node_gone", federated(node_gone=True), warm_up=False)


# --------------------------------------------------------------------------- checkpoints


class Fragile(torch.nn.Sequential):
    """A model whose ``state_dict`` raises once armed (after the first epoch)."""

    armed = False

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            raise RuntimeError("leaks: state_dict failed mid-save")
        return super().state_dict(*args, **kwargs)


def failing_save(directory: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Fragile(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def arm(state: lamploop.LoopState) -> None:
        module.armed = True

    checkpoints = directory / "checkpoints"
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=batches(),
            validation_batches=VALIDATION,
            max_epochs=4,
            device="cpu",
            checkpoint_dir=checkpoints,
            on_epoch=arm,
            reporters=[],
        )
    finally:
        module.armed = False
        NOTES["temporaries"] = temporaries(checkpoints)


def keep_last(directory: Path) -> dict[str, Any]:
    from lamploop.checkpoint import Checkpointer, save_checkpoint
    from lamploop.loop import epochs
    from lamploop.state import LoopStateWithModelAndOptimizerData

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 2), torch.randn(16, 1)

    async def train_epoch(lr_factor: float) -> float:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    async def nothing() -> None:
        pass

    async def main() -> Any:
        checkpointer = Checkpointer(directory / "checkpointer", keep_last=2)

        async def checkpoint_state(loop_state: Any, schedule_state: object) -> None:
            data = LoopStateWithModelAndOptimizerData(loop_state, model.state_dict(), optimizer.state_dict())
            await checkpointer(data, schedule_state)
            save_checkpoint(directory / "direct", data, schedule_state=schedule_state, keep_last=2)

        return await epochs(
            max_epochs=5,
            train_epoch=train_epoch,
            validation_epoch=None,
            save_min_validation_loss_model=nothing,
            checkpoint_state=checkpoint_state,
        )

    anyio.run(main)
    return {
        "temporaries": temporaries(directory),
        "kept": sorted(str(p.relative_to(directory)) for p in directory.glob("*/*") if p.is_dir()),
    }


def resume(killed: Path) -> Callable[[Path], dict[str, Any]]:
    def run(directory: Path) -> dict[str, Any]:
        checkpoints = directory / "checkpoints"
        shutil.rmtree(checkpoints, ignore_errors=True)
        shutil.copytree(killed, checkpoints, symlinks=True)
        NOTES["left_by_the_kill"] = temporaries(checkpoints)
        latest = lamploop.latest_checkpoint(checkpoints)
        reached = int(str(latest.name).split("-")[1]) if latest is not None else 0
        try:
            state = fit(checkpoints, max_epochs=reached + 2, reporters=[], checkpoint_every_n_steps=1)
        finally:
            NOTES["temporaries"] = temporaries(checkpoints)
        return {"epoch": None if state is None else state.epoch}

    return run


def victim(out: Path) -> None:
    """Trains slowly, checkpointing at every step, until the test SIGKILLs it."""
    fit(out, max_epochs=1000, reporters=[], checkpoint_every_n_steps=1, train_batches=batches(delay=0.01))


def group_checkpoints(recorder: Recorder, killed: str | None) -> None:
    recorder.scenario("checkpoint_keep_last", keep_last)
    recorder.scenario("checkpoint_state_dict_fails", failing_save)
    if killed:
        recorder.scenario("checkpoint_resume_after_sigkill", resume(Path(killed)))


# --------------------------------------------------------------------------- main


def main() -> None:
    if os.environ.get("LAMPLOOP_RANK", "0") not in ("", "0") and "LEAKS_FIT" in os.environ:
        follower()
        return
    group, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if group == "victim":
        victim(out)
        return
    recorder = Recorder(group, out)
    if group == "fit":
        group_fit(recorder)
    elif group == "world2":
        group_world2(recorder)
    elif group == "net":
        group_net(recorder)
    elif group == "checkpoints":
        group_checkpoints(recorder, sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        raise SystemExit(f"unknown group {group!r}")
    print("@@@ done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
