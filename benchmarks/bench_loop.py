"""lamploop's single-process loop against a hand-written PyTorch loop.

Usage::

    python benchmarks/bench_loop.py --json bench-results/loop.json [--quick] [--threads N]
    python benchmarks/bench_loop.py --breakdown-only [--quick]   # the step breakdown's cost alone

What is compared, per case (same model, data, optimizer and number of steps):

* ``one_epoch``: ``await lamploop.one_epoch(model=SupervisedModel(module),
  batches=<async stream over a list>, step_optimizer=opt.step)`` against the
  idiomatic hand loop over the same list of batch tensors::

      for x, y in batches:
          opt.zero_grad(set_to_none=True)
          loss = F.cross_entropy(model(x), y)
          loss.backward()
          opt.step()
          losses.append(loss.detach())
      mean = float(torch.stack(losses).mean())      # read once, at the end

* ``epochs(N)``: the driver ``lamploop.epochs(max_epochs=N, validation_epoch=None,
  train_epoch=<one_epoch as above, setting lr = base * factor>)`` against the
  hand loop run N times; each epoch goes over ``steps // N`` batches, so the
  total number of steps matches the ``one_epoch`` comparison.

* ``breakdown``: the cost of the always-on step breakdown (:mod:`lamploop.loop.step_timing`),
  which a run with reporters measures on the root: the same ``one_epoch`` with
  ``step_times=StepTimes()`` (enabled) against ``step_times=None`` (disabled, what a run
  without reporters does), alternated the same way; the ratio is enabled / disabled.  Beside
  it, the breakdown's clock reads and sums of one step timed alone (a tight loop of the
  marks the pass calls), over the median step time: a figure the machine's noise does
  not blur.  The target: below 1 % per step on ``mlp-1M``.

Cases: ``mlp-1M`` (512 -> 1024 -> 512 -> 10 with ReLU, 1,055,242 parameters)
and ``tiny`` (16 -> 8 -> 2, 154 parameters, where per-batch overhead shows),
both with batch 64 and cross entropy over random (seeded) data.

Optimizer: ``torch.optim.SGD(lr=0.01, momentum=0.9)``.  Every repetition
starts from a deep copy of the same initial module and a fresh optimizer (so
the same momentum-buffer allocation happens on both sides); the copies are made
outside the timed region.  The batches are built once (seeded), as contiguous
tensors, and shared by both sides.

The hand loop is the one PyTorch's tutorials and nanoGPT write: a plain ``for`` over
the list, no lamploop code, no event loop.  Both sides run in this one process, so
they share torch's thread settings (torch's default, or ``--threads N`` for both).

Timing: wall clock (``time.perf_counter``) of the loop itself.  lamploop's side
runs inside ``anyio.run`` and is timed inside the event loop; the fixed cost of
starting ``anyio.run`` (paid once per run, not per batch) is measured
separately and reported, and a second ratio times lamploop's side from before
``anyio.run`` to after it (what a caller of ``anyio.run`` waits), against the
hand loop timed the same way.  The two sides alternate (AB, BA, AB, ...) after a
warm-up round, for at least 5 pairs (3 with ``--quick``) and then as many as
a time budget allows; the summary uses the median of the per-pair ratios
lamploop / hand and the median of the per-pair differences divided by the
number of steps (the overhead per batch).  A comparison whose ratios spread
widely (interquartile range > 0.05) is flagged as noisy.  ``torch`` keeps its
default number of threads unless ``--threads`` is given; either is recorded.
"""

from __future__ import annotations

import copy
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate, fmt_seconds, make_parser, print_table, summarize, write_json

import lamploop
from lamploop import BatchContext, SupervisedModel, iterable_batches
from lamploop.loop.step_timing import StepTimes

TARGET_RATIO = 1.03
"""The acceptance target for the ~1M-parameter MLP: lamploop / hand loop <= this."""

TARGET_CASE = "mlp-1M"

BREAKDOWN_TARGET = 0.01
"""The step breakdown's cost per step on the target case: below this share of a step."""

NOISY_IQR = 0.05
"""A comparison whose per-pair ratios have an interquartile range above this is flagged as
noisy: the machine was too busy to resolve a few per cent (re-run it on a quieter one)."""

