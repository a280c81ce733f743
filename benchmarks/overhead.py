"""What nand costs per training step, against no detector and the alternatives.

    python benchmarks/overhead.py            # full run (~10 min on one core)
    python benchmarks/overhead.py --quick    # a smoke run
    python benchmarks/overhead.py --only transformer --detectors none nand --repeats 9
    python benchmarks/overhead.py --only gpt resnet18 custom-mlp --detectors none nand
    python benchmarks/overhead.py --device cuda --detectors none nand nand-sync naive anomaly
    python benchmarks/overhead.py --only hf-gpt2-aot_eager hf-gpt2-inductor \
        resnet18-aot_eager resnet18-inductor --detectors none floor nand

One process, one CPU thread, interleaved repeats (the machine is shared):
each repeat times a few steps of every detector in turn, and the figure is the
median over repeats of ms/step, with its ratio to "none". Time is the
process's CPU time (``time.process_time``): with one thread it is the work
done, and other jobs on a shared machine inflate it far less than wall time;
the wall-clock ratio is printed alongside. Detectors:

- ``none``: the bare training step;
- ``nand``: ``nand.watch(model, opt)``, the default: the light mode since
  issue 32 (dba3ab2), the root module hooked, no probe per module (its replay
  on a hit is not timed: a healthy run has none); on CUDA it reads each step
  one boundary late, without a sync, where the optimizer can skip on the device;
- ``nand-full``: ``mode="full"``, every phase probed in every module, which
  ``nand`` was before dba3ab2 (the ``nand`` columns of benchmarks/README's
  sections from before then);
- ``nand-light``: ``mode="light"`` said explicitly (``nand`` unless ``NAND_MODE``
  says otherwise);
- ``nand-sync``: the same with ``read="sync"`` (the one read per step at the
  boundary: a host-device sync on CUDA; on CPU the same as ``nand``);
- ``nand-deferred``: ``read="deferred"``, what ``nand`` is on CUDA, forced on
  CPU (the copy is synchronous there; parameters read every step);
- ``nand-no-loss``: ``nand`` without its loss checks (issue 42): no listener on
  ``Tensor.backward``, so neither the loss a backward starts from in the step's
  read nor the recording of the calls that made it (``nand/agent/rerun/loss.py``);
  with both, a line gives ``nand``'s paired ratio against it: what checking
  and recording the loss costs a healthy step;
- ``naive``: a forward hook on every module and a tensor hook on every output
  gradient, each doing ``if torch.isnan(t).any(): raise`` (a host sync each);
- ``anomaly``: ``torch.autograd.set_detect_anomaly(True)``;
- ``floor``: no nand, but the device work the light mode cannot do without,
  written into the step by hand: one ``aminmax`` of the loss, one
  ``_foreach_norm`` of the gradients, one ``stack`` and one read
  (``tolist``) before the optimizer step. No Python of nand's: what a light
  tier costs with no bookkeeping at all (holding the step for a replay,
  micro-steps, early warnings, the flight recorder), the lower bound of
  ``nand-light`` on a shape.

Models (``benchmarks/shapes.py``): an MLP 64-256-256-10 (batch 64, SGD) as an
``nn.Sequential`` and as a custom ``nn.Module``; ``nn.TransformerEncoder``
(d256, 4 layers, seq 128, batch 16, AdamW); a GPT-2-style decoder written as
ordinary modules (4 layers, d256, seq 128, batch 8, AdamW); a ResNet-18 for
32x32 inputs (batch 8, SGD with momentum). Beside each ratio of medians, the median
of the per-repeat ratios (each repeat's steps against the bare steps of the
same repeat: drift on a shared machine cancels) and its 95% interval
(bootstrap of that median): a ratio is "shown" under a target only when the
interval's top is. The last line counts nand's host
reads per optimizer step (and, with ``--device cuda``, the synchronising CUDA
calls per step, counted with CUDA's sync debug mode).

Compiled shapes (``--only`` them; compiling takes minutes): an HF GPT-2
(``GPT2LMHeadModel`` from a config, random init; 4 layers, d256, seq 128,
batch 8, AdamW; ``hf-gpt2`` eager) and the ResNet-18, each compiled after
the detector's hooks with ``aot_eager`` and with ``inductor``
(``hf-gpt2-aot_eager``, ``resnet18-inductor``...), every detector's copy
compiled on its own.

``--device cuda`` builds every model and input on the GPU (``torch.device``
as the default device), times wall clock between two ``torch.cuda.synchronize``
calls per repeat (the benchmark's, outside the timed steps' own work), and
exits with a message when CUDA is not there; read its wall-clock ratios (the
CPU column is the host's share). It adds two GPU shapes under bf16 autocast
(``--only`` takes them on CPU too, at about a minute a step): GPT-2 small
(``gpt2-124m``: 12 layers, d768, seq 1024, batch 8, AdamW) and the ResNet-18
at batch 256 (``resnet18-b256``, SGD with momentum).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import shapes  # (benchmarks/shapes.py, beside this script)
import torch
from torch import nn

import nand

Step = Callable[[], None]
KINDS = ["none", "nand", "naive", "anomaly"]
ALL_KINDS = [
    *KINDS,
    "nand-full",
    "nand-light",
    "nand-sync",
    "nand-deferred",
    "nand-no-loss",
    "floor",
]
#: Each nand detector's ``nand.watch(read=, mode=)`` (None: the default).
WATCH_ARGS: dict[str, tuple[str | None, str | None]] = {
    "nand": (None, None),
    "nand-full": (None, "full"),
    "nand-light": (None, "light"),
    "nand-sync": ("sync", None),
    "nand-deferred": ("deferred", None),
    "nand-no-loss": (None, None),
}


@dataclasses.dataclass(frozen=True)
class Bench:
    title: str
    make: Callable[[], shapes.Case]
    optimizer: str  # sgd | momentum | adamw
    repeats: int  # interleaved repeats by default (--quick: a few)
    steps: int  # timed steps per repeat
    autocast: torch.dtype | None = None  # the forward's autocast dtype, if any
    gpu_shape: bool = False  # run by default with --device cuda only
    #: A torch.compile backend: the model is compiled after nand.watch (None: eager).
    compile: str | None = None


MLP = "MLP 64-256-256-10"
BENCHES = {
    "mlp": Bench(f"{MLP} (nn.Sequential), batch 64, SGD", shapes.sequential_mlp, "sgd", 31, 50),
    "custom-mlp": Bench(
        f"{MLP} (custom nn.Module), batch 64, SGD", shapes.custom_mlp, "sgd", 31, 50
    ),
    "transformer": Bench(
        "TransformerEncoder d256 x4, seq 128, batch 16, AdamW", shapes.transformer, "adamw", 9, 3
    ),
    "gpt": Bench("GPT-2-style decoder d256 x4, seq 128, batch 8, AdamW", shapes.gpt, "adamw", 9, 3),
    "resnet18": Bench(
        "ResNet-18 (32x32), batch 8, SGD momentum", shapes.resnet18, "momentum", 9, 3
    ),
    "hf-gpt2": Bench("HF GPT-2 d256 x4, seq 128, batch 8, AdamW", shapes.hf_gpt2, "adamw", 9, 3),
    **{
        f"{name}-{backend}": Bench(
            f"{title}, compiled ({backend})", make, optimizer, 9, 3, compile=backend
        )
        for name, title, make, optimizer in (
            ("hf-gpt2", "HF GPT-2 d256 x4, seq 128, batch 8, AdamW", shapes.hf_gpt2, "adamw"),
            ("resnet18", "ResNet-18 (32x32), batch 8, SGD momentum", shapes.resnet18, "momentum"),
        )
        for backend in ("aot_eager", "inductor")
    },
    "gpt2-124m": Bench(
        "GPT-2 124M (d768 x12), seq 1024, batch 8, bf16 autocast, AdamW",
        shapes.gpt2_124m,
        "adamw",
        9,
        5,
        autocast=torch.bfloat16,
        gpu_shape=True,
    ),
    "resnet18-b256": Bench(
        "ResNet-18 (32x32), batch 256, bf16 autocast, SGD momentum",
        shapes.resnet18_b256,
        "momentum",
        9,
        5,
        autocast=torch.bfloat16,
        gpu_shape=True,
    ),
}


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


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9 if name == "momentum" else 0)


def make_step(
    kind: str,
    case: shapes.Case,
    optimizer: str,
    autocast: torch.dtype | None = None,
    backend: str | None = None,
) -> Step:
    """One training step of ``case`` under detector ``kind``; ``backend``: the
    model compiled with it after the detector's hooks (as a user would)."""
    model = copy.deepcopy(case[0])
    opt = make_optimizer(optimizer, model)
    _, inputs, loss_fn = case
    if kind in WATCH_ARGS:
        read, mode = WATCH_ARGS[kind]
        watch = nand.watch(model, opt, read=read, mode=mode)
        if kind == "nand-no-loss":
            watch._rerun.loss.remove()  # (its listener, recorder and hooks: see above)
    elif kind == "naive":
        naive_hooks(model)
    run = torch.compile(model, backend=backend) if backend else model
    device = next(model.parameters()).device.type
    params = list(model.parameters())
    mixed = torch.autocast(device, dtype=autocast or torch.float32, enabled=autocast is not None)

    def step() -> None:
        with torch.autograd.set_detect_anomaly(kind == "anomaly", check_nan=True):
            with mixed:
                out = run(inputs())
            loss = loss_fn(out)
            loss.backward()
        if kind == "floor":
            floor_checks(loss, params)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def floor_checks(loss: torch.Tensor, params: list[nn.Parameter]) -> None:
    """The light mode's unavoidable device work, by hand (see ``floor`` above)."""
    with torch.no_grad():
        low, high = torch.aminmax(loss.detach())
        norms = torch._foreach_norm([p.grad for p in params if p.grad is not None])
        torch.stack([low, high, *norms]).tolist()  # (mixed dtypes promote)


