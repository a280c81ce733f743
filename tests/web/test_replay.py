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
from tests.agent import test_loss
from tests.agent.test_rerun import Log, line_of, model_with, train

RUN = "replayed-log"
LOSS_RUN = "replayed-loss"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded.EmbeddedServer]:
    tmp = tmp_path_factory.mktemp("replay")
    server = embedded.start(settings=Settings(db_url=f"sqlite:///{tmp / 'nand.db'}"))
    try:
        model = model_with(Log())
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with nand.watch(model, opt, on_nonfinite="skip", server=server.zmq_endpoint, run=RUN):
            train(model, opt, 3, zero_row_at=1)
        test_loss.train("bce", "light", server=server.zmq_endpoint, run=LOSS_RUN)
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


def test_a_loss_event_says_to_look_at_the_loss_computation_not_a_layer(page, replayed) -> None:
    """A hand-written BCE in the user's loop goes NaN (``test_loss``): the
    dashboard names the loss's op and line, and points at the loss computation."""
    line = test_loss.line_of(test_loss.hand_written_bce, "(1 - y) * torch.log(1 - p)")
    page.goto(f"{replayed.http_url}/#/runs/{LOSS_RUN}")
    made_by = page.locator(".verdict .fact", has=page.locator("dt", has_text="Made by"))
    expect(made_by).to_contain_text(f"at {line}")
    expect(made_by).to_contain_text(
        "reproduced by the replay: look at the batch, the loss computation"
    )
    expect(made_by).not_to_contain_text("the layer")
