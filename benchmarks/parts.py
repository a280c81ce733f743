"""What each part of nand costs a small model's step, found by leaving it out.

    python benchmarks/parts.py                      # the custom MLP, 41 repeats
    python benchmarks/parts.py mlp custom-mlp --repeats 61
    python benchmarks/parts.py mlp custom-mlp --mode light    # the light mode's parts

Every variant is a watched copy of the model with one part of nand patched
out around its own timed block (``hooks only``: nand installed and switched
off, so torch still calls every hook and each returns at once). Variants run
in a shuffled order in every repeat, on one thread; the figure is the median
of CPU time per step, with its difference from the full watch, and the
median of that difference taken repeat by repeat with its 95% bootstrap
interval (a part is shown to cost something only when the interval is
below zero). A part's
figure is what leaving it out saves *in situ*, between the model's own
kernels, where a small op costs several times its micro-benchmark.

The patches name nand's internals: a rename fails here loudly (``mock``
refuses to patch a missing attribute) rather than timing nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import overhead  # (benchmarks/overhead.py, beside this script)
import torch

import nand
from nand.agent.detect.hooks import Hooks
from nand.agent.detect.inline import InlineCheck
from nand.agent.detect.optimizer import OptimizerHooks
from nand.agent.rerun.held import Held
from nand.agent.step.blowup import BlowUpWatch
from nand.agent.step.boundary import Boundary
from nand.agent.step.window import HEALTHY

#: How a variant leaves its part out, given the variant's watch.
LeaveOut = Callable[[Any], contextlib.AbstractContextManager[Any]]


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _patched(owner: type, attribute: str, replacement: Callable[..., Any]) -> LeaveOut:
    return lambda watch: mock.patch.object(owner, attribute, replacement)


@contextlib.contextmanager
def _switched_off(watch: Any) -> Iterator[None]:
    """nand installed but off: torch still calls every hook, each returns at once."""
    watch._guard.off = True
    try:
        yield
    finally:
        watch._guard.off = False


#: Variant -> how it leaves its part out (None: no nand at all).
VARIANTS: dict[str, LeaveOut | None] = {
    "none": None,
    "nand": lambda watch: contextlib.nullcontext(),
    "hooks only": _switched_off,
    "- early warnings": _patched(BlowUpWatch, "look", lambda *a, **k: ()),
    "- analysis": _patched(Boundary, "_analyse", lambda *a, **k: HEALTHY),
    "- update plan": _patched(OptimizerHooks, "_plan", _nothing),  # params read every step
    "- bias-gradient probes": _patched(Hooks, "_watch_gradient", _nothing),
    "- input probe": _patched(Hooks, "_probe_input", _nothing),
    "- forward probes": _patched(Hooks, "_probe", _nothing),
    "- inline checks": _patched(InlineCheck, "check_inputs", _nothing),
    "- gradient norms": _patched(OptimizerHooks, "add_norms", _nothing),  # and params, state
    "- held for replay": lambda watch: _both(
        mock.patch.object(Held, "hold_inputs", _nothing),
        mock.patch.object(Held, "hold_gradients", lambda *a, **k: ()),  # (no output taken)
    ),
}


@contextlib.contextmanager
def _both(*patches: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def make_step(b: overhead.Bench, watched: bool, mode: str) -> tuple[Callable[[], None], Any]:
    """A training step of a fresh copy of ``b``'s model, and its watch."""
    model, inputs, loss_fn = b.make()
    model = copy.deepcopy(model)
    opt = overhead.make_optimizer(b.optimizer, model)
    watch = nand.watch(model, opt, log_events=False, mode=mode) if watched else None

    def step() -> None:
        loss_fn(model(inputs())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, watch


def time_variant(name: str, step: Callable[[], None], watch: Any, steps: int) -> float:
    """CPU µs per step of ``steps`` steps with ``name``'s part left out."""
    leave_out = VARIANTS[name]
    with leave_out(watch) if leave_out is not None else contextlib.nullcontext():
        for _ in range(overhead.WARM_STEPS):
            step()
        start = time.process_time()
        for _ in range(steps):
            step()
        return (time.process_time() - start) / steps * 1e6


def run(which: str, repeats: int, mode: str) -> None:
    b = overhead.BENCHES[which]
    steps = {name: make_step(b, leave is not None, mode) for name, leave in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    for _ in range(repeats):
        random.shuffle(order)  # no variant always runs right after the same one
        for name in order:
            times[name].append(time_variant(name, *steps[name], b.steps))
    bare, full = statistics.median(times["none"]), statistics.median(times["nand"])
    runs = f"{repeats} shuffled repeats of {b.steps} steps"
    print(f"\n{b.title}, mode={mode}: median CPU µs/step over {runs}")
    print(f"  {'':24s} {'µs':>8s}   ratio    against nand   paired [95%]")
    for name, samples in times.items():
        us = statistics.median(samples)
        paired, low, high = overhead.paired_difference(samples, times["nand"])
        print(
            f"  {name:24s} {us:8.1f}   {us / bare:5.3f}x   {us - full:+7.1f}"
            f"   {paired:+7.1f} [{low:+.1f}, {high:+.1f}]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help=f"of {', '.join(overhead.BENCHES)}")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--mode", choices=["full", "light"], default="full")
    args = parser.parse_args()
    unknown = set(args.models) - set(overhead.BENCHES)
    if unknown:
        parser.error(f"no such model: {', '.join(sorted(unknown))}")
    torch.set_num_threads(1)
    logging.getLogger("nand").setLevel(logging.WARNING)  # (the "watching run" line, per copy)
    print(f"torch {torch.__version__}, 1 thread")
    for which in args.models or ["custom-mlp"]:
        run(which, args.repeats, args.mode)


if __name__ == "__main__":
    main()
