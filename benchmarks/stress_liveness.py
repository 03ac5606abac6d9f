"""Stress: the default heartbeat settings find a frozen rank in 5 s, and never a slow one.

Usage::

    python benchmarks/stress_liveness.py [--repeat 5] [--spinners 4] [--slow-step 60]
        [--checkpoint-gib 2] [--only freeze link slow-step checkpoint] [--load-faults] [--json PATH]

Every run is real processes on Gloo and the TCP control channel with the *default* heartbeat
settings (:data:`lamploop.control.DEFAULT_HEARTBEAT_INTERVAL_S` and ``..._TIMEOUT_S``), a
small MLP whose every batch computes for 20 ms on the training thread (so that the ranks are
inside a step or a collective when the fault comes), rank 0 on ``TcpControlRoot`` and the
others on ``TcpControlFollower`` (this script again, as ``child``).  Scenarios:

- ``freeze``: once epoch 0 is done, SIGSTOP a follower or the root (2 and 3 ranks): every
  survivor's run must end with ``PeerLostError`` naming the frozen rank, ``how="silent"``,
  within 5 s.  Measured per survivor: from the SIGSTOP to its error (the run ended, its
  control channel closed), and to its process's exit (each rank freezes its heap with
  ``gc.freeze()`` before it exits, as a script that exits after a failed run can: Python's final
  garbage collection of torch's heap otherwise adds 4-6 s at load 15-24), with the threads
  other than the main one, not daemons, still running 5 s after its run returned (there must
  be none);
- ``link``: the same with a frozen link: ranks in two network namespaces (``tests/netns.py``;
  needs root), the link taken down (every packet lost, no reset): 2 ranks (one per host) and
  3 ranks (0 and 1 on host a, 2 on host b): each side names the other;
- ``slow-step``: rank 1 computes for ``--slow-step`` seconds (60) inside one step of epoch 1
  while the others wait in the collective: the run must finish, no rank lost;
- ``checkpoint``: the root writes a checkpoint of ``--checkpoint-gib`` GiB (a checkpoint
  extra beside the model, ~10 s here) after every epoch while the followers wait: the run
  must finish.

``--spinners`` busy processes (``while True: pass``; default 2 per core) load the machine
during ``slow-step`` and ``checkpoint`` and, with ``--load-faults``, during ``freeze`` and
``link`` too.  Printed: per scenario the outcome and times (median and range), the load
average.  Exit status 1 when any run ended otherwise than expected.

``tests/distributed/test_liveness_defaults.py`` imports this module and runs short versions (a 12 s step
under load); ``tests/distributed/test_reliability.py`` checks the 5 s bound for every fault.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
TOKEN = "stress-liveness-token"
END_WITHIN_S = 5.0
BATCH_BUSY_S = 0.02
FEATURES, CLASSES = 16, 4


# --- the child: one rank of one run ----------------------------------------------------------------


def _write(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _busy(seconds: float) -> None:
    """Compute for ``seconds`` on this thread (torch matmuls, as a training step does)."""
    import torch

    deadline = time.monotonic() + seconds
    a = torch.randn(64, 64)
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        return [leaf for e in inner for leaf in _leaves(e)]
    return [exc]


async def _child(config: dict[str, Any], rank: int) -> int:
    import anyio
    import torch

    import lamploop

    torch.set_num_threads(1)
    wd = Path(config["workdir"])
    nranks, host = config["nranks"], config.get("host", "127.0.0.1")
    torch.manual_seed(rank)
    module = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, CLASSES))
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(config["batches"] * 8, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (config["batches"] * 8,), generator=generator)
    plain = lamploop.tensor_batches(x, y, batch_size=8)
    slow = config.get("slow_step")

    def batches(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            async for i, batch in _enumerate(plain(context)):
                _busy(config.get("busy", BATCH_BUSY_S))
                if slow and (context.epoch, context.rank, i) == (slow["epoch"], slow["rank"], slow["batch"]):
                    began = time.time()
                    _busy(slow["seconds"])  # one step computes this long on this rank
                    _write(wd / "slow-step.json", {"began": began, "ended": time.time()})
                yield batch

        return stream()

    common: dict[str, Any] = {
        "device": "cpu",
        "model": lamploop.SupervisedModel(module),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.05),
        "train_batches": batches,
        "validation_batches": None,
        "strategy": "all_reduce",
    }
    started = time.time()
    try:
        async with anyio.create_task_group() as monitor:
            monitor.start_soon(_watch_the_loop, wd / f"stall-{rank}.json")
            await _rank(config, rank, wd, common, module, nranks, host)
            monitor.cancel_scope.cancel()
    except Exception as exc:
        first = _leaves(exc)[0]
        outcome = {
            "type": type(first).__name__,
            "rank": getattr(first, "rank", None),
            "how": getattr(first, "how", None),
        }
        _write(
            wd / f"rank{rank}.json",
            {
                "ok": False,
                "error": {**outcome, "message": str(first)},
                "started": started,
                "failed_at": time.time(),
            },
        )
        return 1
    _write(wd / f"rank{rank}.json", {"ok": True, "started": started, "ended": time.time()})
    return 0


async def _rank(
    config: dict[str, Any], rank: int, wd: Path, common: dict[str, Any], module: Any, nranks: int, host: str
) -> None:
    import anyio
    import torch

    import lamploop
    from lamploop.checkpoint import Checkpointer
    from lamploop.control import TcpControlFollower, TcpControlRoot
    from lamploop.modelspec import model_spec

    with anyio.fail_after(config.get("timeout", 600)):
        if rank == 0:
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the dynamo import, now
            await _root(config, wd, common, model_spec(module), TcpControlRoot, Checkpointer)
        else:
            ready = await _wait_for(wd / "ready.json", 300)
            spec = model_spec(module)
            port = ready["port"]
            async with TcpControlFollower(
                host=host, port=port, rank=rank, nranks=nranks, token=TOKEN, model_spec=spec
            ) as follower:
                await lamploop.follow_distributed_training(
                    rank=rank, nranks=nranks, control=follower, **common
                )


async def _watch_the_loop(path: Path) -> None:
    """How late this rank's event loop (which sends and reads the heartbeats) ever was: the margin left."""
    import anyio

    worst, written = 0.0, time.monotonic()
    while True:
        began = time.monotonic()
        await anyio.sleep(0.05)
        worst = max(worst, time.monotonic() - began - 0.05)
        if time.monotonic() - written > 1.0:
            _write(path, {"max_stall_s": worst})
            written = time.monotonic()


