"""Where nand's time goes on a GPU: the device's work against the host's.

    python benchmarks/gpu_profile.py                      # gpt2-124m and custom-mlp
    python benchmarks/gpu_profile.py --only gpt2-124m --steps 5

For each model of ``overhead.py`` (same shapes, same steps), a few steps of
each detector under ``torch.profiler``: per step, the wall time, the time
the device spent in kernels, the host's self time in operators and the
kernel launches; then nand's operators ranked by device time and by host
time. A detector whose kernels cost little but whose host time passes the
device's makes the step host-bound: the GPU waits for the Python.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import overhead  # (benchmarks/overhead.py, beside this script)
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = ["none", "nand", "nand-sync"]


def profiled(step: overhead.Step, steps: int) -> tuple[float, profile]:
    """Wall ms per step and the profile of ``steps`` steps (after warm-up)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    return wall, prof


def summary(prof: profile, steps: int) -> tuple[float, float, int]:
    """(device ms in kernels, host self ms in operators, kernel launches), per step."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if kernels:  # the device's own records
        device = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    else:  # kernels attributed to the operators that launched them
        device = sum(e.self_device_time_total for e in events) / 1e3
    host = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel"))
    return device / steps, host / steps, launches // steps


def profile_model(name: str, steps: int, top: int) -> None:
    b = overhead.BENCHES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        case = b.make()
    print(f"\n{b.title} on {torch.cuda.get_device_name()}: per step, {steps} profiled steps")
    print(f"  {'':10s} {'wall ms':>8s} {'kernels ms':>11s} {'host ms':>8s} {'launches':>9s}")
    nand_profile = None
    for kind in KINDS:
        wall, prof = profiled(overhead.make_step(kind, case, b.optimizer, b.autocast), steps)
        device, host, launches = summary(prof, steps)
        print(f"  {kind:10s} {wall:8.2f} {device:11.2f} {host:8.2f} {launches:9d}")
        if kind == "nand":
            nand_profile = prof
    assert nand_profile is not None
    table = nand_profile.key_averages()
    print(f"\n  nand: top {top} operators by device time")
    print(table.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=48))
    print(f"\n  nand: top {top} operators by host self time")
    print(table.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(overhead.BENCHES))
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per detector")
    parser.add_argument("--top", type=int, default=15, help="operators listed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_profile.py: no CUDA device here (torch.cuda.is_available())")
    torch.set_num_threads(1)
    logging.getLogger("nand").setLevel(logging.ERROR)
    for name in args.only or ["gpt2-124m", "custom-mlp"]:
        profile_model(name, args.steps, args.top)


if __name__ == "__main__":
    main()
