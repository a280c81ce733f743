"""A real distributed training job, watched by nand, with an optional planted fault.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m nand.demo.trainer --steps 60 --fault overflow:rank=2:step=40

Each rank trains a small GPT (or an MLP with ``--model mlp``) under DDP (or
FSDP2 with ``--fsdp``) on the gloo backend, CPU only. ``NAND_SERVER`` and
``NAND_RUN`` reach ``nand.watch`` through the environment, as in real use.

Exit codes: 0 finished, 3 stopped by nand because the run went non-finite,
4 stopped on request (``nand stop`` / the REST stop).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nand
from nand.demo.faults import Fault, maybe_explode_lr, plant, plant_in_optimizer, poison_batch
from nand.demo.model import TinyGPT, make_batch
from nand.policy import OnNonfinite

EXIT_NONFINITE = 3
EXIT_STOPPED = 4
log = logging.getLogger("nand.demo.trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument(
        "--fault", type=Fault.parse, default=None, help="e.g. overflow:rank=1:step=30"
    )
    parser.add_argument("--policy", choices=[p.value for p in OnNonfinite], default="raise")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    parser.add_argument(
        "--no-dist", action="store_true", help="independent ranks: no process group, no DDP"
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds per step, at least")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    return parser.parse_args(argv)


def build_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
        )
    return TinyGPT()


def default_fault_module(kind: str) -> str:
    return "2" if kind == "mlp" else "blocks.1.mlp.fc2"


def wrap(model: nn.Module, fsdp: bool) -> nn.Module:
    if not dist.is_initialized():
        return model
    if not fsdp:
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for child in model.modules():
        if isinstance(child, nn.Linear):
            fully_shard(child)
    fully_shard(model)
    return model


class Batches:
    """Each rank draws its own data, as with a DistributedSampler."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args = args
        self.generator = torch.Generator().manual_seed(1000 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.args.model == "mlp":
            x = torch.randn(self.args.batch, 32, generator=self.generator)
            return x, x[:, :8].sin()
        return make_batch(self.generator, self.args.batch, self.args.seq, vocab=64)


def compute_loss(model: nn.Module, kind: str, inputs: torch.Tensor, targets: torch.Tensor):
    output = model(inputs)
    if kind == "mlp":
        return nn.functional.mse_loss(output, targets)
    return nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())


def train(args: argparse.Namespace) -> int:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(args.model)
    fault = args.fault
    if fault is not None and not fault.module:
        fault = Fault(fault.kind, fault.rank, fault.step, default_fault_module(args.model))
    clock = plant(fault, model, rank) if fault else None
    plain, model = model, wrap(model, args.fsdp)  # (DDP wraps it; FSDP2 shards it in place)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if clock is not None:
        plant_in_optimizer(fault, optimizer, plain, rank, clock)
    batches = Batches(args, rank)

    with nand.watch(model, optimizer=optimizer, on_nonfinite=args.policy) as watch:
        for step in range(args.steps):
            started = time.monotonic()
            if clock is not None:
                clock.step = step
            maybe_explode_lr(fault, step, optimizer)
            inputs, targets = batches.next()
            inputs = poison_batch(fault, rank, step, inputs)
            loss = compute_loss(model, args.model, inputs, targets)
            loss.backward()
            watch.loss(loss)
            try:
                optimizer.step()
            except nand.NonFiniteError as error:
                log.error("rank %d: stopped at step %d: %s", rank, step, error)
                return EXIT_NONFINITE
            except nand.StopRequested as request:
                log.warning("rank %d: stopping on request at step %d", rank, request.step)
                return EXIT_STOPPED
            optimizer.zero_grad(set_to_none=True)
            time.sleep(max(0.0, args.step_time - (time.monotonic() - started)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    if "RANK" in os.environ and not args.no_dist:
        dist.init_process_group("gloo")
    try:
        return train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
