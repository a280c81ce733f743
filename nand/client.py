"""A minimal client for nand's REST API, on the standard library only.

Used by the CLI (``nand runs``, ``nand verdict``, ``nand wait``...), the demo
and job-script wrappers, so none of them needs an HTTP library::

    verdict = request_json("http://127.0.0.1:8080/api/runs/my-run/verdict")
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class ApiError(Exception):
    """The server answered with an error status; ``.status`` and the message say why."""

    def __init__(self, status: int, detail: str) -> None:
        self.status = status
        super().__init__(detail)


def request_json(
    url: str,
    *,
    method: str = "GET",
    body: Any = None,
    token: str | None = None,
    timeout: float = 10.0,
) -> Any:
    """Send one request and decode the JSON answer; raise ApiError or OSError."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Accept", "application/json")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ApiError(exc.code, _detail(exc)) from None


def run_url(base: str, run: str, suffix: str = "") -> str:
    """``{base}/api/runs/{run}{suffix}`` with the run id escaped."""
    return f"{base.rstrip('/')}/api/runs/{urllib.parse.quote(run, safe='')}{suffix}"


def unreachable_reason(exc: OSError) -> str:
    """Why a request got no answer, in words: "Connection refused", not urllib's
    ``<urlopen error [Errno 111] Connection refused>``.

    >>> unreachable_reason(urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")))
    'Connection refused'
    >>> unreachable_reason(TimeoutError("timed out"))
    'no answer in time'
    """
    inner = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(inner, TimeoutError):
        return "no answer in time"
    if isinstance(inner, OSError) and inner.strerror:
        return inner.strerror
    return str(inner)


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        detail = json.loads(exc.read()).get("detail")
    except (ValueError, AttributeError):
        detail = None
    return detail if isinstance(detail, str) else f"HTTP {exc.code}"
