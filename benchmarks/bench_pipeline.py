"""A 2-stage pipeline on 2 processes against one process training the whole model.

Usage::

    python benchmarks/bench_pipeline.py --json bench-results/pipeline.json [--quick]

The script starts itself twice more (``--worker 0`` and ``--worker 1``), one process per
stage, joined by :func:`lamploop.pipeline.open_pipeline_group` on 127.0.0.1; rank 0 measures
and the parent prints and writes its result.  Each repetition is one epoch of ``STEPS``
optimizer steps (batch 256, SGD with momentum) over the same data, timed on rank 0:

* ``one process``: :func:`lamploop.one_epoch` on the whole model, in rank 0, with one torch
  thread (``--baseline-threads``; rank 1 meanwhile waits, idle, for the next command).  One
  thread, not the two cores the pipeline uses in all: on the 2 shared cores this was written
  on, two OpenMP threads made a step ten times slower (they spin against the neighbours'
  work), which would flatter the pipeline;
* ``pipeline gpipe`` / ``pipeline 1f1b``: :func:`lamploop.pipeline.train_pipeline` for one
  epoch, the model cut in the middle, 4 micro-batches per batch, one torch thread per stage.
  Its time includes the per-call set-up (the ranks' check, torch's stage set-up on the first
  batch), amortised over the epoch.

Each pipeline schedule alternates with the one-process baseline (AB, BA, ...) after a
warm-up; the summary is the median and IQR of the per-pair ratios pipeline / one process
(> 1: the pipeline is slower) and of ms per step.  Rank 1 follows rank 0's commands, sent as
one broadcast integer over the same group.  The load average is printed with the figures:
on a shared machine they are noisy.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, fmt_seconds, make_parser, print_table, ratio_summary, summarize, write_json

from lamploop.batches import BatchContext, tensor_batches
from lamploop.loop.epoch_pass import one_epoch
from lamploop.model import SupervisedModel
from lamploop.pipeline import PipelineSpec, open_pipeline_group, train_pipeline

WIDTH, FEATURES, CLASSES, BATCH, MICRO = 1024, 512, 10, 256, 4
STOP, BASELINE, GPIPE, ONE_F_ONE_B = 0, 1, 2, 3
SCHEDULES = {GPIPE: "gpipe", ONE_F_ONE_B: "1f1b"}


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


class Stage:
    """One worker: rank 0 times, rank 1 follows; both run the pipeline epochs together."""

    def __init__(self, rank: int, steps: int, baseline_threads: int) -> None:
        self.rank, self.steps, self.baseline_threads = rank, steps, baseline_threads
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(steps * BATCH, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (steps * BATCH,), generator=generator)
        self.batches = tensor_batches(x, y, batch_size=BATCH, shuffle=False)

    def command(self, value: int) -> int:
        """Rank 0's command to every rank (rank 1 waits here, idle, while rank 0 runs the baseline)."""
        box = torch.tensor([value])
        dist.broadcast(box, src=0)
        return int(box)

    def baseline(self) -> float:
        torch.set_num_threads(self.baseline_threads)
        model = build_model()
        opt = optimizer(model.parameters())
        stream = self.batches

        async def run() -> float:
            began = time.perf_counter()
            await one_epoch(
                model=SupervisedModel(model), batches=stream(BatchContext(epoch=0)), step_optimizer=opt.step
            )
            return time.perf_counter() - began

        return anyio.run(run)

    def pipeline(self, schedule: int) -> float:
        torch.set_num_threads(1)
        spec = PipelineSpec((4,), n_microbatches=MICRO, schedule=SCHEDULES[schedule])  # type: ignore[arg-type]
        run = functools.partial(
            train_pipeline,
            model=build_model(),
            spec=spec,
            optimizer_factory=optimizer,
            train_batches=self.batches,
            max_epochs=1,
        )

        async def timed() -> float:
            began = time.perf_counter()
            await run()
            return time.perf_counter() - began

        return anyio.run(timed)

    def follow(self) -> None:
        while (command := self.command(0)) != STOP:
            if command != BASELINE:
                self.pipeline(command)

    def lead(self, pairs: int, budget_s: float) -> dict[str, Any]:
        def baseline() -> float:
            self.command(BASELINE)
            return self.baseline()

        def pipeline(schedule: int) -> Any:
            def measure() -> float:
                self.command(schedule)
                return self.pipeline(schedule)

            return measure

        results: dict[str, Any] = {
            "steps_per_epoch": self.steps,
            "baseline_threads": self.baseline_threads,
            "load_average_start": list(os.getloadavg()),
        }
        for schedule, name in SCHEDULES.items():
            timed = alternate(baseline, pipeline(schedule), pairs=pairs, min_pairs=3, budget_s=budget_s)
            results[name] = {
                "pairs": [list(p) for p in timed],
                "ratio": ratio_summary(timed),
                "one_process_ms_per_step": summarize([a / self.steps * 1e3 for a, _ in timed]),
                "pipeline_ms_per_step": summarize([b / self.steps * 1e3 for _, b in timed]),
            }
        results["load_average_end"] = list(os.getloadavg())
        self.command(STOP)
        return results


def worker_main(rank: int, port: int, result: Path, quick: bool, baseline_threads: int) -> int:
    steps = 8 if quick else 16
    with open_pipeline_group(rank=rank, world_size=2, host="127.0.0.1", port=port, timeout=300):
        stage = Stage(rank, steps, baseline_threads)
        if rank == 0:
            document = stage.lead(pairs=3 if quick else 9, budget_s=60 if quick else 240)
            result.write_text(json.dumps(document))
        else:
            stage.follow()
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--baseline-threads", type=int, default=1, help="torch threads of the one process")
    parser.add_argument("--worker", type=int, help="(internal) run as this rank")
    parser.add_argument("--port", type=int, help="(internal)")
    parser.add_argument("--result", type=Path, help="(internal)")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker, args.port, args.result, args.quick, args.baseline_threads)
    port, result = _free_port(), Path(f"/tmp/bench-pipeline-{os.getpid()}.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.baseline_threads))}
    base = [sys.executable, __file__, "--port", str(port), "--result", str(result)]
    base += ["--baseline-threads", str(args.baseline_threads)] + (["--quick"] if args.quick else [])
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
    rows = []
    for name in SCHEDULES.values():
        entry = document[name]
        ratio, one, pipe = entry["ratio"], entry["one_process_ms_per_step"], entry["pipeline_ms_per_step"]
        rows.append(
            [
                f"pipeline {name} / one process",
                f"{ratio['median']:.2f}",
                f"{ratio['q1']:.2f}..{ratio['q3']:.2f}",
                fmt_seconds(one["median"] / 1e3),
                fmt_seconds(pipe["median"] / 1e3),
                ratio["n"],
            ]
        )
    load = f"{document['load_average_start']} -> {document['load_average_end']}"
    print(
        f"2 stages x 1 thread vs 1 process x {document['baseline_threads']} thread(s); "
        f"{document['steps_per_epoch']} steps of batch {BATCH}, {MICRO} micro-batches; load average {load}"
    )
    print_table(["comparison", "ratio (median)", "IQR", "one process /step", "pipeline /step", "pairs"], rows)
    if args.json is not None:
        write_json(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
