"""Training step time with a nand server that is dead, silent, or alive.

    python benchmarks/dead_server.py --steps 300 --repeats 7

Configurations, interleaved in a shuffled order within each repeat:

- ``no nand``: the bare training step (for reference)
- ``watch``: ``nand.watch`` without a server (the baseline the ratios use)
- ``dead``: ``server=`` an endpoint where nothing listens
- ``silent``: a receiver that reads every frame and never acknowledges
- ``live``: a receiver that acknowledges

A heartbeat is sent at every step (``NAND_HEARTBEAT_S=0``), a far heavier load
on the transport than the default of one every 5 s. The figure is the median
step time of each configuration over the repeats and its ratio to ``watch``,
then the same for the fastest repeat (the least disturbed on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

import nand
from nand.testing import Receiver, free_endpoint


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _time_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(20):  # warm up (and let the sender settle into its mode)
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def _one(name: str, endpoint: str | None, steps: int, run: str) -> float:
    model, opt = _model()
    if name == "no nand":
        return _time_steps(model, opt, steps)
    w = nand.watch(model, optimizer=opt, server=endpoint, run=run, log_events=False)
    try:
        return _time_steps(model, opt, steps)
    finally:
        w.close()


def _servers() -> dict[str, Callable[[], AbstractContextManager[Any]]]:
    return {
        "no nand": nullcontext,
        "watch": nullcontext,
        "dead": lambda: nullcontext(free_endpoint()),
        "silent": lambda: Receiver(answer=False),
        "live": lambda: Receiver(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["NAND_HEARTBEAT_S"] = "0"
    os.environ["NAND_SPOOL_DIR"] = tempfile.mkdtemp(prefix="nand-bench-spool-")
    times: dict[str, list[float]] = {name: [] for name in _servers()}
    for r in range(args.repeats):
        order = list(_servers().items())
        random.shuffle(order)
        for name, make in order:
            with make() as server:
                endpoint = server if isinstance(server, str) else getattr(server, "endpoint", None)
                times[name].append(_one(name, endpoint, args.steps, f"bench-{name}-{r}"))
    base, best = statistics.median(times["watch"]), min(times["watch"])
    print(
        f"torch {torch.__version__}, {args.steps} steps x {args.repeats} repeats, "
        f"a heartbeat every step, python {sys.version.split()[0]}"
    )
    print(f"{'configuration':14} {'median ms':>10} {'ratio':>7} {'min ms':>8} {'ratio':>7}")
    for name, values in times.items():
        median, low = statistics.median(values), min(values)
        ms, low_ms = median * 1e3, low * 1e3
        print(f"{name:14} {ms:10.3f} {median / base:7.3f} {low_ms:8.3f} {low / best:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