#: Untimed steps at the start of every repeat.
WARM_STEPS = 2


def bench(b: Bench, reps: int, steps: int, kinds: list[str], device: str = "cpu") -> None:
    torch.manual_seed(0)
    with torch.device(device):  # the model and its inputs made there
        case = b.make()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kinds = ["none"] + [k for k in kinds if k != "none"]
    fns = {k: make_step(k, case, b.optimizer, b.autocast, b.compile) for k in kinds}
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
            sync()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                fns[k]()
            sync()
            cpu[k].append((time.process_time() - c0) / steps * 1e3)
            wall[k].append((time.perf_counter() - t0) / steps * 1e3)
    base, base_wall = statistics.median(cpu["none"]), statistics.median(wall["none"])
    where = f" on {torch.cuda.get_device_name()}" if device == "cuda" else ""
    print(f"\n{b.title}{where}: median ms/step over {reps} interleaved repeats of {steps} steps")
    print(f"  {'':13s} {'CPU ms':>9s}   ratio   {'wall ms':>9s}   ratio   paired CPU ratio [95%]")
    for k in kinds:
        med, med_wall = statistics.median(cpu[k]), statistics.median(wall[k])
        ratio, ratio_wall = med / base, med_wall / base_wall
        paired, low, high = paired_ratio(cpu[k], cpu["none"])
        print(
            f"  {k:13s} {med:9.3f}   {ratio:5.2f}x  {med_wall:9.3f}   {ratio_wall:5.2f}x"
            f"   {paired:.3f}x [{low:.3f}, {high:.3f}]"
        )
    if "nand" in kinds and "nand-no-loss" in kinds:
        paired, low, high = paired_ratio(cpu["nand"], cpu["nand-no-loss"])
        diff, dlow, dhigh = paired_difference(cpu["nand"], cpu["nand-no-loss"])
        print(
            f"  the loss checks: nand / nand-no-loss {paired:.3f}x [{low:.3f}, {high:.3f}],"
            f" {diff * 1e3:+.1f} us/step [{dlow * 1e3:+.1f}, {dhigh * 1e3:+.1f}]"
        )