LEARNING_RATE = 0.01
MOMENTUM = 0.9
BATCH_SIZE = 64
SEED = 0

# name: (layer widths, steps per epoch (full, quick))
CASES: dict[str, tuple[tuple[int, ...], tuple[int, int]]] = {
    "mlp-1M": ((512, 1024, 512, 10), (64, 24)),
    "tiny": ((16, 8, 2), (400, 150)),
}
EPOCHS = (3, 2)  # driver comparison (full, quick): this many epochs of steps // epochs batches each
# Alternated pairs per comparison (full, quick), after one warm-up round: at least MIN_PAIRS, then
# more while the comparison has taken less than BUDGET_S, up to MAX_PAIRS.  On a quiet machine the
# budget buys 10-20 pairs; on a loaded one the run stops at MIN_PAIRS (and takes longer anyway).
MIN_PAIRS = (5, 3)
MAX_PAIRS = (25, 5)
BUDGET_S = (22.0, 4.0)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------- set-up


def make_module(widths: tuple[int, ...]) -> nn.Module:
    """Linear layers of the given widths with ReLU between them (seeded)."""
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


def make_batches(widths: tuple[int, ...], steps: int) -> Batches:
    """``steps`` full batches of Gaussian features and uniform class targets (seeded)."""
    generator = torch.Generator().manual_seed(SEED + 1)
    features = torch.randn(steps * BATCH_SIZE, widths[0], generator=generator)
    target = torch.randint(0, widths[-1], (steps * BATCH_SIZE,), generator=generator)
    return [
        (features[i : i + BATCH_SIZE].clone(), target[i : i + BATCH_SIZE].clone())
        for i in range(0, steps * BATCH_SIZE, BATCH_SIZE)
    ]


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------- the two loops


def hand_epoch(module: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches) -> float:
    """The idiomatic PyTorch training epoch; returns the mean loss (read once)."""
    module.train()
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return float(torch.stack(losses).mean())


def hand_epochs(module: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, n: int) -> list[float]:
    return [hand_epoch(module, optimizer, batches) for _ in range(n)]


async def lamploop_epoch(module: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches) -> float:
    stream = iterable_batches(lambda _context: batches)(BatchContext(epoch=0))
    return await lamploop.one_epoch(
        model=SupervisedModel(module), batches=stream, step_optimizer=optimizer.step
    )


async def lamploop_epoch_with_breakdown(
    module: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches
) -> float:
    """``lamploop_epoch`` with the step breakdown on, as the root of a run with reporters has it."""
    stream = iterable_batches(lambda _context: batches)(BatchContext(epoch=0))
    return await lamploop.one_epoch(
        model=SupervisedModel(module), batches=stream, step_optimizer=optimizer.step, step_times=StepTimes()
    )


def breakdown_marks_seconds(steps: int = 200_000) -> float:
    """Seconds per step of the breakdown's own work: the marks a training pass calls per step
    (one batch awaited, backward, optimizer, step end), in a tight loop, less the empty loop."""
    times = StepTimes()
    times.begin(None)
    clock = time.perf_counter
    start = clock()
    for _ in range(steps):
        began = clock()
        times.waited_for_data(began)
        times.backward_done()
        times.optimizer_done()
        times.step_done()
    marked = clock() - start
    start = clock()
    for _ in range(steps):
        pass
    empty = clock() - start
    return max(0.0, marked - empty) / steps