async def _root(
    config: dict[str, Any], wd: Path, common: dict[str, Any], spec: Any, root_cls: Any, checkpointer_cls: Any
) -> None:
    import torch

    import lamploop

    extras: dict[str, Any] = {}
    if config.get("checkpoint_gib"):
        extras["big"] = _BigExtra(int(config["checkpoint_gib"] * 2**30 / 4))
    checkpointer = checkpointer_cls(wd / "checkpoints", keep_last=1, extras=extras) if extras else None
    writes: list[float] = []

    async def after_epoch(data: Any, schedule_state: Any) -> None:
        if checkpointer is not None:
            began = time.monotonic()
            await checkpointer(data, schedule_state)
            writes.append(time.monotonic() - began)
            _write(wd / "checkpoint-writes.json", writes)
        _write(wd / "progress.json", {"epoch": data.loop_state.epoch - 1, "time": time.time()})

    host = config.get("host", "127.0.0.1")
    async with root_cls(host=host, port=0, nranks=config["nranks"], token=TOKEN, model_spec=spec) as root:
        _write(wd / "ready.json", {"port": root.address[1]})
        await lamploop.drive_distributed_training(
            nranks=config["nranks"],
            control=root,
            host=host,
            max_epochs=config["epochs"],
            checkpoint_state=after_epoch,
            **common,
        )
    del torch


class _BigExtra:
    """A checkpoint extra of ``floats`` float32 values: makes every checkpoint write long."""

    def __init__(self, floats: int) -> None:
        import torch

        self.tensor = torch.randn(floats)

    def state_dict(self) -> tuple[dict[str, Any], Any]:
        return {"big": self.tensor}, {}

    def load_state_dict(self, tensors: Any, meta: Any) -> None:
        self.tensor = tensors["big"]


async def _enumerate(stream: Any) -> Any:
    i = 0
    async for item in stream:
        yield i, item
        i += 1


async def _wait_for(path: Path, within: float) -> Any:
    import anyio

    with anyio.fail_after(within):
        while not await anyio.Path(path).exists():  # noqa: ASYNC110  (another process writes it)
            await anyio.sleep(0.02)
    return json.loads(await anyio.Path(path).read_text())


# --- the parent: start runs, inject faults, time the survivors ---------------------------------------


