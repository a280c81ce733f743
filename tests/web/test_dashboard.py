"""The dashboard in a real Chromium against a real server fed by wire messages.

python -m pytest tests/web -q
"""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.sync_api import expect

from tests.web import scenario
from tests.web.conftest import Dashboard, PageErrors, screenshot

pytestmark = pytest.mark.slow

# A canvas counts as drawn when this many of its pixels are not transparent.
DRAWN = 1000

NON_BLANK_PIXELS = """canvas => {
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let n = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i]) n++;
  return n;
}"""


def open_run(page, dashboard: Dashboard, run: str, query: str = "") -> None:
    page.goto(dashboard.run_url(run, query))
    expect(page.locator(".verdict")).to_be_visible()


def test_runs_page_lists_the_diverged_run_with_its_origin_and_makes_it_stand_out(
    page, dashboard: Dashboard
) -> None:
    planted = dashboard.diverged.planted
    page.goto(dashboard.url)
    row = page.locator(f'tr[data-run="{planted.run}"]')
    expect(row).to_be_visible()
    expect(row.locator(".badge")).to_have_text("diverged")
    expect(row).to_have_class(re.compile(r"\brow-diverged\b"))
    expect(row.locator(".origin-cell")).to_contain_text(planted.module)
    expect(row.locator(".origin-cell")).to_contain_text(f"rank {planted.rank}")
    expect(row.locator(".origin-cell")).to_contain_text(f"step {planted.step}")
    healthy = page.locator(f'tr[data-run="{dashboard.healthy.run}"]')
    expect(healthy.locator(".badge")).to_have_text("healthy")
    # Default order puts diverged runs before healthy ones.
    runs = page.locator("tbody tr").evaluate_all("rows => rows.map(r => r.dataset.run)")
    assert runs.index(planted.run) < runs.index(dashboard.healthy.run)


def test_runs_page_filters_by_state_and_text_and_sorts_and_keeps_them_in_the_url(
    page, dashboard: Dashboard
) -> None:
    # Other tests add runs to the shared server: compare with what it says now.
    runs = httpx.get(f"{dashboard.url}/api/runs").json()
    healthy = sorted(r["run"] for r in runs if r["state"] == "healthy")
    fc2 = [r["run"] for r in runs if r["origin"] and "mlp.fc2" in r["origin"]["module"]]
    page.goto(dashboard.url)
    rows = page.locator("tbody tr")
    expect(rows).to_have_count(len(runs))
    page.get_by_label("Show runs in state").select_option("healthy")
    expect(rows).to_have_count(len(healthy))
    assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.run)")) == healthy
    assert "state=healthy" in page.url
    page.get_by_label("Show runs in state").select_option("")
    # The counts line has a chip per state that toggles the same filter.
    counts = page.locator(".counts")
    expect(counts).to_contain_text(f"{len(runs)} runs")
    counts.get_by_role("button", name=f"{len(healthy)} healthy").click()
    expect(rows).to_have_count(len(healthy))
    expect(page.get_by_label("Show runs in state")).to_have_value("healthy")
    counts.get_by_role("button", name=f"{len(healthy)} healthy").click()
    expect(rows).to_have_count(len(runs))
    assert "object" not in counts.inner_text()
    page.get_by_label("Filter runs by id or module").fill("mlp.fc2")
    expect(rows).to_have_count(len(fc2))
    page.reload()  # the filter is part of the address
    expect(rows).to_have_count(len(fc2))
    expect(page.get_by_label("Filter runs by id or module")).to_have_value("mlp.fc2")
    page.get_by_label("Filter runs by id or module").fill("")
    page.get_by_role("button", name="Ranks").click()
    expect(page.locator('th[aria-sort="ascending"]')).to_contain_text("Ranks")
    ranks = page.locator("tbody tr td:nth-child(3)").all_inner_texts()
    assert ranks == sorted(ranks, key=lambda t: int(t.replace(",", "")))
    page.get_by_role("button", name="Ranks").click()
    expect(page.locator('th[aria-sort="descending"]')).to_contain_text("Ranks")
    ranks = page.locator("tbody tr td:nth-child(3)").all_inner_texts()
    assert ranks == sorted(ranks, key=lambda t: -int(t.replace(",", "")))


