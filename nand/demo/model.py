"""A small GPT-style language model for the demo and the end-to-end tests.

Module names read like a real model (``blocks.1.mlp.fc2``), so a verdict that
names one is easy to follow. Small enough to train on a CPU in seconds.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + attended
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        # Causal mask: -inf above the diagonal, by design (attention masks are
        # the classic "non-finite on purpose" tensor; nand must not flag it).
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def make_batch(
    generator: torch.Generator, batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count upwards modulo ``vocab`` from a random start: easy
    to learn, so the loss visibly falls before things go wrong."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]
