"""SIGKILL during sharded checkpoint writes: the previous checkpoint stays loadable.

    python benchmarks/stress_sharded_kills.py [--kills 20] [--nranks 2] [--fit]

Each round starts ``--nranks`` processes (this script again, ``--worker RANK``) that shard an
MLP (4 x Linear(512, 512), float32, Adam state) over a Gloo group on 127.0.0.1 and write
sharded checkpoints into one root as fast as they can (epoch 1, 2, ...; ``keep_last=2``).
Once the root has a ``latest`` (the round's first checkpoint, or the previous rounds'), the
script waits a random 0-1.5 s and SIGKILLs one rank chosen at random, then the others.
It then checks what ``latest`` names: :func:`lamploop.checkpoint.sharded.verify_sharded` finds
no problem and :func:`~lamploop.checkpoint.sharded.read_full` reads it, and every tensor equals
the one the writers put there (each checkpoint's parameters are the epoch number, so a torn
or mixed checkpoint shows).  Exits 1 on the first checkpoint that fails.

``--fit``: the checkpoints ``fit(strategy="fsdp", world_size=--nranks)`` writes (one ordinary
checkpoint directory, written by rank 0, holding every rank's shard file and ``sharded.json``
beside the descriptor, the RNG states and the optimizer's param groups: see
:class:`lamploop.checkpoint.sharded.ShardWriter`), after every step (``keep_last=2``), same MLP,
Adam.  Each round is a ``fit`` that resumes from the run directory's ``latest``.  Once the
round has written a checkpoint of its own, the script waits a random 0-1 s, then for a write to
be under way (a temporary checkpoint directory exists), then a random 0-40 ms more, and
SIGKILLs one rank chosen at random, then the others.  It then checks that ``latest`` names the
checkpoint :func:`lamploop.checkpoint.verify_checkpoint` reports on, with no problem, that
:func:`~lamploop.checkpoint.load_checkpoint` loads it (one process: the whole model, gathered
from the shards) with finite parameters and Adam state of every parameter, and that it is not
older than the previous round's.  Printed: how many kills came while a write was under way.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import shutil
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


def fit_worker(root: Path, nranks: int, pids: Path) -> None:
    """One round's ``fit`` (rank 0 without a launcher: it starts the others with this command line)."""
    import lamploop
    from lamploop.distributed.launch import launch_env

    torch.set_num_threads(1)
    env = launch_env()
    rank = 0 if env is None else env.rank
    (pids / f"rank{rank}.pid").write_text(str(os.getpid()))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64 * nranks, 512, generator=generator)
    y = torch.randint(0, 512, (64 * nranks,), generator=generator)
    extra: dict[str, object] = {}
    if env is None:
        extra["launch_command"] = [sys.executable, *sys.argv]
    torch.manual_seed(0)
    lamploop.fit(
        model=lamploop.SupervisedModel(_model()),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-4),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, seed=1),
        validation_batches=None,
        max_epochs=100_000,
        strategy="fsdp",
        world_size=nranks,
        checkpoint_dir=str(root),
        checkpoint_every_n_steps=1,
        keep_last=2,
        device="cpu",
        reporters=[],
        **extra,  # type: ignore[arg-type]
    )


def check_fit(root: Path, previous: tuple[int, int] | None) -> tuple[str | None, tuple[int, int]]:
    """What is wrong with the fit checkpoint ``latest`` names (``None``: nothing), and its (epoch, step)."""
    from lamploop.checkpoint import load_checkpoint, verify_checkpoint

    name = (root / "latest").read_text().strip()
    position = _position(name)
    report = verify_checkpoint(root)
    if not report.ok or report.path.name != name:
        return f"{name}: verify reports on {report.path.name}: {report.problems}", position
    checkpoint = load_checkpoint(root)
    if checkpoint.path.name != name:
        return f"{name}: load_checkpoint loaded {checkpoint.path.name}", position
    model = checkpoint.state.model
    if set(model) != set(_model().state_dict()):
        return f"{name}: the model's keys are {sorted(model)}", position
    if not all(bool(t.isfinite().all()) for t in model.values()):
        return f"{name}: a parameter is not finite", position
    states = checkpoint.state.optimizer.get("state", {})
    if len(states) != len(model) or not all({"exp_avg", "exp_avg_sq"} <= set(s) for s in states.values()):
        return f"{name}: the optimizer state is not Adam's for every parameter", position
    if previous is not None and position < previous:
        return f"{name}: older than the previous round's {previous}", position
    return None, position


