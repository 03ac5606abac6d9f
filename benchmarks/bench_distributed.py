"""lamploop's data-parallel training on 2 processes (Gloo) against DistributedDataParallel.

Usage::

    python benchmarks/bench_distributed.py --json bench-results/distributed.json [--quick]
    python benchmarks/bench_distributed.py --breakdown [--json PATH]   # diagnosis, not run by nox

Set-up.  The script starts two worker processes (itself again, with ``--worker
RANK``; nothing is pickled), each with ``torch.set_num_threads(1)``.  Rank 0
opens one ``TCPStore`` on a free port and every process group of the run is
built over it, under a prefix of its own:

* ``ddp``: the default group, ``init_process_group("gloo", store=PrefixStore("ddp", store))``,
  used by ``torch.nn.parallel.DistributedDataParallel`` (defaults: ``bucket_cap_mb=25``);
  each tuned DDP contender has a Gloo group of its own (``dist.new_group``);
* one ``ProcessGroupGloo`` per lamploop contender, wrapped in
  ``lamploop.process_group.ProcessGroupChannel(strategy=...)`` (default ``bucket_cap_mb=25``);
* ``bench``: the harness's barriers and exchanges only.

Contenders (same seeded ~8.4M-parameter MLP, same seeded data cut in disjoint
per-rank shards of 64 examples per batch, ``SGD(lr=0.01, momentum=0.9)``, the
same number of steps):

* ``ddp``: the idiomatic loop of PyTorch's DDP tutorial, ``opt.zero_grad(set_to_none=True);
  loss = F.cross_entropy(ddp(x), y); loss.backward(); opt.step()``, losses read once at
  the end (DDP averages the per-rank mean losses: with equal batch sizes, the
  same gradient as lamploop's mean over all examples), DDP's defaults;
* the same loop on DDP tuned as a user would tune it: ``ddp bucket_view``
  (``gradient_as_bucket_view=True``), ``ddp bucket_view+static`` (and
  ``static_graph=True``: valid here, every parameter is used at every step) and ``ddp
  bucket_view+static, grads kept`` (the same with ``opt.zero_grad(set_to_none=False)``, so
  the gradients stay views into DDP's buckets from step to step; with ``set_to_none=True``
  autograd allocates fresh gradients that DDP copies into its buckets).  The report
  compares lamploop with DDP's defaults and with the fastest DDP variant of the run
  (lowest median wall time), named in the output;
* ``lamploop all_reduce``: ``await lamploop.one_epoch(model=SupervisedModel(module),
  batches=<async stream over the same list>, channel=channel, step_optimizer=...)``
  where ``step_optimizer`` calls ``opt.step()`` and notes the time;
* ``lamploop reduce_to_root``: the same with lamp's strategy (rank 0 steps; on
  rank 1 ``step_optimizer`` only notes the time and the parameters arrive from rank 0);
* floors without any communication: ``local 1 process`` (rank 0 runs the plain
  loop while rank 1 waits) and ``local 2 processes`` (both ranks run the plain
  loop on their shard at once: the compute-only best the machine can do).

Every contender keeps its model, optimizer and wrapper for the whole run and
gets one short warm-up epoch (DDP rebuilds its buckets after its first
iteration).  Then come the rounds: each round runs the three distributed
contenders back to back, in an order rotated from round to round, then the two
floors.  One measurement is ``barrier; t0; epoch; barrier; t1`` on rank 0
(``time.perf_counter``; every side runs inside the same event loop).  Ratios
are taken per round (contenders seconds apart) and summarised by their
median, min and max.  Also recorded: the median step-to-step interval inside
each epoch ("steady", robust to a burst of other work on a shared machine) and
each rank's CPU time.  Every contender trains on the same batches from the
same weights, so the final parameters are compared against DDP's.

Once per strategy the full launch path runs too: ``drive_distributed_training``
on rank 0 and ``follow_distributed_training`` on rank 1 over the TCP control
channel (``TcpControlRoot`` / ``TcpControlFollower``, its address passed through
the shared store); the library opens its own store and process group and
broadcasts the initial state (reported as set-up, paid once).  At the start of
every epoch of that run, before its first batch, both ranks run one direct
``one_epoch`` of the same strategy, so the two are compared epoch by epoch.
"Between epochs" is the time on rank 0 from an epoch's last optimizer step to
the next epoch's request for batches: the epoch's final all-reduce, the loop's
bookkeeping and the ``Train`` command over TCP.

``--breakdown`` (diagnosis) alternates instrumented copies of the loops
(timers per phase, bucket launch times relative to the end of backward),
lamploop with DDP's bucket layout and copies with a non-blocking example count
or a pre-scaled loss, then times single collectives and memory passes.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import lamploop
import lamploop.sync.buckets
from lamploop import BatchContext, SupervisedModel, iterable_batches, model_spec, one_epoch
from lamploop.control.tcp import TcpControlFollower, TcpControlRoot
from lamploop.distributed import drive_distributed_training, follow_distributed_training
from lamploop.settings import DEFAULT_BUCKET_CAP_MB
from lamploop.sync.group_channel import ProcessGroupChannel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_seconds, make_parser, print_table, summarize, write_json

TARGET_RATIO = 1.00
"""The acceptance target: lamploop all_reduce / DDP <= this (median of the per-round ratios)."""

WORLD_SIZE = 2
BATCH_SIZE = 64  # per rank
LAYERS = (1024, 2048, 2048, 1024, 10)
LEARNING_RATE = 0.01
MOMENTUM = 0.9
SEED = 0
HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=300)

# (full, quick)
STEPS = (10, 5)  # optimizer steps per timed epoch
ROUNDS = (6, 3)  # rounds of every contender
WARMUP_STEPS = (3, 2)  # steps of the one warm-up epoch per contender
DRIVE_EPOCHS = (3, 2)  # epochs of the drive/follow run, per strategy
DRIVE_STRATEGIES = (("all_reduce", "reduce_to_root"), ("all_reduce",))
WORKER_DEADLINE_S = (480, 240)  # generous: the machine may be shared
BREAKDOWN_ROUNDS = 5
BREAKDOWN_FIRST_CAP_MB = 8.1
"""``--breakdown`` lays lamploop's buckets out with this first-bucket cap too (the module
constant, patched in the worker only), which gives DDP's layout for this MLP."""