def test_verdict_card_names_the_planted_rank_layer_step_and_phase(
    page, dashboard: Dashboard
) -> None:
    planted = dashboard.diverged.planted
    open_run(page, dashboard, planted.run)
    title = page.locator(".verdict-title")
    expect(title).to_contain_text(f"Rank {planted.rank} produced")
    expect(title).to_contain_text(f"{planted.module} ({planted.module_type})")
    expect(title).to_contain_text(f"during {planted.phase} at step {planted.step}")
    facts = page.locator(".verdict .facts")
    expect(facts.locator(".fact", has_text="Origin rank")).to_contain_text(str(planted.rank))
    expect(facts.locator(".fact", has_text="Step")).to_contain_text(str(planted.step))
    expect(facts.locator(".fact", has_text="Other ranks")).to_contain_text(
        "every other rank received it through a collective"
    )
    # The server's own sentence is shown as it is, and the hint is explained.
    verdict = httpx.get(f"{dashboard.url}/api/runs/{planted.run}/verdict").json()
    expect(page.locator(".verdict .summary")).to_have_text(verdict["summary"])
    expect(page.locator(".verdict .hint")).to_contain_text("Likely cause: Overflow")


def test_health_strip_heatmap_and_charts_are_drawn(page, dashboard: Dashboard) -> None:
    run = dashboard.diverged
    open_run(page, dashboard, run.run)
    strip = page.locator("#ranks canvas")
    heat = page.locator("#flight canvas")
    expect(heat).to_be_visible()
    assert strip.evaluate(NON_BLANK_PIXELS) > DRAWN
    assert heat.evaluate(NON_BLANK_PIXELS) > DRAWN
    # The flight recorder is the origin rank's, and the dtype limit is marked.
    expect(page.get_by_label("Flight recorder of rank")).to_have_value(str(run.planted.rank))
    expect(page.locator(".limit-label")).to_contain_text("float16 limit 65,504")
    expect(page.locator(".closest")).to_contain_text(run.planted.module)
    # One line per rank in every chart that has values, with axes and a legend.
    for name in ("Loss", "Gradient norm", "Steps per second", "Largest activation |x|"):
        chart = page.locator("figure.chart", has=page.locator("figcaption", has_text=name))
        lines = chart.locator("path.line")
        expect(lines).to_have_count(run.world_size)
        paths = lines.evaluate_all("ps => ps.map(p => p.getAttribute('d'))")
        assert all(len(d) > 20 for d in paths)
        assert chart.locator(".axis text").count() >= 4
        expect(chart.locator(".legend li:not(.legend-note)")).to_have_count(run.world_size)
    # Hovering a chart shows the values under the cursor.
    loss = page.locator("figure.chart svg").first
    loss.scroll_into_view_if_needed()
    box = loss.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    expect(page.locator("#tooltip")).to_be_visible()
    expect(page.locator("#tooltip")).to_contain_text("rank 5 (origin)")


def test_event_table_filters_by_rank_phase_and_module_and_keeps_them_in_the_url(
    page, dashboard: Dashboard
) -> None:
    run = dashboard.diverged
    open_run(page, dashboard, run.run)
    table = page.locator("#events")
    expect(table.locator("tbody tr")).to_have_count(run.world_size)
    expect(table.locator("tr.origin-row")).to_contain_text("produced")
    table.get_by_label("Rank").select_option(str(run.planted.rank))
    expect(table.locator("tbody tr")).to_have_count(1)
    table.get_by_label("Rank").select_option("")
    table.get_by_label("Phase").select_option("grad")
    expect(table.locator("tbody tr")).to_have_count(run.world_size - 1)
    table.get_by_label("Module or parameter name").fill("no.such.module")
    expect(table.locator(".state-msg")).to_contain_text("No event matches these filters.")
    assert "phase=grad" in page.url and "module=no.such.module" in page.url
    # The filtered view is a shareable link.
    page.goto(dashboard.run_url(run.run, "phase=grad"))
    expect(page.locator("#events tbody tr")).to_have_count(run.world_size - 1)
    expect(page.locator("#events").get_by_label("Phase")).to_have_value("grad")


