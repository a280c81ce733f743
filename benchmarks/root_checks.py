"""What the light mode's root checks cost on CPU, against the ways to fold them.

    python benchmarks/root_checks.py
    python benchmarks/root_checks.py --repeats 61

The light step checks the root's input, output and output gradient (three
``aminmax`` probes into the slab) and the gradients (one ``_foreach_norm``),
and holds the output gradient for a replay with one autograd hook. This
times, on the MLP benchmark's shapes (batch 64, 64-256-256-10), each of
those against what could replace it:

- the three probes, against adding the same tensors to the gradients'
  ``_foreach_norm`` (a 2-norm: one launch less per tensor, but a 2-norm
  overflows, so a non-finite one is only a suspect), and against one
  ``_foreach_norm(..., ord=inf)`` over them (exact, but not vectorised
  on CPU);
- a backward with no Python hook, one node pre-hook, two on the same node
  (what the light step had before the loss probe rode the held gradient's
  hook), and ``retain_grad`` (a C++ hook: the gradient lands in ``.grad``).

Each variant is timed in interleaved repeats on one thread; the figure is the
median CPU µs of a call (or of the backward's difference from no hook).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

Variant = Callable[[], object]


def per_call_us(variants: dict[str, Variant], repeats: int, calls: int) -> dict[str, float]:
    """The median CPU µs per call of each variant, over interleaved repeats."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            fn = variants[name]
            for _ in range(10):
                fn()
            start = time.process_time()
            for _ in range(calls):
                fn()
            times[name].append((time.process_time() - start) / calls * 1e6)
    return {name: statistics.median(samples) for name, samples in times.items()}


def probe_variants() -> dict[str, Variant]:
    x, out, grad = torch.randn(64, 64), torch.randn(64, 10), torch.randn(64, 10)
    shapes = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
    grads = [torch.randn(*shape) for shape in shapes]
    slab = torch.empty(64)
    views = list(slab.unbind())
    root = [x, out, grad]

    def three_probes() -> None:
        for k, t in enumerate(root):
            torch.aminmax(t, out=views[2 * k : 2 * k + 2])

    return {
        "grads' _foreach_norm": lambda: torch._foreach_norm(grads),
        "+ 3 aminmax probes": lambda: (torch._foreach_norm(grads), three_probes()),
        "grads + root in one 2-norm": lambda: torch._foreach_norm(grads + root),
        "+ root in one inf-norm": lambda: (
            torch._foreach_norm(grads),
            torch._foreach_norm(root, math.inf),
        ),
    }


def backward_variants() -> dict[str, Variant]:
    x = torch.randn(64, 64)
    w1 = torch.randn(64, 64, requires_grad=True)
    w2 = torch.randn(64, 10, requires_grad=True)

    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        return None

    def backward(hooks: int = 0, retain: bool = False) -> Variant:
        def step() -> None:
            out = (x @ w1) @ w2
            for _ in range(hooks):
                out.grad_fn.register_prehook(hook)
            if retain:
                out.retain_grad()
            out.sum().backward()

        return step

    return {
        "no hook": backward(),
        "one node pre-hook": backward(hooks=1),
        "two on the same node": backward(hooks=2),
        "retain_grad": backward(retain=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats")
    print("\nthe checks (CPU µs per step's worth)")
    for name, us in per_call_us(probe_variants(), args.repeats, 400).items():
        print(f"  {name:30s} {us:8.1f}")
    print("\na small backward (CPU µs, and more than with no hook)")
    timed = per_call_us(backward_variants(), args.repeats, 200)
    for name, us in timed.items():
        print(f"  {name:30s} {us:8.1f}   {us - timed['no hook']:+6.1f}")


if __name__ == "__main__":
    main()
