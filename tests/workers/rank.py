"""A worker process for the multi-process tests: one process runs many training runs in turn.

Starting a Python process that imports torch costs seconds, so the tests start a few of
these once and hand each a list of runs, instead of one set of processes per case::

    python tests/workers/rank.py runs CONFIG.json PROCESS_ID
    python tests/workers/rank.py fit OUT_DIR {torchrun,spawn}

``runs``: ``CONFIG.json`` is ``{"workdir": ..., "runs": [run, ...]}``; every process of a
test reads the same file.  A run names its ``members``, the process ids in rank order;
a process that is not a member skips the run.  The root (the first member) opens a
:class:`~lamploop.control.TcpControlRoot` on a free port of 127.0.0.1 and writes
``<workdir>/<run>/ready.json`` with the port; the followers wait for that file (bounded),
join, and everyone trains.  Each rank writes ``rank<r>.json`` (the outcome: the final
``LoopState`` on the root, or the error's type, class hierarchy and message) and
``rank<r>.safetensors`` (its final parameters); the root also writes ``live.safetensors``
(the live model after the last epoch, before the best model is copied back) and
``progress.json`` after every epoch.  A run that fails ends the process with status 1
(and leaves ``<workdir>/aborted-by-p<id>.json``, so that nobody waits for it) unless the
run says ``"continue_on_error": true``.  A root with ``"wait_for": path`` waits for that
file first (another process set's result, e.g. the checkpoints to resume from).
Nothing is pickled.

``fit``: trains the tiny model of :func:`fit_data` with :func:`lamploop.fit` under
``torchrun`` (the launcher's variables decide the rank) or with ``world_size=2`` and
``launch_command`` pointing back at this script (``spawn``: fit starts rank 1 itself).
Rank 0 writes ``result.json`` and ``params.safetensors``; followers ``follower-<r>.json``.

A run's keys: ``name``, ``members``, ``strategy``, ``k`` (batches per step), ``epochs``,
``data`` (``seed``, ``batches`` per rank, ``valid_batches``, ``valid_class``), ``model``
(``seed``, ``hidden``, ``extra_layer``, ``dtype``), ``optimizer``, ``schedule``, and
optionally ``checkpoint_dir``, ``resume_from``, ``wait_for``, ``pause_after_epoch``
(``{"epoch", "until_file"}``: the root waits for that file after that epoch),
``batch_sleep`` (seconds between batches, to make a run long enough to disturb),
``control`` / ``root_control`` (keyword arguments of the control channel), ``token``,
``timeout`` and ``continue_on_error``.

The data, model, optimizer and schedule builders are plain functions of the run's JSON
(and of the epoch and rank), imported by the tests to build single-process references;
so are the test-side helpers at the end (:class:`Processes`: start workers, wait for
their files and exits, every wait bounded, and kill what is left).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import lamploop
from lamploop.batches import BatchContext, BatchStreamFactory, epoch_seed
from lamploop.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from lamploop.control import TcpControlFollower, TcpControlRoot
from lamploop.distributed import drive_distributed_training, follow_distributed_training
from lamploop.distributed.boundaries import StopRequest, rng_from_json, rng_to_json
from lamploop.distributed.launch import launch_env
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import model_spec

HOST = "127.0.0.1"
IN_FEATURES = 4
CLASSES = 3
READY_TIMEOUT_S = 150.0
"""How long a follower waits for its root's ready file (a bound for a loaded machine)."""

Batch = tuple[torch.Tensor, torch.Tensor]
DTYPES = {"float64": torch.float64, "float32": torch.float32}


# --- the pure builders the tests share ----------------------------------------------------------