def compare_breakdown(
    name: str, base: nn.Module, batches: Batches, pairs: int, min_pairs: int, budget_s: float
) -> dict[str, Any]:
    """``one_epoch`` with the step breakdown (enabled) against without it (disabled), alternated."""
    steps = len(batches)
    print(f"  {name:<7} {'breakdown':<10} {steps:>4} steps ...", end="", flush=True)
    started = time.perf_counter()
    off = Side(base, timed_lamploop(lamploop_epoch, batches))
    on = Side(base, timed_lamploop(lamploop_epoch_with_breakdown, batches))
    timings = alternate(off, on, pairs=pairs, warmup=1, min_pairs=min_pairs, budget_s=budget_s)
    print(f" {len(timings)} pairs, {time.perf_counter() - started:.1f} s", flush=True)
    ratios = [t_on / t_off for t_off, t_on in timings]
    cpu = [c_on / c_off for c_off, c_on in zip(off.cpu[1:], on.cpu[1:], strict=True)]
    step_s = statistics.median(t / steps for t, _ in timings)
    marks_s = statistics.median(breakdown_marks_seconds() for _ in range(5))
    return {
        "case": name,
        "steps": steps,
        "pairs": len(timings),
        "disabled_per_step_s": summarize([t / steps for t, _ in timings]),
        "enabled_per_step_s": summarize([t / steps for _, t in timings]),
        "ratio_enabled_over_disabled": summarize(ratios),
        "cpu_ratio_enabled_over_disabled": summarize(cpu),
        "noisy": summarize(ratios)["iqr"] > NOISY_IQR,
        "marks_per_step_s": marks_s,
        "marks_share_of_step": marks_s / step_s,
        "raw": {"disabled_wall_s": off.wall[1:], "enabled_wall_s": on.wall[1:]},
    }


async def lamploop_epochs(
    module: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, n: int
) -> list[float]:
    model = SupervisedModel(module)
    factory = iterable_batches(lambda _context: batches)
    epoch = 0

    async def train_epoch(factor: float) -> float:
        nonlocal epoch
        for group in optimizer.param_groups:
            group["lr"] = LEARNING_RATE * factor
        stream = factory(BatchContext(epoch=epoch))
        loss = await lamploop.one_epoch(
            model=model, batches=stream, step_optimizer=optimizer.step, epoch=epoch
        )
        epoch += 1
        return loss

    async def save_nothing() -> None:
        return None

    state = await lamploop.epochs(
        max_epochs=n,
        train_epoch=train_epoch,
        validation_epoch=None,
        save_min_validation_loss_model=save_nothing,
    )
    return [entry.training_loss for entry in state.learning_curve]


# --------------------------------------------------------------------------- measurement


class Side:
    """One contender: builds fresh state, times one repetition, keeps the raw numbers."""

    def __init__(self, base: nn.Module, run: Callable[[nn.Module, torch.optim.Optimizer], tuple[float, Any]]):
        self._base = base
        self._run = run
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.outer: list[float] = []  # lamploop only: including the start of anyio.run
        self.result: Any = None
        self.module: nn.Module | None = None

    def __call__(self) -> float:
        module = copy.deepcopy(self._base)
        optimizer = make_optimizer(module)
        cpu0, outer0 = time.process_time(), time.perf_counter()
        elapsed, self.result = self._run(module, optimizer)
        outer, cpu = time.perf_counter() - outer0, time.process_time() - cpu0
        self.wall.append(elapsed)
        self.cpu.append(cpu)
        self.outer.append(outer)
        self.module = module
        return elapsed


def timed_hand(
    fn: Callable[..., Any], *args: Any
) -> Callable[[nn.Module, torch.optim.Optimizer], tuple[float, Any]]:
    def run(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, Any]:
        start = time.perf_counter()
        result = fn(module, optimizer, *args)
        return time.perf_counter() - start, result

    return run


def timed_lamploop(
    fn: Callable[..., Any], *args: Any
) -> Callable[[nn.Module, torch.optim.Optimizer], tuple[float, Any]]:
    def run(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, Any]:
        async def main() -> tuple[float, Any]:
            start = time.perf_counter()
            result = await fn(module, optimizer, *args)
            return time.perf_counter() - start, result

        return anyio.run(main)

    return run


@torch.no_grad()
def max_parameter_difference(a: nn.Module, b: nn.Module) -> float:
    """A sanity check that both sides did the same work (0.0 or float rounding)."""
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def anyio_run_cost(repetitions: int) -> dict[str, float]:
    """Wall time of ``anyio.run`` on a coroutine that does nothing (a fixed cost per run)."""

    async def nothing() -> None:
        return None

    anyio.run(nothing)
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        anyio.run(nothing)
        times.append(time.perf_counter() - start)
    return summarize(times)


