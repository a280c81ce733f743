"""What nand costs per training step, against no detector and the alternatives.

    python benchmarks/overhead.py            # full run (~5 min on one core)
    python benchmarks/overhead.py --quick    # a smoke run
    python benchmarks/overhead.py --only transformer --detectors none nand --repeats 9

One process, one CPU thread, interleaved repeats (the machine is shared):
each repeat times a few steps of every detector in turn, and the figure is the
median over repeats of ms/step, with its ratio to "none". Time is the
process's CPU time (``time.process_time``): with one thread it is the work
done, and other jobs on a shared machine inflate it far less than wall time;
the wall-clock ratio is printed alongside. Detectors:

- ``none``: the bare training step;
- ``nand``: ``nand.watch(model, opt)`` with every phase on (the default);
- ``naive``: a forward hook on every module and a tensor hook on every output
  gradient, each doing ``if torch.isnan(t).any(): raise`` (a host sync each);
- ``anomaly``: ``torch.autograd.set_detect_anomaly(True)``.

Models: (a) MLP 64→256→256→10, batch 64, SGD training step; (b)
``nn.TransformerEncoder`` (d_model 256, 4 layers, 8 heads, ff 1024), seq 128,
batch 16, forward + backward + AdamW step. The last line counts nand's host
reads per optimizer step.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nand

Step = Callable[[], None]
KINDS = ["none", "nand", "naive", "anomaly"]


def mlp_case() -> tuple[nn.Module, Callable[[], torch.Tensor], Callable[[Any], torch.Tensor]]:
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    return model, lambda: x, lambda out: nn.functional.cross_entropy(out, y)


def transformer_case() -> tuple[
    nn.Module, Callable[[], torch.Tensor], Callable[[Any], torch.Tensor]
]:
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    x = torch.randn(16, 128, 256)
    return model, lambda: x, lambda out: out.pow(2).mean()


def naive_hooks(model: nn.Module) -> None:
    def check(t: torch.Tensor) -> None:
        if torch.isnan(t).any():
            raise RuntimeError("NaN")

    def forward_hook(module: nn.Module, args: Any, out: Any) -> None:
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                check(t)
                if t.requires_grad:
                    t.register_hook(check)

    for m in model.modules():
        m.register_forward_hook(forward_hook)


def make_step(kind: str, case: Any, base: nn.Module, use_adam: bool) -> Step:
    model = copy.deepcopy(base)
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-4)
        if use_adam
        else torch.optim.SGD(model.parameters(), lr=1e-3)
    )
    _, inputs, loss_fn = case
    if kind == "nand":
        nand.watch(model, opt)
    elif kind == "naive":
        naive_hooks(model)

    def step() -> None:
        with torch.autograd.set_detect_anomaly(kind == "anomaly", check_nan=True):
            loss_fn(model(inputs())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


#: Untimed steps at the start of every repeat.
WARM_STEPS = 2


def bench(
    name: str, case_fn: Callable[[], Any], use_adam: bool, reps: int, steps: int, kinds: list[str]
) -> None:
    torch.manual_seed(0)
    case = case_fn()
    kinds = ["none"] + [k for k in kinds if k != "none"]
    fns = {k: make_step(k, case, case[0], use_adam) for k in kinds}
    for fn in fns.values():  # warm up
        for _ in range(3):
            fn()
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(reps):
        order = kinds if rep % 2 == 0 else kinds[::-1]
        for k in order:
            # Untimed: switching detectors leaves the caches full of the last
            # one's code and data, a cost that a training run (one detector,
            # every step) never pays.
            for _ in range(WARM_STEPS):
                fns[k]()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                fns[k]()
            cpu[k].append((time.process_time() - c0) / steps * 1e3)
            wall[k].append((time.perf_counter() - t0) / steps * 1e3)
    base, base_wall = statistics.median(cpu["none"]), statistics.median(wall["none"])
    print(f"\n{name}: median ms/step over {reps} interleaved repeats of {steps} steps")
    print(f"  {'':8s} {'CPU ms':>9s}   ratio   {'wall ms':>9s}   ratio")
    for k in kinds:
        med, med_wall = statistics.median(cpu[k]), statistics.median(wall[k])
        ratio, ratio_wall = med / base, med_wall / base_wall
        print(f"  {k:8s} {med:9.3f}   {ratio:5.2f}x  {med_wall:9.3f}   {ratio_wall:5.2f}x")


def host_reads(steps: int = 20) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = mlp_case()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # AdamW itself calls .item()
    reads = {"tolist": 0, "item": 0}
    orig_tolist, orig_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self: torch.Tensor) -> Any:
        reads["tolist"] += 1
        return orig_tolist(self)

    def item(self: torch.Tensor) -> Any:
        reads["item"] += 1
        return orig_item(self)

    with nand.watch(model, opt) as w:
        torch.Tensor.tolist, torch.Tensor.item = tolist, item  # type: ignore[method-assign,assignment]
        try:
            for _ in range(steps):
                loss_fn(model(inputs())).backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.Tensor.tolist, torch.Tensor.item = orig_tolist, orig_item  # type: ignore[method-assign]
    total = reads["tolist"] + reads["item"]
    print(
        f"\nhost reads by nand: {total} in {steps} optimizer steps "
        f"({total / steps:.2f} per step; .item() calls: {reads['item']}; "
        f"watch.host_reads={w.host_reads})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, for a smoke run")
    parser.add_argument("--only", choices=["mlp", "transformer"], help="one model only")
    parser.add_argument(
        "--detectors", nargs="+", default=KINDS, choices=KINDS, help="compared with none"
    )
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 31 / 9)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("nand").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, 1 thread")
    if args.only != "transformer":
        bench(
            "MLP 64-256-256-10, batch 64, SGD step",
            mlp_case,
            False,
            reps=args.repeats or (5 if args.quick else 31),
            steps=20 if args.quick else 50,
            kinds=args.detectors,
        )
    if args.only != "mlp":
        bench(
            "TransformerEncoder d256 x4, seq 128, batch 16, AdamW step",
            transformer_case,
            True,
            reps=args.repeats or (2 if args.quick else 9),
            steps=2 if args.quick else 3,
            kinds=args.detectors,
        )
    host_reads()


if __name__ == "__main__":
    main()