DDP = "ddp"
DDP_VIEW = "ddp bucket_view"
DDP_STATIC = "ddp bucket_view+static"
DDP_KEPT = "ddp bucket_view+static, grads kept"
ALL_REDUCE = "lamploop all_reduce"
REDUCE_TO_ROOT = "lamploop reduce_to_root"
LOCAL_1 = "local 1 process"
LOCAL_2 = "local 2 processes"
CONTENDERS = (DDP, DDP_VIEW, DDP_STATIC, DDP_KEPT, ALL_REDUCE, REDUCE_TO_ROOT, LOCAL_1, LOCAL_2)
GROUPS = ((DDP, DDP_VIEW, DDP_STATIC, DDP_KEPT, ALL_REDUCE, REDUCE_TO_ROOT), (LOCAL_1, LOCAL_2))
"""A round runs the groups in turn, each in an order rotated by the round number, so the
contenders compared with DDP always run right next to it."""
DDP_VARIANTS = (DDP, DDP_VIEW, DDP_STATIC, DDP_KEPT)
"""Every DDP contender: the defaults, then the tuned ones (the best of all is found per run)."""
DIRECT_OF = {"all_reduce": ALL_REDUCE, "reduce_to_root": REDUCE_TO_ROOT}

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Runner = Callable[[Batches, list[float]], Awaitable[float | None]]
"""Runs one epoch over the batches, appending the time at the end of every step; returns the loss."""


# =========================================================================== worker side


def make_module() -> nn.Module:
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(LAYERS)):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


def make_shard(rank: int, steps: int) -> Batches:
    """This rank's batches: global batch ``i`` goes to rank ``i % WORLD_SIZE`` (seeded, same everywhere)."""
    generator = torch.Generator().manual_seed(SEED + 1)
    n = steps * WORLD_SIZE * BATCH_SIZE
    features = torch.randn(n, LAYERS[0], generator=generator)
    target = torch.randint(0, LAYERS[-1], (n,), generator=generator)
    starts = range(rank * BATCH_SIZE, n, WORLD_SIZE * BATCH_SIZE)
    return [(features[s : s + BATCH_SIZE].clone(), target[s : s + BATCH_SIZE].clone()) for s in starts]


def make_optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=LEARNING_RATE, momentum=MOMENTUM)


def hand_epoch(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    marks: list[float],
    *,
    set_to_none: bool = True,
) -> float:
    """The idiomatic PyTorch epoch (``module`` may be a DDP wrapper); the local mean loss, read once.

    ``marks`` gets the time at the end of every step (a list append: well under a microsecond).
    """
    module.train()
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        marks.append(time.perf_counter())
    return float(torch.stack(losses).mean())


def steady_step(start: float, marks: Sequence[float]) -> float:
    """The median step-to-step interval (the first step counts from ``start``)."""
    return statistics.median(b - a for a, b in itertools.pairwise([start, *marks]))


def nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


