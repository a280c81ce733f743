"""A 2-rank gloo job with ``ZeroRedundancyOptimizer`` (Adam) under DDP, each
scenario run twice in the same processes: once without nand (the ground
truth, from hooks on the shard's local optimizer), once watched by nand and
reporting to a real server. Used by ``tests/e2e/test_zero_optimizer.py``.

Scenarios (``PLANTED_RANK`` 1, ``PLANTED_STEP`` 2):

- ``healthy``: nothing planted.
- ``lr``: rank 1's learning rate is inf for that step's update: rank 1's
  shard becomes non-finite, and rank 0 gets it through ZeRO's broadcast.
- ``lr_all``: the same on every rank: each makes its own shard non-finite.
- ``state``: after that step's update, a NaN in Adam's ``exp_avg_sq`` of
  rank 1's first own parameter: its next update writes NaN into the shard.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import nand

WORLD = 2
PLANTED_RANK, PLANTED_STEP = 1, 2
STEPS = 6
TOKEN = "e2e-token"


def build(seed: int = 0) -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    torch.manual_seed(seed)
    layers = (nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model = nn.Sequential(*layers)
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    return ddp, opt


def names_of(model: nn.Module) -> dict[torch.Tensor, str]:
    return {p: name.removeprefix("module.") for name, p in model.named_parameters()}


def own_params(opt: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    """The parameters this rank's shard updates (ZeRO's partition)."""
    return [p for group in opt.optim.param_groups for p in group["params"]]


class GroundTruth:
    """Without nand: per step, the parameters this rank's own update made
    non-finite from finite ones (a post-hook on the shard's local optimizer,
    before ZeRO's broadcast), and those non-finite after ``step`` (the broadcast)."""

    def __init__(self, model: nn.Module, opt: ZeroRedundancyOptimizer) -> None:
        self.names = names_of(model)
        self.opt = opt
        self.made: dict[int, list[str]] = {}
        self.after: dict[int, list[str]] = {}
        self.state_bad: dict[int, list[str]] = {}
        self.step = 0
        self._before: set[str] = set()
        self._grads_finite = True
        opt.optim.register_step_pre_hook(self._pre)
        opt.optim.register_step_post_hook(self._post)

    def _bad(self, params: list[torch.Tensor]) -> list[str]:
        return [self.names[p] for p in params if not bool(torch.isfinite(p).all())]

    def _pre(self, *_: Any) -> None:
        grads = [p.grad for p in own_params(self.opt) if p.grad is not None]
        self._grads_finite = all(bool(torch.isfinite(g).all()) for g in grads)
        self._before = set(self._bad(list(self.names)))
        state = self.opt.optim.state
        self.state_bad[self.step] = [
            self.names[p]
            for p in own_params(self.opt)
            for key, t in state.get(p, {}).items()
            if key != "step" and not bool(torch.isfinite(t).all())
        ]

    def _post(self, *_: Any) -> None:
        own = {id(p) for p in own_params(self.opt)}
        made = self._bad([p for p in self.names if id(p) in own])  # (in the model's order)
        # Made here: non-finite out of finite parameters and gradients.
        made = [name for name in made if name not in self._before]
        self.made[self.step] = made if self._grads_finite else []

    def stepped(self) -> None:
        self.after[self.step] = self._bad(list(self.names))
        self.step += 1


def plant(scenario: str, rank: int, step: int, opt: ZeroRedundancyOptimizer, when: str) -> None:
    """The fault of ``scenario`` on ``PLANTED_RANK`` at ``PLANTED_STEP``."""
    if step != PLANTED_STEP or (rank != PLANTED_RANK and scenario != "lr_all"):
        return
    if scenario in ("lr", "lr_all") and when == "before":
        opt.param_groups[0]["lr"] = math.inf  # ZeRO hands it to this rank's shard only
    elif scenario in ("lr", "lr_all") and when == "after":
        opt.param_groups[0]["lr"] = 1e-2
    elif scenario == "state" and when == "after":
        first = own_params(opt)[0]
        opt.optim.state[first]["exp_avg_sq"].view(-1)[0] = math.nan


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def train(rank: int, scenario: str, watch_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """One run of ``scenario``; ``watch_kwargs``: watched by nand, else plain."""
    model, opt = build()
    truth = GroundTruth(model, opt)
    losses: list[float] = []
    updated: list[bool] = []  # per step: did ``opt.step`` change any parameter here
    outcome, left_at = "finished", STEPS
    first = None
    watch = nand.watch(model, opt, **watch_kwargs) if watch_kwargs is not None else None
    try:
        for step in range(STEPS):
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            loss.backward()
            plant(scenario, rank, step, opt, "before")
            before = [p.detach().clone() for p in model.parameters()]
            left_at = step  # (until the step is done)
            opt.step()
            left_at = STEPS
            after = model.parameters()
            updated.append(any(not torch.equal(a, p) for a, p in zip(before, after, strict=True)))
            plant(scenario, rank, step, opt, "after")
            opt.zero_grad()
            truth.stepped()
    except nand.NonFiniteError as exc:
        outcome = f"NonFiniteError@{exc.event.step}"
    except nand.StopRequested as exc:
        outcome = f"StopRequested@{exc.step}"
    finally:
        if watch is not None:
            watch.close()
            first = watch.first
    found = None
    if first is not None:
        found = {
            k: getattr(first, k, None)
            for k in ("phase", "module", "step", "micro_step", "cause", "via")
        }
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {
        "outcome": outcome,
        "first": found,
        "losses": losses,
        "updated": updated,
        "left_at": left_at,
        "made": truth.made,
        "after": truth.after,
        "state_bad": truth.state_bad,
        "finite_at_end": finite,
        "owner": {name: opt._param_to_rank[p] for p, name in names_of(model).items()},
    }


#: (scenario, run id on the server, on_nonfinite): what the job runs, in order.
RUNS = (
    ("healthy", "zero-healthy", "warn"),
    ("lr", "zero-lr", "warn"),
    ("lr_all", "zero-lr-all", "warn"),
    ("state", "zero-state", "warn"),
    ("state", "zero-skip", "skip"),
    ("lr", "zero-stop", "stop"),
)


def rank_main(rank: int, port: int, endpoint: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_TOKEN=TOKEN)
    # A rank left waiting in a collective (a policy that did not agree) fails
    # the job within a minute instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        plain: dict[str, dict[str, Any]] = {}
        for scenario, run, policy in RUNS:
            if scenario not in plain:
                plain[scenario] = train(rank, scenario, None)
            kwargs = dict(on_nonfinite=policy, server=endpoint, run=run, log_events=False)
            results[(run, rank)] = {"plain": plain[scenario], "nand": train(rank, scenario, kwargs)}
    finally:
        dist.destroy_process_group()
