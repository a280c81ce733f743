"""What a browser-facing server on loopback needs: a ``Host`` check and security headers.

DNS rebinding: a web page on ``evil.example`` makes its own name resolve to
127.0.0.1, and the browser then lets it read ``http://evil.example:8080``,
which is this server. The request still says ``Host: evil.example``, so the
server answers only to the names it knows:

- any IP address (a rebinding attack always comes with a domain name);
- ``localhost`` (and ``*.localhost``, which browsers resolve to loopback);
- the host the server binds to, when it is a name;
- this machine's name, when the server binds to all interfaces;
- the names in ``NAND_ALLOWED_HOSTS`` (``*``: any).

Anything else gets 400 before the app sees the request. Every response also
carries the usual security headers: no MIME sniffing, no framing (no
clickjacking), no referrer, a Content-Security-Policy that allows only this
origin (the API docs pages, whose bundled Swagger UI and ReDoc need inline
scripts, get a looser one), and same-origin opener and resource policies.

>>> guard = BrowserGuard(None, bind_host="127.0.0.1", allowed=("nand.example.org",))
>>> [guard.allows(h) for h in ("127.0.0.1:8080", "[::1]:8080", "localhost", "nand.example.org")]
[True, True, True, True]
>>> guard.allows("evil.example:8080")
False
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nand.server.http.asgi import send_json_error
from nand.server.settings import WILDCARD_HOSTS

DASHBOARD_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'"
)
#: Swagger UI and ReDoc start from an inline script; ReDoc also runs a blob: worker.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
DOCS_PATHS = ("/docs", "/redoc")

SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without port, brackets or trailing dot, lower case.

    >>> [host_name(h) for h in ("Example.org.:80", "[::1]:8080", "10.0.0.1")]
    ['example.org', '::1', '10.0.0.1']
    """
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """ASGI middleware: refuse unknown ``Host`` names, add security headers."""

    def __init__(self, app: ASGIApp, *, bind_host: str, allowed: Iterable[str] = ()) -> None:
        self.app = app
        names = {host_name(name) for name in allowed}
        self.any_host = "*" in names
        names.add("localhost")
        if bind_host in WILDCARD_HOSTS:
            names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
        elif not is_ip(host_name(bind_host)):
            names.add(host_name(bind_host))
        self.names = frozenset(names)

    def allows(self, header: str) -> bool:
        name = host_name(header)
        return self.any_host or is_ip(name) or name in self.names or name.endswith(".localhost")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if host is not None and not self.allows(host):
            await _refuse(send, host)
            return
        csp = DOCS_CSP if scope["path"] in DOCS_PATHS else DASHBOARD_CSP

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = _with_security_headers(message.get("headers", []), csp)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _with_security_headers(headers: list[tuple[bytes, bytes]], csp: str) -> list:
    present = {key.lower() for key, _ in headers}
    extra = [(k, v) for k, v in SECURITY_HEADERS if k not in present]
    if b"content-security-policy" not in present:
        extra.append((b"content-security-policy", csp.encode()))
    return [*headers, *extra]


async def _refuse(send: Send, host: str) -> None:
    detail = (
        f"this server does not answer to host {host_name(host)!r}: "
        "add it to NAND_ALLOWED_HOSTS if that is its name"
    )
    await send_json_error(send, 400, detail, SECURITY_HEADERS)
