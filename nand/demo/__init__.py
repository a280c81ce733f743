"""``nand demo``: an embedded server, a real multi-rank job that goes NaN, the verdict.

Only the argument parser lives here, so ``nand --help`` stays light; the demo
itself (``nand.demo.show``) imports the server and launches torchrun.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="watch a real 4-rank training job go NaN, with the dashboard",
        description=(
            "Start an embedded nand server (SQLite, free ports), run a real DDP job "
            "under torchrun (gloo, CPU) that goes NaN on one rank, and print the verdict."
        ),
    )
    demo.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    demo.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    demo.add_argument(
        "--fault",
        default="overflow:rank=2:step=40",
        help="the planted fault, see nand.demo.faults (default overflow:rank=2:step=40)",
    )
    demo.add_argument(
        "--step-time", type=float, default=0.15, help="seconds per step, to watch it live"
    )
    demo.add_argument("--port", type=int, default=0, help="dashboard port (default: a free one)")
    demo.add_argument(
        "--no-wait",
        action="store_true",
        help="exit after the job instead of keeping the dashboard up",
    )
    demo.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from nand.demo.show import run_demo

    return run_demo(args)
