"""What the early warnings cost a step (issue 18): host Python only.

    python benchmarks/warnings_cost.py

``BlowUpWatch.look`` (``nand/agent/step/blowup.py``) with the global gradient
norm, called 20,000 times on one step's worth of figures (80 probe values, 60
gradient norms), median of 5 passes; and the headroom scan alone
(``analysis.near_limit``), which every step paid before the warnings existed.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nand.agent.step.analysis import StepRow, near_limit
from nand.agent.step.blowup import BlowUpWatch, global_norm

STEPS = 20_000


def per_call_us(call: Callable[[StepRow], object], rows: list[StepRow]) -> float:
    passes = []
    for _ in range(5):
        started = time.perf_counter()
        for row in rows:
            call(row)
        passes.append((time.perf_counter() - started) / len(rows))
    return statistics.median(passes) * 1e6


def main() -> None:
    norms = [0.5 + 0.01 * i for i in range(60)]
    rows = [
        StepRow(
            step=step,
            values=[0.1, 0.2] * 40,
            sites=[None] * 40,
            norm_sites=[],
            loss=2.0 + 0.01 * (step % 7),
        )
        for step in range(STEPS)
    ]
    watch = BlowUpWatch(rank=0)
    total = per_call_us(
        lambda row: watch.look(row, 80, global_norm(norms, (0, 60), 1.0), True), rows
    )
    headroom = per_call_us(lambda row: near_limit(row, 80), rows)
    print(f"warnings, all of them: {total:.2f} us a step")
    print(f"  of which the headroom scan (paid before too): {headroom:.2f} us")
    print(f"  new: {total - headroom:.2f} us a step")


if __name__ == "__main__":
    main()
