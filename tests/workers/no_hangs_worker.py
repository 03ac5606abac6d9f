"""A user's small training script with ONE fault injected, for tests/test_acceptance_no_hangs.py.

    python tests/workers/no_hangs_worker.py SCENARIO OUT_DIR [ARGS...]

Every scenario trains a tiny model through lamploop's public API (``fit``, ``fit_async``,
``local_data_parallel_training_loop``, ``dataloader_batches``, the streaming receiver and
producers) and injects the one fault that :data:`SCENARIOS` names.  With ``"world": 2`` the
script calls ``fit(world_size=2)``, which runs this same command line again for rank 1
(``LAMPLOOP_RANK=1``): both ranks read the same scenario and know their rank.

Each process writes, into ``OUT_DIR``:

- ``pid-rank<r>`` at start: its pid (the test checks that every rank ended, and kills what is
  left);
- ``rank<r>`` (a record, tests/workers/records.py: JSON beside a safetensors file, no pickle)
  when its run returns or raises: the error's type, its classes, message and the attributes
  lamploop's errors carry (``rank``, ``how``, ``epoch``), and when (``at``); or the result;
- ``struck-rank<r>``: when the fault struck (``time.time()``), for the tests that time a
  detection.

The exception itself is raised on, as a user's script would let it: Python prints its
traceback on stderr and the process exits with status 1 (after ``gc.freeze()``, which
docs/reliability.md suggests for a script that ends after a failed run).  Only the ``twice``
scenarios catch an error: the first run's, as a user who calls ``fit`` again would.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import torch
from torch.utils.data import DataLoader, Dataset

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: ``workers.records`` from tests/
    sys.path.insert(0, str(HERE.parent))

import lamploop  # noqa: E402
from lamploop.batches import BatchContext  # noqa: E402
from workers.records import save_record, write_whole  # noqa: E402

N_EXAMPLES = 32
FEATURES = 4
BATCH = 4
TOKEN = "no-hangs-token-0123456789abcdef"
PRODUCER = "sim-0"
HEARTBEAT_TIMEOUT_S = 1.0
"""The SIGSTOP scenario's ``heartbeat_timeout`` (a short one: the test waits for it)."""


class InjectedFault(RuntimeError):
    """The fault a scenario injects (its name and message are what the test looks for)."""


def fault_message(where: str, rank: int, epoch: int | None) -> str:
    return f"injected fault in {where} on rank {rank} in epoch {epoch}"


