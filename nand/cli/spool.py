"""``nand spool replay PATH`` and ``nand spool show PATH``.

Imports neither torch nor the transport at module import time: the CLI loads
this module to build its help on any host.

    nand spool show ~/.cache/nand/spool/my-run/rank-3.spool
    nand spool replay ~/.cache/nand/spool/my-run --server tcp://head-node:5557
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nand import exitcodes
from nand.config import AgentConfig
from nand.endpoints import split_list
from nand.errors import CommandError


def register(subparsers: Any) -> None:
    spool = subparsers.add_parser("spool", help="inspect or replay an agent's spool files")
    sub = spool.add_subparsers(dest="spool_command", metavar="ACTION", required=True)
    replay = sub.add_parser("replay", help="send spooled messages to a server, then delete them")
    replay.add_argument("path", type=Path, help="a .spool file or a directory of them")
    replay.add_argument("--server", help="ZeroMQ endpoint (default: $NAND_SERVER)")
    replay.add_argument("--timeout", type=float, default=30.0, help="seconds per file")
    replay.add_argument("--keep", action="store_true", help="keep the files after replay")
    replay.set_defaults(func=_replay)
    show = sub.add_parser("show", help="list the records of spool files")
    show.add_argument("path", type=Path, help="a .spool file or a directory of them")
    show.set_defaults(func=_show)


def _replay(args: argparse.Namespace) -> int:
    from nand.agent.transport.replay import replay_file

    settings = AgentConfig.resolve()
    server = args.server or settings.server
    if not server:
        raise CommandError(
            "spool replay needs a server; pass --server tcp://HOST:PORT or set NAND_SERVER",
            exitcodes.USAGE,
        )
    # A list (NAND_SERVER="tcp://a:5557,tcp://b:5557"): its servers share one
    # database, so the first is as good as any.
    server = split_list(server)[0]
    files = _existing_spool_files(args.path)
    failed = 0
    for path in files:
        result = replay_file(
            path,
            server,
            timeout=args.timeout,
            keep=args.keep,
            curve_server_key=settings.transport.curve_server_key,
        )
        status = "skipped: " + result.skipped if result.skipped else "rejected: " + result.rejected
        if not result.skipped and not result.rejected:
            status = "done" if result.complete else "incomplete (server did not acknowledge)"
        print(f"{path}: {result.acked}/{result.records} acknowledged, {status}")
        failed += not result.complete
    return 1 if failed else 0


def _show(args: argparse.Namespace) -> int:
    import msgpack

    from nand.agent.transport.spool import KIND_NAMES, read_records

    for path in _existing_spool_files(args.path):
        records = read_records(path)
        print(f"{path}: {len(records)} records")
        for tag, payload in records:
            message = msgpack.unpackb(payload, raw=False)
            kind = KIND_NAMES.get(tag & 0x0F, "?")
            print(
                f"  {kind:9} agent={str(message.get('agent'))[:12]} seq={message.get('seq')} "
                f"run={message.get('run')} rank={message.get('rank')} bytes={len(payload)}"
            )
    return 0


def _existing_spool_files(path: Path) -> list[Path]:
    from nand.agent.transport.replay import spool_files

    files = spool_files(path)
    if not files:
        where = "no such file or directory" if not path.exists() else "no .spool files there"
        raise CommandError(
            f"{path}: {where}; spools are under $NAND_SPOOL_DIR "
            "(default ~/.cache/nand/spool/RUN/rank-N.spool)",
            exitcodes.NOT_FOUND,
        )
    return files
