"""A 2-stage pipeline on 2 processes against one process training the whole model.

Usage::

    python benchmarks/bench_pipeline.py --json bench-results/pipeline.json [--quick] [--baseline-threads N]

The script starts itself twice more (``--worker 0`` and ``--worker 1``), one process per
stage, joined by :func:`lamploop.pipeline.open_pipeline_group` on 127.0.0.1; rank 0 measures
and the parent prints and writes its result.  Each repetition is one epoch of ``STEPS``
optimizer steps (batch 256, SGD with momentum) over the same list of batch tensors (seeded,
built once), from the same seeded initial model, timed on rank 0 with ``time.perf_counter``:

* ``one process, N thread(s)``: the plain PyTorch loop over the list, nothing of lamploop
  (``opt.zero_grad(set_to_none=True); loss = F.cross_entropy(model(x), y);
  loss.backward(); opt.step()``, the losses read once at the end), in rank 0 with
  ``torch.set_num_threads(N)`` (rank 1 meanwhile waits, idle, for the next command).  N is 1
  and 2 by default (``--baseline-threads N``, repeatable, to choose): the pipeline uses two
  cores (two processes of one thread), so one process may use two threads too; on 2 cores
  shared with other work two OpenMP threads can also be much slower than one (they spin
  against the neighbours' work).  Both are measured, and the pipeline is compared with each
  and with the faster of them (lowest median time): the baseline a user would pick;
* ``pipeline gpipe`` / ``pipeline 1f1b``: :func:`lamploop.pipeline.train_pipeline` for one
  epoch over the same list, the model cut in the middle, 4 micro-batches per batch, one torch
  thread per stage.  Its time includes the per-call set-up (the ranks' check, torch's stage
  set-up on the first batch), amortised over the epoch: a cost on lamploop's side.

After one warm-up round, every round runs each contender once, in an order rotated from round
to round; the summary is, per pipeline schedule and per one-process variant, the median,
min-max and IQR of the per-round ratios pipeline / one process (> 1: the pipeline is slower)
and the ms per step.  Rank 1 follows rank 0's commands, sent as one broadcast integer over
the same group.  The load average is printed with the figures: on a shared machine they are
noisy.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, make_parser, print_table, summarize, write_json

from lamploop.batches import iterable_batches
from lamploop.pipeline import PipelineSpec, open_pipeline_group, train_pipeline

WIDTH, FEATURES, CLASSES, BATCH, MICRO = 1024, 512, 10, 256, 4
STOP, BASELINE, GPIPE, ONE_F_ONE_B = 0, 1, 2, 3
SCHEDULES = {GPIPE: "gpipe", ONE_F_ONE_B: "1f1b"}
STEPS = (16, 8)  # optimizer steps per epoch (full, quick)
ROUNDS = (9, 3)  # at least this many rounds (full, quick)...
MAX_ROUNDS = (15, 5)  # ...and more while the budget lasts
BUDGET_S = (240.0, 60.0)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def build_model() -> torch.nn.Sequential:
    """512 -> 1024 -> 1024 -> 1024 -> 10 with ReLU (2.6M parameters); cut at layer 4 (after two)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )


def optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)


def make_batches(steps: int) -> Batches:
    """``steps`` batches of ``BATCH`` examples (seeded), as contiguous tensors, shared by every side."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (steps * BATCH,), generator=generator)
    return [(x[i : i + BATCH].clone(), y[i : i + BATCH].clone()) for i in range(0, steps * BATCH, BATCH)]


def hand_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> float:
    """The plain PyTorch training epoch; the mean loss, read once at the end."""
    model.train()
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return float(torch.stack(losses).mean())


def one_process_name(threads: int) -> str:
    return f"one process, {threads} thread{'s' if threads > 1 else ''}"


class Stage:
    """One worker: rank 0 times, rank 1 follows; both run the pipeline epochs together."""

    def __init__(self, rank: int, steps: int, baseline_threads: list[int]) -> None:
        self.rank, self.steps, self.baseline_threads = rank, steps, baseline_threads
        self.batches = make_batches(steps)

    def command(self, value: int) -> int:
        """Rank 0's command to every rank (rank 1 waits here, idle, while rank 0 runs the baseline)."""
        box = torch.tensor([value])
        dist.broadcast(box, src=0)
        return int(box)

    def baseline(self, threads: int) -> float:
        torch.set_num_threads(threads)
        model = build_model()
        opt = optimizer(model.parameters())
        began = time.perf_counter()
        hand_epoch(model, opt, self.batches)
        return time.perf_counter() - began

    def pipeline(self, schedule: int) -> float:
        torch.set_num_threads(1)
        spec = PipelineSpec((4,), n_microbatches=MICRO, schedule=SCHEDULES[schedule])  # type: ignore[arg-type]
        model = build_model()
        batches = self.batches

        async def timed() -> float:
            began = time.perf_counter()
            await train_pipeline(
                model=model,
                spec=spec,
                optimizer_factory=optimizer,
                train_batches=iterable_batches(lambda _context: batches),
                max_epochs=1,
            )
            return time.perf_counter() - began

        return anyio.run(timed)

    def follow(self) -> None:
        while (command := self.command(0)) != STOP:
            if command != BASELINE:
                self.pipeline(command)

    def lead(self, rounds: int, max_rounds: int, budget_s: float) -> dict[str, Any]:
        def baseline(threads: int) -> Callable[[], float]:
            def measure() -> float:
                self.command(BASELINE)
                return self.baseline(threads)

            return measure

        def pipeline(schedule: int) -> Callable[[], float]:
            def measure() -> float:
                self.command(schedule)
                return self.pipeline(schedule)

            return measure

        contenders = {one_process_name(n): baseline(n) for n in self.baseline_threads}
        contenders.update({f"pipeline {name}": pipeline(code) for code, name in SCHEDULES.items()})
        names = list(contenders)
        results: dict[str, Any] = {
            "steps_per_epoch": self.steps,
            "baseline_threads": self.baseline_threads,
            "load_average_start": list(os.getloadavg()),
        }
        started = time.perf_counter()
        for name in names:  # the warm-up round, not kept
            contenders[name]()
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for r in range(max_rounds):
            if r >= rounds and time.perf_counter() - started > budget_s:
                break
            for name in names[r % len(names) :] + names[: r % len(names)]:
                gc.collect()
                seconds[name].append(contenders[name]())
        results["seconds"] = seconds
        results["load_average_end"] = list(os.getloadavg())
        self.command(STOP)
        return results


