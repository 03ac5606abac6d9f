"""A small GPT in plain torch: token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, a final layer norm and a head tied to the token embedding.

The shape follows nanoGPT's ``model.py`` (GPT-2's layout), written from the paper's
description: ``n_layer`` blocks of ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, weights
drawn from N(0, 0.02) with the residual projections scaled by ``1 / sqrt(2 * n_layer)``.
The head and the token embedding share one matrix (``wte.weight`` is ``lm_head.weight``):
lamploop's checkpoints store it once and restore the tie.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "generate", "token_loss"]


@attrs.frozen
class GPTConfig:
    """The model's sizes.

    Attributes:
        vocab_size: the number of distinct characters.
        block_size: the longest context, in characters.
        n_layer, n_head, n_embd: blocks, attention heads and the width of the residual stream.
        dropout: dropout after attention, MLP and embeddings (0 turns it off).
    """

    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            msg = f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}"
            raise ValueError(msg)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


class MLP(nn.Module):
    """Widen by 4, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(F.gelu(self.c_fc(x))))
        return out


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """``GPT(config)(idx)``: next-character logits of shape (B, T, vocab) for indices (B, T)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied: one matrix reads characters in and out
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections: keep the stream's variance
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            msg = f"a sequence of {t} characters is longer than block_size {self.config.block_size}"
            raise ValueError(msg)
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits

    def num_parameters(self) -> int:
        """Parameters in all (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """lamploop's loss: the summed cross entropy over every predicted character, and their number.

    Each character is an example, so a mean over steps, ranks and epochs is per character,
    as nanoGPT's ``F.cross_entropy(logits.view(-1, V), targets.view(-1))`` is per batch.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), reduction="sum"), targets.numel()


@torch.no_grad()
def generate(
    model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.8, seed: int = 0
) -> torch.Tensor:
    """Sample ``max_new_tokens`` more characters after ``idx`` (B, T); a seeded generator of its own."""
    generator = torch.Generator(device=idx.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size :]
        logits = model(context)[:, -1, :] / temperature
        probs = F.softmax(logits.float(), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return idx