def compare(
    name: str, kind: str, hand: Side, lamp: Side, steps: int, pairs: int, min_pairs: int, budget_s: float
) -> dict[str, Any]:
    print(f"  {name:<7} {kind:<10} {steps:>4} steps ...", end="", flush=True)
    started = time.perf_counter()
    timings = alternate(hand, lamp, pairs=pairs, warmup=1, min_pairs=min_pairs, budget_s=budget_s)
    pairs = len(timings)
    print(f" {pairs} pairs, {time.perf_counter() - started:.1f} s", flush=True)
    ratios = [tl / th for th, tl in timings]
    overheads_us = [(tl - th) / steps * 1e6 for th, tl in timings]
    # The same pairs timed from outside: lamploop's side with the start and end of anyio.run.
    outer_ratios = [lo / ho for ho, lo in zip(hand.outer[1:], lamp.outer[1:], strict=True)]
    # Raw lists: drop the warm-up repetition (the first one of each side).
    raw: dict[str, Any] = {
        "hand_wall_s": hand.wall[1:],
        "lamploop_wall_s": lamp.wall[1:],
        "hand_cpu_s": hand.cpu[1:],
        "lamploop_cpu_s": lamp.cpu[1:],
        "lamploop_wall_including_anyio_run_s": lamp.outer[1:],
        "order": ["hand-first" if i % 2 == 0 else "lamploop-first" for i in range(len(timings))],
    }
    assert hand.module is not None
    assert lamp.module is not None
    return {
        "case": name,
        "comparison": kind,
        "steps": steps,
        "pairs": pairs,
        "hand_per_step_s": summarize([t / steps for t, _ in timings]),
        "lamploop_per_step_s": summarize([t / steps for _, t in timings]),
        "ratio_lamploop_over_hand": summarize(ratios),
        "ratio_lamploop_over_hand_including_anyio_run": summarize(outer_ratios),
        "ratio_of_fastest": min(t for _, t in timings) / min(t for t, _ in timings),
        "noisy": summarize(ratios)["iqr"] > NOISY_IQR,
        "overhead_per_batch_us": summarize(overheads_us),
        "cpu_ratio_lamploop_over_hand": summarize(
            [lc / hc for hc, lc in zip(raw["hand_cpu_s"], raw["lamploop_cpu_s"], strict=True)]
        ),
        "final_loss_hand": hand.result,
        "final_loss_lamploop": lamp.result,
        "max_parameter_difference": max_parameter_difference(hand.module, lamp.module),
        "raw": raw,
    }


