"""A JSON error answered by ASGI middleware, before the application sees the request."""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import Send


async def send_json_error(
    send: Send, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    """Answer ``{"detail": detail}`` with ``status`` (and ``headers``)."""
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