class Run:
    """The processes of one run (one per rank), each logging to ``workdir/log-<rank>.txt``."""

    def __init__(self, workdir: Path, config: dict[str, Any], prefixes: dict[int, list[str]] | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        config = {**config, "workdir": str(workdir)}
        path = workdir / "config.json"
        path.write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LAMPLOOP_", "SLURM_"))}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.exited: dict[int, float] = {}
        for rank in range(config["nranks"]):
            argv = [*(prefixes or {}).get(rank, []), sys.executable, str(HERE), "child", str(path), str(rank)]
            with (workdir / f"log-{rank}.txt").open("wb") as log:
                self.procs[rank] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )

    def wait_for_file(self, name: str, timeout: float, until: Any = None) -> Any:
        """The JSON of ``workdir/name`` once it exists (and ``until(value)`` holds, if given).

        Raises RuntimeError (with every rank's outcome and log) if a rank exits meanwhile or
        ``timeout`` passes.
        """
        deadline = time.monotonic() + timeout
        path = self.workdir / name
        while True:
            if path.exists():
                value = json.loads(path.read_text())
                if until is None or until(value):
                    return value
            dead = {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}
            if dead:
                outcomes = {r: self.outcome(r) for r in dead}
                msg = f"ranks exited early {dead} while waiting for {name}: {outcomes}\n{self.logs()}"
                raise RuntimeError(msg)
            if time.monotonic() > deadline:
                msg = f"{name} did not appear (as awaited) within {timeout:g} s:\n{self.logs()}"
                raise RuntimeError(msg)
            time.sleep(0.02)

    def wait(self, ranks: list[int], timeout: float) -> dict[int, int | None]:
        """Wait for ``ranks`` to exit (bounded); record when each did, to 20 ms."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rank in ranks:
                if rank not in self.exited and self.procs[rank].poll() is not None:
                    self.exited[rank] = time.time()
            if all(rank in self.exited for rank in ranks):
                break
            time.sleep(0.02)
        return {rank: self.procs[rank].poll() for rank in ranks}

    def dump_stacks_of_the_living(self, ranks: list[int]) -> None:
        """Have every rank of ``ranks`` still running write its threads' stacks into its log."""
        living = [r for r in ranks if self.procs[r].poll() is None]
        for rank in living:
            with contextlib.suppress(ProcessLookupError):
                self.procs[rank].send_signal(signal.SIGUSR1)
        if living:
            time.sleep(1.0)

    def outcome(self, rank: int) -> dict[str, Any] | None:
        path = self.workdir / f"rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def stalls(self) -> dict[int, float]:
        """Each rank's longest event-loop stall (how late a 50 ms sleep woke): eaten from the timeout."""
        found = {}
        for rank in self.procs:
            path = self.workdir / f"stall-{rank}.json"
            if path.exists():
                found[rank] = round(json.loads(path.read_text())["max_stall_s"], 3)
        return found

    def logs(self, tail: int = 12000) -> str:
        return "\n".join(
            f"--- rank {r} ---\n{(self.workdir / f'log-{r}.txt').read_text(errors='replace')[-tail:]}"
            for r in self.procs
        )

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


