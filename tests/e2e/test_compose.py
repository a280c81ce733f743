"""docker-compose.yml's commands, run here for real (there is no Docker engine
in CI): the server on PostgreSQL with the compose flags, its healthcheck, and
the demo trainer reporting to it; the ``monitoring`` profile's Prometheus and
Alertmanager (Debian's binaries) with their mounted files. Only the published
ports, the database host and the other services' names differ from the file.
Grafana has no Debian package: its provisioning and dashboard are checked
against what Prometheus answers for each panel's query."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from nand.testing import free_port
from tests.e2e import monitoring
from tests.e2e.conftest import TOKEN
from tests.e2e.jobs import api, settled_verdict
from tests.server.agents import FakeAgent
from tests.server.conftest import postgres  # noqa: F401  (the session's PostgreSQL fixture)
from tests.server.helpers import eventually

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


def test_compose_monitoring_profile_scrapes_the_server_and_every_rule_and_panel_works(
    postgres,  # noqa: F811
    tmp_path,
):
    """Prometheus and Alertmanager from the profile's commands and mounted files,
    the nand server from its own: every target up, every rule evaluated without
    error, Alertmanager found, every dashboard query answered with data, every
    metric a rule or a panel names exported by the server, and the Grafana
    provisioning pointing at the dashboard and the datasource it uses."""
    compose = monitoring.services()
    for name in ("prometheus", "alertmanager", "grafana"):
        assert compose[name]["profiles"] == ["monitoring"]
        for host_path in monitoring.mounts(compose[name]).values():
            assert host_path.exists(), f"{name} mounts {host_path}, which is missing"
    ports = {"8080": free_port(), "5557": free_port()}
    prom, alerts = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with postgres.database() as db_url, _compose_server(db_url, ports) as base:
        _fill(base, ports["5557"])
        am_paths = monitoring.mounts(compose["alertmanager"])
        am_flags = {"--web.listen-address": alerts, "--storage.path": str(tmp_path / "am")}
        am_log, prom_log = tmp_path / "alertmanager.log", tmp_path / "prometheus.log"
        am = monitoring.start(monitoring.command("alertmanager", am_flags, am_paths), am_log)
        paths = monitoring.mounts(compose["prometheus"])
        config = monitoring.prometheus_config(
            {"server:8080": f"127.0.0.1:{ports['8080']}", "alertmanager:9093": alerts},
            paths,
            tmp_path,
        )
        paths["/etc/prometheus/prometheus.yml"] = config
        flags = {"--web.listen-address": prom, "--storage.tsdb.path": str(tmp_path / "tsdb")}
        server = monitoring.start(monitoring.command("prometheus", flags, paths), prom_log)
        try:
            monitoring.wait_ready(f"http://{alerts}", am, am_log)
            monitoring.wait_ready(f"http://{prom}", server, prom_log)
            _check_prometheus(f"http://{prom}", base)
        finally:
            for proc in (server, am):
                proc.terminate()
                proc.wait(10)
    _check_grafana(compose["grafana"])


@contextlib.contextmanager
def _compose_server(db_url: str, ports: dict[str, int]) -> Iterator[str]:
    """The compose server (its command and its plain environment) on ``db_url``."""
    server = compose_service("server")
    plain = {k: v for k, v in server["environment"].items() if "${" not in v}
    env = {**os.environ, **plain, "NAND_DB": db_url, "NAND_TOKEN": TOKEN}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    command = with_ports(server["command"], ports)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        health = with_ports(server["healthcheck"]["test"][1:], ports)
        wait_healthy([sys.executable if w == "python" else w for w in health])
        yield f"http://127.0.0.1:{ports['8080']}"
    finally:
        proc.terminate()
        proc.wait(10)


def _fill(base: str, zmq_port: int) -> None:
    """A run that diverges and warns, so the histograms and gauges have data; and
    the scrape's ``Host: server:8080`` (the compose service name) is answered."""
    agent = FakeAgent(f"tcp://127.0.0.1:{zmq_port}", run="monitored")
    agent.hello(token=TOKEN)
    agent.heartbeat(3)
    agent.send(
        "warning",
        {
            "kind": "loss_spike",
            "step": 3,
            "module": "",
            "value": 9.0,
            "reference": 1.0,
            "message": "spike",
            "time": 0.0,
        },
    )
    agent.event(step=4, phase="forward", module="fc1", cause="produced", nan=1)
    agent.wait_acked()
    agent.close()
    response = httpx.get(f"{base}/metrics", headers={"Host": "server:8080"})
    assert response.status_code == 200, response.text


def _check_prometheus(prom: str, base: str) -> None:
    exported = httpx.get(f"{base}/metrics").text
    recorded = {rule["record"] for rule in monitoring.rules() if "record" in rule}
    exprs = [rule["expr"] for rule in monitoring.rules()] + monitoring.dashboard_exprs()
    for name in set().union(*map(monitoring.metric_names, exprs)):
        assert name in recorded or re.search(rf"^{name}[{{ ]", exported, re.M), name

    def settled() -> bool:
        targets = monitoring.api(prom, "/api/v1/targets")["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets
        groups = monitoring.api(prom, "/api/v1/rules")["data"]["groups"]
        states = [(r["name"], r["health"], r.get("lastError")) for g in groups for r in g["rules"]]
        assert len(states) == len(monitoring.rules()) and all(s[1] == "ok" for s in states), states
        managers = monitoring.api(prom, "/api/v1/alertmanagers")["data"]["activeAlertmanagers"]
        assert len(managers) == 1, managers
        for expr in monitoring.dashboard_exprs():
            answer = monitoring.api(prom, "/api/v1/query", query=expr)
            assert answer["status"] == "success" and answer["data"]["result"], (expr, answer)
        return True

    eventually(settled, timeout=60, interval=1.0)


def _check_grafana(grafana: dict) -> None:
    mounts = monitoring.mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards/nand.yml").read_text())["providers"]
    folder = mounts[provider["options"]["path"]]  # the provider reads a mounted folder
    home = monitoring.on_host(
        grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"], mounts
    )
    dashboards = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    assert dashboards and Path(home).parent == folder and Path(home).exists()
    for dashboard in dashboards:
        assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
        for panel in dashboard["panels"]:
            uids = {panel["datasource"]["uid"]} | {t["datasource"]["uid"] for t in panel["targets"]}
            assert uids == {source["uid"]}, panel["title"]
