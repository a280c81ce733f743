"""The ``nand`` command line: ``nand server | demo | runs | verdict | stop | wait | prune | spool``.

Each group of subcommands lives next to the code it drives and exposes
``register(subparsers)``; it must import only light modules at import time
(no torch on a server host, no FastAPI in a training job). A group whose
module is missing (an extra not installed) is left out of the help.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from nand import __version__

#: Modules that add subcommands, in the order their commands are listed.
COMMAND_GROUPS = (
    "nand.server.commands",  # server, runs, verdict, stop, wait, prune
    "nand.agent.transport.commands",  # spool replay
    "nand.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nand", description="Find where a PyTorch training run first went non-finite."
    )
    parser.add_argument("--version", action="version", version=f"nand {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_GROUPS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # nand's own messages at INFO; libraries (alembic, uvicorn) only when they warn.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("nand").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
