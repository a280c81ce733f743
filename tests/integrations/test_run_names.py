"""A framework's own run naming reaches the server: Lightning's default logger
(``lightning_logs/0``) and the HF ``Trainer``'s ``run_name``/``output_dir`` are
made run ids the server accepts (``/`` → ``-``), and every name a framework
could give becomes an id the server stores and answers for.

The runs are real: a Lightning ``Trainer`` with its default logger, an HF
``Trainer``, each with ``NandCallback(server=...)`` and nothing else, against a
real ``nand server`` process; the data carries a NaN in one planted batch, so
the first event (the input at that step) is known without nand.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from nand.config import AgentConfig
from nand.integrations import with_run
from nand.runids import run_problem
from nand.server import embedded
from nand.testing import free_port
from tests.integrations.named_runs import (
    NAN_AT,
    STEPS,
    batches,
    fit_lightning_with_its_default_logger,
)
from tests.server.agents import FakeAgent
from tests.server.processes import ServerProcess

LAUNCHER_VARS = ("NAND_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "NAND_SERVER")


@pytest.fixture(autouse=True)
def _no_run_id_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the framework names the run here, as for a user without a launcher."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("run-names") / "nand.db"
    process = ServerProcess(f"sqlite:///{db}", free_port(), module="nand").start()
    yield process
    process.stop()


def stored_events(server: ServerProcess, run: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The run's events once the server has them (``[]`` if the run never arrived)."""
    url = f"{server.http_url}/api/runs/{urllib.parse.quote(run, safe='')}/events"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(url)
        if response.status_code == 200 and response.json()["items"]:
            return response.json()["items"]
        time.sleep(0.2)
    return []


def assert_planted_nan_stored(server: ServerProcess, run: str) -> None:
    runs = [r["run"] for r in httpx.get(f"{server.http_url}/api/runs").json()]
    assert run in runs, runs
    first = stored_events(server, run)[0]
    assert (first["phase"], first["step"], first["cause"]) == ("input", NAN_AT, "data"), first


# --- Lightning's default logger -------------------------------------------------


def test_lightning_with_its_default_logger_is_stored_as_lightning_logs_0(server, tmp_path):
    pytest.importorskip("lightning")
    run = fit_lightning_with_its_default_logger(tmp_path, server=server.zmq_endpoint)
    assert_planted_nan_stored(server, "lightning_logs-0")
    assert run == "lightning_logs-0"


# --- HF Trainer ---------------------------------------------------------------


def train_hf(output_dir: str, **training_args: Any) -> str | None:
    """An HF ``Trainer`` with ``NandCallback()`` (the server from ``NAND_SERVER``)."""
    from transformers import Trainer, TrainingArguments

    from nand.integrations.transformers import NandCallback

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.fc(x), y)}

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        **training_args,
    )
    callback = NandCallback()
    model = Regression()
    data = [{"x": x, "y": y} for x, y in batches()]
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=lambda items: items[0],
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
        callbacks=[callback],
    )
    trainer.train()
    return callback.watch.first.run if callback.watch and callback.watch.first else None


def test_an_hf_run_name_with_a_slash_is_stored_with_a_dash(server, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("NAND_SERVER", server.zmq_endpoint)
    run = train_hf(str(tmp_path / "out"), run_name="sweep-7/lr=0.1")
    assert_planted_nan_stored(server, "sweep-7-lr=0.1")
    assert run == "sweep-7-lr=0.1"


def test_an_hf_output_dir_of_dot_names_the_run_after_the_working_directory(
    server, tmp_path, monkeypatch
):
    pytest.importorskip("transformers")
    monkeypatch.setenv("NAND_SERVER", server.zmq_endpoint)
    workdir = tmp_path / "exp-dot"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    run = train_hf(".")
    assert_planted_nan_stored(server, "exp-dot")
    assert run == "exp-dot"


# --- any name a framework could give -------------------------------------------

#: Names as frameworks and launchers make them: paths, versions, sweeps, and
#: anything else text can hold (surrogates: an environment variable of bytes
#: that are not UTF-8).
FRAMEWORK_NAMES = st.one_of(
    st.lists(st.sampled_from(["lightning_logs", "version_3", ".", "..", "", "é", "a b"])).map(
        "/".join
    ),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=300),
)


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded.EmbeddedServer]:
    db = tmp_path_factory.mktemp("any-name") / "nand.db"
    started = embedded.start(f"sqlite:///{db}")
    yield started
    started.stop()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=FRAMEWORK_NAMES)
def test_whatever_run_id_a_framework_name_becomes_the_server_stores_and_answers(
    embedded_server, name: str
) -> None:
    options = with_run({}, name)
    if "run" not in options:  # nothing of the name could name a run: nand makes one up
        return
    run = options["run"]
    assert run_problem(run) is None
    assert AgentConfig.resolve(run=run).run == run  # the agent takes it as it is
    agent = FakeAgent(embedded_server.zmq_endpoint, run=run)
    try:
        agent.hello()
        agent.heartbeat(1)
        agent.wait_acked()
        path = urllib.parse.quote(run, safe="")
        verdict = httpx.get(f"{embedded_server.http_url}/api/runs/{path}/verdict")
        assert verdict.status_code == 200, verdict.text
        assert verdict.json()["run"] == run
    finally:
        agent.close()
