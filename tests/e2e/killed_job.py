"""A 2-rank DDP job (gloo, CPU) in which one rank kills itself with SIGKILL at a
planted step: the ground truth of the killed-rank tests, written down by the
job itself (``OUT/rank-N.json``: the step and the time each rank died or
raised) without asking nand.

Run as ``python -m tests.e2e.killed_job`` in every rank, with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and:

- ``KILL_RANK``, ``KILL_STEP``: who dies, at which step;
- ``KILL_AT``: ``start`` (before the step's forward: the survivor is next in
  DDP's gradient all-reduce) or ``after_backward`` (before ``optimizer.step``:
  the survivor is next in whatever the step boundary runs, e.g. the agreed
  flag of ``on_nonfinite="stop"``);
- ``POLICY``: nand's ``on_nonfinite``; ``GLOO_TIMEOUT_S``: the process group's
  timeout (how long the survivor waits in a collective for the dead rank);
- ``OUT``: the folder for the ground truth.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import nand

STEPS = 200


def record(rank: int, **facts: object) -> None:
    path = Path(os.environ["OUT"]) / f"rank-{rank}.json"
    path.write_text(json.dumps({"rank": rank, "time": time.time(), **facts}))


def train(rank: int) -> None:
    kill_rank, kill_step = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"])
    kill_at = os.environ.get("KILL_AT", "start")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    policy = os.environ.get("POLICY", "warn")
    step = 0
    try:
        with nand.watch(ddp, optimizer=optimizer, on_nonfinite=policy):
            for step in range(STEPS):
                dies = rank == kill_rank and step == kill_step
                if dies and kill_at == "start":
                    die(rank, step)
                loss = ddp(torch.randn(4, 8)).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                if dies:
                    die(rank, step)
                optimizer.step()
                time.sleep(0.05)
    except BaseException as exc:
        record(rank, step=step, raised=type(exc).__name__)
        raise
    record(rank, step=step, raised=None)


def die(rank: int, step: int) -> None:
    record(rank, step=step, killed=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT_S", "5")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    try:
        train(rank)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
