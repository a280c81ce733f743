"""The dashboard shows a run named by its framework: a real Lightning ``Trainer``
with its default logger and ``NandCallback(server=...)`` only, a real ``nand
server`` process, Chromium. The run is listed as ``lightning_logs-0`` (the
logger's ``lightning_logs/0``, each ``/`` made ``-``) and its page shows the
NaN planted in the input of step 2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from nand.testing import free_port
from tests.integrations.named_runs import NAN_AT, fit_lightning_with_its_default_logger
from tests.server.processes import ServerProcess

pytestmark = pytest.mark.slow
RUN = "lightning_logs-0"


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    pytest.importorskip("lightning")
    tmp = tmp_path_factory.mktemp("lightning-default-logger")
    server = ServerProcess(f"sqlite:///{tmp / 'nand.db'}", free_port(), module="nand").start()
    try:
        fit_lightning_with_its_default_logger(tmp, server=server.zmq_endpoint)
        yield server
    finally:
        server.stop()


def test_a_lightning_run_with_its_default_logger_is_listed_and_shows_its_nan(
    page, lightning_run
) -> None:
    page.goto(lightning_run.http_url)
    expect(page.locator(f'tr[data-run="{RUN}"] .badge')).to_have_text("diverged")

    page.goto(f"{lightning_run.http_url}/#/runs/{RUN}")
    expect(page.locator(".verdict-title")).to_contain_text(f"step {NAN_AT}")
    first = page.locator("#events tbody tr").first
    expect(first).to_contain_text("input")
