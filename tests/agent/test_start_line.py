"""Rank 0 says once, at start, which run it watches and where it reports."""

from __future__ import annotations

import torch

import nand
from nand.agent.identity import Identity
from nand.agent.output.session import Session
from nand.config import AgentConfig
from tests.agent.models import mlp, train


def test_rank_0_prints_one_start_line_and_nothing_more_on_a_healthy_run(capsys, monkeypatch):
    monkeypatch.delenv("NAND_SERVER", raising=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt, run="healthy-run"):
        train(model, opt, 5)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "nand: watching run healthy-run (1 process, on_nonfinite=warn); no server (log only)"
    ]


def test_other_ranks_and_quiet_watches_print_nothing(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = mlp()
    with nand.watch(model, run="r"):
        model(torch.randn(4, 8))
    monkeypatch.setenv("RANK", "0")
    with nand.watch(model, run="r", log_events=False):
        model(torch.randn(4, 8))
    assert capsys.readouterr().err == ""


def test_with_a_server_and_its_url_the_line_links_the_run_page():
    who = Identity(run="job#7", rank=0, local_rank=0, world_size=4, host="h", pid=1)
    settings = AgentConfig(server="tcp://head:5557", url="http://head:8080/", run="job#7")
    line = Session(who, [], settings).start_line("stop")
    assert line == (
        "nand: watching run job#7 (4 ranks, on_nonfinite=stop); server tcp://head:5557; "
        "dashboard http://head:8080/#/runs/job%237"
    )
