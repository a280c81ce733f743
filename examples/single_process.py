"""A small training run that goes NaN at a planted step, and what nand says about it.

    python examples/single_process.py                    # a layer's inline code makes inf
    python examples/single_process.py --fault backward   # NaN only in backward (log at 0)
    python examples/single_process.py --fault data --step 25

The model is a tiny attention classifier on synthetic data, trained with
AdamW. At ``--step`` a fault is planted; ``nand.watch`` finds the first
non-finite value (rank, step, micro-step, phase, module) and, with
``on_nonfinite="raise"``, stops *before* the optimizer writes it into the
weights. Nothing else in the training loop changes.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import nand


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.temperature = 1.0  # the planted fault sets it to 0 (inline code, no submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / (self.temperature * q.shape[-1] ** 0.5)
        return self.out(torch.softmax(scores, dim=-1) @ v)


class LogFeatures(nn.Module):
    """log(x) where x > 0, else 0: finite forward, NaN gradient where x == 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class Classifier(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.attn = Attention(dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim))
        self.features = LogFeatures()
        self.head = nn.Linear(dim, classes)
        self.gate = 1.0  # the "backward" fault sets it to 0: log sees exact zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.norm(h + self.attn(h))
        h = h + self.mlp(h)
        return self.head(self.features(h * self.gate).mean(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["layer", "backward", "data"], default="layer")
    parser.add_argument("--step", type=int, default=40, help="step at which to plant it")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(format="%(levelname)s %(message)s")
    torch.manual_seed(0)

    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with nand.watch(model, opt, on_nonfinite="raise") as watch:
        try:
            for step in range(args.steps):
                x, y = torch.rand(16, 10, 8), torch.randint(0, 4, (16,))
                planted = step == args.step
                model.attn.temperature = 0.0 if planted and args.fault == "layer" else 1.0
                if planted and args.fault == "data":
                    x[3, 2, 1] = float("nan")
                model.gate = 0.0 if planted and args.fault == "backward" else 1.0
                loss = watch.loss(nn.functional.cross_entropy(model(x), y))
                loss.backward()
                opt.step()
                opt.zero_grad()
        except nand.NonFiniteError as err:
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            print(f"\nstopped at step {watch.step}; the weights are still finite: {finite}")
            report(err.event, watch)
            return
    print(f"finished {watch.step} steps; nand saw nothing non-finite")


def report(event: nand.Event, watch: nand.Watch) -> None:
    print("\nfirst non-finite value:")
    for key in ("rank", "step", "micro_step", "phase", "module", "module_type", "cause"):
        print(f"  {key:11s} {getattr(event, key)}")
    print(f"  {'values':11s} min={event.min} max={event.max} shape={event.shape} {event.dtype}")
    flight = watch.flight_window()
    if event.module in flight.modules:
        j = flight.modules.index(event.module)
        series = [row[j] for row in flight.act_max_abs[-6:]]
        print(f"\nflight recorder, max|activation| of {event.module!r} over the last steps:")
        print("  " + "  ".join("-" if v is None else f"{v:.3g}" for v in series))
    print("  loss: " + "  ".join("-" if v is None else f"{v:.3f}" for v in flight.loss[-6:]))


if __name__ == "__main__":
    main()
