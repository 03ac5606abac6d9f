"""The text (Python's own standard library source), its characters, and nanoGPT-style batches.

Nothing is downloaded: the text is the concatenation of the standard library's top-level
``*.py`` files, in name order, cut to ``max_chars``; the same Python gives the same text.
Characters are the tokens; the vocabulary is the sorted set of characters in the text.

Batches are drawn as nanoGPT's ``get_batch`` draws them: ``batch_size`` random offsets into
the split, ``x`` the ``block_size`` characters from each, ``y`` the same shifted by one. The
offsets of epoch ``e`` come from a generator seeded with ``(seed, e)``, so the batches are a
pure function of (seed, epoch, rank): a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

import lamploop
from lamploop.batches import epoch_seed

__all__ = [
    "Corpus",
    "draw_batch",
    "epoch_generator",
    "load_corpus",
    "stdlib_text",
    "training_batches",
    "validation_batches",
]


def stdlib_text(max_chars: int) -> str:
    """The first ``max_chars`` characters of the standard library's top-level modules, joined."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(folder.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    if len(text) < max_chars:
        msg = f"the standard library in {folder} has {len(text)} characters of *.py, fewer than {max_chars}"
        raise ValueError(msg)
    return text


@attrs.frozen
class Corpus:
    """The encoded text, split 90/10 into training and validation characters.

    Attributes:
        chars: the vocabulary: ``chars[i]`` is token ``i``.
        train, val: the token ids of each split (int64, 1-D).
    """

    chars: str
    train: torch.Tensor
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return _encode(self.chars, text)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in tokens.tolist())


def load_corpus(max_chars: int) -> Corpus:
    """The standard library's text cut to ``max_chars``, encoded and split."""
    text = stdlib_text(max_chars)
    chars = "".join(sorted(set(text)))
    data = _encode(chars, text)
    n = int(0.9 * len(data))
    return Corpus(chars=chars, train=data[:n], val=data[n:])


def _encode(chars: str, text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def draw_batch(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's ``get_batch``: random windows of ``block_size`` characters and their next characters."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()])
    return x, y


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator that draws epoch ``epoch``'s offsets (shared by every rank)."""
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


def training_batches(
    data: torch.Tensor, *, block_size: int, batch_size: int, steps_per_epoch: int, seed: int
) -> lamploop.BatchStreamFactory:
    """``steps_per_epoch`` steps of random windows per epoch, every rank one batch per step.

    Every rank draws all ``steps_per_epoch * nranks`` batches of the epoch from the same
    generator and keeps batch ``i`` when ``i % nranks == rank``, as ``tensor_batches`` deals
    them: two ranks with batches of ``b`` train on what one rank with batches of ``2b`` would.
    """

    def make(context: lamploop.BatchContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = epoch_generator(seed, context.epoch)
        for i in range(steps_per_epoch * context.nranks):
            x, y = draw_batch(data, block_size, batch_size, generator)
            if i % context.nranks == context.rank:
                yield x, y

    return lamploop.iterable_batches(make)


def validation_batches(
    data: torch.Tensor, *, block_size: int, batch_size: int, batches: int, seed: int
) -> lamploop.BatchStreamFactory:
    """The same ``batches`` windows of the validation split every epoch, dealt over the ranks."""

    def make(context: lamploop.BatchContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        for i in range(batches):
            x, y = draw_batch(data, block_size, batch_size, generator)
            if i % context.nranks == context.rank:
                yield x, y

    return lamploop.iterable_batches(make)
