"""The FastAPI application: :func:`create_app` builds it from :class:`Settings`.

The lifespan opens the database (upgrading its schema), starts the ZeroMQ
ingest thread and, with ``NAND_NOTIFY_URL`` set, the notifier thread
(:mod:`nand.server.notify.notifier`), and stops them on shutdown. API routes come first; the
dashboard's static files (``nand/web/``) are served at ``/``, with
``index.html`` also answering the dashboard's own routes (``/runs/<id>``).

>>> from fastapi.testclient import TestClient
>>> app = create_app(Settings(db_url="sqlite:///:memory:", zmq_bind="tcp://127.0.0.1:*"))
>>> with TestClient(app, base_url="http://127.0.0.1") as client:
...     client.get("/healthz").json()["database"]
'ok'
"""

from __future__ import annotations

import importlib.resources
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import OperationalError
from starlette.routing import Match, Mount
from starlette.types import Scope

from nand import __version__
from nand.server.agents.ingest import Ingest
from nand.server.http.api import ROUTERS
from nand.server.http.api.deps import ServerState
from nand.server.http.bodylimit import BodyLimit
from nand.server.http.guard import BrowserGuard
from nand.server.http.hub import StreamHub
from nand.server.http.timing import RequestTimer
from nand.server.metrics import Metrics
from nand.server.notify.notifier import Notifier
from nand.server.settings import Settings
from nand.server.storage.db import make_engine
from nand.server.storage.migrate import upgrade

log = logging.getLogger("nand.server")

WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def create_app(settings: Settings | None = None, *, ingest: bool = True) -> FastAPI:
    """The app; ``ingest=False`` serves the REST API without the ZeroMQ socket."""
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.db_url)
        upgrade(engine)
        metrics = Metrics()
        loop = Ingest(engine, settings, metrics) if ingest else None
        if loop is not None:
            try:
                loop.start()
            except Exception as exc:  # kept for embedded.start to raise: why, not "did not start"
                app.state.startup_error = exc
                engine.dispose()
                raise
        notifier = Notifier(engine, settings, metrics) if settings.notify_urls else None
        if notifier is not None:
            notifier.start()
        hub = StreamHub(engine, settings, on_poll=metrics.stream_poll)
        app.state.nand = ServerState(settings, engine, metrics, hub, loop)
        try:
            yield
        finally:
            app.state.nand.closing.set()
            await hub.close()
            if loop is not None:
                loop.stop()
            if notifier is not None:
                notifier.stop()
            engine.dispose()

    app = FastAPI(
        title="nand",
        version=__version__,
        summary="Where a PyTorch training run first went non-finite: rank, layer, step, phase.",
        lifespan=lifespan,
        docs_url=None,  # served by _mount_docs, from local assets
        redoc_url=None,
    )
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(RequestTimer)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    # Outermost: a request for a foreign Host is refused before anything else runs.
    app.add_middleware(BrowserGuard, bind_host=settings.http_host, allowed=settings.allowed_hosts)
    app.add_exception_handler(OperationalError, _database_unavailable)
    _mount_docs(app)
    _mount_web(app)
    return app


async def _database_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", exc)
    return JSONResponse({"detail": "the database is unavailable; retry"}, status_code=503)


#: Swagger UI's and ReDoc's files, shipped in the fastapi-offline wheel.
DOCS_ASSETS = Path(str(importlib.resources.files("fastapi_offline") / "static"))


def _mount_docs(app: FastAPI) -> None:
    """``/docs`` and ``/redoc`` with their scripts served here, not from a CDN: an
    operator on an offline cluster gets the API reference too."""
    app.mount("/docs-assets", StaticFiles(directory=DOCS_ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/favicon.svg",
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            redoc_js_url="/docs-assets/redoc.standalone.js",
            redoc_favicon_url="/favicon.svg",
            with_google_fonts=False,
        )


def _mount_web(app: FastAPI) -> None:
    index = WEB_DIR / "index.html"

    @app.get("/runs/{path:path}", include_in_schema=False)
    def dashboard_route(path: str) -> FileResponse:
        """Client-side routes of the dashboard all load its index.html."""
        if not index.is_file():
            raise HTTPException(404, "the dashboard is not installed")
        return FileResponse(index)

    files = StaticFiles(directory=WEB_DIR, html=True, check_dir=False)
    app.router.routes.append(WebMount("/", app=files, name="web"))


class WebMount(Mount):
    """The dashboard's files at ``/``, for every path but the API's.

    A plain mount at ``/`` matches every path, so a request with the wrong
    method for an API route (``OPTIONS /api/runs/x/stop``) would reach the
    static files and get their 405 with ``Allow: GET, HEAD``. Without it, the
    router answers with the API route's own methods, and an unknown ``/api/``
    path gets the API's JSON 404.
    """

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and scope["path"].startswith("/api/"):
            return Match.NONE, {}
        return super().matches(scope)