def test_event_table_paginates_and_shows_text_from_events_as_text(
    page, dashboard: Dashboard, errors: PageErrors
) -> None:
    run = dashboard.many_events
    open_run(page, dashboard, run.run)
    expect(page.locator("#flight .state-msg")).to_contain_text("No flight-recorder window")
    table = page.locator("#events")
    expect(table.locator(".page-status")).to_have_text("1–50 of 10,000")
    table.get_by_role("button", name="Next →").click()
    expect(table.locator(".page-status")).to_have_text("51–100 of 10,000")
    table.locator("tbody tr").first.click()
    detail = table.locator(".event-detail")
    expect(detail).to_contain_text("<b>not bold</b>")
    assert table.locator("b").count() == 0  # the markup stayed text


def test_live_stream_adds_a_new_run_without_a_reload(page, dashboard: Dashboard) -> None:
    page.goto(dashboard.url)
    expect(page.locator("#live")).to_have_text("live")
    expect(page.locator("tbody tr").first).to_be_visible()
    page.evaluate("window.__notReloaded = true")
    late = scenario.diverged_run(run="late-arrival", world_size=2, origin_rank=1, bad_step=6)
    scenario.replay(dashboard.server.zmq_endpoint, late, token=dashboard.token)
    row = page.locator('tr[data-run="late-arrival"]')
    expect(row).to_be_visible()
    expect(row.locator(".badge")).to_have_text("diverged")
    assert page.evaluate("window.__notReloaded") is True


def test_an_open_run_page_shows_the_incident_when_it_arrives(page, dashboard: Dashboard) -> None:
    run = scenario.diverged_run(run="goes-bad-live", world_size=2, origin_rank=0, bad_step=8)
    before, after = scenario.split_before_first_event(run)
    scenario.replay(dashboard.server.zmq_endpoint, before, token=dashboard.token)
    open_run(page, dashboard, run.run)
    expect(page.locator(".verdict-title")).to_contain_text("All finite so far")
    page.evaluate("window.__notReloaded = true")
    scenario.replay(dashboard.server.zmq_endpoint, after, token=dashboard.token)
    expect(page.locator(".verdict-title")).to_contain_text("Rank 0 produced")
    expect(page.locator(".run-head .badge")).to_have_text("diverged")
    expect(page.locator("#flight canvas")).to_be_visible()
    # Under the red verdict the table shows the events without a click.
    expect(page.locator("#events tbody tr")).to_have_count(2)
    expect(page.get_by_text("No non-finite value has been seen")).to_have_count(0)
    assert page.evaluate("window.__notReloaded") is True


def test_an_incident_s_events_arriving_apart_all_show_without_a_click(
    page, dashboard: Dashboard
) -> None:
    # The ranks' events of one incident reach the server over a second or two:
    # the page's first refresh may see only the first. The second must still
    # show without a click (before: a "new events arrived" button, because the
    # table had a row already, though its page had room for every event).
    run = scenario.diverged_run(run="bad-in-turns", world_size=2, origin_rank=0, bad_step=8)
    before, after = scenario.split_before_first_event(run)
    event_times = {
        agent: min(m["time"] for m in messages if m["kind"] == "event")
        for agent, messages in after.messages.items()
        if any(m["kind"] == "event" for m in messages)
    }
    first_agent = min(event_times, key=event_times.__getitem__)  # the origin's agent
    first = scenario.Scenario(run.run, run.world_size, planted=run.planted)
    rest = scenario.Scenario(run.run, run.world_size, planted=run.planted)
    for agent, messages in after.messages.items():
        (first if agent == first_agent else rest).messages[agent] = messages
    scenario.replay(dashboard.server.zmq_endpoint, before, token=dashboard.token)
    open_run(page, dashboard, run.run)
    expect(page.locator(".verdict-title")).to_contain_text("All finite so far")
    scenario.replay(dashboard.server.zmq_endpoint, first, token=dashboard.token)
    rows = page.locator("#events tbody tr")
    expect(rows).to_have_count(1)
    scenario.replay(dashboard.server.zmq_endpoint, rest, token=dashboard.token)
    expect(rows).to_have_count(2)
    expect(page.get_by_role("button", name="New events arrived: show them")).to_be_hidden()


