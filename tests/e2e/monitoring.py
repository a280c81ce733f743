"""The compose ``monitoring`` profile's services run here from the compose
file (no Docker engine): Debian's ``prometheus`` and ``prometheus-alertmanager``
with the compose commands, the mounted files read from where the volumes say,
and the names of the other services replaced by loopback addresses."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
#: The binaries Debian installs for each image's entrypoint.
BINARIES = {"prometheus": "/usr/bin/prometheus", "alertmanager": "/usr/bin/prometheus-alertmanager"}


def services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → host path, for the service's bind mounts (``./...``)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            found[target] = REPO / source
    return found


def on_host(word: str, paths: dict[str, Path]) -> str:
    """``word`` with a mounted container path (or a file under one) as the host's."""
    for container, host in sorted(paths.items(), key=lambda item: -len(item[0])):
        if word == container or word.startswith(container + "/"):
            return str(host) + word[len(container) :]
    return word


def command(name: str, flags: dict[str, str], paths: dict[str, Path]) -> list[str]:
    """The service's compose command for this host: its mounts mapped, the
    ``--flag=`` values in ``flags`` replaced (listen addresses, storage)."""
    if not Path(BINARIES[name]).exists():
        pytest.fail(
            f"{BINARIES[name]} is missing: `apt-get install -y prometheus "
            "prometheus-alertmanager` (scripts/test does)"
        )
    words = []
    for word in services()[name]["command"]:
        flag, equals, value = word.partition("=")
        value = flags.get(flag, value)
        words.append(f"{flag}={on_host(value, paths)}" if equals else word)
    return [BINARIES[name], *words]


def prometheus_config(addresses: dict[str, str], paths: dict[str, Path], tmp: Path) -> Path:
    """deploy/prometheus/prometheus.yml for this host: service names replaced by
    ``addresses``, rule files at their host paths, 1 s intervals."""
    config = yaml.safe_load(on_host_text(paths["/etc/prometheus/prometheus.yml"], addresses))
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [on_host(path, paths) for path in config["rule_files"]]
    out = tmp / "prometheus.yml"
    out.write_text(yaml.safe_dump(config))
    return out


def on_host_text(path: Path, addresses: dict[str, str]) -> str:
    text = path.read_text()
    for name, address in addresses.items():
        text = text.replace(f'"{name}"', f'"{address}"')
    return text


def start(words: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(words, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def api(base: str, path: str, **query: str) -> Any:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{base} never got ready:\n{log.read_text()[-3000:]}"
                ) from None
            time.sleep(0.3)


def rules() -> list[dict[str, Any]]:
    path = REPO / "deploy/prometheus/rules.yml"
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/nand.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads: exported ``nand_*`` and recorded ``nand:*``."""
    return set(re.findall(r"\bnand[_:][A-Za-z0-9_:]+", expr))
