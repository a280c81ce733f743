"""The dashboard shows what the replay of the bad step found: the aten op,
the line, reproduced or not (a real watch, a real server, a real browser)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from playwright.sync_api import expect

import nand
from nand.server import embedded
from nand.server.settings import Settings
from tests.agent.test_rerun import Log, line_of, model_with, train

RUN = "replayed-log"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded.EmbeddedServer]:
    tmp = tmp_path_factory.mktemp("replay")
    server = embedded.start(settings=Settings(db_url=f"sqlite:///{tmp / 'nand.db'}"))
    try:
        model = model_with(Log())
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with nand.watch(model, opt, on_nonfinite="skip", server=server.zmq_endpoint, run=RUN):
            train(model, opt, 3, zero_row_at=1)
        yield server
    finally:
        server.stop()


def test_the_verdict_and_the_event_details_name_the_op_and_the_line(page, replayed) -> None:
    line = line_of(Log.forward, "torch.log")
    page.goto(f"{replayed.http_url}/#/runs/{RUN}")
    made_by = page.locator(".verdict .fact", has=page.locator("dt", has_text="Made by"))
    expect(made_by).to_contain_text(f"aten::log at {line}")
    expect(made_by).to_contain_text("reproduced by the replay")
    page.locator("#events tbody tr").first.click()
    detail = page.locator(".event-detail")
    expect(detail).to_contain_text(f"aten::log at {line}")
    expect(detail).to_contain_text("reproduced by the replay")