def test_stop_asks_for_the_token_confirms_and_shows_the_agreed_step(
    page, dashboard: Dashboard, errors: PageErrors
) -> None:
    errors.allowed.append("status of 401")  # the wrong token, on purpose
    run = dashboard.wide  # a run no other test stops
    open_run(page, dashboard, run.run)
    page.get_by_role("button", name="Stop run…").click()
    dialog = page.locator("dialog.stop-dialog")
    expect(dialog).to_be_visible()
    expect(dialog.get_by_label("Token")).to_be_focused()
    dialog.get_by_label("Token").fill("wrong")
    dialog.get_by_role("button", name="Stop the run").click()
    dialog.get_by_role("button", name=f"Yes, stop {run.run}").click()
    expect(dialog.locator(".form-error")).to_contain_text("refused this token")
    screenshot(page, "stop-refused-light", full_page=False)
    dialog.get_by_label("Token").fill(dashboard.token)
    dialog.get_by_label("Reason").fill("diverged; see nand")
    dialog.get_by_role("button", name="Stop the run").click()
    dialog.get_by_role("button", name=f"Yes, stop {run.run}").click()
    expect(dialog.locator(".agreed")).to_be_visible()
    screenshot(page, "stop-agreed-light", full_page=False)
    verdict = httpx.get(f"{dashboard.url}/api/runs/{run.run}/verdict").json()
    step = verdict["stop"]["step"]
    expect(dialog.locator(".agreed-step")).to_have_text(f"{step:,}")
    dialog.get_by_role("button", name="Close").click()
    expect(page.locator(".stop-note")).to_contain_text(f"every rank stops at step {step:,}")


def test_a_live_update_does_not_close_the_stop_dialog(page, dashboard: Dashboard) -> None:
    run = scenario.diverged_run(run="typing-a-token", world_size=2, origin_rank=1, bad_step=6)
    before, after = scenario.split_before_first_event(run)
    scenario.replay(dashboard.server.zmq_endpoint, before, token=dashboard.token)
    open_run(page, dashboard, run.run)
    page.get_by_role("button", name="Stop run…").click()
    dialog = page.locator("dialog.stop-dialog")
    dialog.get_by_label("Token").fill("half-typed")
    scenario.replay(dashboard.server.zmq_endpoint, after, token=dashboard.token)
    expect(page.locator(".run-head .badge")).to_have_text("diverged")
    expect(dialog).to_be_visible()
    expect(dialog.get_by_label("Token")).to_have_value("half-typed")


def test_an_empty_server_says_how_to_send_it_a_run(page, dark_page, empty_server) -> None:
    for theme, p in (("light", page), ("dark", dark_page)):
        p.goto(empty_server.http_url)
        expect(p.locator(".state-msg")).to_contain_text("No runs yet.")
        expect(p.locator(".state-msg")).to_contain_text("NAND_SERVER=tcp://")
        screenshot(p, f"runs-empty-{theme}")


