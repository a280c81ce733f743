"""The dashboard on a real job: a 2-rank DDP torchrun (gloo, CPU) with a planted
overflow reports to a real server; the pages show exactly what was planted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from nand.server import embedded
from nand.server.settings import Settings
from tests.e2e.jobs import TRAINER, agent_env, launch, settled_verdict, torchrun
from tests.web.conftest import screenshot
from tests.web.test_dashboard import DRAWN, NON_BLANK_PIXELS

pytestmark = pytest.mark.slow
TOKEN = "web-real-run"
RUN = "real-ddp-overflow"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded.EmbeddedServer]:
    tmp = tmp_path_factory.mktemp("real-run")
    settings = Settings(db_url=f"sqlite:///{tmp / 'nand.db'}", token=TOKEN, lost_after_s=3600)
    server = embedded.start(settings=settings)
    try:
        env = agent_env(server.zmq_endpoint, RUN, TOKEN)
        args = ["--steps", "20", "--step-time", "0.15", "--fault", "overflow:rank=1:step=14"]
        launch([*torchrun(2), *TRAINER, *args], env, tmp / "job.log").wait()
        settled_verdict(server.http_url, RUN, 2)
        yield server
    finally:
        server.stop()


def test_a_real_ddp_run_shows_its_planted_origin_heatmap_and_charts(page, real_run) -> None:
    page.goto(real_run.http_url)
    row = page.locator(f'tr[data-run="{RUN}"]')
    expect(row.locator(".badge")).to_have_text("diverged")

    page.goto(f"{real_run.http_url}/#/runs/{RUN}")
    title = page.locator(".verdict-title")
    expect(title).to_contain_text("Rank 1 produced")
    expect(title).to_contain_text("blocks.1.mlp.fc2 (Linear)")
    expect(title).to_contain_text("during forward at step 14")
    expect(page.locator(".verdict .hint")).to_contain_text("Overflow")
    heat = page.locator("#flight canvas")
    expect(heat).to_be_visible()
    assert heat.evaluate(NON_BLANK_PIXELS) > DRAWN
    assert page.locator("#ranks canvas").evaluate(NON_BLANK_PIXELS) > DRAWN
    loss = page.locator("figure.chart", has=page.locator("figcaption", has_text="Loss"))
    expect(loss.locator("path.line")).to_have_count(2)
    expect(page.locator("#events tbody tr").first).to_contain_text("blocks.1.mlp.fc2")
    screenshot(page, "run-real-ddp-light")
