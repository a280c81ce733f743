"""A whole nand server (REST + ingest) in a background thread, on free ports.

Used by ``nand server``, by the demo and by the tests::

    server = embedded.start("sqlite:///nand.db")       # http_port=0, zmq port "*"
    print(server.http_url, server.zmq_endpoint)
    ...
    server.stop()
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI

from nand.server.agents import descriptors
from nand.server.http.app import create_app
from nand.server.settings import Settings


@dataclass
class EmbeddedServer:
    http_url: str
    zmq_endpoint: str
    app: FastAPI
    _server: uvicorn.Server
    _thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        state = getattr(self.app.state, "nand", None)
        if state is not None:
            state.closing.set()  # open event streams end, so shutdown is quick and clean
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def start(
    db_url: str | None = None,
    *,
    http_host: str = "127.0.0.1",
    http_port: int = 0,
    zmq_endpoint: str = "tcp://127.0.0.1:*",
    settings: Settings | None = None,
    timeout: float = 30.0,
    log_level: str = "warning",
) -> EmbeddedServer:
    """Start a server; ``settings`` (default: from the environment) gives the rest."""
    base = settings or Settings.from_env()
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on accepted
    # connections only when the listening socket says it is TCP. Without it,
    # Nagle's algorithm and delayed ACKs add ~40 ms to every keep-alive request.
    family = socket.AF_INET6 if ":" in http_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((http_host, http_port))
    settings = replace(
        base,
        db_url=db_url or base.db_url,
        http_host=http_host,
        http_port=sock.getsockname()[1],  # the port bound (notifications link to it)
        zmq_bind=zmq_endpoint,
    )
    app = create_app(settings)
    descriptors.quiet_accept_failures()
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="on", access_log=False, timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="nand-http", daemon=True
    )
    thread.start()
    _wait_started(server, thread, app, timeout)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return EmbeddedServer(
        http_url=f"http://{shown}:{port}",
        zmq_endpoint=app.state.nand.ingest.endpoint,
        app=app,
        _server=server,
        _thread=thread,
    )


def _wait_started(
    server: uvicorn.Server, thread: threading.Thread, app: FastAPI, timeout: float
) -> None:
    """Until uvicorn serves. A start-up that failed raises its own error (a ZeroMQ port
    taken since the preflight probe: EADDRINUSE, which the CLI says in one line),
    without uvicorn's traceback of it: the caller decides what to show."""
    quiet = _QuietOnceRaised(app)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                error = getattr(app.state, "startup_error", None)
                if error is not None:
                    raise error
                raise RuntimeError("the nand server did not start; see the log above")
            time.sleep(0.02)
    finally:
        uvicorn_log.removeFilter(quiet)


class _QuietOnceRaised(logging.Filter):
    """Drops uvicorn's log lines once the app kept a start-up error to raise."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(self.app.state, "startup_error", None) is None