# A scenario: where the fault is, on which rank, in which epoch, and how it strikes.
#   world: None (one process) or 2 (fit starts rank 1 itself)
#   where: forward | loss | optimizer | extra | train_stream | valid_stream | getitem | ...
#   how:   raise | exit | os_exit | keyboard | sigkill | wrong_type | uneven | ...
SCENARIOS: dict[str, dict[str, Any]] = {
    # --- a Dataset's __getitem__ under dataloader_batches, one rank ------------------------------
    "getitem-w0-e0": {"kind": "dataloader", "workers": 0, "persistent": False, "epoch": 0},
    "getitem-w2-e1": {"kind": "dataloader", "workers": 2, "persistent": False, "epoch": 1},
    "getitem-w2p-e0": {"kind": "dataloader", "workers": 2, "persistent": True, "epoch": 0},
    "getitem-w2p-e1": {"kind": "dataloader", "workers": 2, "persistent": True, "epoch": 1},
    "getitem-w2p-rank1": {
        "kind": "dataloader",
        "workers": 2,
        "persistent": True,
        "epoch": 1,
        "world": 2,
        "rank": 1,
    },
    "worker-init-w2": {"kind": "dataloader", "workers": 2, "persistent": False, "epoch": 0, "where": "init"},
    # --- a fault in the user's code on one rank of fit(world_size=2) ------------------------------
    "forward-rank1": {"world": 2, "where": "forward", "rank": 1, "epoch": 1, "how": "raise"},
    "forward-rank0": {"world": 2, "where": "forward", "rank": 0, "epoch": 1, "how": "raise"},
    "loss-rank1": {"world": 2, "where": "loss", "rank": 1, "epoch": 0, "how": "raise"},
    "optimizer-rank1": {"world": 2, "where": "optimizer", "rank": 1, "epoch": None, "how": "raise"},
    "extra-rank1": {"world": 2, "where": "extra", "rank": 1, "epoch": 0, "how": "raise", "checkpoints": True},
    "extra-rank0": {"world": 2, "where": "extra", "rank": 0, "epoch": 0, "how": "raise", "checkpoints": True},
    "reporter-report": {"world": 2, "where": "report", "rank": 0, "epoch": 0, "how": "raise"},
    "reporter-start": {"world": 2, "where": "start", "rank": 0, "epoch": None, "how": "raise"},
    "exit-rank1": {"world": 2, "where": "forward", "rank": 1, "epoch": 1, "how": "exit"},
    "os-exit-rank1": {"world": 2, "where": "forward", "rank": 1, "epoch": 1, "how": "os_exit"},
    "keyboard-rank1": {"world": 2, "where": "forward", "rank": 1, "epoch": 1, "how": "keyboard"},
    # --- batch streams ----------------------------------------------------------------------------
    "stream-raises-rank1": {"world": 2, "where": "train_stream", "rank": 1, "epoch": 1, "how": "raise"},
    "stream-wrong-type-rank1": {
        "world": 2,
        "where": "train_stream",
        "rank": 1,
        "epoch": 1,
        "how": "wrong_type",
    },
    "stream-uneven": {"world": 2, "where": "train_stream", "rank": 1, "epoch": 0, "how": "uneven"},
    # --- a rank killed ----------------------------------------------------------------------------
    "sigkill-rank1-validation": {
        "world": 2,
        "where": "valid_stream",
        "rank": 1,
        "epoch": 0,
        "how": "sigkill",
    },
    "sigkill-rank1-checkpoint": {
        "world": 2,
        "where": "extra",
        "rank": 0,
        "epoch": 0,
        "how": "kill_rank1",
        "checkpoints": True,
    },
    "sigkill-rank1-before-join": {
        "world": 2,
        "where": "start_of_script",
        "rank": 1,
        "epoch": None,
        "how": "sigkill",
    },
    "sigkill-rank0-forward": {"world": 2, "where": "forward", "rank": 0, "epoch": 1, "how": "sigkill"},
    "sigstop-rank1": {
        "world": 2,
        "where": "forward",
        "rank": 1,
        "epoch": 1,
        "how": "sigstop",
        "heartbeat_timeout": HEARTBEAT_TIMEOUT_S,
    },
    "sigkill-rank0-rank1-in-slow-source": {
        "world": 2,
        "where": "forward",
        "rank": 0,
        "epoch": 1,
        "how": "sigkill",
        "slow_source_rank": 1,
    },
    "getitem-w2p-rank0": {
        "kind": "dataloader",
        "workers": 2,
        "persistent": True,
        "epoch": 1,
        "world": 2,
        "rank": 0,
    },
    "sigkill-rank1-w2p": {
        "kind": "dataloader",
        "workers": 2,
        "persistent": True,
        "world": 2,
        "where": "forward",
        "rank": 1,
        "epoch": 1,
        "how": "sigkill",
    },
    "sigkill-rank0-w2p": {
        "kind": "dataloader",
        "workers": 2,
        "persistent": True,
        "world": 2,
        "where": "forward",
        "rank": 0,
        "epoch": 1,
        "how": "sigkill",
    },
    # --- one rank: leaving from inside a forward --------------------------------------------------
    "exit-single": {"where": "forward", "rank": 0, "epoch": 1, "how": "exit"},
    "keyboard-single-w2p": {
        "kind": "dataloader",
        "workers": 2,
        "persistent": True,
        "where": "forward",
        "rank": 0,
        "epoch": 1,
        "how": "keyboard",
    },
    "sigkill-rank0-rank1-waits-for-samples": {"kind": "buffer-ranks", "world": 2, "how": "sigkill"},
    # --- fit twice in one process -----------------------------------------------------------------
    "twice-2ranks": {"kind": "twice", "world": 2, "where": "forward", "rank": 1, "epoch": 0, "how": "raise"},
    "twice-dataloader": {"kind": "twice-dataloader", "workers": 2, "persistent": True, "epoch": 0},
    # --- local_data_parallel_training_loop --------------------------------------------------------
    "local-forward-replica1": {"kind": "local", "where": "forward", "rank": 1, "epoch": 1, "how": "raise"},
    "local-checkpoint-state": {
        "kind": "local",
        "where": "checkpoint_state",
        "rank": 0,
        "epoch": 0,
        "how": "raise",
    },
    # --- streaming --------------------------------------------------------------------------------
    "stream-trainer": {"kind": "stream-trainer"},
    "stream-receiver": {"kind": "stream-receiver"},
    "stream-producer": {"kind": "stream-producer"},
}


