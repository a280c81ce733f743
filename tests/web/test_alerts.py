"""Early warnings on the dashboard, in real Chromium against a real server
(issue 18): counted in the verdict card, marked on the training charts and on
the warned rank's row of the ranks-over-time strip.
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
    strip = page.locator("#ranks canvas")
    assert "early warnings: 1" in (strip.get_attribute("aria-label") or "")
    expect(page.locator("#ranks .legend")).to_contain_text("early warning")
    # The triangle is drawn in the warning colour on rank 1's row, not rank 0's.
    assert strip.evaluate(WARNING_PIXELS_BY_ROW) == [0, pytest.approx(12, abs=10)]
    screenshot(page, "early-warning")


# Pixels of the warning colour in the top and bottom half of a two-row strip
# (rows start 6 CSS px down and are 16 px tall; see strip.js).
WARNING_PIXELS_BY_ROW = """(canvas) => {
  const hex = getComputedStyle(document.body).getPropertyValue('--stall').trim();
  const rgb = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const counts = [0, 0];
  const rowPx = 16 * devicePixelRatio, top = 6 * devicePixelRatio;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i] !== rgb[0] || d[i + 1] !== rgb[1] || d[i + 2] !== rgb[2]) continue;
    const row = Math.floor((Math.floor(i / 4 / canvas.width) - top) / rowPx);
    if (row === 0 || row === 1) counts[row] += 1;
  }
  return counts;
}"""
