"""``python -m nand.server [server|runs|verdict|stop|wait|prune] ...``: the server's
commands alone (the same as ``nand server ...``), without the other groups."""

from __future__ import annotations

import argparse
import logging
import sys

from nand.server import commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nand.server")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
