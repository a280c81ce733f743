"""``nand runs | verdict | stop``: the REST API from the command line (standard library only).

Every failure is a :class:`~nand.errors.CommandError`: the server's own reason
(exit 1, or 9 for an unknown run), an unreachable server in words (exit 8), a
``--url`` that points below the server's base (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import json
import urllib.parse
from collections.abc import Callable
from typing import Any

from nand import config, exitcodes
from nand.client import ApiError, request_json, run_url, unreachable_reason
from nand.endpoints import split_list
from nand.errors import CommandError

DEFAULT_URL = "http://127.0.0.1:8080"


def base_urls(args: argparse.Namespace) -> list[str]:
    """The servers' base URLs from ``--url`` / ``NAND_URL``: one, or several servers
    sharing a database, separated by commas or spaces (every command tries the
    next when one is down); each refused if it is not one, e.g. ends in ``/api``."""
    text = args.url or config.get_str(config.NAND_URL, DEFAULT_URL) or ""
    return [_checked_base(url) for url in split_list(text) or [text]]


def base_url(args: argparse.Namespace) -> str:
    """The first of :func:`base_urls` (each command is run with one, see
    :func:`reports_api_errors`)."""
    return base_urls(args)[0]


def _checked_base(url: str) -> str:
    url = url.rstrip("/")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise CommandError(
            f"--url {url!r} is not an http(s) URL; pass the server's base, e.g. {DEFAULT_URL}",
            exitcodes.USAGE,
        )
    if parsed.path.endswith("/api"):
        fixed = url[: -len("/api")]
        raise CommandError(
            f"--url {url} ends in /api, but nand adds /api/... itself: pass --url {fixed}",
            exitcodes.USAGE,
        )
    return url


def run_endpoint(args: argparse.Namespace, suffix: str = "") -> str:
    return run_url(base_url(args), args.run, suffix)


def unreachable(base: str, exc: OSError) -> CommandError:
    return CommandError(
        f"cannot reach the nand server at {base} ({unreachable_reason(exc)}); "
        "is `nand server` running there? Pass --url or set NAND_URL",
        exitcodes.UNREACHABLE,
    )


def api_failure(base: str, exc: ApiError) -> CommandError:
    """The server's reason; a bare 404 means --url is not a nand server's base."""
    if exc.status == 404 and str(exc) in ("Not Found", "HTTP 404"):
        return CommandError(
            f"{base} has no nand API (HTTP 404); pass the base URL of `nand server`, "
            f"e.g. {DEFAULT_URL}",
            exitcodes.USAGE,
        )
    code = exitcodes.NOT_FOUND if exc.status == 404 else exitcodes.ERROR
    return CommandError(str(exc), code)


def reports_api_errors(
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """API errors and an unreachable server become one-line CommandErrors. Given
    several servers (one database), the command goes on at the next when one
    cannot be reached: any of them answers the same."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        bases = base_urls(args)
        for base in bases:
            try:
                return command(argparse.Namespace(**{**vars(args), "url": base}))
            except ApiError as exc:
                raise api_failure(base, exc) from exc
            except BrokenPipeError:
                raise  # our stdout closed (`| head`), not the server
            except OSError as exc:
                if base == bases[-1]:
                    raise unreachable(", ".join(bases), exc) from exc
        raise AssertionError("base_urls returns at least one URL")

    return run


@reports_api_errors
def cmd_runs(args: argparse.Namespace) -> int:
    runs = request_json(f"{base_url(args)}/api/runs?limit={max(1, min(args.limit, 1000))}")
    if args.json:
        print(json.dumps(runs, indent=2))
        return exitcodes.OK
    print(f"{'RUN':<36} {'STATE':<16} {'RANKS':>5} {'STEP':>8} {'EVENTS':>7}  ORIGIN")
    for run in runs:
        print(
            f"{run['run']:<36} {run['state']:<16} {run['ranks_seen']:>5} "
            f"{run['latest_step']:>8} {run['event_count']:>7}  {_origin_text(run.get('origin'))}"
        )
    return exitcodes.OK


def _origin_text(origin: dict[str, Any] | None) -> str:
    if not origin:
        return ""
    return (
        f"rank {origin['rank']} {origin['phase']} {origin['module'] or '<root>'} "
        f"step {origin['step']}"
    )


@reports_api_errors
def cmd_hosts(args: argparse.Namespace) -> int:
    page = request_json(f"{base_url(args)}/api/hosts?limit={max(1, min(args.limit, 1000))}")
    if args.json:
        print(json.dumps(page, indent=2))
        return exitcodes.OK
    print(f"{'HOST':<32} {'INCIDENTS':>9} {'MISMATCHES':>10} {'CRASHES':>7} {'RUNS':>5}  GPUS")
    for host in page["items"]:
        gpus = ", ".join(
            f"{g['gpu']}: {g['incidents']}/{g['mismatches']}/{g['crashes']}"
            for g in host["gpus"]
            if g["incidents"] or g["mismatches"] or g["crashes"]
        )
        print(
            f"{host['host']:<32} {host['incidents']:>9} {host['mismatches']:>10} "
            f"{host['crashes']:>7} {host['runs']:>5}  {gpus}"
        )
    print(f"({page['total']} hosts over the last {page['runs']} runs)")
    return exitcodes.OK


@reports_api_errors
def cmd_verdict(args: argparse.Namespace) -> int:
    verdict = request_json(run_endpoint(args, "/verdict"))
    if args.json:
        print(json.dumps(verdict, indent=2))
    else:
        print(f"{verdict['run']}: {verdict['state']}")
        print(verdict["summary"])
        if verdict.get("gaps_summary"):
            print(verdict["gaps_summary"])
    return exitcodes.OK


@reports_api_errors
def cmd_stop(args: argparse.Namespace) -> int:
    token = args.token or config.get_str(config.NAND_TOKEN)
    body: dict[str, Any] = {"reason": args.reason}
    if args.step is not None:
        body["step"] = args.step
    answer = request_json(run_endpoint(args, "/stop"), method="POST", body=body, token=token)
    ranks = ", ".join(map(str, answer["ranks"])) or "none running"
    print(
        f"{answer['run']}: every rank stops at step {answer['step']} or the next step boundary "
        f"after it (ranks {ranks})"
    )
    return exitcodes.OK