def _batches(
    seed: int, parts: Iterable[int], count: int, data: dict[str, Any], dtype: torch.dtype, *, validation: bool
) -> list[Batch]:
    generator = torch.Generator().manual_seed(epoch_seed(seed, *parts))
    low, high = data.get("min_size", 3), data.get("max_size", 6)
    # With "valid_class" set, validation targets are all that class and training never shows
    # it, so the validation loss rises while training goes on: the best epoch is not the last.
    odd_one = data.get("valid_class")
    out = []
    for _ in range(count):
        size = int(torch.randint(low, high + 1, (1,), generator=generator))
        x = torch.randn(size, IN_FEATURES, generator=generator, dtype=torch.float64).to(dtype)
        if odd_one is None:
            y = torch.randint(0, CLASSES, (size,), generator=generator)
        elif validation:
            y = torch.full((size,), odd_one, dtype=torch.int64)
        else:
            y = torch.randint(0, CLASSES - 1, (size,), generator=generator)
            y = y + (y >= odd_one).long()
        out.append((x, y))
    return out


def train_batches_of(
    data: dict[str, Any], epoch: int, rank: int, dtype: torch.dtype = torch.float64
) -> list[Batch]:
    """Rank ``rank``'s training batches of ``epoch``: ``data["batches"][rank]`` of random sizes."""
    return _batches(data["seed"], (epoch, rank), data["batches"][rank], data, dtype, validation=False)


def valid_batches_of(
    data: dict[str, Any], epoch: int, rank: int, dtype: torch.dtype = torch.float64
) -> list[Batch]:
    """Rank ``rank``'s validation batches, the same every epoch.

    ``data["valid_batches"]`` is their number, or a list of one number per rank.
    """
    count = data.get("valid_batches", 2)
    count = count[rank] if isinstance(count, list) else count
    return _batches(data["seed"], (10**6, rank), count, data, dtype, validation=True)


def _cat(batches: list[Batch]) -> Batch:
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def union_train_batches(data: dict[str, Any], epoch: int, nranks: int, k: int) -> list[Batch]:
    """What one rank alone must see to match ``nranks`` ranks accumulating ``k`` batches each.

    One batch per optimizer step: every rank's (up to) ``k`` batches of that step
    concatenated, in rank order; a rank whose stream is exhausted adds nothing.
    """
    per_rank = [train_batches_of(data, epoch, r) for r in range(nranks)]
    steps = max(math.ceil(len(b) / k) for b in per_rank)
    union = []
    for s in range(steps):
        parts = [b for r in range(nranks) for b in per_rank[r][s * k : (s + 1) * k]]
        union.append(_cat(parts))
    return union


def union_valid_batches(data: dict[str, Any], epoch: int, nranks: int) -> list[Batch]:
    return [b for r in range(nranks) for b in valid_batches_of(data, epoch, r)]


def make_module(model: dict[str, Any], rank: int) -> nn.Module:
    """The run's model; followers (``rank > 0``) start from other weights than the root."""
    with torch.random.fork_rng():
        torch.manual_seed(model.get("seed", 0) + 7919 * rank)
        hidden = model.get("hidden", 8)
        layers: list[nn.Module] = [nn.Linear(IN_FEATURES, hidden), nn.Tanh()]
        if model.get("dropout"):
            layers.append(nn.Dropout(model["dropout"]))
        layers.append(nn.Linear(hidden, CLASSES))
        if model.get("extra_layer"):
            layers += [nn.Tanh(), nn.Linear(CLASSES, CLASSES)]
        return nn.Sequential(*layers).to(DTYPES[model.get("dtype", "float64")])


def optimizer_factory(optimizer: dict[str, Any]) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    name, lr = optimizer.get("name", "adam"), optimizer.get("lr", 0.05)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=optimizer.get("momentum", 0.9))
    msg = f"unknown optimizer {name!r}"
    raise ValueError(msg)


def make_schedule(schedule: dict[str, Any]) -> lamploop.LearningRateSchedule[Any]:
    name = schedule.get("name", "decrement")
    if name == "decrement":
        return lamploop.decrement(schedule.get("every", 1), schedule.get("fraction", 0.5))
    if name == "plateau":
        return lamploop.reduce_lr_on_plateau(
            patience=0, threshold=schedule.get("threshold", 0.3), reduce_factor=0.5
        )
    if name == "noop":
        return lamploop.noop()
    msg = f"unknown schedule {name!r}"
    raise ValueError(msg)


