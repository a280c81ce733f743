"""The dashboard stays responsive with a 10,000-event page and a 256-rank run.

Render times are measured inside the browser (performance.now() around the
DOM work, exposed as data-render-ms) and written to artifacts/web-perf.json.
The bounds are generous on purpose (a shared 2-core CI machine); the figures
themselves are the report.

    python -m pytest tests/web/test_performance.py -q -s
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.web.conftest import Dashboard, PageErrors, screenshot

pytestmark = [pytest.mark.slow, pytest.mark.timed]

RENDER_BOUND_MS = 3000.0
INTERACTION_BOUND_MS = 1000.0
CLICK_TO_FRAME_MS = """async (index) => {
  const row = document.querySelectorAll("#events tbody tr")[index];
  const started = performance.now();
  row.click();
  await new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)));
  return performance.now() - started;
}"""
FIGURES = Path(__file__).resolve().parents[2] / "artifacts" / "web-perf.json"


def record(name: str, value: float) -> None:
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    figures[name] = round(value, 1)
    FIGURES.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print(f"{name}: {value:.1f}")


def test_a_page_of_ten_thousand_events_renders_and_responds_quickly(
    page, dashboard: Dashboard, errors: PageErrors
) -> None:
    started = time.perf_counter()
    page.goto(dashboard.run_url(dashboard.many_events.run, "limit=10000"))
    root = page.locator(".events-root")
    expect(root).to_have_attribute("data-rows", "10000", timeout=60_000)
    load_ms = (time.perf_counter() - started) * 1000
    render_ms = float(root.get_attribute("data-render-ms"))
    record("events_10000_rows_render_ms", render_ms)
    record("events_10000_rows_page_load_ms", load_ms)
    expect(root.locator("tbody tr")).to_have_count(10_000)
    expect(root.locator(".page-status")).to_have_text("1–10,000 of 10,000")
    assert render_ms < RENDER_BOUND_MS

    # Selecting a row in the big table answers at once: measured in the page
    # from the click to the next painted frame (Playwright's own click adds
    # its actionability checks, which are not what a user waits for).
    click_ms = page.evaluate(CLICK_TO_FRAME_MS, 9_999)
    expect(root.locator(".event-detail")).to_contain_text("event 2499")
    record("events_10000_rows_select_ms", click_ms)
    assert click_ms < INTERACTION_BOUND_MS
    root.locator("tbody tr").nth(5_000).click()
    expect(root.locator("tbody tr").nth(5_000)).to_have_attribute("aria-selected", "true")
    expect(root.locator("tr[aria-selected]")).to_have_count(1)

    # A filter re-renders the big page: the bound holds again.
    root.get_by_label("Rank").select_option("3")
    # (as long as the first page's wait: on a loaded CI machine the filtered
    # request once stayed in flight past 30 s; the render bound below is the test)
    expect(root).to_have_attribute("data-rows", "2500", timeout=60_000)
    record("events_2500_rows_filtered_render_ms", float(root.get_attribute("data-render-ms")))
    assert float(root.get_attribute("data-render-ms")) < RENDER_BOUND_MS


def test_a_run_of_256_ranks_renders_and_responds_quickly(page, dashboard: Dashboard) -> None:
    run = dashboard.wide
    started = time.perf_counter()
    page.goto(dashboard.run_url(run.run))
    expect(page.locator("main[data-render-ms]")).to_have_count(1, timeout=60_000)
    expect(page.locator("#flight canvas")).to_be_visible()
    load_ms = (time.perf_counter() - started) * 1000
    render_ms = float(page.locator("main").get_attribute("data-render-ms"))
    record("ranks_256_run_page_render_ms", render_ms)
    record("ranks_256_run_page_load_ms", load_ms)
    assert render_ms < RENDER_BOUND_MS
    expect(page.locator(".verdict-title")).to_contain_text(f"Rank {run.planted.rank} produced")
    expect(page.locator(".verdict .facts")).to_contain_text("every other rank received it")
    # Every rank is a line in each chart; the legend summarises instead of listing 256.
    loss = page.locator("figure.chart").first
    expect(loss.locator("path.line")).to_have_count(run.world_size)
    expect(loss.locator(".legend li")).to_have_count(2)
    expect(loss.locator(".legend")).to_contain_text("255 other ranks")
    # The strip has a row per rank: at least 2 CSS pixels each.
    height = page.locator("#ranks canvas").evaluate("c => c.getBoundingClientRect().height")
    assert height >= 2 * run.world_size

    # Hovering a chart with 256 lines shows its values at once.
    svg = loss.locator("svg")
    svg.scroll_into_view_if_needed()
    box = svg.bounding_box()
    started = time.perf_counter()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5)
    expect(page.locator("#tooltip")).to_contain_text(f"rank {run.planted.rank} (origin)")
    hover_ms = (time.perf_counter() - started) * 1000
    record("ranks_256_chart_hover_ms", hover_ms)
    assert hover_ms < INTERACTION_BOUND_MS

    # A click on a row of the strip lists that rank's events.
    strip = page.locator("#ranks canvas")
    strip.scroll_into_view_if_needed()
    box = strip.bounding_box()
    row_h = (box["height"] - 28) / run.world_size
    strip.click(position={"x": box["width"] * 0.5, "y": 6 + row_h * (run.planted.rank + 0.5)})
    events = page.locator("#events")
    expect(events.get_by_label("Rank")).to_have_value(str(run.planted.rank))
    expect(events.locator("tbody tr")).to_have_count(1)
    expect(events.locator("tr.origin-row")).to_be_visible()
    screenshot(page, "run-256-ranks-light")