@contextlib.contextmanager
def spinners(count: int) -> Iterator[None]:
    """``count`` busy processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)


def _base(nranks: int, **extra: Any) -> dict[str, Any]:
    return {"nranks": nranks, "epochs": 1000, "batches": 20, "busy": BATCH_BUSY_S, **extra}


def freeze(
    workdir: Path, nranks: int, target: int, *, link: bool = False, slow_step: float = 0.0
) -> dict[str, Any]:
    """SIGSTOP rank ``target`` (or cut the link) once epoch 0 is done; time the survivors.

    With ``slow_step``, rank 1 first computes that long inside one step of epoch 1 (it must not
    be taken for lost), and the fault comes once epoch 2 is done.
    """
    hosts = None
    with contextlib.ExitStack() as stack:
        prefixes: dict[int, list[str]] = {}
        config = _base(nranks)
        after_epoch = 0
        if slow_step:
            config["slow_step"] = {"rank": 1, "epoch": 1, "batch": 1, "seconds": slow_step}
            after_epoch = 2
        if link:
            sys.path.insert(0, str(HERE.parent.parent / "tests"))
            from netns import ADDRESSES, two_hosts

            hosts = stack.enter_context(two_hosts())
            config["host"] = ADDRESSES["a"]
            prefixes = {r: hosts.run("b" if r == nranks - 1 else "a", []) for r in range(nranks)}
        run = Run(workdir, config, prefixes)
        stack.callback(run.kill)
        # A rank that fails before the fault (a false abort) ends the wait with every rank's outcome.
        run.wait_for_file("progress.json", 300 + slow_step, until=lambda p: p["epoch"] >= after_epoch)
        time.sleep(random.uniform(0.2, 0.8))  # inside a step or a collective of the next epoch
        faulted = time.time()
        if hosts is not None:
            hosts.cut()
        else:
            run.procs[target].send_signal(signal.SIGSTOP)
        survivors = list(range(nranks)) if link else [r for r in range(nranks) if r != target]
        codes = run.wait(survivors, END_WITHIN_S + 30)
        run.dump_stacks_of_the_living(survivors)
        result: dict[str, Any] = {"nranks": nranks, "target": "link" if link else target, "survivors": {}}
        for rank in survivors:
            outcome = run.outcome(rank) or {}
            error = outcome.get("error", {})
            blamed = (0 if rank == nranks - 1 else nranks - 1) if link else target
            took = outcome["failed_at"] - faulted if "failed_at" in outcome else None
            exited = run.exited[rank] - faulted if rank in run.exited else None
            returned_path = run.workdir / f"returned-{rank}.json"
            returned = json.loads(returned_path.read_text()) if returned_path.exists() else {}
            shutdown = run.exited[rank] - returned["returned_at"] if returned and rank in run.exited else None
            result["survivors"][rank] = {
                "status": codes[rank],
                "error": error.get("type"),
                "named": error.get("rank"),
                "how": error.get("how"),
                "failed_after_s": took,
                "exited_after_s": exited,
                "shutdown_s": shutdown,
                "non_daemon_threads": returned.get("non_daemon_threads"),
                "expected": codes[rank] == 1
                and error.get("type") == "PeerLostError"
                and error.get("rank") == blamed
                and error.get("how") == "silent"
                and took is not None
                and took < END_WITHIN_S,
            }
        if slow_step:
            step = json.loads((run.workdir / "slow-step.json").read_text())
            result["slow_step_s"] = step["ended"] - step["began"]
        result["ok"] = all(s["expected"] for s in result["survivors"].values())
        if not result["ok"]:
            result["logs"] = run.logs()
        result["load_average"] = os.getloadavg()
        result["max_loop_stall_s"] = run.stalls()
        return result


def completes(
    workdir: Path, nranks: int, *, slow_step: float = 0.0, checkpoint_gib: float = 0.0, epochs: int = 3
) -> dict[str, Any]:
    """A run with a long step on rank 1 (or long checkpoint writes on the root) must finish, no rank lost."""
    extra: dict[str, Any] = {"epochs": epochs, "batches": 6 * nranks, "timeout": 600}  # 6 per rank
    if slow_step:
        extra["slow_step"] = {"rank": 1, "epoch": 1, "batch": 2, "seconds": slow_step}
    if checkpoint_gib:
        extra["checkpoint_gib"] = checkpoint_gib
    run = Run(workdir, _base(nranks, **extra))
    try:
        began = time.time()
        codes = run.wait(list(range(nranks)), slow_step + 60 * epochs * (1 + checkpoint_gib) + 300)
        outcomes = {r: run.outcome(r) for r in range(nranks)}
        result: dict[str, Any] = {
            "nranks": nranks,
            "codes": codes,
            "seconds": time.time() - began,
            "errors": {r: (o or {}).get("error") for r, o in outcomes.items() if not (o or {}).get("ok")},
            "ok": all(c == 0 for c in codes.values()) and all((o or {}).get("ok") for o in outcomes.values()),
            "load_average": os.getloadavg(),
            "max_loop_stall_s": run.stalls(),
        }
        slow = run.workdir / "slow-step.json"
        if slow.exists():
            step = json.loads(slow.read_text())
            result["slow_step_s"] = step["ended"] - step["began"]
        writes = run.workdir / "checkpoint-writes.json"
        if writes.exists():
            result["checkpoint_writes_s"] = json.loads(writes.read_text())
        if not result["ok"]:
            result["logs"] = run.logs()
        return result
    finally:
        run.kill()


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):.2f} s [{min(values):.2f}-{max(values):.2f}] (n={len(values)})"


def main(argv: list[str]) -> int:
    if argv[:1] == ["child"]:
        import faulthandler

        import anyio

        # Every thread's stack into the log on SIGUSR1: what a survivor that does not exit is blocked in.
        faulthandler.register(signal.SIGUSR1, all_threads=True)

        config, rank = json.loads(Path(argv[1]).read_text()), int(argv[2])
        code = anyio.run(_child, config, rank)
        import threading

        # What could keep this process from exiting once its run returned: a thread the library
        # left running that Python's exit would join.  Checked here, not inferred from timing:
        # each is given 5 s to end (anyio's idle worker threads are told to stop as the event
        # loop closes, and may still be ending), and those still running are named.
        returned_at = time.time()
        staying = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        for thread in staying:
            thread.join(timeout=max(0.0, returned_at + 5.0 - time.time()))
        _write(
            Path(config["workdir"]) / f"returned-{rank}.json",
            {
                "returned_at": returned_at,
                "non_daemon_threads": [t.name for t in staying if t.is_alive()],
            },
        )
        if not os.environ.get("STRESS_PLAIN_EXIT"):
            # Python's final garbage collection walks torch's whole heap (about 0.9 s of CPU,
            # 4-6 s at load 15-24, up to 10 s at load 28): frozen, the process exits in under a
            # second after its error.  STRESS_PLAIN_EXIT=1 measures the plain exit.
            import gc

            gc.freeze()
        if os.environ.get("STRESS_DUMP_EXIT"):  # where the time between the error and the exit goes
            import atexit
            import threading

            print(f"returning at {time.time():.3f}; threads: {threading.enumerate()}", flush=True)
            atexit.register(lambda: print(f"atexit at {time.time():.3f}", flush=True))
            faulthandler.dump_traceback_later(float(os.environ["STRESS_DUMP_EXIT"]), repeat=True)
        return code
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--spinners", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("--load-faults", action="store_true", help="also load the machine during the faults")
    parser.add_argument("--slow-step", type=float, default=60.0)
    parser.add_argument("--checkpoint-gib", type=float, default=2.0)
    parser.add_argument("--only", nargs="*", default=["freeze", "link", "slow-step", "checkpoint"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/stress-liveness"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from lamploop.control import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S

    report: dict[str, Any] = {
        "heartbeat_interval_s": DEFAULT_HEARTBEAT_INTERVAL_S,
        "heartbeat_timeout_s": DEFAULT_HEARTBEAT_TIMEOUT_S,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "runs": [],
    }
    print(f"heartbeat every {DEFAULT_HEARTBEAT_INTERVAL_S:g} s, lost after {DEFAULT_HEARTBEAT_TIMEOUT_S:g} s")
    ok = True
    n = 0

    def record(name: str, result: dict[str, Any]) -> None:
        nonlocal ok
        ok = ok and bool(result["ok"])
        report["runs"].append({"scenario": name, **{k: v for k, v in result.items() if k != "logs"}})
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1, default=str))
        line = {k: v for k, v in result.items() if k not in ("logs",)}
        print(name, json.dumps(line, default=str), flush=True)
        if not result["ok"]:
            print(result.get("logs", ""), flush=True)

    load = spinners(args.spinners) if args.load_faults else contextlib.nullcontext()
    with load:
        faults = [("freeze", nranks, target) for nranks in (2, 3) for target in (nranks - 1, 0)]
        faults += [("link", nranks, -1) for nranks in (2, 3)]
        for _ in range(args.repeat):
            for kind, nranks, target in faults:
                if kind not in args.only:
                    continue
                n += 1
                who = "link" if target < 0 else ("root" if target == 0 else f"rank{target}")
                name = f"{kind}-{who}-of-{nranks}"
                try:
                    result = freeze(args.workdir / f"{n}-{name}", nranks, target, link=kind == "link")
                except BaseException as exc:  # a skipped netns (not root) or a run that did not start
                    if type(exc).__name__ == "Skipped":
                        print(f"{name}: skipped ({exc})")
                        continue
                    result = {"ok": False, "crashed": repr(exc)}
                record(name, result)
    with spinners(args.spinners):
        if "slow-step" in args.only:
            for nranks in (2, 3):
                n += 1
                record(
                    f"slow-step-{args.slow_step:g}s-of-{nranks}",
                    completes(args.workdir / f"{n}-slow", nranks, slow_step=args.slow_step),
                )
        if "checkpoint" in args.only:
            n += 1
            record(
                f"checkpoint-{args.checkpoint_gib:g}GiB-of-2",
                completes(args.workdir / f"{n}-checkpoint", 2, checkpoint_gib=args.checkpoint_gib),
            )
    print("\nsummary (from the fault to each survivor's error / exit):")
    by: dict[str, tuple[list[float], list[float]]] = {}
    for run in report["runs"]:
        for survivor in run.get("survivors", {}).values():
            failed, exited = by.setdefault(run["scenario"], ([], []))
            if survivor["failed_after_s"] is not None:
                failed.append(survivor["failed_after_s"])
            if survivor["exited_after_s"] is not None:
                exited.append(survivor["exited_after_s"])
    for scenario, (failed, exited) in sorted(by.items()):
        print(f"  {scenario}: error {_summary(failed)}; exit {_summary(exited)}")
    for run in report["runs"]:
        if "survivors" not in run:
            details = {k: v for k, v in run.items() if k != "scenario"}
            print(f"  {run['scenario']}: {json.dumps(details, default=str)}")
    print(f"load average at the end: {os.getloadavg()}; all as expected: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
