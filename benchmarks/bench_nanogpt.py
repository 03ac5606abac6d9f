"""The char-level GPT of examples/char_gpt trained by a hand-written nanoGPT-style loop and by lamploop.fit.

Usage::

    python benchmarks/bench_nanogpt.py [--quick] [--json PATH] [--threads N] [--steps N] [--precision bf16]

Both sides train the same model (``examples/char_gpt/gpt.py``, built from the same seed)
for the same ``N`` steps on the same batches in the same order (``get_batch``-style random
windows of Python's standard library source, drawn from one generator seeded alike), with
AdamW as nanoGPT configures it (weight decay on matrices only, betas 0.9/0.95), a per-step
warm-up + cosine learning rate, and the global gradient norm clipped to 1.0:

* **hand**: the loop of nanoGPT's ``train.py`` on one process, written out here: set the
  step's learning rate in every param group, forward under the precision's context,
  ``F.cross_entropy`` (mean over the batch's characters), prefetch the next batch,
  ``backward``, ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
  each step's loss is kept as a tensor (not read) and read once at the end;
* **lamploop**: ``lamploop.fit(max_epochs=1, step_schedule=warmup_cosine(...),
  max_gradient_norm=1.0, precision=..., device="cpu", reporters=[])`` on one rank with the
  batch stream ``examples/char_gpt/corpus.training_batches`` (the same draws), the loss
  summed over characters (``lamploop`` divides by their number).

Checks, before any figure is trusted: the per-step losses of the two sides (lamploop's
recorded by its loss function, as sum / count) and their final parameters are compared;
they should be equal to float rounding (the largest absolute difference is printed, and the
run fails if it exceeds ``--tolerance``).

Timing: wall clock (``time.perf_counter``) of each side's whole training call, the model
already built: for the hand loop from making the optimizer to its last step, for lamploop
the ``fit`` call (its set-up, event loop and checks included).  A second figure,
"steady", times step 1's forward to step N's forward on each side (N - 1 whole steps,
excluding set-up).  tokens/s = steps * batch * block / seconds.  The two sides alternate
(AB, BA, ...) after one warm-up round, at least 5 pairs (3 with ``--quick``) and more while
a time budget lasts; the ratio lamploop / hand of tokens/s is summarised per pair (median,
min-max).  The target (issue 22) is a median ratio >= 0.98; a min-max range that straddles
it is reported as inconclusive.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "char_gpt"))

from _common import alternate, make_parser, print_table, summarize, write_json
from corpus import Corpus, draw_batch, epoch_generator, load_corpus, training_batches
from gpt import GPT, token_loss
from train import RunConfig, build_model, make_optimizer

import lamploop
from lamploop.loop.precision import Precision

TARGET_RATIO = 0.98
"""Issue 22's acceptance: lamploop's tokens/s over the hand loop's, median of alternated runs."""

# The model of the example's full size with batches of 8 (a few tenths of a second per step
# on a CPU core); --quick: the example's quick size.
BENCH = RunConfig(
    max_chars=400_000,
    block_size=128,
    n_layer=4,
    n_head=4,
    n_embd=256,
    dropout=0.0,  # nanoGPT's default for pretraining
    batch_size=8,
    steps_per_epoch=30,
    validation_batches=0,
    epochs=1,
    learning_rate=1e-3,
    warmup_steps=5,
)
QUICK = attrs.evolve(
    BENCH, max_chars=60_000, block_size=32, n_layer=2, n_head=2, n_embd=32, batch_size=8, steps_per_epoch=12
)
MIN_PAIRS = (5, 3)
MAX_PAIRS = (15, 3)
BUDGET_S = (240.0, 10.0)
DEFAULT_TOLERANCE = 1e-6


# --------------------------------------------------------------------------- the two loops