class Fault:
    """The scenario's one fault: :meth:`strike` where it is due."""

    def __init__(self, spec: dict[str, Any], rank: int, out: Path) -> None:
        self.spec = spec
        self.rank = rank
        self.out = out
        self.epoch: int | None = None  # the training epoch this rank is in (set by its stream)

    def due(self, where: str, epoch: int | None = None) -> bool:
        spec = self.spec
        if spec.get("where") != where or spec.get("rank", 0) != self.rank:
            return False
        target = spec.get("epoch")
        current = self.epoch if epoch is None else epoch
        return target is None or current == target

    def strike(self, where: str) -> None:
        how = self.spec.get("how", "raise")
        message = fault_message(where, self.rank, self.spec.get("epoch"))
        at = time.time()
        write_whole((self.out / f"struck-rank{self.rank}"), repr(at))
        print(f"[rank {self.rank}] striking: {how} in {where} at {at:.3f}", file=sys.stderr, flush=True)
        if how == "raise":
            raise InjectedFault(message)
        if how == "exit":
            sys.exit(3)
        if how == "os_exit":
            os._exit(3)
        if how == "keyboard":
            raise KeyboardInterrupt(message)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if how == "kill_rank1":
            pid = int((self.out / "pid-rank1").read_text())
            os.kill(pid, signal.SIGKILL)
            time.sleep(1.5)  # a slow write: rank 1 dies while the root's checkpoint is under way
            return
        raise AssertionError(how)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N_EXAMPLES, FEATURES, generator=generator)
    return x, (x.sum(1) > 0).long()


class Net(torch.nn.Module):
    def __init__(self, fault: Fault, replica: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(FEATURES, 2)
        self.fault = fault
        self.replica = replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.replica is not None:
            spec = self.fault.spec
            mine = self.replica == spec.get("rank") and spec.get("where") == "forward"
            if mine and self.fault.epoch == spec.get("epoch"):
                self.fault.rank = self.replica  # the message names the replica
                self.fault.strike("forward")
        elif self.training and self.fault.due("forward"):
            self.fault.strike("forward")
        out: torch.Tensor = self.linear(x)
        return out


def make_loss(fault: Fault) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]:
    def loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        if torch.is_grad_enabled() and fault.due("loss"):
            fault.strike("loss")
        return lamploop.cross_entropy_loss(output, target)

    return loss


