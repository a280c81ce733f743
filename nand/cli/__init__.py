"""The ``nand`` command line: ``nand server | demo | runs | hosts | verdict | stop | wait |
watchdog | prune | spool``.

Each group of subcommands lives next to the code it drives and exposes
``register(subparsers)``; it must import only light modules at import time
(no torch on a server host, no FastAPI in a training job). A group whose
module is missing (an extra not installed) is left out of the help.

A failure is one line on stderr, ``nand: <what was wrong>; <what to do>``,
and an exit code from :mod:`nand.exitcodes`; ``-v`` adds the traceback. A
command's ``run`` argument that no run can have (:mod:`nand.runids`) is such a
failure (``USAGE``), said before any request.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

from nand import __version__, exitcodes
from nand.errors import CommandError
from nand.runids import RULE, run_flaw, run_id_from, shown_id

#: Modules that add subcommands, in the order their commands are listed.
COMMAND_GROUPS = (
    "nand.cli.server_args",  # server, runs, hosts, verdict, stop, wait, prune
    "nand.cli.watchdog",  # watchdog
    "nand.cli.spool",  # spool replay
    "nand.demo",  # demo
)

VERBOSE_HELP = "debug logging, and the traceback of a failure"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nand", description="Find where a PyTorch training run first went non-finite."
    )
    parser.add_argument("--version", action="version", version=f"nand {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_GROUPS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.register(subparsers)
    add_verbose_to_commands(subparsers)
    return parser


def add_verbose_to_commands(subparsers: Any) -> None:
    """``nand server -v`` works as ``nand -v server`` does (SUPPRESS: no override)."""
    for command in subparsers.choices.values():
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
        )


def configure_logging(verbose: bool) -> None:
    # nand's own messages at INFO; libraries (alembic, uvicorn) only when they warn.
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("nand").setLevel(logging.DEBUG if verbose else logging.INFO)


def check_run_id(args: argparse.Namespace) -> None:
    """Refuse a ``run`` argument no run can have (``nand verdict lightning_logs/0``):
    the server could only answer 404 for it, which reads as a wrong ``--url``."""
    run = getattr(args, "run", None)
    if not isinstance(run, str):
        return
    flaw = run_flaw(run)
    if flaw is None:
        return
    hint = "see `nand runs` for the runs there are"
    if flaw.startswith("contains"):  # e.g. Lightning's "name/version", as nand reports it
        hint = f"a framework's run name like it is reported as {run_id_from(run)!r}"
    raise CommandError(
        f"no run can have the id {shown_id(run)}: it {flaw} (a run id has {RULE}); {hint}",
        exitcodes.USAGE,
    )


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run one command; a failure becomes one line on stderr and its exit code."""
    verbose = bool(getattr(args, "verbose", False))
    try:
        check_run_id(args)
        return int(func(args) or 0)
    except CommandError as exc:
        if verbose:
            traceback.print_exc()
        print(f"nand: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        hint = "" if verbose else " (run with -v for the traceback)"
        print(f"nand: unexpected error: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return exitcodes.ERROR


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(bool(getattr(args, "verbose", False)))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return exitcodes.USAGE
    return run_command(func, args)


if __name__ == "__main__":
    sys.exit(main())
