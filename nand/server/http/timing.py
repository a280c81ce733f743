"""Request latency for ``/metrics``: an ASGI middleware timing each HTTP request
to its first byte (so a Server-Sent Events stream counts its start, not its
hours), labelled by the route's template (``/api/runs/{run}/verdict``), never the
raw path: one series per route, however many runs there are."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestTimer:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                _record(scope, message["status"], time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, timed_send)


def _record(scope: Scope, status: int, seconds: float) -> None:
    state = getattr(scope["app"].state, "nand", None)
    if state is not None:
        state.metrics.request(scope["method"], route_template(scope), status, seconds)


def route_template(scope: Scope) -> str:
    """The matched route's path template; the router wrote it into ``scope``."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str) and path:
        return path
    return "static" if scope.get("endpoint") is not None else "unmatched"
