"""``python -m nand.server [server|runs|verdict|stop|wait|prune] ...``: the server's
commands alone (the same as ``nand server ...``), without the other groups."""

from __future__ import annotations

import argparse
import sys

from nand.cli import (
    VERBOSE_HELP,
    add_verbose_to_commands,
    configure_logging,
    run_command,
    server_args,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nand.server")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    server_args.register(subparsers)
    add_verbose_to_commands(subparsers)
    args = parser.parse_args(argv)
    configure_logging(bool(getattr(args, "verbose", False)))
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