class RecordingGroup:
    """A process group that notes when (and how many bytes) each all-reduce is launched."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.launches: list[tuple[float, int]] = []

    def allreduce(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        self.launches.append((time.perf_counter(), nbytes(tensors[0])))
        return self.group.allreduce(tensors, *args)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.group, attribute)


class Worker:
    """One rank: the store, the groups, every contender, and the measurements."""

    def __init__(self, rank: int, store: dist.Store, quick: bool) -> None:
        q = 1 if quick else 0
        self.quick = quick
        self.rank = rank
        self.store = store
        self.steps = STEPS[q]
        self.rounds = ROUNDS[q]
        self.warmup_steps = WARMUP_STEPS[q]
        self.drive_epochs = DRIVE_EPOCHS[q]
        self.bench = self.new_group("bench")
        self.batches = make_shard(rank, self.steps)
        self.base = make_module()
        self.runners: dict[str, Runner] = {}
        self.modules: dict[str, nn.Module] = {}
        self.channels: dict[str, ProcessGroupChannel] = {}
        self.ddp: DistributedDataParallel | None = None
        # --breakdown only: per-step phase times and bucket launch times, by contender.
        self.phases: dict[str, list[dict[str, float]]] = {}
        self.launches: dict[str, list[list[tuple[float, int]]]] = {}

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def new_group(self, prefix: str) -> Any:  # a ProcessGroupGloo (its stubs lack the collectives)
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), self.rank, WORLD_SIZE, TIMEOUT)

    def barrier(self) -> None:
        self.bench.allreduce([torch.zeros(1)]).wait()

    def gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length on every rank), indexed by rank."""
        buffer = torch.zeros(WORLD_SIZE, len(values), dtype=torch.float64)
        buffer[self.rank] = torch.tensor(list(values), dtype=torch.float64)
        self.bench.allreduce([buffer]).wait()
        return [list(map(float, row)) for row in buffer.tolist()]

    # ---------------------------------------------------------------- contenders

    def setup(self) -> None:
        # DDP over the default group (the usual way), on the shared store.
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("ddp", self.store),
            rank=self.rank,
            world_size=WORLD_SIZE,
            timeout=TIMEOUT,
        )
        self.ddp = self.add_ddp(DDP)
        # The baselines a user would tune: gradients as views into DDP's buckets (no copy back),
        # a static graph, and gradients that stay those views from step to step.
        self.add_ddp(DDP_VIEW, gradient_as_bucket_view=True)
        self.add_ddp(DDP_STATIC, gradient_as_bucket_view=True, static_graph=True)
        self.add_ddp(DDP_KEPT, set_to_none=False, gradient_as_bucket_view=True, static_graph=True)
        self.add_lamploop(ALL_REDUCE, "all_reduce")
        self.add_lamploop(REDUCE_TO_ROOT, "reduce_to_root")
        self.add_local(LOCAL_1, alone=True)
        self.add_local(LOCAL_2, alone=False)

    def add_ddp(self, name: str, *, set_to_none: bool = True, **options: Any) -> DistributedDataParallel:
        """A DDP contender: DDP's defaults on the default group, else ``options`` on a group of its own."""
        module = copy.deepcopy(self.base)
        group = dist.new_group(backend="gloo") if options else None
        ddp = DistributedDataParallel(module, process_group=group, **options)
        optimizer = make_optimizer(ddp.parameters())

        async def run(batches: Batches, marks: list[float]) -> float:
            return hand_epoch(ddp, optimizer, batches, marks, set_to_none=set_to_none)

        self.modules[name] = module
        self.runners[name] = run
        return ddp

    def add_lamploop(
        self,
        name: str,
        strategy: str,
        *,
        first_cap_mb: float | None = None,
        group: Any = None,
        register: bool = True,
    ) -> tuple[ProcessGroupChannel, nn.Module, torch.optim.Optimizer]:
        """A lamploop contender on a process group of its own; returns its channel, module and optimizer.

        ``first_cap_mb`` replaces lamploop's first-bucket cap (a module constant) while this
        contender's buckets are laid out, in this worker process only.
        """
        channel = ProcessGroupChannel.of_group(
            group if group is not None else self.new_group(f"lamploop-{name}"),
            rank=self.rank,
            nranks=WORLD_SIZE,
            device=torch.device("cpu"),
            strategy=strategy,
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB,
        )
        module = copy.deepcopy(self.base)
        optimizer = make_optimizer(module.parameters())
        if first_cap_mb is not None:
            saved = lamploop.sync.buckets.FIRST_BUCKET_CAP_MB
            lamploop.sync.buckets.FIRST_BUCKET_CAP_MB = first_cap_mb  # type: ignore[misc]
            try:  # one_epoch asks for the same module, so it gets these buckets
                channel.gradient_sync(module)
            finally:
                lamploop.sync.buckets.FIRST_BUCKET_CAP_MB = saved  # type: ignore[misc]
        if not register:
            return channel, module, optimizer
        steps_here = strategy == "all_reduce" or self.rank == 0
        model = SupervisedModel(module)
        context = BatchContext(epoch=0, rank=self.rank, nranks=WORLD_SIZE)

        async def run(batches: Batches, marks: list[float]) -> float:
            def step() -> None:  # opt.step() where this rank steps, nothing elsewhere; then the mark
                if steps_here:
                    optimizer.step()
                marks.append(time.perf_counter())

            stream = iterable_batches(lambda _context: batches)(context)
            return await one_epoch(model=model, batches=stream, channel=channel, step_optimizer=step)

        self.channels[name] = channel
        self.modules[name] = module
        self.runners[name] = run
        return channel, module, optimizer

    def add_local(self, name: str, *, alone: bool) -> None:
        module = copy.deepcopy(self.base)
        optimizer = make_optimizer(module.parameters())
        rank = self.rank

        async def run(batches: Batches, marks: list[float]) -> float | None:
            if alone and rank != 0:
                return None
            return hand_epoch(module, optimizer, batches, marks)

        self.modules[name] = module
        self.runners[name] = run

    # ---------------------------------------------------------------- measurement

    async def measure(self, name: str, batches: Batches) -> dict[str, Any]:
        marks: list[float] = []
        gc.collect()
        self.barrier()
        cpu0 = time.process_time()
        start = time.perf_counter()
        loss = await self.runners[name](batches, marks)
        self.barrier()
        wall = time.perf_counter() - start
        return {
            "contender": name,
            "wall_s": wall,
            "steady_step_s": steady_step(start, marks) if marks else float("nan"),
            "cpu_s": time.process_time() - cpu0,
            "loss": loss,
        }

    async def run_rounds(self, groups: Sequence[Sequence[str]], rounds: int) -> list[dict[str, Any]]:
        contenders = [name for group in groups for name in group]
        self.log(f"warm-up: {self.warmup_steps} steps per contender")
        for name in contenders:
            await self.measure(name, self.batches[: self.warmup_steps])
        for steps in self.phases.values():  # the timed copies keep no warm-up step
            steps.clear()
        for launches in self.launches.values():
            launches.clear()
        records = []
        for r in range(rounds):
            order = [name for g in groups for name in [*g[r % len(g) :], *g[: r % len(g)]]]
            started = time.perf_counter()
            for position, name in enumerate(order):
                record = await self.measure(name, self.batches)
                record.update(round=r, position=position)
                records.append(record)
            walls = {rec["contender"]: rec["wall_s"] for rec in records if rec["round"] == r}
            text = ", ".join(f"{n} {walls[n] / self.steps * 1e3:.1f}" for n in contenders)
            self.log(f"round {r + 1}/{rounds} ({time.perf_counter() - started:.1f} s), ms/step: {text}")
        cpus = self.gather_floats([rec["cpu_s"] for rec in records])  # each rank's, side by side
        for i, rec in enumerate(records):
            rec["cpu_s"] = [cpus[k][i] for k in range(WORLD_SIZE)]
        return records

    def parameter_check(self, names: Sequence[str]) -> dict[str, float]:
        """Max |parameter difference| of each contender against DDP (same data, same init, same steps)."""
        reference = list(self.modules[DDP].parameters())
        result = {}
        with torch.no_grad():
            for name in names:
                params = list(self.modules[name].parameters())
                result[name] = max(float((p - q).abs().max()) for p, q in zip(reference, params, strict=True))
        return result

    def layout(self) -> dict[str, Any]:
        """Gradient bucket sizes (bytes, in launch order) and collectives per step."""
        assert self.ddp is not None
        data = self.ddp._get_ddp_logging_data()
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
        buckets = [int(s) for s in sizes.split(",") if s.strip()]
        out: dict[str, Any] = {DDP: {"gradient_buckets_bytes": buckets, "collectives_per_step": len(buckets)}}
        for name, channel in self.channels.items():
            for sync in channel.syncs():
                grads = sync.bucket_bytes()  # type: ignore[attr-defined]
                entry: dict[str, Any] = {
                    "gradient_buckets_bytes": grads,
                    "collectives_per_step": 1 + len(grads),  # the example count, then the buckets
                    "collectives_per_epoch_extra": 1,  # the final all-reduce of the loss sum and count
                }
                if channel.strategy.name == "reduce_to_root":
                    broadcasts = sync.parameter_bucket_bytes()  # type: ignore[attr-defined]
                    entry["parameter_broadcast_buckets_bytes"] = broadcasts
                    entry["collectives_per_step"] += len(broadcasts)
                out[name] = entry
        return out

    # ---------------------------------------------------------------- the full drive/follow path

    async def drive_path(self, strategy: str) -> dict[str, Any]:
        """drive/follow over TCP control, each epoch preceded by a direct epoch of the same strategy."""
        module = copy.deepcopy(self.base)
        spec = model_spec(module)
        key = f"control-{strategy}"
        batches = self.batches
        direct = self.runners[DIRECT_OF[strategy]]
        requests: list[float] = []  # when each drive epoch asks for its batches
        starts: list[float] = []  # when its first batch is handed over (after the direct epoch)
        marks: list[float] = []  # the end of every optimizer step of the drive run
        directs: list[dict[str, float]] = []

        def train_batches(context: BatchContext) -> Any:
            requests.append(time.perf_counter())

            async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
                direct_marks: list[float] = []
                self.barrier()
                start = time.perf_counter()
                await direct(batches, direct_marks)
                self.barrier()
                end = time.perf_counter()
                directs.append({"wall_s": end - start, "steady_step_s": steady_step(start, direct_marks)})
                starts.append(time.perf_counter())
                for batch in batches:
                    yield batch

            return stream()

        class MarkedSGD(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:
                result = super().step(closure)
                marks.append(time.perf_counter())
                return result

        def optimizer_factory(parameters: Any) -> torch.optim.Optimizer:
            return MarkedSGD(parameters, lr=LEARNING_RATE, momentum=MOMENTUM)

        gc.collect()
        self.barrier()
        start = time.perf_counter()
        if self.rank == 0:
            token = secrets.token_hex(16)
            async with TcpControlRoot(host=HOST, nranks=WORLD_SIZE, token=token, model_spec=spec) as root:
                self.store.set(key, f"{root.address[1]}:{token}")
                await drive_distributed_training(
                    nranks=WORLD_SIZE,
                    device=torch.device("cpu"),
                    control=root,
                    model=SupervisedModel(module),
                    optimizer_factory=optimizer_factory,
                    train_batches=train_batches,
                    validation_batches=None,
                    max_epochs=self.drive_epochs,
                    strategy=strategy,  # type: ignore[arg-type]
                    host=HOST,
                )
        else:
            port, _, token = self.store.get(key).decode().partition(":")
            async with TcpControlFollower(
                host=HOST, port=int(port), rank=self.rank, nranks=WORLD_SIZE, token=token, model_spec=spec
            ) as follower:
                await follow_distributed_training(
                    rank=self.rank,
                    nranks=WORLD_SIZE,
                    device=torch.device("cpu"),
                    control=follower,
                    model=SupervisedModel(module),
                    train_batches=train_batches,
                    validation_batches=None,
                    optimizer_factory=optimizer_factory,
                    strategy=strategy,  # type: ignore[arg-type]
                )
        end = time.perf_counter()
        self.barrier()
        if self.rank != 0:  # rank 0 steps in both strategies: its marks tell the story
            return {}
        n = self.steps
        epochs = [marks[e * n : (e + 1) * n] for e in range(len(requests))]
        return {
            "strategy": strategy,
            "epochs": self.drive_epochs,
            "steps_per_epoch": n,
            "total_s": end - start,
            "set_up_s": requests[0] - start,  # control join, store, process group, initial broadcasts
            "between_epochs_s": [requests[e + 1] - epochs[e][-1] for e in range(len(epochs) - 1)],
            "last_step_to_end_s": end - marks[-1],  # the final all-reduce, Stop and the teardown
            "drive_epoch_s": [
                epochs[e][-1] - starts[e] for e in range(len(epochs))
            ],  # first batch to last step
            "drive_steady_step_s": [steady_step(starts[e], epochs[e]) for e in range(len(epochs))],
            "direct_wall_s": [d["wall_s"] for d in directs],
            "direct_steady_step_s": [d["steady_step_s"] for d in directs],
        }

    # ---------------------------------------------------------------- everything

    def describe(self) -> int:
        parameters = sum(p.numel() for p in self.base.parameters())
        self.log(
            f"MLP {' -> '.join(map(str, LAYERS))}: {parameters:,} parameters; batch {BATCH_SIZE} per rank, "
            f"{WORLD_SIZE} ranks; {self.steps} steps per epoch; {torch.get_num_threads()} thread(s) per rank"
        )
        return parameters

    async def main(self) -> dict[str, Any]:
        self.setup()
        parameters = self.describe()
        records = await self.run_rounds(GROUPS, self.rounds)
        check = self.parameter_check(
            [*DDP_VARIANTS[1:], ALL_REDUCE, REDUCE_TO_ROOT, LOCAL_2, *([LOCAL_1] if self.rank == 0 else [])]
        )
        layout = self.layout()
        drive = []
        for strategy in DRIVE_STRATEGIES[1 if self.quick else 0]:
            self.log(f"drive/follow over the TCP control channel, {strategy}: {self.drive_epochs} epochs")
            drive.append(await self.drive_path(strategy))
        return {
            "parameters": parameters,
            "steps": self.steps,
            "rounds_count": self.rounds,
            "warmup_steps": self.warmup_steps,
            "records": records,
            "max_parameter_difference_vs_ddp": check,
            "layout": layout,
            "drive_follow": drive,
            "load_average_end": list(os.getloadavg()),
        }

    # ---------------------------------------------------------------- diagnosis (--breakdown)

    def add_timed_ddp(self, name: str) -> None:
        """A copy of the DDP loop with a timer per phase, on a DDP wrapper of its own whose comm hook
        (DDP's default all-reduce, called from Python) notes when each bucket is launched."""
        module = copy.deepcopy(self.base)
        ddp = DistributedDataParallel(module)
        launch: list[tuple[float, int]] = []

        def recording_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
            launch.append((time.perf_counter(), nbytes(bucket.buffer())))
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        ddp.register_comm_hook(None, recording_hook)
        self.add_timed_hand(name, ddp, make_optimizer(ddp.parameters()), launch)

    def add_timed_hand(
        self,
        name: str,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        launch: list[tuple[float, int]] | None,
    ) -> None:
        phases = self.phases.setdefault(name, [])
        launches = self.launches.setdefault(name, [])

        async def run(batches: Batches, marks: list[float]) -> float:
            module.train()
            for x, y in batches:
                if launch is not None:
                    launch.clear()
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                loss = F.cross_entropy(module(x), y)
                t2 = time.perf_counter()
                loss.backward()
                t3 = time.perf_counter()
                optimizer.step()
                t4 = time.perf_counter()
                marks.append(t4)
                phases.append(
                    {
                        "zero_grad": t1 - t0,
                        "forward": t2 - t1,
                        "backward (+ DDP's wait)": t3 - t2,
                        "step": t4 - t3,
                    }
                )
                if launch is not None:
                    launches.append([(t - t3, size) for t, size in launch])
            return 0.0

        self.runners[name] = run

    def add_timed_lamploop(
        self,
        name: str,
        *,
        first_cap_mb: float | None = None,
        async_count: bool = False,
        prescale: bool = False,
    ) -> None:
        """A copy of ``one_epoch``'s training pass (all_reduce, one batch per step) with a timer per phase.

        ``async_count``: launch the example-count all-reduce without waiting, wait for it after
        backward.  ``prescale``: backpropagate ``loss_sum / global_count`` (the count is known
        before the backward) and skip the scaling pass over the reduced gradients.
        """
        recording = RecordingGroup(self.new_group(f"timed-{name}"))
        channel, module, optimizer = self.add_lamploop(
            name, "all_reduce", first_cap_mb=first_cap_mb, group=recording, register=False
        )
        model = SupervisedModel(module)
        phases = self.phases.setdefault(name, [])
        launches = self.launches.setdefault(name, [])

        async def run(batches: Batches, marks: list[float]) -> float:
            module.train()
            sync = channel.gradient_sync(module)
            losses, count = [], 0
            for x, y in batches:
                recording.launches.clear()
                t0 = time.perf_counter()
                loss_sum, n = model.loss_sum_and_count(x, y)
                t1 = time.perf_counter()
                if async_count:
                    counts = torch.tensor([float(n)], dtype=torch.float64)
                    pending = recording.allreduce([counts])
                else:
                    global_count = int(channel.all_reduce_sum([n])[0])
                sync.last_backward()
                t2 = time.perf_counter()
                (loss_sum / global_count if prescale else loss_sum).backward()
                t3 = time.perf_counter()
                if async_count:
                    pending.wait()
                    global_count = int(counts.item())
                sync.reduce(1.0)  # the wait alone; the scaling pass that reduce() would do follows
                t4 = time.perf_counter()
                if not prescale:
                    for flat in sync._buckets._grads.flats:  # type: ignore[attr-defined]  # a diagnostic
                        flat.mul_(1.0 / global_count)
                t5 = time.perf_counter()
                optimizer.step()
                t6 = time.perf_counter()
                sync.after_step()
                t7 = time.perf_counter()
                marks.append(t7)
                losses.append(loss_sum.detach())
                count += n
                phases.append(
                    {
                        "forward": t1 - t0,
                        "count all-reduce" + (" (launch)" if async_count else ""): t2 - t1,
                        "backward": t3 - t2,
                        "wait": t4 - t3,
                        "scale": t5 - t4,
                        "step": t6 - t5,
                        "after_step (zero)": t7 - t6,
                    }
                )
                launches.append([(t - t3, size) for t, size in recording.launches[1:]])  # not the count
            sync.end_pass()
            total, _ = channel.all_reduce_sum([float(torch.stack(losses).sum()), count])
            return total

        self.runners[name] = run

    def micro(self, repetitions: int = 9) -> dict[str, float]:
        """Both ranks at once: blocking Gloo all-reduces of a few sizes, and whole-gradient memory passes."""
        group = self.new_group("micro")
        n = sum(p.numel() for p in self.base.parameters())
        flat, other = torch.zeros(n), torch.randn(n)
        out: dict[str, float] = {}

        def timed(label: str, run: Callable[[], object]) -> None:
            run()
            times = []
            for _ in range(repetitions):
                self.barrier()
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            out[label] = statistics.median(times)

        sizes = {
            "8 bytes (the example count)": 1,
            "8 MiB": 2**21,
            "24 MiB": 6 * 2**20,
            "32 MiB (every gradient)": n,
        }
        for label, numel in sizes.items():
            tensor = torch.ones(numel, dtype=torch.float64 if numel == 1 else torch.float32)
            timed(f"all-reduce of {label}", lambda tensor=tensor: group.allreduce([tensor]).wait())  # type: ignore[misc]
        timed("zero_ of every gradient", flat.zero_)
        timed("add_ into every gradient", lambda: flat.add_(other))
        timed("mul_ of every gradient by a scalar", lambda: flat.mul_(0.5))
        timed(
            "torch.mul(out=) of every gradient (DDP's copy into its buckets)",
            lambda: torch.mul(other, 0.5, out=flat),
        )
        timed("copy_ of every gradient (DDP's copy back)", lambda: flat.copy_(other))
        return out

    async def breakdown(self) -> dict[str, Any]:
        """Instrumented copies of the loops and lamploop variants in rounds; then micro-timings."""
        self.setup()
        parameters = self.describe()
        layout_name = f"lamploop all_reduce, DDP's bucket layout (first cap {BREAKDOWN_FIRST_CAP_MB} MiB)"
        self.add_lamploop(layout_name, "all_reduce", first_cap_mb=BREAKDOWN_FIRST_CAP_MB)
        self.add_timed_ddp("timed ddp")
        self.add_timed_lamploop("timed lamploop all_reduce")
        self.add_timed_lamploop("timed lamploop, non-blocking count", async_count=True)
        self.add_timed_lamploop("timed lamploop, pre-scaled loss", prescale=True)
        self.add_timed_lamploop("timed lamploop, DDP's bucket layout", first_cap_mb=BREAKDOWN_FIRST_CAP_MB)
        local = copy.deepcopy(self.base)
        self.add_timed_hand("timed local 2 processes", local, make_optimizer(local.parameters()), None)
        groups = [
            [DDP, ALL_REDUCE, layout_name],
            [
                "timed ddp",
                "timed lamploop all_reduce",
                "timed lamploop, non-blocking count",
                "timed lamploop, pre-scaled loss",
                "timed lamploop, DDP's bucket layout",
                "timed local 2 processes",
            ],
        ]
        records = await self.run_rounds(groups, BREAKDOWN_ROUNDS)
        micro = self.micro()
        phase_medians = {
            name: {k: statistics.median(s[k] for s in steps) for k in steps[0]}
            for name, steps in self.phases.items()
            if steps
        }
        launch_medians = {}
        for name, per_step in self.launches.items():
            per_step = [s for s in per_step if s]
            if not per_step:
                continue
            launch_medians[name] = [
                {
                    "bytes": per_step[0][i][1],
                    "launch_to_backward_end_s": statistics.median(s[i][0] for s in per_step),
                }
                for i in range(min(len(s) for s in per_step))
            ]
        return {
            "parameters": parameters,
            "steps": self.steps,
            "rounds_count": BREAKDOWN_ROUNDS,
            "warmup_steps": self.warmup_steps,
            "contenders": [name for group in groups for name in group],
            "records": records,
            "phase_medians_s": phase_medians,
            "launch_medians": launch_medians,
            "micro_medians_s": micro,
            "layout": self.layout(),
            "load_average_end": list(os.getloadavg()),
        }


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rank = args.worker
    if rank == 0:
        store = dist.TCPStore(HOST, 0, WORLD_SIZE, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        tmp = args.port_file.with_name(args.port_file.name + ".tmp")
        tmp.write_text(str(store.port))
        tmp.replace(args.port_file)
    else:
        store = dist.TCPStore(HOST, args.port, WORLD_SIZE, is_master=False, timeout=TIMEOUT)
    worker = Worker(rank, store, args.quick)
    result = anyio.run(worker.breakdown if args.breakdown else worker.main)
    if rank == 0:
        args.result.write_text(json.dumps(result))
    worker.barrier()  # rank 0's store outlives rank 1's last use of it
    dist.destroy_process_group()
    return 0


# =========================================================================== launcher side


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Start both workers, wait for them, and return rank 0's result."""
    deadline = time.monotonic() + WORKER_DEADLINE_S[1 if args.quick else 0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    base = [sys.executable, str(Path(__file__).resolve())]
    base += ["--quick"] if args.quick else []
    base += ["--breakdown"] if args.breakdown else []
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        port_file, result_file = Path(tmp) / "port", Path(tmp) / "result.json"
        rank0 = [*base, "--worker", "0", "--port-file", str(port_file), "--result", str(result_file)]
        procs = [subprocess.Popen(rank0, env=env)]
        try:
            while not port_file.exists():
                if procs[0].poll() is not None or time.monotonic() > deadline:
                    msg = "rank 0 did not open its store"
                    raise RuntimeError(msg)
                time.sleep(0.05)
            procs.append(subprocess.Popen([*base, "--worker", "1", "--port", port_file.read_text()], env=env))
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    msg = f"a worker failed (exit codes {[p.poll() for p in procs]})"
                    raise RuntimeError(msg)
                if time.monotonic() > deadline:
                    msg = "the workers ran past the deadline"
                    raise RuntimeError(msg)
                time.sleep(0.1)
            if any(p.returncode != 0 for p in procs):
                msg = f"a worker failed (exit codes {[p.returncode for p in procs]})"
                raise RuntimeError(msg)
            return json.loads(result_file.read_text())  # type: ignore[no-any-return]
        finally:
            for p in procs:  # only our own children, by handle
                if p.poll() is None:
                    p.kill()
                    p.wait()


def best_ddp(records: list[dict[str, Any]], contenders: Sequence[str]) -> str | None:
    """The DDP variant of the run with the lowest median wall time (the baseline a user would pick)."""
    variants = [name for name in DDP_VARIANTS if name in contenders]
    if not variants:
        return None
    walls = {v: statistics.median(r["wall_s"] for r in records if r["contender"] == v) for v in variants}
    return min(variants, key=walls.__getitem__)


def per_contender(records: list[dict[str, Any]], steps: int, contenders: Sequence[str]) -> dict[str, Any]:
    """Per-step summaries of each contender, and its per-round ratios to DDP and to the best DDP."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for rec in records:
        by_round.setdefault(rec["round"], {})[rec["contender"]] = rec
    best = best_ddp(records, contenders)
    out: dict[str, Any] = {}
    for name in contenders:
        mine = [rounds[name] for rounds in by_round.values()]
        ddp = [rounds[DDP] for rounds in by_round.values()]
        ranks = 1 if name == LOCAL_1 else WORLD_SIZE  # rank 1 idles meanwhile
        entry = {
            "wall_per_step_s": summarize([r["wall_s"] / steps for r in mine]),
            "steady_step_s": summarize([r["steady_step_s"] for r in mine]),
            "cpu_per_step_per_rank_s": summarize([sum(r["cpu_s"][:ranks]) / ranks / steps for r in mine]),
        }
        if name != DDP:
            pairs = list(zip(mine, ddp, strict=True))
            entry["ratio_wall_over_ddp"] = summarize([r["wall_s"] / d["wall_s"] for r, d in pairs])
            entry["ratio_steady_over_ddp"] = summarize(
                [r["steady_step_s"] / d["steady_step_s"] for r, d in pairs]
            )
            entry["ratio_cpu_over_ddp"] = summarize([sum(r["cpu_s"]) / sum(d["cpu_s"]) for r, d in pairs])
        if best is not None and name != best:
            tuned = [rounds[best] for rounds in by_round.values()]
            pairs = list(zip(mine, tuned, strict=True))
            entry["best_ddp"] = best
            entry["ratio_wall_over_ddp_best"] = summarize([r["wall_s"] / d["wall_s"] for r, d in pairs])
            cpu = [sum(r["cpu_s"]) / sum(d["cpu_s"]) for r, d in pairs]
            entry["ratio_cpu_over_ddp_best"] = summarize(cpu)
        out[name] = entry
    return out


def load_text(result: dict[str, Any]) -> str:
    return str([round(x, 2) for x in result["load_average_end"]])


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def spread(s: dict[str, float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"


def _ratio_or_dash(summary: dict[str, Any], key: str) -> str:
    """``median [min-max]``, marked inconclusive when the range straddles 1."""
    if key not in summary:
        return "-"
    s = summary[key]
    mark = " inconclusive" if s["min"] < 1.0 < s["max"] else ""
    return spread(s, lambda v: f"{v:.3f}") + mark


def contender_table(summary: dict[str, Any], layout: dict[str, Any], check: dict[str, float]) -> None:
    headers = [
        "contender",
        "wall ms/step med [min-max]",
        "/ DDP defaults med [min-max]",
        "/ best DDP med [min-max]",
        "CPU / best DDP",
        "steady ms/step",
        "CPU ms/step/rank",
        "colls/step",
        "max|Δparam|",
        f"<= {TARGET_RATIO:.2f}",
    ]
    rows = []
    for name, s in summary.items():
        verdict = "-"
        if name == ALL_REDUCE:
            verdict = "ok" if s["ratio_wall_over_ddp"]["median"] <= TARGET_RATIO else "ABOVE"
        rows.append(
            [
                name,
                spread(s["wall_per_step_s"], ms),
                spread(s["ratio_wall_over_ddp"], lambda v: f"{v:.3f}") if name != DDP else "1",
                _ratio_or_dash(s, "ratio_wall_over_ddp_best"),
                _ratio_or_dash(s, "ratio_cpu_over_ddp_best"),
                ms(s["steady_step_s"]["median"]),
                ms(s["cpu_per_step_per_rank_s"]["median"]),
                str(layout.get(name, {}).get("collectives_per_step", 0)),
                f"{check[name]:.1e}" if name in check else "-",
                verdict,
            ]
        )
    print_table(headers, rows)
    mib = 2**20
    for name, entry in layout.items():
        text = ", ".join(f"{b / mib:.2f}" for b in entry["gradient_buckets_bytes"])
        extra = entry.get("parameter_broadcast_buckets_bytes")
        more = f"; parameter broadcasts {', '.join(f'{b / mib:.2f}' for b in extra)}" if extra else ""
        print(f"  {name}: gradient buckets in launch order {text} MiB{more}")


def verdict_of(ratio: dict[str, float]) -> str:
    """How a ratio lamploop / peer reads: faster or slower only when every round agrees."""
    if ratio["max"] < 1.0:
        return "lamploop faster in every round"
    if ratio["min"] > 1.0:
        return "lamploop slower in every round"
    return "no clear winner: the rounds disagree"


def report(result: dict[str, Any], total: float) -> dict[str, Any]:
    steps = result["steps"]
    summary = per_contender(result["records"], steps, CONTENDERS)
    print()
    contender_table(summary, result["layout"], result["max_parameter_difference_vs_ddp"])
    print()
    rows, drive_summary = [], []
    for d in result["drive_follow"]:
        ratios = [a / b for a, b in zip(d["drive_steady_step_s"], d["direct_steady_step_s"], strict=True)]
        entry = {
            "strategy": d["strategy"],
            "set_up_s": d["set_up_s"],
            "between_epochs_median_s": statistics.median(d["between_epochs_s"])
            if d["between_epochs_s"]
            else None,
            "drive_steady_step_median_s": statistics.median(d["drive_steady_step_s"]),
            "direct_steady_step_median_s": statistics.median(d["direct_steady_step_s"]),
            "ratio_drive_over_direct_steady": summarize(ratios),
        }
        drive_summary.append(entry)
        gap = entry["between_epochs_median_s"]
        rows.append(
            [
                d["strategy"],
                str(d["epochs"]),
                fmt_seconds(d["set_up_s"]),
                "-" if gap is None else f"{fmt_seconds(gap)} ({fmt_seconds(gap / steps)}/step)",
                ms(entry["drive_steady_step_median_s"]),
                ms(entry["direct_steady_step_median_s"]),
                spread(entry["ratio_drive_over_direct_steady"], lambda v: f"{v:.3f}"),
            ]
        )
    print_table(
        [
            "drive/follow, TCP control",
            "epochs",
            "set-up (once)",
            "between epochs med",
            "steady ms/step",
            "direct, same epochs",
            "drive / direct",
        ],
        rows,
    )
    all_reduce = summary[ALL_REDUCE]["ratio_wall_over_ddp"]
    met = all_reduce["median"] <= TARGET_RATIO
    best = summary[ALL_REDUCE].get("best_ddp", DDP)
    against_best = summary[ALL_REDUCE].get("ratio_wall_over_ddp_best", all_reduce)
    print(
        f"\n{result['parameters']:,} parameters; {steps} steps of {BATCH_SIZE} examples per rank per epoch; "
        f"{result['rounds_count']} rounds after a {result['warmup_steps']}-step warm-up.\n"
        "wall = rank 0's barrier-to-barrier epoch time / steps; steady = median step-to-step interval;\n"
        "ratios = median [min-max] over rounds of contender / DDP in the same round; CPU = process time "
        "per rank;\nbest DDP = the DDP variant with the lowest median wall time in this run: "
        f"{best!r}.\n"
        "drive/follow: between epochs = last optimizer step to the next epoch's request for batches;\n"
        "drive / direct = per epoch, steady step of a drive epoch over that of the direct epoch before it.\n"
        f"Target lamploop all_reduce / DDP <= {TARGET_RATIO:.2f}: {all_reduce['median']:.3f} -> "
        f"{'met' if met else 'NOT met'}; against the best DDP ({best}): {against_best['median']:.3f} "
        f"[{against_best['min']:.3f}-{against_best['max']:.3f}] "
        f"({verdict_of(against_best)})."
        f"\nLoad average at the end {load_text(result)} "
        f"on {os.cpu_count()} CPUs.  Total {total:.1f} s."
    )
    return {
        "target_ratio": TARGET_RATIO,
        "ratio_all_reduce_over_ddp": all_reduce,
        "ratio_reduce_to_root_over_ddp": summary[REDUCE_TO_ROOT]["ratio_wall_over_ddp"],
        "best_ddp": best,
        "ratio_all_reduce_over_best_ddp": against_best,
        "ratio_reduce_to_root_over_best_ddp": summary[REDUCE_TO_ROOT].get("ratio_wall_over_ddp_best"),
        "target_met": met,
        "contenders": summary,
        "drive_follow": drive_summary,
    }


def report_breakdown(result: dict[str, Any], total: float) -> dict[str, Any]:
    summary = per_contender(result["records"], result["steps"], result["contenders"])
    print()
    contender_table(summary, result["layout"], {})
    print("\nPhase medians per step (ms):")
    for name, phases in result["phase_medians_s"].items():
        text = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())
        print(f"  {name}: {text} (sum {sum(phases.values()) * 1e3:.1f})")
    print("\nGradient all-reduces: size and launch time relative to the end of backward (median):")
    for name, entries in result["launch_medians"].items():
        text = ", ".join(
            f"{e['bytes'] / 2**20:.2f} MiB at {e['launch_to_backward_end_s'] * 1e3:+.1f} ms" for e in entries
        )
        print(f"  {name}: {text}")
    print("\nMicro-timings, both ranks at once (ms, median):")
    for label, seconds in result["micro_medians_s"].items():
        print(f"  {label}: {seconds * 1e3:.2f}")
    print(f"\nLoad average at the end {load_text(result)}.  Total {total:.1f} s.")
    return {"contenders": summary}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_distributed")
    parser.add_argument("--breakdown", action="store_true", help="diagnosis: timed phases and variants")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    load_start = list(os.getloadavg())
    print(
        f"lamploop {lamploop.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{[round(x, 2) for x in load_start]}; {WORLD_SIZE} worker processes on Gloo, 1 thread each; "
        f"SGD(lr={LEARNING_RATE}, momentum={MOMENTUM})" + (" (quick)" if args.quick else ""),
        flush=True,
    )
    started = time.perf_counter()
    result = launch(args)
    total = time.perf_counter() - started
    summary = report_breakdown(result, total) if args.breakdown else report(result, total)
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "distributed-breakdown" if args.breakdown else "distributed",
                "quick": args.quick,
                "settings": {
                    "world_size": WORLD_SIZE,
                    "backend": "gloo",
                    "layers": list(LAYERS),
                    "parameters": result["parameters"],
                    "batch_size_per_rank": BATCH_SIZE,
                    "optimizer": f"SGD(lr={LEARNING_RATE}, momentum={MOMENTUM})",
                    "steps_per_epoch": result["steps"],
                    "rounds": result["rounds_count"],
                    "warmup_steps": result["warmup_steps"],
                    "ddp": "DistributedDataParallel defaults (bucket_cap_mb=25); zero_grad(set_to_none=True)",
                    "ddp_tuned": {
                        DDP_VIEW: "gradient_as_bucket_view=True; zero_grad(set_to_none=True)",
                        DDP_STATIC: "... and static_graph=True; zero_grad(set_to_none=True)",
                        DDP_KEPT: "... and static_graph=True; zero_grad(set_to_none=False)",
                    },
                    "lamploop": "ProcessGroupChannel(bucket_cap_mb=25) + one_epoch",
                    "threads_per_worker": 1,
                    "timer": "time.perf_counter on rank 0 between barriers, inside the event loop",
                    "seed": SEED,
                    "load_average_start": load_start,
                },
                "summary": summary,
                "raw": result,
                "total_seconds": total,
            },
        )
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
