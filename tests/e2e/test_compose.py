"""docker-compose.yml's commands, run here for real (there is no Docker engine
in CI): the server on PostgreSQL with the compose flags, its healthcheck, and
the demo trainer reporting to it. Only the published ports and the database
host differ from the file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nand.testing import free_port
from tests.e2e.conftest import TOKEN
from tests.e2e.jobs import api, settled_verdict
from tests.server.conftest import postgres  # noqa: F401  (the session's PostgreSQL fixture)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # where `nand` is installed


def compose_service(name: str) -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"][name]


def with_ports(words: list[str], ports: dict[str, int]) -> list[str]:
    out = []
    for word in words:
        for published, free in ports.items():
            word = word.replace(f":{published}", f":{free}")
        out.append(word)
    return out


def wait_healthy(check: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(check, capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, "the compose healthcheck never passed"
        time.sleep(0.5)


def test_compose_server_and_demo_trainer_find_the_planted_fault(postgres, tmp_path):  # noqa: F811
    server, trainer = compose_service("server"), compose_service("trainer")
    ports = {"8080": free_port(), "5557": free_port()}
    with postgres.database() as db_url:
        env = dict(os.environ, NAND_DB=db_url, NAND_TOKEN=TOKEN)
        env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
        command = with_ports(server["command"], ports)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            health = with_ports(server["healthcheck"]["test"][1:], ports)
            wait_healthy([sys.executable if w == "python" else w for w in health])
            trainer_env = dict(env, **trainer["environment"])
            trainer_env["NAND_SERVER"] = f"tcp://127.0.0.1:{ports['5557']}"
            trainer_env["NAND_TOKEN"] = TOKEN
            words = [sys.executable if w == "python" else w for w in trainer["command"]]
            subprocess.run(words, env=trainer_env, capture_output=True, timeout=240)
            base = f"http://127.0.0.1:{ports['8080']}"
            verdict = settled_verdict(base, trainer["environment"]["NAND_RUN"], 2)
            origin = verdict["origin"]
            assert (origin["rank"], origin["module"], origin["step"], origin["phase"]) == (
                1,
                "blocks.1.mlp.fc2",
                40,
                "forward",
            ), verdict["summary"]
            assert api(base, "compose-demo", "/ranks")["items"][0]["relation"] == "received"
        finally:
            proc.terminate()
            proc.wait(10)
