"""Sync strategies that send less: bytes per step, ms per step and accuracy, on 2 ranks (Gloo).

Usage::

    python benchmarks/bench_strategies.py --json bench-results/strategies.json [--quick]
    python benchmarks/bench_strategies.py --slowlink --json bench-results/strategies-slowlink.json

Set-up.  Two worker processes (this script again, ``--worker RANK``; nothing pickled),
``torch.set_num_threads(1)`` each, train the same seeded MLP ``64-2048-2048-2048-10``
(8.55M parameters) on scikit-learn's digits (1797 8x8 images, features / 16; a seeded
split of 1437 training and 360 validation images; the training images dealt to the ranks
alternately, 32 per rank per batch, 23 steps per epoch) with ``SGD(lr=0.02, momentum=0.9)``
through :func:`lamploop.one_epoch`, one contender per strategy, each with its own model,
optimizer and Gloo group: ``all_reduce`` (the baseline), ``all_reduce_bf16``,
``all_reduce_fp16``, ``powersgd4``, ``local_sgd8``, ``diloco8``.

Loopback phase (always): every epoch runs every contender's epoch in turn, in an order
rotated from epoch to epoch, each timed on rank 0 between two barriers; "ms/step" is
epoch time / steps.  Epoch 0 is a warm-up and not counted.  The ratio of a contender to
``all_reduce`` is taken per epoch (they ran seconds apart) and summarised by median and
IQR.  Bytes per step are the sizes of the tensors this rank handed to collectives during
the epoch (a counting wrapper around the process group), over the steps, so they include
the loop's small per-step count and loss sum.  Accuracy is the validation accuracy after
the last epoch (every rank holds the same parameters then).

``--slowlink`` adds the shaped phase: two network namespaces joined by a veth pair, each
end shaped with ``tc netem delay 5ms rate 100mbit`` (where the kernel lacks ``sch_netem``,
as this project's CI VM does, ``tc tbf rate 100mbit``: the rate without the delay, and the
output says so), addresses 10.200.0.1/30 and 10.200.0.2/30 inside them only; created
before and always removed after (also on failure or Ctrl-C).  The workers run inside them
and time every contender on the first 16 steps of an epoch (8 with ``--quick``: local SGD
H=8 then averages once or twice), repeated with rotated orders after one warm-up round;
accuracy there is the loopback phase's (the link changes no number).
Where namespaces cannot be made (not root, no ``ip``/``tc``) it says why and times on
loopback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, print_table, summarize, write_json

import lamploop
from lamploop import SupervisedModel, one_epoch
from lamploop.distributed.process_group import new_process_group
from lamploop.sync import Collectives
from lamploop.sync.group_channel import ProcessGroupChannel

BASELINE = "all_reduce"
CONTENDERS = (BASELINE, "all_reduce_bf16", "all_reduce_fp16", "powersgd4", "local_sgd8", "diloco8")
TARGETS = {"powersgd4": 3.0, "local_sgd8": 4.0}
"""Speed-up over all_reduce per step on the shaped link that the issue asks for."""
ACCURACY_TOLERANCE = 0.01
LAYERS = (64, 2048, 2048, 2048, 10)
BATCH = 32
LR, MOMENTUM = 0.02, 0.9
SEED = 0
WORLD = 2
EPOCHS = (6, 3)  # (full, quick), the first a warm-up
SHAPED_STEPS = (16, 8)
SHAPED_ROUNDS = (3, 2)
DELAY_MS, RATE_MBIT = 5, 100
TIMEOUT_S = 300.0
WORKER_DEADLINE_S = (1500, 600)
ADDRESSES = ("10.200.0.1", "10.200.0.2")

Batches = list[tuple[torch.Tensor, torch.Tensor]]


# =========================================================================== worker side


def make_module() -> nn.Module:
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for i in range(len(LAYERS) - 1):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(LAYERS[i], LAYERS[i + 1]))
    return nn.Sequential(*layers)


def digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The seeded training and validation sets."""
    from sklearn.datasets import load_digits  # the benchmark's own dependency, imported where used

    x_all, y_all = load_digits(return_X_y=True)
    x = torch.tensor(x_all, dtype=torch.float32) / 16.0
    y = torch.tensor(y_all, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    train, valid = order[:1437], order[1437:]
    return (x[train], y[train]), (x[valid], y[valid])


def shard(rank: int) -> Batches:
    """Rank ``rank``'s training batches: images ``rank, rank + 2, ...`` of the training set."""
    (x, y), _ = digits()
    mine = torch.arange(rank, len(x), WORLD)
    return [(x[mine[s : s + BATCH]], y[mine[s : s + BATCH]]) for s in range(0, len(mine), BATCH)]


class CountingGroup:
    """A process group that adds up the bytes of the tensors handed to its collectives."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.bytes = 0

    def _count(self, tensors: list[torch.Tensor]) -> None:
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)

    def allreduce(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        self._count(tensors)
        return self.group.allreduce(tensors, *args)

    def broadcast(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        self._count(tensors)
        return self.group.broadcast(tensors, *args)

    def reduce(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        self._count(tensors)
        return self.group.reduce(tensors, *args)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.group, attribute)


class Contender:
    def __init__(self, name: str, store: dist.Store, rank: int, host: str) -> None:
        self.name = name
        group = new_process_group(
            store,
            rank=rank,
            nranks=WORLD,
            device=torch.device("cpu"),
            timeout=TIMEOUT_S,
            prefix=name,
            root_host=host,
        )
        self.group = CountingGroup(group)
        collectives = Collectives(
            self.group, rank=rank, nranks=WORLD, device=torch.device("cpu"), timeout=TIMEOUT_S
        )
        self.channel = ProcessGroupChannel(collectives, lamploop.sync.strategy_named(name))
        self.module = make_module()
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        self.model = SupervisedModel(self.module)

    async def epoch(self, batches: Batches) -> tuple[float, int]:
        """One training pass; (loss, bytes handed to collectives)."""
        before = self.group.bytes

        async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            for batch in batches:
                yield batch

        loss = await one_epoch(
            model=self.model, batches=stream(), channel=self.channel, step_optimizer=self.optimizer.step
        )
        return float(loss), self.group.bytes - before

    def accuracy(self, valid: tuple[torch.Tensor, torch.Tensor]) -> float:
        self.module.eval()
        with torch.no_grad():
            return float((self.module(valid[0]).argmax(1) == valid[1]).float().mean())


class Worker:
    def __init__(self, rank: int, store: dist.Store, host: str) -> None:
        self.rank = rank
        self.bench = new_process_group(
            store,
            rank=rank,
            nranks=WORLD,
            device=torch.device("cpu"),
            timeout=TIMEOUT_S,
            prefix="bench",
            root_host=host,
        )
        self.contenders = {name: Contender(name, store, rank, host) for name in CONTENDERS}
        self.batches = shard(rank)
        self.valid = digits()[1]

    def barrier(self) -> None:
        self.bench.allreduce([torch.zeros(1)]).wait(datetime.timedelta(seconds=TIMEOUT_S))

    async def timed(self, name: str, batches: Batches) -> dict[str, float]:
        self.barrier()
        began = time.perf_counter()
        loss, sent = await self.contenders[name].epoch(batches)
        self.barrier()
        return {"seconds": time.perf_counter() - began, "bytes": sent, "loss": loss}

    async def loopback(self, epochs: int) -> dict[str, Any]:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
        for epoch in range(epochs):
            order = CONTENDERS[epoch % len(CONTENDERS) :] + CONTENDERS[: epoch % len(CONTENDERS)]
            for name in order:
                runs[name].append(await self.timed(name, self.batches))
            if self.rank == 0:
                print(
                    f"epoch {epoch}: " + ", ".join(f"{n} {runs[n][-1]['seconds']:.1f}s" for n in CONTENDERS),
                    flush=True,
                )
        accuracy = {name: c.accuracy(self.valid) for name, c in self.contenders.items()}
        return {"steps": len(self.batches), "runs": runs, "accuracy": accuracy}

    async def shaped(self, steps: int, rounds: int) -> dict[str, Any]:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
        batches = self.batches[:steps]
        for r in range(rounds + 1):  # round 0: warm-up on this link
            order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
            for name in order:
                result = await self.timed(name, batches)
                if r:
                    runs[name].append(result)
                if self.rank == 0:
                    print(f"round {r} {name}: {result['seconds']:.2f} s", flush=True)
        return {"steps": steps, "runs": runs}


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rendezvous = Path(args.rendezvous)
    host = args.host
    if args.worker == 0:
        store = dist.TCPStore(
            host,
            0,
            WORLD,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        (rendezvous / "port.tmp").write_text(str(store.port))
        (rendezvous / "port.tmp").replace(rendezvous / "port")
    else:
        deadline = time.monotonic() + 180  # rank 0 may start slowly on a loaded machine
        while not (rendezvous / "port").exists():
            if time.monotonic() > deadline:
                print("rank 1: rank 0 never published its store's port", file=sys.stderr)
                return 1
            time.sleep(0.05)
        port = int((rendezvous / "port").read_text())
        store = dist.TCPStore(
            host, port, WORLD, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
        )
    worker = Worker(args.worker, store, host)
    q = 1 if args.quick else 0
    if args.phase == "loopback":
        result = anyio.run(worker.loopback, EPOCHS[q])
    else:
        result = anyio.run(worker.shaped, SHAPED_STEPS[q], SHAPED_ROUNDS[q])
    if args.worker == 0:
        (rendezvous / "result.json").write_text(json.dumps(result))
    return 0


# =========================================================================== driver side


def run_workers(phase: str, quick: bool, *, namespaces: tuple[str, str] | None) -> dict[str, Any]:
    """Start both ranks (inside ``namespaces`` if given), wait for them, return rank 0's result."""
    host = ADDRESSES[0] if namespaces else "127.0.0.1"
    deadline = WORKER_DEADLINE_S[1 if quick else 0]
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        processes = []
        for rank in range(WORLD):
            argv = [
                sys.executable,
                __file__,
                "--worker",
                str(rank),
                "--phase",
                phase,
                "--host",
                host,
                "--rendezvous",
                tmp,
            ]
            argv += ["--quick"] if quick else []
            if namespaces:
                argv = ["ip", "netns", "exec", namespaces[rank], *argv]
            processes.append(subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        try:
            began = time.monotonic()
            # Poll both: a rank that fails ends the run at once (its peer would wait for it).
            while any(p.poll() is None for p in processes):
                if any(p.poll() not in (None, 0) for p in processes):
                    break
                if time.monotonic() - began > deadline:
                    msg = f"the {phase} workers did not finish within {deadline} s"
                    raise RuntimeError(msg)
                time.sleep(0.2)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)
        codes = [p.returncode for p in processes]
        if any(codes):
            msg = f"the {phase} workers failed with exit codes {codes}"
            raise RuntimeError(msg)
        return json.loads((Path(tmp) / "result.json").read_text())


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _shape(namespace: str, device: str) -> str:
    """Shape ``device``'s egress: netem (delay and rate) if the kernel has it, else tbf (rate only).

    Returns what was applied.  Some kernels (this project's CI VM) lack ``sch_netem``.
    """
    netem = ["netem", "delay", f"{DELAY_MS}ms", "rate", f"{RATE_MBIT}mbit", "limit", "100000"]
    tbf = ["tbf", "rate", f"{RATE_MBIT}mbit", "burst", "64kb", "latency", "100ms"]
    for qdisc, applied in (
        (netem, f"netem {DELAY_MS} ms + {RATE_MBIT} Mbit/s"),
        (tbf, f"tbf {RATE_MBIT} Mbit/s, no delay"),
    ):
        command = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", *qdisc]
        done = subprocess.run(command, capture_output=True, timeout=10, check=False)
        if done.returncode == 0:
            return applied
        if b"unknown" not in done.stderr:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    msg = "neither netem nor tbf is available"
    raise subprocess.CalledProcessError(1, "tc", b"", msg.encode())


@contextlib.contextmanager
def shaped_link() -> Iterator[tuple[tuple[str, str], str] | str]:
    """Two namespaces joined by a shaped veth pair: (their names, the shaping), or why not (a str).

    Both namespaces are removed on the way out, whatever happened inside.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        yield "network namespaces need root and the `ip` and `tc` commands"
        return
    tag = f"llbs{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    try:
        why_not = None
        try:
            for ns in names:
                _ip("netns", "add", ns)
            _ip(
                "link",
                "add",
                f"v{tag}a",
                "netns",
                names[0],
                "type",
                "veth",
                "peer",
                "name",
                f"v{tag}b",
                "netns",
                names[1],
            )
            shaping = []
            for ns, which, address in zip(names, "ab", ADDRESSES, strict=True):
                device = f"v{tag}{which}"
                _ip("-n", ns, "addr", "add", f"{address}/30", "dev", device)
                _ip("-n", ns, "link", "set", device, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                shaping.append(_shape(ns, device))
        except subprocess.CalledProcessError as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
            why_not = f"cannot make the shaped link: {stderr.strip()}"
        if why_not is not None:
            for ns in names:  # gone before the fallback runs
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10, check=False)
            yield why_not
        else:
            yield names, shaping[0]
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10, check=False)


def per_step(runs: list[dict[str, float]], steps: int, skip: int) -> list[float]:
    return [r["seconds"] / steps * 1e3 for r in runs[skip:]]


def speedups(result: dict[str, Any], name: str, skip: int) -> list[float]:
    """Per repetition: all_reduce's time over ``name``'s (the two ran seconds apart)."""
    base, other = result["runs"][BASELINE][skip:], result["runs"][name][skip:]
    return [b["seconds"] / o["seconds"] for b, o in zip(base, other, strict=True)]


def fmt_spread(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['q1']:.{digits}f}, {s['q3']:.{digits}f}]"


def verdict(speedup: dict[str, float], target: float) -> str:
    if speedup["q1"] >= target:
        return f"met (>= {target:g}x)"
    if speedup["q3"] < target:
        return f"MISSED (< {target:g}x)"
    return f"inconclusive (IQR straddles {target:g}x)"


def report(phase: str, result: dict[str, Any], accuracy: dict[str, float], skip: int) -> list[dict[str, Any]]:
    steps = result["steps"]
    rows, table = [], []
    for name in CONTENDERS:
        ms = summarize(per_step(result["runs"][name], steps, skip))
        sent = statistics.median(r["bytes"] / steps for r in result["runs"][name][skip:])
        speed = summarize(speedups(result, name, skip))
        acc_gap = accuracy[name] - accuracy[BASELINE]
        row = {
            "strategy": name,
            "bytes_per_step": sent,
            "ms_per_step": ms,
            "speedup_vs_all_reduce": speed,
            "accuracy": accuracy[name],
        }
        target = TARGETS.get(name)
        check = ""
        if target is not None and phase == "shaped":
            row["target"] = verdict(speed, target)
            accuracy_ok = acc_gap >= -ACCURACY_TOLERANCE
            row["accuracy_within_1_point"] = accuracy_ok
            check = f"{row['target']}; accuracy {'ok' if accuracy_ok else 'MISSED'}"
        rows.append(row)
        table.append(
            [
                name,
                f"{sent / 2**20:.2f}",
                fmt_spread(ms),
                f"{fmt_spread(speed, 2)} ({speed['min']:.2f}-{speed['max']:.2f})",
                f"{100 * accuracy[name]:.1f}",
                check,
            ]
        )
    headers = ["strategy", "MiB/step", "ms/step [IQR]", "x all_reduce [IQR] (min-max)", "val acc %", "target"]
    print_table(headers, table)
    return rows


def main() -> int:
    parser = make_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument(
        "--slowlink", action="store_true", help="also time on a shaped veth link between namespaces"
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="loopback", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker_main(args)
    try:
        import sklearn  # noqa: F401  (checked here: the workers would fail one by one)
    except ImportError:
        print("bench_strategies.py needs scikit-learn (its digits data set): pip install scikit-learn")
        return 2
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    params = sum(p.numel() for p in make_module().parameters())
    print(f"model: {params / 1e6:.2f}M parameters; {WORLD} ranks; batch {BATCH} per rank", flush=True)
    loopback = run_workers("loopback", args.quick, namespaces=None)
    accuracy = loopback["accuracy"]
    print(f"\nloopback ({loopback['steps']} steps per epoch, epoch 0 a warm-up):")
    payload: dict[str, Any] = {"parameters": params, "loopback": report("loopback", loopback, accuracy, 1)}
    if args.slowlink:
        with shaped_link() as link:
            if isinstance(link, str):
                print(f"\nno shaped link ({link}): timing on loopback instead", flush=True)
                shaped = run_workers("shaped", args.quick, namespaces=None)
                payload["shaped_link"] = None
                payload["shaped_link_unavailable"] = link
            else:
                names, shaping = link
                print(f"\nshaped link: veth {names[0]} <-> {names[1]}, each end: {shaping}", flush=True)
                shaped = run_workers("shaped", args.quick, namespaces=names)
                payload["shaped_link"] = {"namespaces": names, "shaping": shaping}
        print(f"\nshaped ({shaped['steps']} steps per repetition; accuracy from the loopback phase):")
        payload["shaped"] = report("shaped", shaped, accuracy, 0)
    load_after = os.getloadavg()
    print(
        f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (2 cores, shared)"
    )
    payload["load_average"] = {"before": load_before, "after": load_after}
    if args.json:
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
