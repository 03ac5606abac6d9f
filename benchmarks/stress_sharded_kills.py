"""SIGKILL during sharded checkpoint writes: the previous checkpoint stays loadable.

    python benchmarks/stress_sharded_kills.py [--kills 20] [--nranks 2]

Each round starts ``--nranks`` processes (this script again, ``--worker RANK``) that shard an
MLP (4 x Linear(512, 512), float32, Adam state) over a Gloo group on 127.0.0.1 and write
sharded checkpoints into one root as fast as they can (epoch 1, 2, ...; ``keep_last=2``).
Once the root has a ``latest`` (the round's first checkpoint, or the previous rounds'), the
script waits a random 0-1.5 s and SIGKILLs one rank chosen at random, then the others.
It then checks what ``latest`` names: :func:`lamploop.checkpoint.sharded.verify_sharded` finds
no problem and :func:`~lamploop.checkpoint.sharded.read_full` reads it, and every tensor equals
the one the writers put there (each checkpoint's parameters are the epoch number, so a torn
or mixed checkpoint shows).  Exits 1 on the first checkpoint that fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _model() -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])


def worker(root: Path, rank: int, nranks: int, port: int) -> None:
    from lamploop.checkpoint.sharded import load_sharded, save_sharded
    from lamploop.distributed.process_group import new_process_group
    from lamploop.sync.collectives import Collectives
    from lamploop.sync.fsdp import FullyShard

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, nranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    cpu = torch.device("cpu")
    group = new_process_group(store, rank=rank, nranks=nranks, device=cpu, timeout=60, prefix="kills")
    collectives = Collectives(group, rank=rank, nranks=nranks, device=cpu, timeout=60)
    module = _model()
    FullyShard().shard(collectives, module)
    optimizer = torch.optim.Adam(module.parameters())
    epoch = 0
    if (root / "latest").exists():
        epoch = int(load_sharded(root, module=module, optimizer=optimizer)["epoch"])
    while True:
        epoch += 1
        with torch.no_grad():
            for p in module.parameters():
                p.to_local().fill_(float(epoch))  # type: ignore[attr-defined]
        for p in module.parameters():  # Adam state as well, filled with the epoch too
            optimizer.state[p] = {
                "step": torch.tensor(float(epoch)),
                "exp_avg": p.detach().clone(),
                "exp_avg_sq": p.detach().clone(),
            }
        save_sharded(root, collectives=collectives, module=module, optimizer=optimizer, epoch=epoch,
                     meta={"epoch": epoch}, keep_last=2)  # fmt: skip


def check(root: Path) -> str | None:
    """What is wrong with the checkpoint ``latest`` names (``None``: nothing)."""
    from lamploop.checkpoint.sharded import read_full, verify_sharded

    name = (root / "latest").read_text().strip()
    problems = verify_sharded(root / name)
    if problems:
        return f"{name}: {problems}"
    model, optimizer, meta = read_full(root)
    epoch = float(meta["epoch"])
    for key, tensor in model.items():
        if key.endswith(("weight", "bias")) and not bool((tensor == epoch).all()):
            return f"{name}: {key} is not all {epoch}"
    for state in optimizer["state"].values():
        if not all(bool((t == epoch).all()) for t in state.values()):
            return f"{name}: optimizer state is not all {epoch}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--nranks", type=int, default=2)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.root, args.worker, args.nranks, args.port)
        return 0
    import socket

    rng = random.Random(0)
    checked = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for kill in range(args.kills):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            command = [
                sys.executable,
                __file__,
                "--nranks",
                str(args.nranks),
                "--root",
                str(root),
                "--port",
                str(port),
            ]
            procs = [
                subprocess.Popen(
                    [*command, "--worker", str(rank)], env={**os.environ, "OMP_NUM_THREADS": "1"}
                )
                for rank in range(args.nranks)
            ]
            try:
                before = (root / "latest").read_text() if (root / "latest").exists() else None
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:  # the round's own first write has begun
                    now = (root / "latest").read_text() if (root / "latest").exists() else None
                    if now is not None and now != before:
                        break
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 1.5))
                victim = rng.randrange(args.nranks)
                procs[victim].send_signal(signal.SIGKILL)
                time.sleep(0.2)
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGKILL)
                    proc.wait(timeout=30)
            problem = check(root)
            name = (root / "latest").read_text().strip()
            verdict = "ok" if problem is None else problem
            print(f"kill {kill + 1}: rank {victim} killed; latest {name}: {verdict}")
            if problem is not None:
                return 1
            checked.append(name)
    print(f"{len(checked)} kills, every latest checkpoint verified and read; load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
