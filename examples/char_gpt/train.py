"""Train a small character-level GPT on Python's standard library source with ``lamploop.fit``.

    python examples/char_gpt/train.py --quick                 # a few seconds, 1 rank
    python examples/char_gpt/train.py --quick --ranks 2       # 2 processes (Gloo on CPU)
    python examples/char_gpt/train.py                         # ~3.2M parameters, checkpoints in runs/char_gpt

Run the same command again and it resumes from the latest checkpoint in ``--out``; a larger
``--epochs`` trains on. Ctrl-C stops every rank after the step in progress and checkpoints
there. Rank 0 prints each epoch's losses and, at the end, a sample of generated text.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import Corpus, load_corpus, training_batches, validation_batches
from gpt import GPT, GPTConfig, generate, token_loss

import lamploop
from lamploop.distributed.launch import launch_env
from lamploop.loop.precision import Precision

__all__ = ["FULL", "QUICK", "RunConfig", "build_model", "make_optimizer", "main", "parse", "train"]


@attrs.frozen
class RunConfig:
    """What one run trains: the model's sizes, the data and the optimizer's settings."""

    max_chars: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    batch_size: int
    steps_per_epoch: int
    validation_batches: int
    epochs: int
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337

    def gpt(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


# About 3.2M parameters: on a CPU core ~0.5 s a step, on a GPU much less.
FULL = RunConfig(
    max_chars=2_000_000,
    block_size=128,
    n_layer=4,
    n_head=4,
    n_embd=256,
    dropout=0.1,
    batch_size=32,
    steps_per_epoch=200,
    validation_batches=20,
    epochs=10,
    learning_rate=1e-3,
    warmup_steps=100,
)

# A few seconds on a CPU: what the tests run.
QUICK = RunConfig(
    max_chars=60_000,
    block_size=32,
    n_layer=2,
    n_head=2,
    n_embd=32,
    dropout=0.1,
    batch_size=8,
    steps_per_epoch=12,
    validation_batches=4,
    epochs=3,
    learning_rate=1e-2,
    warmup_steps=4,
)


def build_model(config: RunConfig, vocab_size: int) -> GPT:
    """The GPT, initialised from ``config.seed`` (the same weights on every rank and every run)."""
    torch.manual_seed(config.seed)
    return GPT(config.gpt(vocab_size))


def make_optimizer(config: RunConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW as nanoGPT configures it: weight decay on matrices and embeddings, none on biases and norms."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95))


def train(
    config: RunConfig,
    corpus: Corpus,
    *,
    out: Path | None,
    max_epochs: int | None = None,
    ranks: int | None = None,
    precision: Precision = "32",
    device: str = "auto",
    resume: bool = True,
    checkpoint_every_n_steps: int | None = None,
    launch_command: Sequence[str] | None = None,
    reporters: Sequence[lamploop.Reporter] | None = None,
    on_epoch: Callable[[lamploop.LoopState], object] | None = None,
) -> tuple[GPT, lamploop.LoopState | None]:
    """Train with ``lamploop.fit``; the model (the best validation epoch's) and rank 0's state.

    ``max_epochs`` (default ``config.epochs``) stops the run earlier than the learning-rate
    schedule, which always spans ``config.epochs``: a run stopped there and resumed with the
    default is the uninterrupted run.

    ``ranks > 1``: this process is rank 0 and runs ``launch_command`` (default: this
    process's command line) for the others, which must make the same call; ``None``: as many
    as a launcher (torchrun, Slurm) started, else 1.
    """
    model = build_model(config, corpus.vocab_size)
    total_steps = config.epochs * config.steps_per_epoch
    schedule = lamploop.warmup_cosine(
        warmup_steps=min(config.warmup_steps, total_steps),  # a short run (--epochs 1) warms up less
        total_steps=total_steps,
        steps_per_epoch=config.steps_per_epoch,
        final=config.min_lr_ratio,
    )
    state = lamploop.fit(
        model=lamploop.SupervisedModel(model, token_loss),
        optimizer_factory=lambda params: make_optimizer(config, params),
        train_batches=training_batches(
            corpus.train,
            block_size=config.block_size,
            batch_size=config.batch_size,
            steps_per_epoch=config.steps_per_epoch,
            seed=config.seed,
        ),
        validation_batches=validation_batches(
            corpus.val,
            block_size=config.block_size,
            batch_size=config.batch_size,
            batches=config.validation_batches,
            seed=config.seed + 1,
        ),
        max_epochs=config.epochs if max_epochs is None else max_epochs,
        step_schedule=schedule,
        max_gradient_norm=config.grad_clip,
        precision=precision,
        device=device,
        world_size=ranks,
        launch_command=launch_command,
        checkpoint_dir=out,
        resume=resume,
        checkpoint_every_n_steps=checkpoint_every_n_steps,
        reporters=reporters,
        on_epoch=on_epoch,
    )
    return model, state


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the tiny size: a few seconds on a CPU")
    parser.add_argument(
        "--ranks", type=int, default=None, help="processes to train on (default: the launcher's, else 1)"
    )
    parser.add_argument(
        "--precision",
        choices=["32", "bf16", "fp16"],
        default="bf16",
        help="autocast the forward passes (default bf16; fp16 on GPUs, with a loss scale)",
    )
    parser.add_argument("--device", default="auto", help="'auto' (default): CUDA when there, else the CPU")
    parser.add_argument("--out", type=Path, default=None, help="checkpoint directory (default runs/char_gpt)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs in all (a resumed run included)")
    parser.add_argument("--steps-per-epoch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--no-resume", action="store_true", help="start from epoch 0 even if --out has checkpoints"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, metavar="N", help="also checkpoint every N steps"
    )
    parser.add_argument(
        "--sample", type=int, default=200, metavar="N", help="characters to generate at the end"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default torch's)")
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace) -> RunConfig:
    config = QUICK if args.quick else FULL
    changes = {
        name: value
        for name, value in (
            ("epochs", args.epochs),
            ("steps_per_epoch", args.steps_per_epoch),
            ("seed", args.seed),
        )
        if value is not None
    }
    return attrs.evolve(config, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = config_of(args)
    corpus = load_corpus(config.max_chars)
    out = args.out if args.out is not None else Path("runs", "char_gpt-quick" if args.quick else "char_gpt")
    began = time.perf_counter()
    model, state = train(
        config,
        corpus,
        out=out,
        ranks=args.ranks,
        precision=args.precision,
        device=args.device,
        resume=not args.no_resume,
        checkpoint_every_n_steps=args.checkpoint_every,
    )
    if state is None:  # ranks 1.. return nothing: rank 0 reports
        return 0
    launcher = launch_env()
    ranks = args.ranks if args.ranks is not None else (launcher.world_size if launcher is not None else 1)
    seconds = time.perf_counter() - began
    print(
        f"{model.num_parameters():,} parameters, vocabulary {corpus.vocab_size}, "
        f"{len(corpus.train):,} training characters; {ranks} rank(s), precision {args.precision}"
    )
    for entry in state.learning_curve:
        validation = (
            "" if entry.validation_loss is None else f", validation loss {entry.validation_loss[1]:.4f}"
        )
        print(f"epoch {entry.epoch}: train loss {entry.training_loss:.4f}{validation}")
    print(f"best epoch {state.min_validation_epoch}; {seconds:.1f} s; checkpoints in {out}")
    if args.sample > 0:
        prompt = corpus.encode("def ")[None, :]
        device = next(model.parameters()).device
        text = corpus.decode(generate(model, prompt.to(device), args.sample, seed=config.seed)[0])
        print(f"sample (ln(vocab) = {math.log(corpus.vocab_size):.2f} nats is chance):\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
