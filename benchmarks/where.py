"""Where nand's cost goes on one model: per phase, and the reductions it launches.

    python benchmarks/where.py resnet18
    python benchmarks/where.py gpt --repeats 15

Times forward, backward and the optimizer step separately, bare and watched,
as interleaved repeats in one process on one thread (medians of CPU time, as
``overhead.py``); then counts, for one watched step, the ``aminmax`` probes
and the elements they read, by phase (forward values, gradients), and the
tensors of the step's ``_foreach_norm``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import overhead  # (benchmarks/overhead.py, beside this script)
import torch

import nand
from nand.agent.detect import probes

PHASES = ("forward", "backward", "step")


def timed_phases(b: overhead.Bench, watched: bool) -> Callable[[], dict[str, float]]:
    """One training step that returns the CPU ms of each phase."""
    model, inputs, loss_fn = b.make()
    model = copy.deepcopy(model)
    opt = overhead.make_optimizer(b.optimizer, model)
    if watched:
        nand.watch(model, opt, log_events=False)

    def step() -> dict[str, float]:
        t0 = time.process_time()
        loss = loss_fn(model(inputs()))
        t1 = time.process_time()
        loss.backward()
        t2 = time.process_time()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.process_time()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}

    return step


def phase_costs(b: overhead.Bench, repeats: int) -> None:
    steps = {False: timed_phases(b, False), True: timed_phases(b, True)}
    times: dict[bool, dict[str, list[float]]] = {w: {p: [] for p in PHASES} for w in steps}
    for step in steps.values():
        step()
        step()
    for rep in range(repeats):
        for watched in (False, True) if rep % 2 == 0 else (True, False):
            for _ in range(b.steps):
                for phase, t in steps[watched]().items():
                    times[watched][phase].append(t * 1e3)
    print(f"{b.title}: CPU ms per phase, median of {repeats * b.steps} steps each")
    print(f"  {'phase':9s} {'bare':>9s} {'watched':>9s} {'added':>8s}")
    for phase in PHASES:
        bare = statistics.median(times[False][phase])
        watched = statistics.median(times[True][phase])
        print(f"  {phase:9s} {bare:9.2f} {watched:9.2f} {watched - bare:+8.2f}")


@contextlib.contextmanager
def counting(name: str, counts: list[int]) -> Iterator[None]:
    """Record the elements each call of ``torch.<name>`` reads."""
    real = getattr(torch, name)

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        counts.extend(t.numel() for t in items)
        return real(tensors, *args, **kwargs)

    setattr(torch, name, counted)
    try:
        yield
    finally:
        setattr(torch, name, real)


def reductions(b: overhead.Bench) -> None:
    model, inputs, loss_fn = b.make()
    opt = overhead.make_optimizer(b.optimizer, model)
    with nand.watch(model, opt, log_events=False):
        for _ in range(3):  # past the first steps, which also read the parameters
            loss_fn(model(inputs())).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        forward: list[int] = []
        backward: list[int] = []
        norms: list[int] = []
        with counting("_foreach_norm", norms):
            probes._aminmax = _counted(probes._aminmax, forward)
            try:
                loss = loss_fn(model(inputs()))
                probes._aminmax = _counted(probes._aminmax.__wrapped__, backward)
                loss.backward()
                opt.step()
            finally:
                probes._aminmax = getattr(probes._aminmax, "__wrapped__", probes._aminmax)
            opt.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    for what, counts, unit in (
        ("aminmax in forward", forward, "probes"),
        ("aminmax in backward", backward, "probes"),
        ("_foreach_norm", norms, "tensors"),
    ):
        print(f"  {what:20s} {len(counts):4d} {unit:7s} {sum(counts) / 1e6:8.2f} M elements")
    print(f"  (parameters: {params / 1e6:.2f} M)")


def _counted(real: Callable[..., Any], counts: list[int]) -> Callable[..., Any]:
    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts.append(t.numel())
        return real(t, *args, **kwargs)

    counted.__wrapped__ = real  # type: ignore[attr-defined]
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list(overhead.BENCHES))
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    b = overhead.BENCHES[args.model]
    phase_costs(b, args.repeats)
    reductions(b)


if __name__ == "__main__":
    main()
