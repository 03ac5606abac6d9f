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
modes: plain lines, and a live terminal display (forced, written to /dev/null), redrawn at
each event.

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
# Per case (full, quick): epochs per run and how often its batches repeat in an epoch, and
# alternated pairs.  An epoch lasts about 0.8 s (MLP) or 0.5 s (tiny): what a reporter pays per
# epoch (a line, a flush, a redraw) weighs as in a short real epoch, not as in a 50 ms one.
# What it pays once per run is measured apart (the "once/run" column).
EPOCHS = {"mlp-1M": (2, 1), "tiny": (2, 1)}
REPEATS = {"mlp-1M": (5, 2), "tiny": (5, 2)}
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


class Timed:
    """A reporter whose ``report`` calls are timed into ``spent`` (seconds, summed)."""

    def __init__(self, inner: Reporter, spent: list[float]) -> None:
        self.inner, self.spent = inner, spent

    def report(self, event: Any) -> None:
        began = time.perf_counter()
        self.inner.report(event)
        self.spent[0] += time.perf_counter() - began

    def start(self) -> None:
        if callable(getattr(self.inner, "start", None)):
            self.inner.start()  # type: ignore[attr-defined]

    def close(self) -> None:
        if callable(getattr(self.inner, "close", None)):
            self.inner.close()  # type: ignore[attr-defined]


def sampler_seconds_per_step(calls: int = 200_000) -> float:
    """What the progress sampler costs per training step (one call, a sample every 0.5 s)."""
    from lamploop.reporting.sampler import ProgressSampler

    sampler = ProgressSampler(lambda event: None)
    sampler.start_epoch(0)
    began = time.perf_counter()
    for _ in range(calls):
        sampler.after_step(64, 0.5)
    return (time.perf_counter() - began) / calls


def timed_run(
    widths: tuple[int, ...],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    make: Callable[[], list[Reporter]],
    epochs: int,
    spent_log: list[float] | None = None,
) -> Callable[[], float]:
    """One repetition: a fresh model copy, ``epochs`` epochs; only the training is timed.

    With ``spent_log``, each run appends the seconds its reporters spent in ``report``.
    """
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    batch_size = batches[0][0].shape[0]

    def run() -> float:
        module = make_module(widths)
        spent = [0.0]
        reporters: list[Reporter] = [Timed(r, spent) for r in make()] if spent_log is not None else make()
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
            if spent_log is not None:
                spent_log.append(spent[0])
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
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_reporters")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="measure only this reporter (repeatable)"
    )
    args = parser.parse_args(argv)
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
            batches = make_batches(widths, steps[q]) * REPEATS[case][q]
            epochs = EPOCHS[case][q]
            per_step = sampler_seconds_per_step()
            total_steps = epochs * len(batches)
            baseline = timed_run(widths, batches, list, epochs)
            for name, make in factories.items():
                if args.only and name not in args.only:
                    continue
                spent: list[float] = []
                run = timed_run(widths, batches, make, epochs, spent)
                pairs = alternate(baseline, run, pairs=PAIRS[case][q])
                spent = spent[-len(pairs) :]  # the warm-up's left out
                # What the reporters' own code took, as a share of the run without them: the
                # sampler's per-step call and every report() call, timed inside the run.
                attributed = summarize(
                    [(s + total_steps * per_step) / a for s, (a, _) in zip(spent, pairs, strict=True)]
                )
                ratios = summarize([b / a for a, b in pairs])
                per_step_us = summarize([(b - a) / total_steps * 1e6 for a, b in pairs])
                results.setdefault(name, {})[case] = {
                    "pairs": pairs,
                    "ratio": ratios,
                    "per_step_us": per_step_us,
                    "steps": total_steps,
                    "attributed": attributed,
                }
                results[name]["once_per_run_ms"] = once_per_run_ms(make)
                spread = f"[{ratios['q1']:.4f}-{ratios['q3']:.4f}]"
                print(f"  {case:7s} {name:20s} ratio {ratios['median']:.4f} {spread}")
    rows = []
    for name, by_case in results.items():
        mlp, tiny = by_case["mlp-1M"]["ratio"], by_case["tiny"]["per_step_us"]
        verdict = "yes" if mlp["q3"] <= TARGET else ("no" if mlp["q1"] > TARGET else "inconclusive")
        own = by_case["mlp-1M"]["attributed"]
        rows.append(
            [
                name,
                f"{mlp['median']:.4f} [{mlp['q1']:.4f}-{mlp['q3']:.4f}]",
                verdict,
                f"{own['median'] * 100:.3f}% [{own['q1'] * 100:.3f}-{own['q3'] * 100:.3f}]",
                f"{tiny['median']:.1f} [{tiny['q1']:.1f} to {tiny['q3']:.1f}]",
                f"{by_case['once_per_run_ms']:.1f}",
            ]
        )
    print()
    headers = [
        "reporter",
        "mlp-1M on/off med [IQR]",
        f"<= {TARGET}",
        "mlp-1M own code",
        "tiny µs/step med [IQR]",
        "once/run ms",
    ]
    print_table(headers, rows)
    print(
        f"\non/off: median over alternated pairs of (run with the reporter) / (run without) on the "
        f"1M-parameter MLP;\n'yes' when the whole IQR is <= {TARGET}, 'no' when all of it is above, "
        "else inconclusive.\nown code: the time spent inside the reporters' report() and the progress "
        "sampler's per-step\ncall, timed inside the runs, over the run without reporters (threads of a "
        "reporter's own are\nnot in it; the on/off ratio has them).\n"
        "µs/step: (with - without) / steps on the 154-parameter model.  once/run: "
        "start, first and last\nevents and close of the reporter alone (median of 5), included in the runs "
        "above.  "
        f"Total {time.perf_counter() - started:.0f} s."
    )
    if args.json:
        write_json(args.json, {"results": results, "target": TARGET})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
