"""The verdict card names the first failure in time, in real Chromium: a rank
that fell silent (SIGKILL) before its peer raised reads "Lost: rank 1 …
first", and the summary under it names the peer's exception as the
consequence. Stored through the server's writer at chosen times (the
dashboard's server calls a rank lost after an hour of silence)."""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import expect

from nand import wire
from nand.events import StepSummary
from nand.server.agents.writer import write_batch
from tests.web.conftest import Dashboard, screenshot

pytestmark = pytest.mark.slow


def store(dashboard: Dashboard, now: float, kind: str, rank: int, seq: int, **body) -> None:
    message = wire.agent_message(
        kind, agent=f"killed-first-{rank}", seq=seq, run="killed-first", rank=rank, body=body
    )
    write_batch(dashboard.server.app.state.nand.engine, [wire.decode(wire.encode(message))], now)


def test_the_card_names_the_killed_rank_first_and_its_peers_exception_after(
    page, dashboard: Dashboard
) -> None:
    start = time.time() - 7200  # silent for two hours: lost
    for rank in (0, 1):
        store(dashboard, start, "hello", rank, 1, world_size=2, host=f"node-{rank}", pid=7)
        store(dashboard, start + 5, "heartbeat", rank, 2, **StepSummary(step=5).to_dict())
    store(dashboard, start + 5.2, "bye", 0, 3, step=5, reason="exception: RuntimeError")
    page.goto(dashboard.run_url("killed-first"))
    title = page.locator(".verdict-title")
    expect(title).to_have_text("Lost: rank 1 stopped reporting first (step 5).")
    expect(page.locator(".verdict .summary")).to_contain_text(
        "Then, as a consequence: rank 0 crashed 0.2 s later (left with an exception: RuntimeError"
    )
    screenshot(page, "verdict-lost-first")
