"""What a replay costs, and what holding a step for one costs in memory.

    python benchmarks/replay_cost.py                        # gpt and resnet18, on CPU
    python benchmarks/replay_cost.py --only gpt2-124m resnet18-b256 --device cuda

For each model of ``overhead.py`` (same shapes, optimizers and autocast),
three fresh processes run the same steps: bare; watched (the default, light
mode); and watched with a NaN written into one element of a middle module's
output at the last step, so that the step's boundary replays it. Each
reports:

- the median time of a healthy step, and the time of the replay itself
  (``Rerun.explain``, timed around; its op watch reads every op's outputs on
  the host, so it is the slow path by design);
- the peak memory of the process against the bare run's: on CUDA the
  allocator's peak (``torch.cuda.max_memory_allocated``), on CPU the peak
  resident set (``ru_maxrss``). The watched run's extra is what the light
  mode holds across a step for a replay (references to the root's inputs and
  to the gradient that arrived at its output, which would otherwise be freed
  after backward); the replay's extra is its own forward and backward, with
  the step's graph already freed.

One process per run, so that each peak is its own (``ru_maxrss`` never goes
down). Figures are for one run each: the memory figures are exact, the
times single samples on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
from typing import Any
from unittest import mock

import overhead  # (benchmarks/overhead.py, beside this script)
import torch
from torch import nn

import nand
from nand.agent.rerun.rerun import Rerun

RUNS = ("bare", "watched", "replayed")
#: Healthy steps before the measured ones (the optimizer's state is made at the first).
WARM = 2


def middle_module(model: nn.Module) -> nn.Module:
    """A leaf module half way through the model, where the NaN is written."""
    leaves = [m for m in model.modules() if not list(m.children()) and list(m.parameters())]
    return leaves[len(leaves) // 2]


def run_one(which: str, run: str, steps: int, device: str) -> dict[str, Any]:
    """One run in this process (see the module); returns its figures."""
    b = overhead.BENCHES[which]
    torch.manual_seed(0)
    with torch.device(device):
        model, inputs, loss_fn = b.make()
    opt = overhead.make_optimizer(b.optimizer, model)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    armed = {"now": False}
    if run == "replayed":
        middle_module(model).register_forward_hook(
            lambda m, a, out: (
                out.index_fill(-1, torch.tensor([0], device=out.device), float("nan"))
                if armed["now"]
                else None
            )
        )
    watch = nand.watch(model, opt, log_events=False) if run != "bare" else None
    replays: list[float] = []
    explain = Rerun.explain

    def timed_explain(self: Rerun, *args: Any, **kwargs: Any) -> None:
        sync()
        start = time.perf_counter()
        explain(self, *args, **kwargs)
        sync()
        replays.append(time.perf_counter() - start)

    autocast = b.autocast or torch.float32
    mixed = torch.autocast(device, dtype=autocast, enabled=b.autocast is not None)
    times = []
    with mock.patch.object(Rerun, "explain", timed_explain):
        for i in range(WARM + steps):
            armed["now"] = run == "replayed" and i == WARM + steps - 1
            sync()
            start = time.perf_counter()
            with mixed:
                out = model(inputs())
            loss_fn(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if i >= WARM and not armed["now"]:
                times.append(time.perf_counter() - start)
    first = watch.first if watch is not None else None
    if watch is not None:
        watch.close()
    peak_mb = (
        torch.cuda.max_memory_allocated() / 2**20
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "step_ms": statistics.median(times) * 1e3 if times else None,
        "replay_ms": replays[0] * 1e3 if replays else None,
        "peak_mb": peak_mb,
        "event": first.message if first is not None else None,
    }


def measure(which: str, steps: int, device: str) -> dict[str, dict[str, Any]]:
    """The three runs of one model, each in a fresh process."""
    found = {}
    for run in RUNS:
        args = [sys.executable, __file__, "--child", which, run, str(steps), device]
        done = subprocess.run(args, capture_output=True, text=True, check=True)
        found[run] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def report(which: str, found: dict[str, dict[str, Any]], device: str) -> None:
    bare, watched, replayed = (found[run] for run in RUNS)
    memory = "allocator peak" if device == "cuda" else "peak RSS"
    print(f"\n{overhead.BENCHES[which].title} on {device}:")
    print(f"  healthy step: bare {bare['step_ms']:.1f} ms, watched {watched['step_ms']:.1f} ms")
    print(f"  one replay: {replayed['replay_ms']:.0f} ms (the step's boundary; its event below)")
    held = watched["peak_mb"] - bare["peak_mb"]
    replay = replayed["peak_mb"] - bare["peak_mb"]
    print(f"  {memory}: bare {bare['peak_mb']:.0f} MB; watched {held:+.0f}; replayed {replay:+.0f}")
    print(f"  event: {replayed['event']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        which, run, steps, device = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        torch.set_num_threads(1)
        logging.getLogger("nand").setLevel(logging.ERROR)
        print(json.dumps(run_one(which, run, steps, device)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = list(overhead.BENCHES)
    parser.add_argument("--only", nargs="+", choices=models, default=["gpt", "resnet18"])
    parser.add_argument("--steps", type=int, default=3, help="measured healthy steps per run")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("replay_cost.py: --device cuda: no CUDA device here")
    print(f"torch {torch.__version__}, 1 thread")
    for which in args.only:
        report(which, measure(which, args.steps, args.device), args.device)


if __name__ == "__main__":
    main()