@attrs.define
class Run:
    """What one training run left: its per-step losses and step start times, and the model."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the process's CPU time (every thread), less sensitive to a busy machine
    losses: list[float] = attrs.field(factory=list)
    step_starts: list[float] = attrs.field(factory=list)
    module: GPT | None = None

    def steady_seconds(self) -> float:
        """Step 1's forward to step N's forward: N - 1 whole steps."""
        return self.step_starts[-1] - self.step_starts[0]


def precision_context(precision: Precision) -> contextlib.AbstractContextManager[Any]:
    """nanoGPT's ``ctx``: autocast to the precision's dtype, or nothing for float32."""
    if precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type="cpu", dtype=dtype)


def hand_loop(config: RunConfig, corpus: Corpus, model: GPT, precision: Precision) -> Run:
    """nanoGPT's training loop, on one process and the CPU, written out by hand."""
    run = Run(module=model)
    learning_rate, warmup_iters, max_iters = config.learning_rate, config.warmup_steps, config.steps_per_epoch
    lr_decay_iters, min_lr_ratio = max_iters, config.min_lr_ratio
    generator = epoch_generator(config.seed, 0)
    ctx = precision_context(precision)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return draw_batch(corpus.train, config.block_size, config.batch_size, generator)

    def get_lr(it: int) -> float:
        # Warm-up then a half cosine to min_lr_ratio * learning_rate, in the algebra of
        # lamploop.warmup_cosine (so that both sides set bit-identical rates).
        if it < warmup_iters:
            return learning_rate * ((it + 1) / warmup_iters)
        decay_ratio = min(1.0, (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters))
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return learning_rate * (min_lr_ratio + (1.0 - min_lr_ratio) * coeff)

    start, cpu_start = time.perf_counter(), time.process_time()
    optimizer = make_optimizer(config, model.parameters())  # model.configure_optimizers(...)
    model.train()
    losses: list[torch.Tensor] = []
    X, Y = get_batch()  # fetch the very first batch
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        # gradient_accumulation_steps = 1: nanoGPT's loss / gradient_accumulation_steps is left out
        with ctx:
            logits = model(X)
            run.step_starts.append(time.perf_counter())  # after the forward, as lamploop's side
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
        X, Y = get_batch()  # prefetch the next batch while... (on a GPU: asynchronously)
        loss.backward()
        if config.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    run.losses = torch.stack(losses).tolist()  # read once, at the end
    run.seconds, run.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return run


