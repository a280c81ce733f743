"""Early warnings on the dashboard, in real Chromium against a real server
(issue 18): counted in the verdict card, marked on the training charts.
Screenshot: artifacts/screenshots/."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.server.agents import FakeAgent
from tests.web.conftest import TOKEN, Dashboard, screenshot

pytestmark = pytest.mark.slow


def warned_run(endpoint: str, run: str) -> None:
    agents = [FakeAgent(endpoint, run=run, rank=r, world_size=2) for r in range(2)]
    for agent in agents:
        agent.hello(token=TOKEN)
    for step in range(0, 60, 5):
        for agent in agents:
            loss = 2.0 if step != 40 else 9.0
            agent.heartbeat(step, loss=loss, grad_norm=1.0, steps_per_s=3.0)
    message = "loss spike at step 40: 9, 4.5x the mean of the last 20 steps (2)"
    spike = {"kind": "loss_spike", "step": 40, "module": "", "value": 9.0, "message": message}
    agents[1].send("warning", spike)
    for agent in agents:
        agent.wait_acked()
        agent.close()


def test_warnings_are_counted_in_the_verdict_and_marked_on_the_charts(page, dashboard: Dashboard):
    warned_run(dashboard.server.zmq_endpoint, "warned")
    page.goto(dashboard.run_url("warned"))
    note = page.locator(".verdict .early-warnings")
    expect(note).to_contain_text("1 early warning (1 loss spike)")
    expect(note).to_contain_text("rank 1, loss spike at step 40")
    loss_chart = page.locator("figure.chart", has=page.locator("figcaption", has_text="Loss"))
    expect(loss_chart.locator("path.warn-mark")).to_have_count(1)
    expect(loss_chart.locator("path.warn-mark")).to_have_attribute("data-step", "40")
    screenshot(page, "early-warning")
