"""A real 2-rank run while strangers flood the root's control port: what it costs the root.

Usage::

    python benchmarks/bench_hostile.py --json bench-results/hostile.json [--quick] [--pairs N] [--epochs N]

Two runs of the same training (2 processes on Gloo, the TCP control channel, a small MLP,
a fixed number of epochs), one undisturbed and one while this process sends the root's
control port, from the moment it listens:

1. 10,000 random byte strings (one per connection, on 50 connections at a time);
2. 64 hellos announcing 4 MB each, before authentication;
3. 300 connections that say nothing, held open until the run ends;
4. 100 new connections a second (garbage, then closed) until the run ends.

Reported, for each of ``--pairs`` pairs of runs (undisturbed and flooded, the order
alternating from pair to pair: undisturbed first in pairs 0, 2, ...): the root
process's CPU time (``/proc/<pid>/stat``, user + system) in each run, the extra share the
flood cost and that extra divided by the strangers sent, the run's wall time, how many
strangers were sent, and whether the disturbed run's final parameters equal the undisturbed run's bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, make_parser, print_table, write_json

import lamploop
from lamploop.control import TcpControlFollower, TcpControlRoot

TOKEN = "bench-hostile-token"
EPOCHS, QUICK_EPOCHS = 40, 12


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(4096, 32, generator=generator), torch.randint(0, 4, (4096,), generator=generator)


def _model() -> lamploop.SupervisedModel:
    torch.manual_seed(5)
    return lamploop.SupervisedModel(
        torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    )


async def _rank(rank: int, workdir: Path, epochs: int) -> None:
    x, y = _data()
    model = _model()
    common = {
        "nranks": 2,
        "device": "cpu",
        "model": model,
        "train_batches": lamploop.tensor_batches(x, y, batch_size=64, seed=1),
        "validation_batches": None,
        "optimizer_factory": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    }
    spec = lamploop.model_spec(model.module)
    if rank == 0:
        async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=spec) as root:
            (workdir / "port").write_text(str(root.address[1]))
            await lamploop.drive_distributed_training(control=root, max_epochs=epochs, **common)
            (workdir / "refused").write_text(str(len(root.recent_refusals)))
    else:
        while not (workdir / "port").exists():  # noqa: ASYNC110 -- another process writes it
            await anyio.sleep(0.01)
        port = int((workdir / "port").read_text())
        async with TcpControlFollower(
            host="127.0.0.1", port=port, rank=1, nranks=2, token=TOKEN, model_spec=spec
        ) as follower:
            await lamploop.follow_distributed_training(rank=1, control=follower, **common)
    save_file(
        {k: v.contiguous() for k, v in model.module.state_dict().items()}, str(workdir / f"rank{rank}.st")
    )


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Flood:
    """Strangers on the root's port, from a few threads of this process, until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.sent = {"random": 0, "big hellos": 0, "silent": 0, "per second": 0}
        self.silent: list[socket.socket] = []

    def _connect(self) -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", self.port), timeout=5)
        except OSError:
            return None

    def _send_and_close(self, data: bytes, key: str) -> None:
        s = self._connect()
        if s is None:
            return
        with s, contextlib.suppress(OSError):
            s.sendall(data)
        self.sent[key] += 1

    def random_strings(self, count: int) -> None:
        for _ in range(count):
            if self.stop.is_set():
                return
            self._send_and_close(os.urandom(64), "random")

    def run(self) -> None:
        workers = [threading.Thread(target=self.random_strings, args=(10_000 // 50,)) for _ in range(50)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for _ in range(64):
            self._send_and_close((4 * 1024 * 1024).to_bytes(4, "big") + b"{" * 4096, "big hellos")
        for _ in range(300):
            s = self._connect()
            if s is not None:
                self.silent.append(s)
                self.sent["silent"] += 1
        while not self.stop.is_set():
            started = time.monotonic()
            for _ in range(100):
                self._send_and_close(b"\x00\x00\x00\x08garbage!", "per second")
            self.stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))
        for s in self.silent:
            s.close()


def _run(workdir: Path, epochs: int, flood: bool) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--rank"]
    started = time.monotonic()
    procs = [subprocess.Popen([*argv, str(r), str(workdir), str(epochs)], env=env) for r in (0, 1)]
    attack: Flood | None = None
    thread: threading.Thread | None = None
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "port").exists():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                msg = "the run did not start"
                raise RuntimeError(msg)
            time.sleep(0.01)
        if flood:
            attack = Flood(int((workdir / "port").read_text()))
            thread = threading.Thread(target=attack.run)
            thread.start()
        cpu = 0.0
        while procs[0].poll() is None:
            cpu = _cpu_seconds(procs[0].pid)  # the last reading before the root exits
            time.sleep(0.05)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        if attack is not None and thread is not None:
            attack.stop.set()
            thread.join(timeout=30)
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {
        "codes": codes,
        "wall_s": time.monotonic() - started,
        "root_cpu_s": cpu,
        "sent": attack.sent if attack is not None else {},
        "params": load_file(str(workdir / "rank0.st")),
    }


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--rank":
        torch.set_num_threads(1)
        anyio.run(_rank, int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
        return
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="undisturbed/flooded pairs (default 3)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs per run (default {EPOCHS})")
    args = parser.parse_args()
    epochs = QUICK_EPOCHS if args.quick else args.epochs
    pairs = 1 if args.quick else args.pairs
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-hostile-{os.getpid()}"
    rows, extras, results, same = [], [], [], True
    for i in range(pairs):
        if i % 2 == 0:
            quiet = _run(base / f"quiet{i}", epochs, flood=False)
            flooded = _run(base / f"flooded{i}", epochs, flood=True)
        else:
            flooded = _run(base / f"flooded{i}", epochs, flood=True)
            quiet = _run(base / f"quiet{i}", epochs, flood=False)
        same = same and all(torch.equal(flooded["params"][k], v) for k, v in quiet["params"].items())
        extra = flooded["root_cpu_s"] / quiet["root_cpu_s"] - 1.0
        extras.append(extra)
        strangers = sum(flooded["sent"].values())
        per_stranger_ms = 1e3 * (flooded["root_cpu_s"] - quiet["root_cpu_s"]) / strangers
        rows.append(
            [
                str(i),
                f"{quiet['wall_s']:.1f} / {flooded['wall_s']:.1f}",
                f"{quiet['root_cpu_s']:.2f} / {flooded['root_cpu_s']:.2f}",
                f"{extra * 100:+.1f}%",
                f"{per_stranger_ms:.3f}",
                json.dumps(flooded["sent"]),
                f"{quiet['codes']} / {flooded['codes']}",
            ]
        )
        results.append(
            {
                k: {kk: vv for kk, vv in r.items() if kk != "params"}
                for k, r in (("undisturbed", quiet), ("flooded", flooded))
            }
        )
    print_table(
        [
            "pair",
            "wall s (quiet / flood)",
            "root CPU s",
            "extra",
            "ms per stranger",
            "strangers sent",
            "exit codes",
        ],
        rows,
    )
    ordered = sorted(extras)
    median = ordered[len(ordered) // 2]
    print(
        f"root's extra CPU under the flood: median {median * 100:+.1f}% "
        f"(range {ordered[0] * 100:+.1f}% .. {ordered[-1] * 100:+.1f}%) of the undisturbed run's "
        "(target < 10%)"
    )
    print(f"final parameters equal bit for bit in every pair: {same}")
    if args.json:
        write_json(
            args.json,
            {
                "machine": machine_info(),
                "epochs": epochs,
                "pairs": results,
                "extra_root_cpu": extras,
                "same_parameters": same,
            },
        )


if __name__ == "__main__":
    main()