class Extra:
    """A checkpoint extra (its state_dict is where the ``extra`` faults strike)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.calls = 0

    def state_dict(self) -> tuple[dict[str, torch.Tensor], Any]:
        epoch = self.calls if self.fault.rank == 0 else self.fault.epoch
        self.calls += 1
        if self.fault.due("extra", epoch):
            self.fault.strike("extra")
        return {"x": torch.zeros(2)}, {"calls": self.calls}

    def load_state_dict(self, tensors: Any, meta: Any) -> None:
        del tensors, meta


class Reporter:
    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def start(self) -> None:
        if self.fault.due("start"):
            self.fault.strike("start")

    def report(self, event: Any) -> None:
        if type(event).__name__ == "EpochFinished" and self.fault.due("report", event.state.epoch - 1):
            self.fault.strike("report")


SLOW_SOURCE_S = 300.0
"""How long the slow data source of rank ``slow_source_rank`` takes for a batch of epoch 1."""


def slow_source_factory(fault: Fault) -> lamploop.BatchStreamFactory:
    """``iterable_batches`` over a plain generator; on the slow rank, in epoch 1, the source
    takes :data:`SLOW_SOURCE_S` for its first batch (a network read that stalls)."""
    x, y = data()

    def make(context: BatchContext) -> Any:
        fault.epoch = context.epoch
        for i in range(context.rank, N_EXAMPLES // BATCH, context.nranks):
            if context.epoch == 1 and context.rank == fault.spec["slow_source_rank"]:
                write_whole((fault.out / f"slow-source-rank{context.rank}"), str(time.time()))
                time.sleep(SLOW_SOURCE_S)
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    return lamploop.iterable_batches(make)


def train_factory(fault: Fault) -> lamploop.BatchStreamFactory:
    if "slow_source_rank" in fault.spec:
        return slow_source_factory(fault)
    x, y = data()
    inner = lamploop.tensor_batches(x, y, batch_size=BATCH, seed=1)

    def factory(context: BatchContext) -> Any:
        fault.epoch = context.epoch

        async def stream() -> AsyncIterator[Any]:
            made = 0
            async for batch in inner(context):
                if made == 1 and fault.due("train_stream", context.epoch):
                    how = fault.spec["how"]
                    if how == "wrong_type":
                        yield "not a batch"
                    elif how == "uneven":
                        return  # rank 1 has 1 batch, rank 0 has 4
                    else:
                        fault.strike("train_stream")
                made += 1
                yield batch

        return stream()

    return factory


def valid_factory(fault: Fault) -> lamploop.BatchStreamFactory:
    x, y = data()
    inner = lamploop.tensor_batches(x[:16], y[:16], batch_size=8, shuffle=False)

    def factory(context: BatchContext) -> Any:
        async def stream() -> AsyncIterator[Any]:
            async for batch in inner(context):
                if fault.due("valid_stream", context.epoch):
                    fault.strike("valid_stream")
                yield batch

        return stream()

    return factory


def error_record(exc: BaseException) -> dict[str, Any]:
    """What the test reads of an error; an exception group of one (anyio's task groups) is
    described by that one (its ``group`` says so)."""
    group = None
    inner = getattr(exc, "exceptions", None)  # a BaseExceptionGroup
    while isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException):
        group = group or type(exc).__name__
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)

    def plain(value: Any) -> Any:
        return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)

    return {
        "error": type(exc).__name__,
        "classes": [cls.__name__ for cls in type(exc).__mro__],
        "message": str(exc),
        "rank_attr": plain(getattr(exc, "rank", None)),
        "how": plain(getattr(exc, "how", None)),
        "epoch": plain(getattr(exc, "epoch", None)),
        "cause": None if exc.__cause__ is None else f"{type(exc.__cause__).__name__}: {exc.__cause__}",
        "group": group,
    }


# --- fit over a model / streams with a fault ------------------------------------------------------


def fit_with_fault(spec: dict[str, Any], rank: int, out: Path, *, suffix: str = "") -> Any:
    fault = Fault(spec, rank, out)
    if fault.due("start_of_script"):
        fault.strike("start_of_script")

    def optimizer_factory(params: Any) -> torch.optim.Optimizer:
        if fault.due("optimizer"):
            fault.strike("optimizer")
        return torch.optim.SGD(params, lr=0.1)

    def on_epoch(state: lamploop.LoopState) -> None:
        if fault.due("on_epoch", state.epoch - 1):
            fault.strike("on_epoch")

    keywords: dict[str, Any] = {}
    if spec.get("checkpoints"):
        keywords["checkpoint_dir"] = out / f"checkpoints{suffix}"
        keywords["checkpoint_extras"] = {"extra": Extra(fault)}
    return lamploop.fit(
        model=lamploop.SupervisedModel(Net(fault), make_loss(fault)),
        optimizer_factory=optimizer_factory,
        train_batches=train_factory(fault),
        validation_batches=valid_factory(fault),
        max_epochs=2,
        world_size=spec.get("world"),
        heartbeat_timeout=spec.get("heartbeat_timeout", 4.0),
        on_epoch=on_epoch,
        reporters=[Reporter(fault), lamploop.LoggingReporter()],
        **keywords,
    )


# --- a Dataset whose __getitem__ fails ------------------------------------------------------------


class Items(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Example ``i``; items ``i % 5 == 3`` raise in ``fail_epoch``, which the process learns
    from ``OUT/epoch-rank<r>`` (written by the training stream's factory as each epoch starts:
    the loader's worker processes read it, persistent ones too)."""

    def __init__(self, out: Path, fail_epoch: int | None, rank: int) -> None:
        self.out = out
        self.fail_epoch = fail_epoch
        self.rank = rank

    def __len__(self) -> int:
        return N_EXAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail_epoch is not None and i % 5 == 3:
            marker = self.out / f"epoch-rank{self.rank}"
            if marker.exists() and int(marker.read_text()) == self.fail_epoch:
                raise InjectedFault(fault_message("__getitem__", self.rank, self.fail_epoch) + f" (item {i})")
        x, y = data()
        return x[i], y[i]


def failing_init(worker_id: int) -> None:
    raise InjectedFault(fault_message("worker_init_fn", 0, 0) + f" (worker {worker_id})")


def dataloader_fit(spec: dict[str, Any], rank: int, out: Path, *, fail: bool = True) -> Any:
    fail_rank = spec.get("rank", 0)
    in_getitem = spec.get("where", "getitem") == "getitem"
    fail_epoch = spec["epoch"] if fail and rank == fail_rank and in_getitem else None
    fault = Fault(spec if fail and not in_getitem else {}, rank, out)
    loader = DataLoader(
        Items(out, fail_epoch, rank),
        batch_size=BATCH,
        shuffle=True,
        num_workers=spec["workers"],
        persistent_workers=spec["persistent"],
        worker_init_fn=failing_init if fail and spec.get("where") == "init" else None,
    )
    inner = lamploop.dataloader_batches(loader, seed=3)
    marker = out / f"epoch-rank{rank}"

    def factory(context: BatchContext) -> Any:
        write_whole(marker, str(context.epoch))
        fault.epoch = context.epoch
        return inner(context)

    return lamploop.fit(
        model=lamploop.SupervisedModel(Net(fault), lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=factory,
        max_epochs=2,
        world_size=spec.get("world"),
        reporters=[lamploop.LoggingReporter()],
    )


# --- local_data_parallel_training_loop ------------------------------------------------------------


def local_fit(spec: dict[str, Any], out: Path) -> Any:
    from lamploop.distributed import local_data_parallel_training_loop

    fault = Fault(spec, 0, out)
    x, y = data()
    batches = lamploop.tensor_batches(x, y, batch_size=BATCH)

    def train(context: BatchContext) -> Any:
        fault.epoch = context.epoch
        return batches(context)

    replicas = [
        (lamploop.SupervisedModel(Net(fault, replica=r), lamploop.cross_entropy_loss), train, batches)
        for r in range(2)
    ]

    async def checkpoint_state(state: Any, schedule_state: Any) -> None:
        del schedule_state
        if fault.due("checkpoint_state", state.loop_state.epoch - 1):
            fault.strike("checkpoint_state")

    return anyio.run(
        lambda: local_data_parallel_training_loop(
            replicas, lambda params: torch.optim.SGD(params, lr=0.1), 2, checkpoint_state=checkpoint_state
        )
    )


# --- streaming ------------------------------------------------------------------------------------


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


async def until_exists(path: Path) -> None:
    """Return once ``path`` exists (polled: another process makes it)."""
    for _ in range(100_000):
        if await anyio.Path(path).exists():
            return
        await anyio.sleep(0.02)


async def stream_trainer(out: Path, argv: list[str]) -> Any:
    """fit_async over buffer_batches; the buffer is closed once ``OUT/close-buffer`` exists.

    ``argv``: ``own-thread`` (the receiver serves on a thread of its own) and ``fail`` (the
    model's forward raises in epoch 3, while the producer still sends)."""
    from lamploop.streaming import FifoBuffer, buffer_batches
    from lamploop.streaming.receiver import SampleReceiver

    fault = Fault({"where": "forward", "rank": 0, "epoch": 3} if "fail" in argv else {}, 0, out)
    buffer = FifoBuffer(capacity=256, watermark=1, seed=0)
    batches = buffer_batches(buffer, batch_size=BATCH, batches_per_epoch=2)

    def train(context: BatchContext) -> Any:
        fault.epoch = context.epoch
        return batches(context)

    receiving = SampleReceiver(
        buffer, token=TOKEN, expected_producers=[PRODUCER], own_thread="own-thread" in argv
    )
    async with receiving as receiver:
        _write_json(out / "address.json", list(receiver.address))

        async def close_when_told() -> None:
            await until_exists(out / "close-buffer")
            buffer.close()

        async with anyio.create_task_group() as group:
            group.start_soon(close_when_told)
            state = await lamploop.fit_async(
                model=lamploop.SupervisedModel(Net(fault), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=train,
                max_epochs=1000,
                reporters=[lamploop.LoggingReporter()],
            )
            group.cancel_scope.cancel()
        return {"epoch": None if state is None else state.epoch, "received": receiver.stats.samples}


async def buffer_ranks(spec: dict[str, Any], rank: int, out: Path) -> Any:
    """fit_async(world_size=2) over each rank's FifoBuffer (buffer_batches, as
    docs/streaming.md's several ranks): rank 0's holds 2 batches, rank 1's none (its producers
    have not come).  Once rank 1 waits for its first batch, rank 0 strikes before its second
    batch (``how``: SIGKILL)."""
    from lamploop.streaming import FifoBuffer, Sample, buffer_batches

    buffer = FifoBuffer(capacity=64, watermark=1, seed=rank)
    x, y = data()
    if rank == 0:
        for seq in range(2 * BATCH):
            await buffer.put(Sample(PRODUCER, seq, {"x": x[seq], "y": y[seq]}))
    inner = buffer_batches(buffer, batch_size=BATCH, batches_per_epoch=10)
    fault = Fault({**spec, "where": "buffer", "rank": 0, "epoch": 0}, rank, out)
    waiting = out / "rank1-waits-for-samples"

    class Marked:
        """The buffer's stream; rank 1 says when it waits, rank 0 strikes at its second batch."""

        def __init__(self, stream: Any) -> None:
            self.stream = stream

        @property
        def source_ended(self) -> bool:
            return bool(self.stream.source_ended)

        def __aiter__(self) -> AsyncIterator[Any]:
            return self.batches()

        async def batches(self) -> AsyncIterator[Any]:
            iterator = aiter(self.stream)
            made = 0
            while True:
                if rank == 1:
                    write_whole(waiting, str(time.time()))
                if rank == 0 and made == 1:
                    await until_exists(waiting)
                    await anyio.sleep(0.3)
                    fault.strike("buffer")
                batch = await anext(iterator, None)
                if batch is None:
                    return
                made += 1
                yield batch

    state = await lamploop.fit_async(
        model=lamploop.SupervisedModel(torch.nn.Linear(FEATURES, 2), lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lambda context: Marked(inner(context)),
        max_epochs=2,
        world_size=2,
        reporters=[lamploop.LoggingReporter()],
    )
    return None if state is None else state.epoch


async def stream_receiver(out: Path) -> Any:
    """A receiver into a buffer nobody reads: the 'trainer' the producer test kills."""
    from lamploop.streaming import FifoBuffer
    from lamploop.streaming.receiver import SampleReceiver

    buffer = FifoBuffer(capacity=1024, watermark=1, seed=0)
    async with SampleReceiver(buffer, token=TOKEN, expected_producers=[PRODUCER]) as receiver:
        _write_json(out / "address.json", list(receiver.address))
        await anyio.sleep(600)
    return None


def stream_producer(out: Path, argv: list[str]) -> Any:
    """A BlockingProducer: ``kill-self N`` (SIGKILL itself once N samples were acknowledged) or
    ``keep-sending RECONNECT_TIMEOUT`` (send until the process ends; the trainer will be gone)."""
    from lamploop.streaming.producer import BlockingProducer

    mode = argv[0]
    host, port = json.loads((out / "address.json").read_text())
    reconnect = float(argv[1]) if mode == "keep-sending" else 300.0
    sent = 0
    with BlockingProducer((host, port), name=PRODUCER, token=TOKEN, reconnect_timeout=reconnect) as producer:
        while True:
            x = torch.randn(FEATURES)
            producer.send({"x": x, "y": (x.sum() > 0).long()})
            sent += 1
            if mode == "kill-self" and sent == int(argv[1]):
                producer.flush()
                while producer.acknowledged_seq < sent - 1:
                    time.sleep(0.01)
                _write_json(out / "producer-acknowledged.json", {"sent": sent})
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "keep-sending":
                if sent == 16:
                    producer.flush()
                    _write_json(out / "producer-sending.json", {"sent": sent})
                time.sleep(0.002)


# --- main -----------------------------------------------------------------------------------------


def run(name: str, rank: int, out: Path, argv: list[str]) -> Any:
    spec = SCENARIOS[name]
    kind = spec.get("kind", "fit")
    if kind == "fit":
        state = fit_with_fault(spec, rank, out)
        return None if state is None else state.epoch
    if kind == "dataloader":
        state = dataloader_fit(spec, rank, out)
        return None if state is None else state.epoch
    if kind == "local":
        return local_fit(spec, out).epoch
    if kind == "twice":
        second = (out / "second-run").exists()
        if rank == 0 and not second:
            try:
                fit_with_fault(spec, rank, out)
            except Exception as exc:  # the first run's failure, as a user would catch it
                print(f"[rank 0] first fit failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                save_record(error_record(exc), out / "first-run")
            else:
                raise AssertionError("the first fit did not fail")
            write_whole((out / "second-run"), "1")
            second = True
        clean = {**spec, "where": None}
        state = fit_with_fault(clean if second else spec, rank, out, suffix="-second" if second else "")
        return None if state is None else state.epoch
    if kind == "twice-dataloader":
        try:
            dataloader_fit(spec, rank, out)
        except Exception as exc:
            print(f"[rank 0] first fit failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            save_record(error_record(exc), out / "first-run")
        else:
            raise AssertionError("the first fit did not fail")
        state = dataloader_fit(spec, rank, out, fail=False)
        return state.epoch
    if kind == "buffer-ranks":
        return anyio.run(buffer_ranks, spec, rank, out)
    if kind == "stream-trainer":
        return anyio.run(stream_trainer, out, argv)
    if kind == "stream-receiver":
        return anyio.run(stream_receiver, out)
    if kind == "stream-producer":
        return stream_producer(out, argv)
    raise AssertionError(kind)


def main() -> int:
    name, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("LAMPLOOP_RANK", "0"))
    role = "producer" if SCENARIOS[name].get("kind") == "stream-producer" else f"rank{rank}"
    write_whole((out / f"pid-{role}"), str(os.getpid()))
    torch.set_num_threads(1)
    try:
        result = run(name, rank, out, sys.argv[3:])
    except BaseException as exc:
        save_record({**error_record(exc), "traceback": traceback.format_exc(), "at": time.time()}, out / role)
        print(f"[{role}] ended by {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        gc.freeze()  # docs/reliability.md: a short shutdown for a script that ends after a failed run
        raise
    save_record({"error": None, "result": result}, out / role)
    gc.freeze()
    print(f"[{role}] finished: {result}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