def busy(seconds: float) -> None:
    """Keep this thread's CPU busy for ``seconds`` (torch compute, as a training step would)."""
    deadline = time.monotonic() + seconds
    a = torch.randn(64, 64)
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


def stream_factory(
    make: Callable[[int, int], list[Batch]],
    *,
    batch_sleep: float = 0.0,
    batch_busy: float = 0.0,
    slow_batch: dict[str, Any] | None = None,
) -> BatchStreamFactory:
    """A batch-stream factory over ``make(epoch, rank)``.

    Optionally it sleeps (async) or computes (blocking the training thread, as a long step
    does) before each batch, and blocks once for ``slow_batch["seconds"]`` before batch
    ``slow_batch["batch"]`` of epoch ``slow_batch["epoch"]`` on rank ``slow_batch["rank"]``.
    """

    def factory(context: BatchContext) -> AsyncIterator[Batch]:
        async def stream() -> AsyncIterator[Batch]:
            for i, batch in enumerate(make(context.epoch, context.rank)):
                if batch_sleep:
                    await anyio.sleep(batch_sleep)
                if batch_busy:
                    busy(batch_busy)
                if slow_batch is not None and (context.epoch, context.rank, i) == (
                    slow_batch["epoch"],
                    slow_batch["rank"],
                    slow_batch["batch"],
                ):
                    time.sleep(slow_batch["seconds"])  # noqa: ASYNC251 (blocks the training thread on purpose)
                yield batch

        return stream()

    return factory


# --- files ----------------------------------------------------------------------------------------


