"""examples/kubernetes: the servers' Deployment and Service agree with each other,
with the training Job that reports to them, and with the server the compose file
runs (and tests/e2e/test_compose.py runs for real). No cluster in CI: read, not applied."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import yaml

from tests.e2e.test_compose import compose_service

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/kubernetes"


def _documents(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((EXAMPLE / name).read_text())}


def _env(container: dict) -> dict[str, object]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_the_server_deployment_has_replicas_behind_a_service_the_job_reports_to() -> None:
    docs = _documents("nand-server.yaml")
    deployment, service = docs["Deployment"], docs["Service"]
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    [server] = pod["spec"]["containers"]
    assert server["command"] == compose_service("server")["command"]
    env = _env(server)
    assert {"NAND_DB", "NAND_TOKEN"} <= set(env)
    named = {port["name"]: port["containerPort"] for port in server["ports"]}
    assert server["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    exposed = {port["port"]: named[port["targetPort"]] for port in service["spec"]["ports"]}

    job = _documents("job.yaml")["Job"]
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    job_env = _env(trainer)
    for variable, scheme in (("NAND_SERVER", "tcp"), ("NAND_URL", "http")):
        address = urlsplit(str(job_env[variable]))
        assert address.scheme == scheme and address.hostname == service["metadata"]["name"]
        assert address.port in exposed, (variable, exposed)
    assert exposed[urlsplit(str(job_env["NAND_SERVER"])).port] == 5557
    assert env["NAND_ALLOWED_HOSTS"] == service["metadata"]["name"]  # the Host the job sends