def worker_main(rank: int, port: int, result: Path, quick: bool, baseline_threads: list[int]) -> int:
    q = 1 if quick else 0
    with open_pipeline_group(rank=rank, world_size=2, host="127.0.0.1", port=port, timeout=300):
        stage = Stage(rank, STEPS[q], baseline_threads)
        if rank == 0:
            document = stage.lead(ROUNDS[q], MAX_ROUNDS[q], BUDGET_S[q])
            result.write_text(json.dumps(document))
        else:
            stage.follow()
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def summarise(document: dict[str, Any]) -> dict[str, Any]:
    """Per pipeline schedule and per one-process variant: the per-round ratios pipeline / one process."""
    steps, seconds = document["steps_per_epoch"], document["seconds"]
    ones = [one_process_name(n) for n in document["baseline_threads"]]
    best = min(ones, key=lambda name: statistics.median(seconds[name]))
    out: dict[str, Any] = {
        "best_one_process": best,
        "ms_per_step": {name: summarize([t / steps * 1e3 for t in times]) for name, times in seconds.items()},
    }
    for schedule in SCHEDULES.values():
        pipe = seconds[f"pipeline {schedule}"]
        out[schedule] = {
            one: summarize([p / o for p, o in zip(pipe, seconds[one], strict=True)]) for one in ones
        }
        out[schedule]["best"] = out[schedule][best]
    return out


def verdict(ratio: dict[str, float]) -> str:
    if ratio["min"] > 1.0:
        return "pipeline slower in every round"
    if ratio["max"] < 1.0:
        return "pipeline faster in every round"
    return "no clear winner"


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline-threads",
        type=int,
        action="append",
        metavar="N",
        help="torch threads of the one process (repeatable; default: 1 and 2)",
    )
    parser.add_argument("--worker", type=int, help="(internal) run as this rank")
    parser.add_argument("--port", type=int, help="(internal)")
    parser.add_argument("--result", type=Path, help="(internal)")
    args = parser.parse_args(argv)
    threads = sorted(set(args.baseline_threads or [1, 2]))
    if threads[0] < 1:
        parser.error("--baseline-threads must be >= 1")
    if args.worker is not None:
        return worker_main(args.worker, args.port, args.result, args.quick, threads)
    port, result = _free_port(), Path(f"/tmp/bench-pipeline-{os.getpid()}.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(threads))}
    base = [sys.executable, __file__, "--port", str(port), "--result", str(result)]
    for n in threads:
        base += ["--baseline-threads", str(n)]
    base += ["--quick"] if args.quick else []
    children = [subprocess.Popen([*base, "--worker", str(rank)], env=env) for rank in (0, 1)]
    try:
        codes = [child.wait(timeout=900) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    if codes != [0, 0]:
        print(f"workers failed: exit codes {codes}", file=sys.stderr)
        return 1
    document = json.loads(result.read_text())
    result.unlink()
    summary = summarise(document)
    document["summary"] = summary
    best = summary["best_one_process"]
    ms = summary["ms_per_step"]
    rows = []
    for schedule in SCHEDULES.values():
        pipe = f"pipeline {schedule}"
        for one in (one_process_name(n) for n in threads):
            ratio = summary[schedule][one]
            rows.append(
                [
                    f"{pipe} / {one}" + (" (best)" if one == best and len(threads) > 1 else ""),
                    f"{ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]",
                    f"{ratio['q1']:.3f}..{ratio['q3']:.3f}",
                    fmt_seconds(ms[one]["median"] / 1e3),
                    fmt_seconds(ms[pipe]["median"] / 1e3),
                    ratio["n"],
                    verdict(ratio),
                ]
            )
    load = f"{document['load_average_start']} -> {document['load_average_end']}"
    print(
        f"2 stages x 1 thread vs 1 process (plain PyTorch loop) x {threads} thread(s); "
        f"{document['steps_per_epoch']} steps of batch {BATCH}, {MICRO} micro-batches; load average {load}"
    )
    print_table(
        [
            "comparison",
            "ratio med [min-max]",
            "IQR",
            "one process /step",
            "pipeline /step",
            "rounds",
            "reading",
        ],
        rows,
    )
    print(f"best one process (lowest median): {best}; ratios are per round, pipeline / one process")
    if args.json is not None:
        write_json(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
