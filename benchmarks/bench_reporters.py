"""What reporting costs: a training run with each reporter on, against the same run with none.

Runs ``drive_distributed_training`` on one rank (no control channel, no checkpoints) over
a fixed list of batches, alternating "no reporters" (A) with "this reporter" (B) inside the
same process, and prints per reporter:

- on the 1M-parameter MLP (512 -> 1024 -> 512 -> 10, batches of 64): the median over
  pairs of B / A with its interquartile range (target: <= 1.01; a range that straddles it
  is inconclusive, the honest reading on a shared 2-core machine);
- on the 154-parameter model (where per-step overhead shows): the median over pairs of
  (B - A) / steps in microseconds, with its interquartile range.

"Every reporter" puts all of them on at once.  The progress bar is measured in both of its
modes: plain lines, and a live terminal display (forced, written to /dev/null) whose
redraws run on rich's own thread.

    python benchmarks/bench_reporters.py [--quick] [--json PATH]
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate, make_parser, print_table, summarize, write_json
from bench_loop import CASES, make_batches, make_module, make_optimizer

import lamploop
from lamploop.reporting import (
    LoggingReporter,
    MetricsFileReporter,
    ProgressReporter,
    PrometheusReporter,
    Reporter,
    TensorBoardReporter,
)

TARGET = 1.01
# Per case (full, quick): epochs per run, and alternated pairs.  A run is long enough (about
# 1.5 s) that what a reporter pays once per run (a display to start, a file to create) is
# amortised as in real training, and is reported apart, in the "once per run" column.
EPOCHS = {"mlp-1M": (10, 2), "tiny": (4, 1)}
PAIRS = {"mlp-1M": (12, 3), "tiny": (12, 3)}


def reporter_factories(tmp: Path, devnull: Any) -> dict[str, Callable[[], list[Reporter]]]:
    quiet = logging.getLogger("lamploop.bench")
    quiet.addHandler(logging.NullHandler())  # configured: lines go to a handler, not stderr
    quiet.propagate = False
    counter = iter(range(10**6))

    def fresh(name: str) -> Path:
        return tmp / f"{name}-{next(counter)}"

    factories: dict[str, Callable[[], list[Reporter]]] = {
        "logging": lambda: [LoggingReporter(quiet)],
        "progress (plain)": lambda: [ProgressReporter(devnull, terminal=False)],
        "progress (terminal)": lambda: [ProgressReporter(devnull, terminal=True)],
        "tensorboard": lambda: [TensorBoardReporter(fresh("tb"))],
        "prometheus": lambda: [PrometheusReporter(0)],
        "csv": lambda: [MetricsFileReporter(fresh("curve").with_suffix(".csv"))],
    }
    every = list(factories.values())
    factories["every reporter"] = lambda: [r for make in every for r in make()]
    return factories


def timed_run(
    widths: tuple[int, ...],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    make: Callable[[], list[Reporter]],
    epochs: int,
) -> Callable[[], float]:
    """One repetition: a fresh model copy, ``epochs`` epochs; only the training is timed."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    batch_size = batches[0][0].shape[0]

    def run() -> float:
        module = make_module(widths)
        reporters = make()
        for reporter in reporters:
            start = getattr(reporter, "start", None)
            if callable(start):
                start()

        async def train() -> float:
            began = time.perf_counter()
            await lamploop.drive_distributed_training(
                nranks=1,
                device="cpu",
                control=None,
                model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: make_optimizer_of(params),
                train_batches=lamploop.tensor_batches(x, y, batch_size=batch_size, shuffle=False),
                validation_batches=None,
                max_epochs=epochs,
                reporters=reporters,
            )
            return time.perf_counter() - began

        try:
            return anyio.run(train)
        finally:
            for reporter in reporters:
                close = getattr(reporter, "close", None)
                if callable(close):
                    close()

    return run


def once_per_run_ms(make: Callable[[], list[Reporter]], repetitions: int = 5) -> float:
    """Median ms a reporter costs once per run: start, a run's first and last events, close."""
    from lamploop.reporting.events import RunFinished, RunStarted

    times = []
    for _ in range(repetitions):
        began = time.perf_counter()
        reporters = make()
        for reporter in reporters:
            if callable(getattr(reporter, "start", None)):
                reporter.start()  # type: ignore[attr-defined]
            reporter.report(RunStarted(1, 0, 1))
            reporter.report(RunFinished(lamploop.LoopState(epoch=1)))
            if callable(getattr(reporter, "close", None)):
                reporter.close()  # type: ignore[attr-defined]
        times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def make_optimizer_of(params: Any) -> torch.optim.Optimizer:
    holder = torch.nn.Module()
    holder.p = torch.nn.ParameterList(list(params))
    return make_optimizer(holder)


def main(argv: list[str] | None = None) -> int:
    args = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_reporters").parse_args(argv)
    q = 1 if args.quick else 0
    print(
        f"lamploop {lamploop.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs; alternated pairs of runs (no reporter, the reporter)"
        + (" (quick)" if args.quick else "")
    )
    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        factories = reporter_factories(Path(tmp), devnull)
        for case in ("mlp-1M", "tiny"):
            widths, steps = CASES[case]
            batches = make_batches(widths, steps[q])
            epochs = EPOCHS[case][q]
            total_steps = epochs * len(batches)
            baseline = timed_run(widths, batches, list, epochs)
            for name, make in factories.items():
                run = timed_run(widths, batches, make, epochs)
                pairs = alternate(baseline, run, pairs=PAIRS[case][q])
                ratios = summarize([b / a for a, b in pairs])
                per_step_us = summarize([(b - a) / total_steps * 1e6 for a, b in pairs])
                results.setdefault(name, {})[case] = {
                    "pairs": pairs,
                    "ratio": ratios,
                    "per_step_us": per_step_us,
                    "steps": total_steps,
                }
                results[name]["once_per_run_ms"] = once_per_run_ms(make)
                spread = f"[{ratios['q1']:.4f}-{ratios['q3']:.4f}]"
                print(f"  {case:7s} {name:20s} ratio {ratios['median']:.4f} {spread}")
    rows = []
    for name, by_case in results.items():
        mlp, tiny = by_case["mlp-1M"]["ratio"], by_case["tiny"]["per_step_us"]
        verdict = "yes" if mlp["q3"] <= TARGET else ("no" if mlp["q1"] > TARGET else "inconclusive")
        rows.append(
            [
                name,
                f"{mlp['median']:.4f} [{mlp['q1']:.4f}-{mlp['q3']:.4f}]",
                verdict,
                f"{tiny['median']:.1f} [{tiny['q1']:.1f} to {tiny['q3']:.1f}]",
                f"{by_case['once_per_run_ms']:.1f}",
            ]
        )
    print()
    headers = ["reporter", "mlp-1M on/off med [IQR]", f"<= {TARGET}", "tiny µs/step med [IQR]", "once/run ms"]
    print_table(headers, rows)
    print(
        f"\non/off: median over alternated pairs of (run with the reporter) / (run without) on the "
        f"1M-parameter MLP;\n'yes' when the whole IQR is <= {TARGET}, 'no' when all of it is above, "
        "else inconclusive.\nµs/step: (with - without) / steps on the 154-parameter model.  once/run: "
        "start, first and last\nevents and close of the reporter alone (median of 5), included in the runs "
        "above.  "
        f"Total {time.perf_counter() - started:.0f} s."
    )
    if args.json:
        write_json(args.json, {"results": results, "target": TARGET})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
