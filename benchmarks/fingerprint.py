"""What a replica fingerprint costs (issue 18): one pass over the parameters
every ``NAND_FINGERPRINT_STEPS`` steps, on the benchmark models.

    python benchmarks/fingerprint.py [--only transformer gpt ...]

For each model, in one process and one thread, interleaved repeats of a
training step and of a fingerprint of every parameter and its per-element
optimizer state after it (AdamW's two moments, SGD's momentum buffer;
``nand.agent.step.fingerprint`` and the read of its result),
each timed on its own (a fingerprint is a few milliseconds against a step's
noise of more); medians. The cost per step at N is the fingerprint's share of
a step divided by N (one is taken every N steps). Single process: the DDP
ranks' comparison is the server's and costs the job nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.overhead import BENCHES, make_optimizer
from nand.agent.step.fingerprint import Fingerprints, fingerprint

DEFAULT_EVERY = 100  # nand.config.AgentConfig.fingerprint_steps


def measure(name: str, repeats: int) -> tuple[float, float]:
    bench = BENCHES[name]
    model, inputs, loss_fn = bench.make()
    opt = make_optimizer(bench.optimizer, model)
    # The parameters and the optimizer's per-element state, as a DDP rank takes them.
    taker = Fingerprints(1, model, send=lambda *_: None, state=opt.state)

    def step() -> float:
        started = time.process_time()
        loss_fn(model(inputs())).backward()
        opt.step()
        opt.zero_grad()
        return time.process_time() - started

    def take() -> float:
        started = time.process_time()
        fingerprint(taker._tensors()[1]).tolist()  # (the read a rank does a step later)
        return time.process_time() - started

    step(), take()  # warm-up
    steps, takes = [], []
    for _ in range(repeats):
        steps.append(step())
        takes.append(take())
    return statistics.median(steps), statistics.median(takes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHES), default=["transformer", "gpt", "resnet18"]
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats (CPU time)")
    for name in args.only:
        step, take = measure(name, args.repeats)
        share = take / step
        print(
            f"{BENCHES[name].title}: step {step * 1e3:.1f} ms, fingerprint {take * 1e3:.2f} ms"
            f" = {100 * share:.2f}% of a step at N=1, "
            f"{100 * share / DEFAULT_EVERY:.4f}% at N={DEFAULT_EVERY}"
        )


if __name__ == "__main__":
    main()