def paired_ratio(times: list[float], bare: list[float]) -> tuple[float, float, float]:
    """The median of per-repeat ratios, and a 95% bootstrap interval of it."""
    return median_interval([t / b for t, b in zip(times, bare, strict=True)])


def paired_difference(times: list[float], other: list[float]) -> tuple[float, float, float]:
    """The median of per-repeat differences, and a 95% bootstrap interval of it."""
    return median_interval([t - o for t, o in zip(times, other, strict=True)])


def median_interval(samples: list[float]) -> tuple[float, float, float]:
    """The median of ``samples`` and a 95% bootstrap interval of it."""
    rng = random.Random(0)  # (the same interval for the same samples)
    medians = sorted(
        statistics.median(rng.choices(samples, k=len(samples))) for _ in range(BOOTSTRAP)
    )
    low, high = medians[int(0.025 * BOOTSTRAP)], medians[int(0.975 * BOOTSTRAP) - 1]
    return statistics.median(samples), low, high


#: Resamples of the bootstrap interval.
BOOTSTRAP = 2000


def host_reads(steps: int = 20) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = shapes.sequential_mlp()
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


def cuda_syncs(b: Bench, steps: int = 20) -> None:
    """Synchronising CUDA calls per step of one model, bare and under nand."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        case = b.make()
    print(f"\n{b.title}:")
    for kind in ("none", "nand", "nand-sync"):
        step = make_step(kind, case, b.optimizer, b.autocast)
        for _ in range(WARM_STEPS):
            step()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        n = sum("synchronizing" in str(w.message) for w in caught)
        print(f"  CUDA syncs, {kind}: {n} in {steps} steps ({n / steps:.2f} per step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, for a smoke run")
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), help="these models only")
    parser.add_argument(
        "--detectors", nargs="+", default=KINDS, choices=ALL_KINDS, help="compared with none"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default per model)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("overhead.py: --device cuda: no CUDA device here (torch.cuda.is_available())")
    torch.set_num_threads(1)
    logging.getLogger("nand").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, 1 thread")
    # Compiled shapes on request (--only): compiling is minutes of a run.
    default = [
        name
        for name, b in BENCHES.items()
        if (args.device == "cuda" or not b.gpu_shape) and b.compile is None
    ]
    for name in args.only or default:
        b = BENCHES[name]
        reps = args.repeats or (min(b.repeats, 3) if args.quick else b.repeats)
        steps = max(1, b.steps // 5) if args.quick else b.steps
        bench(b, reps, steps=steps, kinds=args.detectors, device=args.device)
    host_reads()
    if args.device == "cuda":
        for name in ("mlp", "gpt"):  # SGD, and AdamW with tied embeddings
            cuda_syncs(BENCHES[name])


if __name__ == "__main__":
    main()