def test_unreachable_api_and_unknown_run_say_what_to_do(
    page, dashboard: Dashboard, errors: PageErrors
) -> None:
    errors.allowed += ["net::ERR_FAILED", "status of 404"]
    page.goto(dashboard.run_url("no-such-run"))
    expect(page.locator(".state-msg")).to_contain_text("There is no run called “no-such-run”")
    page.route("**/api/runs", lambda route: route.abort())
    page.goto(dashboard.url)
    page.reload()
    expect(page.locator(".state-error")).to_contain_text("Could not load the runs.")
    expect(page.get_by_role("button", name="Try again")).to_be_visible()
    page.unroute("**/api/runs")
    page.get_by_role("button", name="Try again").click()
    expect(page.locator("tbody tr").first).to_be_visible()


def test_keyboard_reaches_a_run_and_the_event_rows(page, dashboard: Dashboard) -> None:
    run = dashboard.diverged.run
    page.goto(dashboard.url)
    expect(page.locator("tbody tr").first).to_be_visible()
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.textContent") == run:
            break
    else:
        pytest.fail("Tab never reached the run's link")
    page.keyboard.press("Enter")
    expect(page.locator(".verdict")).to_be_visible()
    # The event table is one Tab stop; the arrow keys move between its rows.
    rows = page.locator("#events tbody tr")
    expect(rows.first).to_have_attribute("tabindex", "0")
    expect(page.locator('#events tbody tr[tabindex="0"]')).to_have_count(1)
    rows.first.focus()
    page.keyboard.press("ArrowDown")
    expect(rows.nth(1)).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator(".event-detail")).to_contain_text("rank 0")
    page.keyboard.press("Tab")  # leaves the table for the pager, not the next row
    assert page.evaluate("document.activeElement.closest('tbody') === null")


def test_path_links_open_the_same_run_page(page, dashboard: Dashboard) -> None:
    run = dashboard.diverged.run
    page.goto(f"{dashboard.url}/runs/{run}")
    expect(page.locator(".run-id")).to_have_text(run)
    assert page.url.endswith(f"/#/runs/{run}")


def test_screenshots_of_every_page_in_light_and_dark(page, dark_page, dashboard: Dashboard) -> None:
    for theme, p in (("light", page), ("dark", dark_page)):
        p.goto(dashboard.url)
        expect(p.locator("tbody tr").first).to_be_visible()
        screenshot(p, f"runs-{theme}")
        open_run(p, dashboard, dashboard.diverged.run)
        expect(p.locator("#flight canvas")).to_be_visible()
        p.locator("#events tr.origin-row").click()
        screenshot(p, f"run-diverged-{theme}")
        open_run(p, dashboard, dashboard.healthy.run)
        screenshot(p, f"run-healthy-{theme}")
    # The two themes really differ: the dark page background is dark.
    background = dark_page.evaluate("getComputedStyle(document.body).backgroundColor")
    channels = [int(c) for c in background[background.index("(") + 1 : -1].split(",")[:3]]
    assert sum(channels) < 3 * 60, background


def _launched(run: scenario.Scenario, launch: str) -> scenario.Scenario:
    """The scenario's hellos carrying a launch identity (NAND_LAUNCH)."""
    for messages in run.messages.values():
        for i, message in enumerate(messages):
            if message["kind"] == "hello":
                messages[i] = {**message, "body": {**message["body"], "launch": launch}}
    return run


def test_a_rerun_under_the_same_id_shows_its_live_attempt(page, dashboard: Dashboard) -> None:
    name = "reapplied-job"
    first = scenario.diverged_run(run=name, world_size=2, origin_rank=1, bad_step=6)
    scenario.replay(dashboard.server.zmq_endpoint, _launched(first, "uid-1"), token=dashboard.token)
    second = scenario.healthy_run(run=name, world_size=2, steps=20)
    scenario.replay(
        dashboard.server.zmq_endpoint, _launched(second, "uid-2"), token=dashboard.token
    )
    open_run(page, dashboard, name)
    expect(page.locator(".meta")).to_contain_text("attempt 2 of 2")
    expect(page.locator(".run-head .badge")).not_to_have_text("diverged")
    expect(page.locator(".verdict-title")).not_to_contain_text("produced")
