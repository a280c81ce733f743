"""A replica mismatch and the hosts page, in real Chromium against a real server
(issue 18): shown like a divergence (which rank, since when, which
parameters), its badge in the runs list. Screenshot: artifacts/screenshots/."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.server.agents import FakeAgent
from tests.web.conftest import TOKEN, Dashboard, screenshot

pytestmark = pytest.mark.slow

NAMES = ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "head.weight"]


def mismatched_run(endpoint: str, run: str) -> None:
    agents = [FakeAgent(endpoint, run=run, rank=r, world_size=4) for r in range(4)]
    for agent in agents:
        agent.hello(token=TOKEN)
        agent.heartbeat(400, steps_per_s=2.0, loss=1.5)
    for step in (200, 300, 400):
        for agent in agents:
            values = [5, 6, 7] if agent.rank != 3 or step < 300 else [5, 9, 7]
            agent.send("fingerprint", {"step": step, "names": NAMES, "values": values})
    for agent in agents:
        agent.wait_acked()
        agent.close()


def test_a_mismatch_names_the_rank_the_bracket_and_the_parameter(page, dashboard: Dashboard):
    mismatched_run(dashboard.server.zmq_endpoint, "silent-corruption")
    page.goto(dashboard.run_url("silent-corruption"))
    title = page.locator(".verdict-title")
    expect(title).to_contain_text("Replica mismatch")
    expect(title).to_contain_text("Rank 3's parameters differ")
    expect(title).to_contain_text("between steps 200 and 300")
    expect(title).to_contain_text("blocks.0.attn.qkv.bias")
    expect(page.locator(".verdict .summary")).to_contain_text("suspect its GPU or host")
    expect(page.locator(".verdict-replica_mismatch")).to_be_visible()
    screenshot(page, "replica-mismatch")
    page.goto(dashboard.url)
    row = page.locator('tr[data-run="silent-corruption"]')
    expect(row.locator(".badge-replica_mismatch")).to_be_visible()


def test_the_hosts_page_counts_the_odd_replicas_host(page, dashboard: Dashboard):
    mismatched_run(dashboard.server.zmq_endpoint, "silent-corruption-2")
    page.goto(f"{dashboard.url}#/hosts")
    odd = page.locator('table.hosts tr[data-host="host-3"]')  # FakeAgent: rank r on host-r
    expect(odd.locator("td").nth(1)).to_have_text("2")  # mismatches: the two runs here
    expect(odd).to_have_class("row-diverged")
    clean = page.locator('table.hosts tr[data-host="host-0"]')
    expect(clean.locator("td").nth(1)).to_have_text("0")
    expect(page.locator('.topbar nav a[href="#/hosts"]')).to_have_attribute("aria-current", "page")
    screenshot(page, "hosts")