def write_json(path: Path, value: Any) -> None:
    """Write atomically, so that a reader polling for ``path`` never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _aborted(workdir: Path | None) -> list[str]:
    return [p.name for p in workdir.glob("aborted-by-*")] if workdir is not None else []


async def wait_for_json(path: Path, within: float, *, workdir: Path | None = None) -> Any:
    """Poll for ``path`` for ``within`` seconds; give up early when a worker of ``workdir`` aborted."""
    with anyio.fail_after(within):
        while not await anyio.Path(path).exists():
            aborted = await anyio.to_thread.run_sync(_aborted, workdir)
            if aborted:
                msg = f"waiting for {path}: another worker aborted ({aborted})"
                raise RuntimeError(msg)
            await anyio.sleep(0.02)
    return json.loads(await anyio.Path(path).read_text())


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)  # an exception group (no BaseExceptionGroup on 3.10)
    if isinstance(inner, tuple):
        return [leaf for e in inner for leaf in _leaves(e)]
    return [exc]


def describe_error(exc: BaseException) -> dict[str, Any]:
    leaves = _leaves(exc)
    first = leaves[0]
    return {
        "type": type(first).__name__,
        "mro": [c.__name__ for c in type(first).__mro__],
        "message": str(first),
        "rank": getattr(first, "rank", None),
        "how": getattr(first, "how", None),
        "all": [f"{type(e).__name__}: {e}" for e in leaves],
    }


# --- one run --------------------------------------------------------------------------------------


def _common(run: dict[str, Any]) -> dict[str, Any]:
    data, dtype = run["data"], DTYPES[run["model"].get("dtype", "float64")]
    pace = {
        "batch_sleep": run.get("batch_sleep", 0.0),
        "batch_busy": run.get("batch_busy", 0.0),
        "slow_batch": run.get("slow_batch"),
    }
    return {
        "train_batches": stream_factory(lambda e, r: train_batches_of(data, e, r, dtype), **pace),
        "validation_batches": stream_factory(lambda e, r: valid_batches_of(data, e, r, dtype)),
        "accumulate_gradient_over_n_batches": run.get("k", 1),
        "strategy": run.get("strategy", "reduce_to_root"),
        "device": "cpu",
    }


async def run_root(run: dict[str, Any], wd: Path) -> dict[str, Any]:
    nranks = len(run["members"])
    module = make_module(run["model"], 0)
    schedule = make_schedule(run.get("schedule", {}))
    init_state, schedule_state = None, None
    if run.get("wait_for"):  # another process set's output, e.g. the checkpoints to resume from
        waited = Path(run["wait_for"])
        await wait_for_json(waited, run.get("timeout", 120.0), workdir=waited.parent.parent)
    if run.get("resume_from"):
        checkpoint = load_checkpoint(run["resume_from"], schedule=schedule, model=module)
        checkpoint.rng.restore()
        init_state, schedule_state = checkpoint.state, checkpoint.schedule_state
    position: dict[str, Any] = {}
    if run.get("resume_position"):  # a step-boundary checkpoint written by _step_boundaries
        checkpoint = load_checkpoint(run["resume_position"], schedule=schedule, model=module)
        init_state, schedule_state = checkpoint.state, checkpoint.schedule_state
        saved = json.loads((Path(run["resume_position"]) / "position.json").read_text())
        position = {
            "init_position": EpochPosition(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in saved["position"].items()}
            ),
            "init_rank_rngs": [checkpoint.rng, *(rng_from_json(r) for r in saved["rngs"])],
        }
    checkpointer = Checkpointer(run["checkpoint_dir"], keep_last=None) if run.get("checkpoint_dir") else None
    live: dict[str, torch.Tensor] = {}
    pause = run.get("pause_after_epoch")

    async def after_epoch(data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        live.clear()
        live.update({k: v.detach().clone() for k, v in data.model.items()})
        if checkpointer is not None:
            await checkpointer(data, schedule_state)
        finished = data.loop_state.epoch - 1
        write_json(wd / "progress.json", {"epoch": finished, "time": time.time()})
        if pause is not None and pause["epoch"] == finished:
            await wait_for_json(Path(pause["until_file"]), pause.get("timeout", 30.0))

    kwargs = {
        **_common(run),
        **_step_boundaries(run),
        "nranks": nranks,
        "model": lamploop.SupervisedModel(module),
        "optimizer_factory": optimizer_factory(run.get("optimizer", {})),
        "max_epochs": run.get("epochs", 3),
        "checkpoint_state": after_epoch,
        "return_min_validation_loss_model": lamploop.ALL_EPOCHS,
        "learning_rate_schedule": schedule,
        "init_state": init_state,
        "learning_rate_schedule_init_state": schedule_state,
        **position,
    }
    refusals: list[str] = []
    if nranks == 1:
        state = await drive_distributed_training(control=None, **kwargs)
    else:
        async with TcpControlRoot(
            host=run.get("host", HOST),
            port=0,
            nranks=nranks,
            token=run.get("token", "test-token"),
            model_spec=model_spec(module),
            **run.get("control", {}),
            **run.get("root_control", {}),
        ) as root:
            write_json(wd / "ready.json", {"port": root.address[1]})
            state = await drive_distributed_training(control=root, host=run.get("host", HOST), **kwargs)
            refusals = list(root.recent_refusals)
    save_tensors(wd / "rank0.safetensors", module.state_dict())
    save_tensors(wd / "live.safetensors", live)
    return {"state": lamploop.state.converter.unstructure(state), "refusals": refusals}


def _step_boundaries(run: dict[str, Any]) -> dict[str, Any]:
    """The root's stop request and step-boundary checkpoints of a run that asks for them.

    ``stop_at`` (``{"epoch", "batch"}``): the root asks to stop when its stream yields that
    batch; ``position_dir``: each step-boundary checkpoint goes there (``save_checkpoint``
    plus a ``position.json`` with the position and the followers' RNG states).
    """
    extra: dict[str, Any] = {}
    stop_at = run.get("stop_at")
    if stop_at is not None:
        stop = StopRequest()
        extra["stop"] = stop
        inner = _common(run)["train_batches"]

        def train_batches(context: BatchContext) -> AsyncIterator[Batch]:
            async def stream() -> AsyncIterator[Batch]:
                async for i, batch in _enumerate(inner(context)):
                    if context.rank == 0 and (context.epoch, i) == (stop_at["epoch"], stop_at["batch"]):
                        stop.request("a test")
                    yield batch

            return stream()

        extra["train_batches"] = train_batches
    if run.get("position_dir"):

        async def save_position(data: Any, schedule_state: Any, position: EpochPosition, rngs: Any) -> None:
            path = save_checkpoint(run["position_dir"], data, schedule_state=schedule_state, rng=rngs[0])
            saved = {"position": attrs.asdict(position), "rngs": [rng_to_json(r) for r in rngs[1:]]}
            write_json(path / "position.json", saved)

        extra["checkpoint_position"] = save_position
        extra["checkpoint_every_n_steps"] = run.get("checkpoint_every_n_steps")
    return extra


async def _enumerate(stream: AsyncIterator[Batch]) -> AsyncIterator[tuple[int, Batch]]:
    i = 0
    async for item in stream:
        yield i, item
        i += 1


async def run_follower(run: dict[str, Any], wd: Path, rank: int) -> dict[str, Any]:
    nranks = len(run["members"])
    module = make_module(run["model"], rank)
    ready = await wait_for_json(wd / "ready.json", READY_TIMEOUT_S, workdir=wd.parent)
    if rank in run.get("via_proxy", []):  # the test relays this rank's control connection
        ready = await wait_for_json(wd / f"proxy{rank}.json", READY_TIMEOUT_S, workdir=wd.parent)
    strategy = run.get("strategy", "reduce_to_root")
    async with TcpControlFollower(
        host=run.get("host", HOST),
        port=ready["port"],
        rank=rank,
        nranks=nranks,
        token=run.get("token", "test-token"),
        model_spec=model_spec(module),
        **run.get("control", {}),
    ) as follower:
        await follow_distributed_training(
            rank=rank,
            control=follower,
            nranks=nranks,
            model=lamploop.SupervisedModel(module),
            optimizer_factory=optimizer_factory(run.get("optimizer", {}))
            if strategy == "all_reduce"
            else None,
            **_common(run),
        )
    save_tensors(wd / f"rank{rank}.safetensors", module.state_dict())
    return {}


async def run_all(config: dict[str, Any], process: int) -> int:
    workdir = Path(config["workdir"])
    for run in config["runs"]:
        if process not in run["members"]:
            continue
        rank = run["members"].index(process)
        wd = workdir / run["name"]
        wd.mkdir(parents=True, exist_ok=True)
        started = time.time()
        torch.manual_seed(run.get("seed", 0) * 1000 + rank)  # each run draws (dropout) from its own seed
        try:
            with anyio.fail_after(run.get("timeout", 120.0)):
                if rank == 0:
                    outcome = await run_root(run, wd)
                else:
                    outcome = await run_follower(run, wd, rank)
        except Exception as exc:  # recorded for the test, which decides whether it was expected
            traceback.print_exc()
            write_json(
                wd / f"rank{rank}.json",
                {"ok": False, "error": describe_error(exc), "started": started, "failed_at": time.time()},
            )
            if not run.get("continue_on_error"):
                write_json(workdir / f"aborted-by-p{process}.json", {"run": run["name"]})
                return 1
            continue
        write_json(wd / f"rank{rank}.json", {"ok": True, "started": started, "ended": time.time(), **outcome})
    return 0


# --- lamploop.fit under a launcher ------------------------------------------------------------------

FIT_BATCH = 8
FIT_EPOCHS = 3


def fit_data() -> tuple[Batch, Batch]:
    """Training and validation examples for the ``fit`` mode (96 and 32 examples)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(128, IN_FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (128,), generator=generator)
    return (x[:96], y[:96]), (x[96:], y[96:])


def fit_kwargs(rank: int, batch_size: int) -> dict[str, Any]:
    """What the ``fit`` mode passes to :func:`lamploop.fit` (the tests reuse it for the reference)."""
    (x, y), (xv, yv) = fit_data()
    return {
        "model": lamploop.SupervisedModel(make_module({"seed": 5}, rank)),
        "optimizer_factory": optimizer_factory({"name": "adam", "lr": 0.05}),
        "train_batches": lamploop.tensor_batches(x, y, batch_size=batch_size, seed=3),
        "validation_batches": lamploop.tensor_batches(xv, yv, batch_size=8, shuffle=False),
        "max_epochs": FIT_EPOCHS,
        "learning_rate_schedule": lamploop.decrement(1, 0.5),
    }


def checkpointed_fit_kwargs(rank: int, out: Path, every_n_steps: int | None) -> dict[str, Any]:
    """A longer run with dropout that checkpoints into ``out/checkpoints`` (the ``stoppable`` mode)."""
    generator = torch.Generator().manual_seed(4321)
    x = torch.randn(480, IN_FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (480,), generator=generator)
    torch.manual_seed(17 + rank)  # the dropout draws of each rank
    base = iterable_batches_sleeping(lamploop.tensor_batches(x[:400], y[:400], batch_size=8, seed=5), 0.02)
    return {
        "model": lamploop.SupervisedModel(make_module({"seed": 8, "hidden": 16, "dropout": 0.25}, rank)),
        "optimizer_factory": optimizer_factory({"name": "adam", "lr": 0.02}),
        "train_batches": base,
        "validation_batches": lamploop.tensor_batches(x[400:], y[400:], batch_size=40, shuffle=False),
        "max_epochs": 10,
        "learning_rate_schedule": lamploop.decrement(2, 0.7),
        "checkpoint_dir": out / "checkpoints",
        "keep_last": 2,
        "checkpoint_every_n_steps": every_n_steps,
    }


def iterable_batches_sleeping(inner: BatchStreamFactory, seconds: float) -> BatchStreamFactory:
    """``inner``'s batches, with a short sleep before each (a run long enough to interrupt)."""

    def factory(context: BatchContext) -> AsyncIterator[Batch]:
        async def stream() -> AsyncIterator[Batch]:
            async for batch in inner(context):
                await anyio.sleep(seconds)
                yield batch

        return stream()

    return factory


def fit_main(out: Path, mode: str, every_n_steps: int | None = None) -> int:
    env = launch_env()
    rank = env.rank if env is not None else 0
    if rank == 0:
        warm_up_optimizers()
    extra: dict[str, Any] = {}
    if mode in ("spawn", "stoppable"):
        # fit starts rank 1 itself; the non-default strategy also checks that fit passes it on.
        command = [sys.executable, str(Path(__file__).resolve()), "fit", str(out), mode]
        if every_n_steps is not None:
            command.append(str(every_n_steps))
        extra = {"world_size": 2, "launch_command": command, "strategy": "reduce_to_root"}
    if mode == "stoppable":
        extra["strategy"] = "all_reduce"
        kwargs = checkpointed_fit_kwargs(rank, out, every_n_steps)
    else:
        kwargs = fit_kwargs(rank, FIT_BATCH)
    try:
        state = lamploop.fit(**kwargs, **extra)
    except lamploop.errors.TrainingInterrupted as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 143 if exc.reason == "SIGTERM" else 130
    who = {
        "launcher": env.launcher if env else None,
        "rank": rank,
        "world_size": env.world_size if env else None,
    }
    if state is None:
        write_json(out / f"follower-{rank}.json", who)
        return 0
    save_tensors(out / "params.safetensors", kwargs["model"].module.state_dict())
    write_json(out / "result.json", {"state": lamploop.state.converter.unstructure(state), **who})
    return 0


# --- for the tests: start workers, wait for files and exits; every wait is bounded ---------------

WORKER_SCRIPT = Path(__file__).resolve()
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)