def lamploop_fit(config: RunConfig, corpus: Corpus, model: GPT, precision: Precision) -> Run:
    """The same training by ``lamploop.fit`` on one rank."""
    run = Run(module=model)
    sums: list[torch.Tensor] = []
    counts: list[int] = []

    def recorded_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        run.step_starts.append(time.perf_counter())  # after the forward, as the hand's side
        loss_sum, count = token_loss(logits, targets)
        sums.append(loss_sum.detach())
        counts.append(count)
        return loss_sum, count

    schedule = lamploop.warmup_cosine(
        warmup_steps=config.warmup_steps,
        total_steps=config.steps_per_epoch,
        steps_per_epoch=config.steps_per_epoch,
        final=config.min_lr_ratio,
    )
    batches = training_batches(
        corpus.train,
        block_size=config.block_size,
        batch_size=config.batch_size,
        steps_per_epoch=config.steps_per_epoch,
        seed=config.seed,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    lamploop.fit(
        model=lamploop.SupervisedModel(model, recorded_loss),
        optimizer_factory=lambda params: make_optimizer(config, params),
        train_batches=batches,
        max_epochs=1,
        step_schedule=schedule,
        max_gradient_norm=config.grad_clip,
        precision=precision,
        device="cpu",
        reporters=[],
    )
    run.seconds, run.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    # lamploop's loss per step: the sum over the batch's characters over their number.
    run.losses = [float(s / c) for s, c in zip(sums, counts, strict=True)]
    return run


# --------------------------------------------------------------------------- measurement


class Side:
    """One contender: builds the model (untimed), runs, keeps every run."""

    def __init__(
        self,
        train: Callable[[RunConfig, Corpus, GPT, Precision], Run],
        config: RunConfig,
        corpus: Corpus,
        precision: Precision,
    ) -> None:
        self._train, self._config, self._corpus, self._precision = train, config, corpus, precision
        self.runs: list[Run] = []

    def __call__(self) -> float:
        model = build_model(self._config, self._corpus.vocab_size)  # the same seed: the same weights
        run = self._train(self._config, self._corpus, model, self._precision)
        self.runs.append(run)
        return run.seconds


@torch.no_grad()
def max_parameter_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def loss_comparison(hand: Run, lamp: Run) -> dict[str, Any]:
    """Step-for-step loss differences and the final parameters' difference of two runs."""
    if len(hand.losses) != len(lamp.losses):
        msg = f"the hand loop took {len(hand.losses)} steps, lamploop {len(lamp.losses)}"
        raise AssertionError(msg)
    diffs = [abs(h - lp) for h, lp in zip(hand.losses, lamp.losses, strict=True)]
    assert hand.module is not None
    assert lamp.module is not None
    return {
        "steps": len(diffs),
        "max_abs_loss_difference": max(diffs),
        "steps_bitwise_equal": sum(d == 0.0 for d in diffs),
        "first_differing_step": next((i for i, d in enumerate(diffs) if d != 0.0), None),
        "max_abs_parameter_difference": max_parameter_difference(hand.module, lamp.module),
        "hand_losses": hand.losses,
        "lamploop_losses": lamp.losses,
    }


def _load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _fmt_load(load: list[float] | None) -> str:
    return "n/a" if load is None else "/".join(f"{x:.2f}" for x in load)


def _fmt_range(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def verdict(ratio: dict[str, float]) -> str:
    """'met', 'missed' or 'inconclusive' (the min-max range straddles the target)."""
    if ratio["min"] < TARGET_RATIO <= ratio["max"]:
        return "inconclusive"
    return "met" if ratio["median"] >= TARGET_RATIO else "missed"


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_nanogpt")
    parser.add_argument("--threads", type=int, metavar="N", help="torch.set_num_threads(N) first")
    parser.add_argument("--steps", type=int, metavar="N", help="steps per run (default 30, quick 12)")
    parser.add_argument(
        "--precision", choices=["32", "bf16"], default="32", help="default 32, as nanoGPT on a CPU"
    )
    parser.add_argument("--pairs", type=int, metavar="N", help="at most N alternated pairs")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"largest per-step loss difference accepted (default {DEFAULT_TOLERANCE})",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    q = 1 if args.quick else 0
    config = QUICK if args.quick else BENCH
    if args.steps is not None:
        config = attrs.evolve(config, steps_per_epoch=args.steps)
    pairs = args.pairs if args.pairs is not None else MAX_PAIRS[q]
    min_pairs = min(MIN_PAIRS[q], pairs)
    precision: Precision = args.precision
    corpus = load_corpus(config.max_chars)
    tokens = config.steps_per_epoch * config.batch_size * config.block_size
    parameters = build_model(config, corpus.vocab_size).num_parameters()
    print(
        f"lamploop {lamploop.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; GPT {config.n_layer} layers "
        f"x {config.n_embd} wide, {parameters:,} parameters, "
        f"vocabulary {corpus.vocab_size}; {config.steps_per_epoch} steps of {config.batch_size} x "
        f"{config.block_size} characters, precision {precision}; {min_pairs}-{pairs} alternated pairs "
        f"after 1 warm-up" + (" (quick)" if args.quick else "")
    )
    load_start = _load()
    started = time.perf_counter()
    hand = Side(hand_loop, config, corpus, precision)
    lamp = Side(lamploop_fit, config, corpus, precision)
    timings = alternate(hand, lamp, pairs=pairs, warmup=1, min_pairs=min_pairs, budget_s=BUDGET_S[q])
    total = time.perf_counter() - started
    load_end = _load()

    equality = loss_comparison(hand.runs[0], lamp.runs[0])
    # Every repetition of a side must train alike too (determinism), or the comparison means little.
    repeat_spread = max(
        max(abs(a - b) for a, b in zip(side.runs[0].losses, run.losses, strict=True))
        for side in (hand, lamp)
        for run in side.runs[1:]
    )
    measured_hand, measured_lamp = hand.runs[1:], lamp.runs[1:]  # the warm-up round left out
    steady_tokens = tokens * (config.steps_per_epoch - 1) / config.steps_per_epoch
    # name: (the hand loop's seconds per pair, lamploop's, the tokens they trained on)
    measures: dict[str, tuple[list[float], list[float], float]] = {
        "whole run": ([t for t, _ in timings], [t for _, t in timings], tokens),
        "steady (steps 1..N)": (
            [r.steady_seconds() for r in measured_hand],
            [r.steady_seconds() for r in measured_lamp],
            steady_tokens,
        ),
        "whole run, CPU time": (
            [r.cpu_seconds for r in measured_hand],
            [r.cpu_seconds for r in measured_lamp],
            tokens,
        ),
    }
    # tokens/s lamploop over hand = the hand's seconds over lamploop's, per pair
    ratios = {
        name: summarize([th / tl for th, tl in zip(hs, ls, strict=True)])
        for name, (hs, ls, _) in measures.items()
    }
    whole, steady = ratios["whole run"], ratios["steady (steps 1..N)"]
    rows = [
        [
            name,
            f"{n / summarize(hs)['median']:,.0f}",
            f"{n / summarize(ls)['median']:,.0f}",
            _fmt_range(ratios[name]),
            verdict(ratios[name]),
        ]
        for name, (hs, ls, n) in measures.items()
    ]
    print()
    print_table(
        ["timed", "hand tokens/s", "lamploop tokens/s", "ratio med [min-max]", f">= {TARGET_RATIO}"], rows
    )
    print(
        f"\n{len(timings)} pairs.  ratio: lamploop tokens/s over the hand loop's, per alternated pair; "
        "tokens/s: median run (CPU time: tokens per CPU-second of the process).\n"
        f"Losses step for step ({equality['steps']} steps): max |hand - lamploop| = "
        f"{equality['max_abs_loss_difference']:.3g}, {equality['steps_bitwise_equal']} of "
        f"{equality['steps']} bitwise equal; final parameters max |diff| = "
        f"{equality['max_abs_parameter_difference']:.3g}; "
        f"repetitions of one side differ by at most {repeat_spread:.3g}.\n"
        f"hand losses:     {' '.join(f'{x:.4f}' for x in equality['hand_losses'][:6])} ... "
        f"{equality['hand_losses'][-1]:.4f}\n"
        f"lamploop losses: {' '.join(f'{x:.4f}' for x in equality['lamploop_losses'][:6])} ... "
        f"{equality['lamploop_losses'][-1]:.4f}\n"
        f"Load average at start {_fmt_load(load_start)}, at end {_fmt_load(load_end)}; total {total:.1f} s."
    )
    ok = equality["max_abs_loss_difference"] <= args.tolerance
    if not ok:
        print(f"FAILED: the losses differ by more than --tolerance {args.tolerance}")
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "nanogpt",
                "quick": args.quick,
                "settings": {
                    "config": attrs.asdict(config),
                    "parameters": parameters,
                    "vocab_size": corpus.vocab_size,
                    "precision": precision,
                    "tokens_per_run": tokens,
                    "torch_threads": torch.get_num_threads(),
                    "pairs": len(timings),
                    "timer": "time.perf_counter (wall) of each side's whole training call; steady: step 1's "
                    "forward to step N's",
                },
                "summary": {
                    "target_ratio": TARGET_RATIO,
                    "ratio_whole_run": whole,
                    "ratio_steady": steady,
                    "ratio_cpu_time": ratios["whole run, CPU time"],
                    "verdict_whole_run": verdict(whole),
                    "verdict_steady": verdict(steady),
                    "load_average_start": load_start,
                    "load_average_end": load_end,
                    "losses_equal_within_tolerance": ok,
                    "tolerance": args.tolerance,
                    "repeat_spread": repeat_spread,
                },
                "equality": equality,
                "raw": {
                    "hand_seconds": [t for t, _ in timings],
                    "lamploop_seconds": [t for _, t in timings],
                    "hand_steady_seconds": [r.steady_seconds() for r in measured_hand],
                    "lamploop_steady_seconds": [r.steady_seconds() for r in measured_lamp],
                    "hand_cpu_seconds": [r.cpu_seconds for r in measured_hand],
                    "lamploop_cpu_seconds": [r.cpu_seconds for r in measured_lamp],
                    "order": ["hand-first" if i % 2 == 0 else "lamploop-first" for i in range(len(timings))],
                },
                "total_seconds": total,
            },
        )
        print(f"Wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
