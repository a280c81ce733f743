"""``nand wait RUN``: follow the server's event stream until the run reaches a state.

The command reads ``GET /api/stream?run=RUN`` (Server-Sent Events, one ``run``
event with the run's summary whenever it changes, keep-alives in between)
instead of polling. When the server goes away it reconnects with backoff, for
``--retry-for`` seconds (default: for as long as ``--timeout`` allows, or
forever), saying once on stderr that it lost the server and once that it is
back; a watchdog never goes blind because the server restarted. Given several
servers that share a database (``--url http://a:8080,http://b:8080``), it goes
on at the next one at once when one goes away, and says nothing unless all of
them are down.

It follows the run's live attempt (:mod:`nand.server.agents.attempts`): when a run id
is used again the states that count are the new attempt's. ``--launch ID``
counts only the attempt of that launch identity (the agents' ``NAND_LAUNCH``):
a watchdog started next to a re-applied Kubernetes Job begins before its
trainer says hello, while the live attempt is still last time's, diverged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from nand import exitcodes
from nand.cli.rest_client import api_failure, base_urls, unreachable
from nand.client import ApiError, request_json, run_url, unreachable_reason
from nand.errors import CommandError

#: Exit code of ``nand wait`` for a state that is not the one waited for.
STATE_EXIT = {
    "diverged": exitcodes.DIVERGED,
    "lost": exitcodes.LOST,
    "stalled": exitcodes.STALLED,
    "crashed": exitcodes.CRASHED,
    "replica_mismatch": exitcodes.REPLICA_MISMATCH,
}
#: ``--until`` names a state by a shorter word where it has one.
UNTIL_STATE = {"mismatch": "replica_mismatch"}
#: The server sends a keep-alive every 15 s: silence for longer means it is gone.
READ_TIMEOUT_S = 40.0
MAX_BACKOFF_S = 30.0


def wait_exit_code(until: str, state: str) -> int | None:
    """The exit code once ``state`` is seen while waiting for ``until``; None: keep waiting."""
    if state == UNTIL_STATE.get(until, until) or (until == "any" and state == "finished"):
        return exitcodes.OK
    if state in STATE_EXIT:
        return STATE_EXIT[state]
    if state == "finished":
        return exitcodes.FINISHED
    return None


def stream_summaries(base: str, run: str, timeout: float) -> Iterator[dict[str, Any]]:
    """The run's summaries as the server streams them; ends with the connection."""
    url = f"{base}/api/stream?run={urllib.parse.quote(run, safe='')}"
    request = urllib.request.Request(url, headers={"Accept": "text/event-stream"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        kind = ""
        for raw in response:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.startswith("event:"):
                kind = line[len("event:") :].strip()
            elif line.startswith("data:") and kind == "run":
                summary = json.loads(line[len("data:") :])
                if summary.get("run") == run:
                    yield summary
            elif not line:
                kind = ""


class Waiter:
    """One ``nand wait``: the deadline, the outage bookkeeping, the messages."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        #: Several servers on one database (``--url a,b``): any of them will do.
        self.bases = base_urls(args)
        self.index = 0
        #: Servers that failed in a row since the last answer.
        self.failed = 0
        now = time.monotonic()
        self.deadline = now + args.timeout if args.timeout is not None else None
        self.down_since: float | None = None
        self.announced_unknown = False
        #: The attempt last said to be another launch's (said once per attempt).
        self.announced_other: int | None = None

    @property
    def base(self) -> str:
        return self.bases[self.index]

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def run(self) -> int:
        backoff = self.args.interval
        while True:
            try:
                code = self._follow()
                if code is not None:
                    return code
                backoff = self.args.interval  # the stream ended cleanly: reconnect soon
            except ApiError as exc:
                raise api_failure(self.base, exc) from exc
            except OSError as exc:
                if self._try_another():
                    continue
                self._server_down(exc)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            left = self.left()
            if left is not None and left <= 0:
                return self._timed_out()
            time.sleep(backoff if left is None else max(0.0, min(backoff, left)))

    def _follow(self) -> int | None:
        """Check the run once, then follow its stream; an exit code, or None to reconnect."""
        self._announce_if_unknown()
        left = self.left()
        timeout = READ_TIMEOUT_S if left is None else max(0.1, min(READ_TIMEOUT_S, left))
        try:
            for summary in stream_summaries(self.base, self.args.run, timeout):
                self._server_up()
                if not self._counts(summary):
                    continue
                state = str(summary["state"])
                if self.args.until == "warning" and summary.get("warnings"):
                    state = "warning"  # an early warning: what was asked
                code = self.exit_code(state)
                if code is not None:
                    print(f"{self.args.run}: {state}", flush=True)
                    return code
                left = self.left()
                if left is not None and left <= 0:
                    return self._timed_out()
        except TimeoutError:
            left = self.left()
            if left is not None and left <= 0:
                return self._timed_out()
            raise
        return None

    def exit_code(self, state: str) -> int | None:
        """The exit code once the live attempt is in ``state``; None: keep following."""
        return wait_exit_code(self.args.until, state)

    def _counts(self, summary: dict[str, Any]) -> bool:
        """Whether this attempt's state is the one to act on (``--launch``)."""
        wanted = self.args.launch
        if wanted is None or summary.get("launch") == wanted:
            return True
        attempt = int(summary.get("attempt", 1))
        if self.announced_other != attempt:
            self.announced_other = attempt
            _say(
                f"the live attempt {attempt} of {self.args.run!r} is another launch "
                f"({summary.get('launch')}); waiting for launch {wanted}"
            )
        return False

    def _announce_if_unknown(self) -> None:
        """Say once that the run has not reported yet: waiting is not hanging."""
        try:
            request_json(run_url(self.base, self.args.run, "/verdict"))
        except ApiError as exc:
            if exc.status != 404 or str(exc).startswith("Not Found"):
                raise
            if not self.announced_unknown:
                self.announced_unknown = True
                _say(
                    f"run {self.args.run!r} has not reported to {self.base} yet; waiting for it "
                    "(--timeout to give up)"
                )
        self._server_up()

    def _try_another(self) -> bool:
        """After a failed connection, go to the next server in the list; True
        while one is left that has not failed since the last answer (no pause,
        no word: a server of several going away is not news)."""
        self.failed += 1
        self.index = (self.index + 1) % len(self.bases)
        return self.failed < len(self.bases)

    def _server_down(self, exc: OSError) -> None:
        now = time.monotonic()
        where = ", ".join(self.bases)
        if self.down_since is None:
            self.down_since = now
            _say(f"lost the server at {where} ({unreachable_reason(exc)}); retrying")
        retry_for = self.args.retry_for
        if retry_for is not None and now - self.down_since > retry_for:
            raise unreachable(where, exc) from exc

    def _server_up(self) -> None:
        self.failed = 0
        if self.down_since is not None:
            self.down_since = None
            _say(f"reached the server at {self.base} again")

    def _timed_out(self) -> int:
        raise CommandError(
            f"timed out after {self.args.timeout:g} s waiting for {self.args.run} "
            f"(--until {self.args.until})",
            exitcodes.TIMEOUT,
        )


def _say(message: str) -> None:
    print(f"nand wait: {message}", file=sys.stderr, flush=True)


def cmd_wait(args: argparse.Namespace) -> int:
    return Waiter(args).run()
