"""The models ``overhead.py`` times, each as real code writes it.

A case is ``(model, inputs, loss_fn)``: ``inputs()`` gives the batch,
``loss_fn(output)`` the loss. Shapes are realistic for one CPU thread:
large enough that a step is kernels, not Python, small enough for
interleaved repeats; ``gpt2_124m`` and ``resnet18_b256`` are a GPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Case = tuple[nn.Module, Callable[[], Tensor], Callable[[Any], Tensor]]


def sequential_mlp() -> Case:
    """MLP 64-256-256-10 as an ``nn.Sequential``, batch 64."""
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    return model, lambda: x, lambda out: F.cross_entropy(out, y)


class CustomMLP(nn.Module):
    """The same MLP as most code writes it: layers as attributes, ``F.relu`` inline."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def custom_mlp() -> Case:
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    return CustomMLP(), lambda: x, lambda out: F.cross_entropy(out, y)


def transformer() -> Case:
    """``nn.TransformerEncoder`` d256 x4, 8 heads, ff 1024; seq 128, batch 16."""
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    x = torch.randn(16, 128, 256)
    return model, lambda: x, lambda out: out.pow(2).mean()


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-norm blocks, tied head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt() -> Case:
    """4 layers, d256, 8 heads, vocab 2048; seq 128, batch 8."""
    ids = torch.randint(0, 2048, (8, 129))
    x, y = ids[:, :-1], ids[:, 1:]
    model = GPT(vocab=2048, dim=256, layers=4, heads=8, context=128)
    return model, lambda: x, lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())


def gpt2_124m() -> Case:
    """GPT-2 small's shape (12 layers, d768, 12 heads, vocab 50304); seq 1024, batch 8.

    A GPU's shape, as nanoGPT-style code trains it: on one CPU thread a step
    takes about a minute."""
    ids = torch.randint(0, 50304, (8, 1025))
    x, y = ids[:, :-1], ids[:, 1:]
    model = GPT(vocab=50304, dim=768, layers=12, heads=12, context=1024)
    return model, lambda: x, lambda out: F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (a 3x3 stem, no max-pool), as CIFAR code writes it."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64))
        layers: list[nn.Module] = []
        inputs = 64
        for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(inputs, channels, stride), BasicBlock(channels, channels, 1)]
            inputs = channels
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(F.relu(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18() -> Case:
    """Batch 8 of 3x32x32."""
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return ResNet18(), lambda: x, lambda out: F.cross_entropy(out, y)


def resnet18_b256() -> Case:
    """The same ResNet-18, batch 256 of 3x32x32: CIFAR training on a GPU."""
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    return ResNet18(), lambda: x, lambda out: F.cross_entropy(out.float(), y)


def hf_gpt2() -> Case:
    """HF ``GPT2LMHeadModel`` from a config (random init): 4 layers, d256, 8
    heads, vocab 2048; seq 128, batch 8 (transformers, imported on use)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=8)
    ids = torch.randint(0, 2048, (8, 129))
    x, y = ids[:, :-1], ids[:, 1:]

    def loss(out: Any) -> Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    return GPT2LMHeadModel(config), lambda: x, loss
