"""REST routers, one per resource; :data:`ROUTERS` is what the app includes."""

from __future__ import annotations

from fastapi import APIRouter

from nand.server.http.api import alerts, events, health, hosts, runs, stop, stream, verdict

ROUTERS: tuple[APIRouter, ...] = (
    runs.router,
    events.router,
    verdict.router,
    stop.router,
    stream.router,
    health.router,
    hosts.router,
    alerts.router,
)

__all__ = ["ROUTERS"]