def run_case(
    name: str,
    widths: tuple[int, ...],
    steps: int,
    epochs: int,
    pairs: int,
    min_pairs: int,
    budget_s: float,
    *,
    breakdown_only: bool = False,
) -> dict[str, Any]:
    base = make_module(widths)
    batches = make_batches(widths, steps)
    parameters = count_parameters(base)
    print(f"{name}: layers {' -> '.join(map(str, widths))}, {parameters:,} parameters, batch {BATCH_SIZE}")
    breakdown = compare_breakdown(name, base, batches, pairs, min_pairs, budget_s)
    if breakdown_only:
        return {"case": name, "parameters": parameters, "comparisons": [], "breakdown": breakdown}
    one = compare(
        name,
        "one_epoch",
        Side(base, timed_hand(hand_epoch, batches)),
        Side(base, timed_lamploop(lamploop_epoch, batches)),
        steps,
        pairs,
        min_pairs,
        budget_s,
    )
    per_epoch = batches[: steps // epochs]
    many = compare(
        name,
        f"epochs({epochs})",
        Side(base, timed_hand(hand_epochs, per_epoch, epochs)),
        Side(base, timed_lamploop(lamploop_epochs, per_epoch, epochs)),
        len(per_epoch) * epochs,
        pairs,
        min_pairs,
        budget_s,
    )
    return {
        "case": name,
        "layers": list(widths),
        "parameters": parameters,
        "batch_size": BATCH_SIZE,
        "steps_per_epoch": steps,
        "epochs": epochs,
        "comparisons": [one, many],
        "breakdown": breakdown,
    }


def breakdown_rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for case in cases:
        b = case["breakdown"]
        ratio, cpu = b["ratio_enabled_over_disabled"], b["cpu_ratio_enabled_over_disabled"]
        verdict = "-"
        if case["case"] == TARGET_CASE:
            verdict = "ok" if b["marks_share_of_step"] < BREAKDOWN_TARGET else "ABOVE"
        rows.append(
            [
                case["case"],
                str(b["pairs"]),
                fmt_seconds(b["disabled_per_step_s"]["median"]),
                fmt_seconds(b["enabled_per_step_s"]["median"]),
                f"{ratio['median']:.4f} [{ratio['min']:.4f}-{ratio['max']:.4f}]",
                f"{cpu['median']:.4f} [{cpu['min']:.4f}-{cpu['max']:.4f}]",
                fmt_seconds(b["marks_per_step_s"]),
                f"{100 * b['marks_share_of_step']:.3f}%",
                verdict + (" (noisy)" if b["noisy"] else ""),
            ]
        )
    return rows


def table_rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for case in cases:
        for c in case["comparisons"]:
            ratio = c["ratio_lamploop_over_hand"]
            over = c["overhead_per_batch_us"]
            outer = c["ratio_lamploop_over_hand_including_anyio_run"]
            if case["case"] == TARGET_CASE:
                verdict = "ok" if ratio["median"] <= TARGET_RATIO else "ABOVE"
            else:
                verdict = "-"
            rows.append(
                [
                    case["case"],
                    f"{case['parameters']:,}",
                    c["comparison"],
                    str(c["steps"]),
                    fmt_seconds(c["hand_per_step_s"]["median"]),
                    fmt_seconds(c["lamploop_per_step_s"]["median"]),
                    f"{ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]",
                    f"{outer['median']:.3f} [{outer['min']:.3f}-{outer['max']:.3f}]",
                    f"{over['median']:+.1f} [{over['q1']:+.1f}..{over['q3']:+.1f}]",
                    f"{c['ratio_of_fastest']:.3f}",
                    f"{c['max_parameter_difference']:.1e}",
                    verdict + (" (noisy)" if c["noisy"] else ""),
                ]
            )
    return rows


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _fmt_load(load: list[float] | None) -> str:
    return "n/a" if load is None else "/".join(f"{x:.2f}" for x in load)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_loop")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="call torch.set_num_threads(N) first (default: leave torch's default, which is recorded)",
    )
    parser.add_argument(
        "--breakdown-only",
        action="store_true",
        help="measure only the step breakdown's cost (enabled vs disabled), not lamploop vs the hand loop",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    q = 1 if args.quick else 0
    pairs, min_pairs, budget_s, epochs = MAX_PAIRS[q], MIN_PAIRS[q], BUDGET_S[q], EPOCHS[q]
    print(
        f"lamploop {lamploop.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; "
        f"SGD(lr={LEARNING_RATE}, momentum={MOMENTUM}); {min_pairs}-{pairs} alternated pairs "
        f"({budget_s:.0f} s budget each) after 1 warm-up" + (" (quick)" if args.quick else "")
    )
    load_start = _load_average()
    started = time.perf_counter()
    cases = [
        run_case(
            name, widths, steps[q], epochs, pairs, min_pairs, budget_s, breakdown_only=args.breakdown_only
        )
        for name, (widths, steps) in CASES.items()
    ]
    print()
    print_table(
        [
            "case",
            "pairs",
            "off/step",
            "on/step",
            "on/off wall med [min-max]",
            "on/off cpu med [min-max]",
            "marks/step",
            "marks/step time",
            f"< {100 * BREAKDOWN_TARGET:g}%",
        ],
        breakdown_rows(cases),
    )
    print(
        "\nThe step breakdown: one_epoch with step_times=StepTimes() (on) against step_times=None (off), "
        "alternated.\nwall/cpu: median over pairs of on/off [min-max].  marks/step: the breakdown's own "
        "work per step timed alone\n(its clock reads and sums in a tight loop); the verdict compares it "
        "with the median step time,\nas the wall ratio cannot resolve a fraction of a per cent on a "
        "shared machine."
    )
    if args.breakdown_only:
        load_end = _load_average()
        print(f"Load average at start {_fmt_load(load_start)}, at end {_fmt_load(load_end)}.")
        if args.json is not None:
            write_json(
                args.json,
                {
                    "benchmark": "loop-breakdown",
                    "quick": args.quick,
                    "load_average_start": load_start,
                    "load_average_end": load_end,
                    "breakdown": [case["breakdown"] for case in cases],
                },
            )
            print(f"Wrote {args.json}")
        return 0
    fixed = anyio_run_cost(20 if args.quick else 50)
    total = time.perf_counter() - started

    print()
    headers = [
        "case",
        "params",
        "loop",
        "steps",
        "hand/step",
        "lamploop/step",
        "ratio med [min-max]",
        "incl. anyio.run",
        "overhead µs/batch med [IQR]",
        "min/min",
        "max|Δparam|",
        f"<= {TARGET_RATIO}",
    ]
    print_table(headers, table_rows(cases))
    load_end = _load_average()
    print(
        "\nhand/step, lamploop/step: median wall time per step.  ratio: median over pairs of lamploop/hand "
        "[min-max].\nincl. anyio.run: the same, lamploop's side timed from before anyio.run to after it.\n"
        "overhead: median over pairs of (lamploop - hand) / steps [interquartile range].  "
        "min/min: fastest lamploop\nrepetition / fastest hand repetition.  max|Δparam|: largest difference "
        "between the parameters\nthe two loops ended with (both start from the same copy).\n"
        f"Fixed cost outside the table: anyio.run of an empty coroutine {fmt_seconds(fixed['median'])} "
        f"(median of {fixed['n']}), paid once per anyio.run.\n"
        f"Load average at start {_fmt_load(load_start)}, at end {_fmt_load(load_end)}; total {total:.1f} s."
    )
    noisy = [f"{c['case']}/{c['comparison']}" for case in cases for c in case["comparisons"] if c["noisy"]]
    if noisy:
        print(
            f"WARNING: noisy comparisons (ratio IQR > {NOISY_IQR}): {', '.join(noisy)}. "
            "The machine was busy; re-run on a quiet machine before drawing conclusions."
        )

    target = next(
        c
        for case in cases
        if case["case"] == TARGET_CASE
        for c in case["comparisons"]
        if c["comparison"] == "one_epoch"
    )
    summary = {
        "noisy_comparisons": noisy,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "target_case": TARGET_CASE,
        "target_ratio": TARGET_RATIO,
        "target_ratio_measured": target["ratio_lamploop_over_hand"]["median"],
        "target_ratio_including_anyio_run": target["ratio_lamploop_over_hand_including_anyio_run"]["median"],
        "target_met": target["ratio_lamploop_over_hand"]["median"] <= TARGET_RATIO,
        "breakdown_ratio_enabled_over_disabled": {
            case["case"]: case["breakdown"]["ratio_enabled_over_disabled"]["median"] for case in cases
        },
        "breakdown_marks_share_of_step": {
            case["case"]: case["breakdown"]["marks_share_of_step"] for case in cases
        },
        "target_conclusive": not target["noisy"],
        "overhead_per_batch_us": {
            f"{c['case']}/{c['comparison']}": c["overhead_per_batch_us"]["median"]
            for case in cases
            for c in case["comparisons"]
        },
    }
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "loop",
                "quick": args.quick,
                "settings": {
                    "optimizer": f"SGD(lr={LEARNING_RATE}, momentum={MOMENTUM})",
                    "batch_size": BATCH_SIZE,
                    "seed": SEED,
                    "max_pairs": pairs,
                    "min_pairs": min_pairs,
                    "budget_s_per_comparison": budget_s,
                    "warmup_rounds": 1,
                    "epochs_for_driver": epochs,
                    "timer": "time.perf_counter (wall); lamploop timed inside anyio.run, and again "
                    "around it (ratio_lamploop_over_hand_including_anyio_run)",
                    "torch_threads": torch.get_num_threads(),
                    "torch_threads_forced": args.threads is not None,
                },
                "summary": summary,
                "anyio_run_fixed_cost_s": fixed,
                "cases": cases,
                "total_seconds": total,
            },
        )
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