def _position(name: str) -> tuple[int, int]:
    """(epochs done, steps done since) of a checkpoint's name: ``epoch-000003`` (3, 0) comes before
    ``epoch-000003-step-000002`` (3, 2), two steps into the next epoch."""
    parts = name.split("-")
    return int(parts[1]), int(parts[3]) if len(parts) > 3 else 0


def _writing(root: Path, pid: int) -> bool:
    """Whether process ``pid`` (rank 0) is writing a checkpoint: its temporary directory exists."""
    from lamploop.checkpoint.format import _TMP_PREFIX

    return any(p.name.startswith(_TMP_PREFIX) and f"-{pid}-" in p.name for p in root.iterdir())


def main_fit(kills: int, nranks: int) -> int:
    """The ``--fit`` rounds (see the module doc)."""
    rng = random.Random(1)
    during_writes = 0
    previous: tuple[int, int] | None = None
    with tempfile.TemporaryDirectory() as scratch:
        root, pids = Path(scratch) / "run", Path(scratch) / "pids"
        root.mkdir()
        for kill in range(kills):
            shutil.rmtree(pids, ignore_errors=True)
            pids.mkdir()
            command = [sys.executable, __file__, "--fit-worker", "--nranks", str(nranks)]
            command += ["--root", str(root), "--pids", str(pids)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("LAMPLOOP_")}
            rank0 = subprocess.Popen(
                command, env={**env, "OMP_NUM_THREADS": "1"}, start_new_session=True, stderr=subprocess.PIPE
            )
            try:
                before = (root / "latest").read_text() if (root / "latest").exists() else None
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:  # the round has written a checkpoint of its own
                    now = (root / "latest").read_text() if (root / "latest").exists() else None
                    if now is not None and now != before:
                        break
                    if rank0.poll() is not None:
                        _, err = rank0.communicate()
                        print(f"round {kill + 1}: fit ended ({rank0.returncode}) before a checkpoint:")
                        print(err.decode(errors="replace")[-4000:])
                        return 1
                    time.sleep(0.02)
                else:
                    print(f"round {kill + 1}: no checkpoint within 180 s")
                    return 1
                time.sleep(rng.uniform(0.0, 1.0))
                waited = time.monotonic() + 10
                while not _writing(root, rank0.pid) and time.monotonic() < waited:
                    time.sleep(0.002)
                time.sleep(rng.uniform(0.0, 0.04))
                victim = rng.randrange(nranks)
                writing = _writing(root, rank0.pid)
                os.kill(int((pids / f"rank{victim}.pid").read_text()), signal.SIGKILL)
                during_writes += writing
                time.sleep(0.2)
            finally:
                for pid_file in pids.glob("rank*.pid"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid_file.read_text()), signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank0.pid, signal.SIGKILL)
                rank0.wait(timeout=30)
            problem, previous = check_fit(root, previous)
            name = (root / "latest").read_text().strip()
            verdict = "ok" if problem is None else problem
            where = "during a write" if writing else "between writes"
            print(f"kill {kill + 1}: rank {victim} killed {where}; latest {name}: {verdict}", flush=True)
            if problem is not None:
                return 1
    print(
        f"{kills} kills ({during_writes} while a checkpoint write was under way), every latest checkpoint "
        f"verified and loaded; load average {os.getloadavg()}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--nranks", type=int, default=2)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fit", action="store_true", help="kill during fit(strategy='fsdp')'s checkpoints")
    parser.add_argument("--fit-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pids", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_worker:
        fit_worker(args.root, args.nranks, args.pids)
        return 0
    if args.fit:
        return main_fit(args.kills, args.nranks)
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