def worker_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables (a worker must not think torchrun started it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARIABLES and not k.startswith(("LAMPLOOP_", "SLURM_"))
    }
    # PYTHONFAULTHANDLER: a worker that aborts (SIGABRT, SIGSEGV) prints every thread's Python
    # stack into its log, which the failing test shows.
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)
    return env


class Processes:
    """The worker processes of one test, each logging to a file.

    Leaving the ``with`` block kills whatever still runs and reaps it, so no test leaves
    a process behind, whatever happens.
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, Any] = {}  # subprocess.Popen, or a warm_start.WarmProcess

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                # Each worker leads its own process group: this also ends what it started
                # (torchrun's ranks, the follower that fit spawns).
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(timeout=30)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Any:
        from workers import warm_start  # test-side only: this script runs with tests/workers on its path

        path = self.logdir / f"log-{name}.txt"
        path.write_bytes(b"")
        # Forked from a process with torch and lamploop imported where the command allows:
        # about 5 s of CPU less per worker (tests/workers/warm_start.py).
        env = env if env is not None else worker_env()
        proc = warm_start.popen(argv, env=env, cwd=self.logdir, stdout=path, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_runs(self, config: dict[str, Any], path: Path, ids: Iterable[int]) -> None:
        """Write ``config`` to ``path`` and start one ``runs`` worker per process id."""
        path.write_text(json.dumps(config, indent=1))
        for i in ids:
            self.start(f"p{i}", [sys.executable, str(WORKER_SCRIPT), "runs", str(path), str(i)])

    def log(self, name: str) -> str:
        path = self.logdir / f"log-{name}.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(
            f"--- {name} (exit {p.poll()}) ---\n{self.log(name)[-tail:]}" for name, p in self.procs.items()
        )

    def check_alive(self, names: Iterable[str]) -> None:
        for name in names:
            code = self.procs[name].poll()
            if code is not None:
                msg = f"worker {name} exited early with status {code}\n{self.logs()}"
                raise AssertionError(msg)

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            msg = f"worker {name} still runs after {timeout:g} s\n{self.logs()}"
            raise AssertionError(msg) from None

    def wait_all(self, timeout: float, *, grace: float = 10.0) -> dict[str, int]:
        """Wait for every worker; once one fails, the others get only ``grace`` more seconds."""
        deadline = time.monotonic() + timeout
        while True:
            codes = {name: p.poll() for name, p in self.procs.items()}
            if all(code is not None for code in codes.values()):
                return codes  # type: ignore[return-value]
            if any(code not in (None, 0) for code in codes.values()):
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                msg = f"workers still run after {timeout:g} s (or {grace:g} s after one failed): {codes}"
                msg += f"\n{self.logs()}"
                raise AssertionError(msg)
            time.sleep(0.05)

    def wait_for_file(self, path: Path, timeout: float, *, alive: Iterable[str] = ()) -> Any:
        """Poll for ``path`` (JSON) while the ``alive`` workers keep running; its content."""
        deadline = time.monotonic() + timeout
        names = list(alive)
        while not path.exists():
            self.check_alive(names)
            if time.monotonic() > deadline:
                msg = f"{path} did not appear within {timeout:g} s\n{self.logs()}"
                raise AssertionError(msg)
            time.sleep(0.02)
        return json.loads(path.read_text())


def outcome(workdir: Path, run: str, rank: int) -> dict[str, Any]:
    """What rank ``rank`` wrote about run ``run`` (``ok``, the state or the error)."""
    return json.loads((workdir / run / f"rank{rank}.json").read_text())


def tensors(workdir: Path, run: str, name: str) -> dict[str, torch.Tensor]:
    """A parameter file a worker wrote: ``rank<r>`` (final) or ``live`` (root, last epoch)."""
    return load_file(str(workdir / run / f"{name}.safetensors"))


def warm_up_optimizers() -> None:
    """Build a first optimizer now, before any control channel opens (roots only).

    A process's first optimizer imports ``torch._dynamo``: seconds of CPU, ten and more on
    a loaded machine.  ``drive_distributed_training`` builds the root's optimizer on the
    event loop while the control root already serves, so a follower that connects then
    waits for its challenge and can pass its handshake timeout.  That is a lamploop bug
    with its own test (test_distributed.py::test_slow_setup_on_the_root_does_not_time_out_a_joining_follower);
    the other tests keep clear of it.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if len(argv) == 3 and argv[0] == "runs":
        config, process = json.loads(Path(argv[1]).read_text()), int(argv[2])
        if any(run["members"][0] == process for run in config["runs"]):
            warm_up_optimizers()
        return anyio.run(run_all, config, process)
    if len(argv) in (3, 4) and argv[0] == "fit":
        return fit_main(Path(argv[1]), argv[2], int(argv[3]) if len(argv) == 4 else None)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
