"""deploy/'s Prometheus rules and Alertmanager config through Debian's own
tools (installed by scripts/test): ``promtool check rules``, ``promtool test
rules`` (deploy/prometheus/rules_test.yml: each alert fires on its series and
stays silent on a healthy deployment) and ``amtool check-config``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is missing: `apt-get install -y prometheus prometheus-alertmanager` "
            "(scripts/test does)"
        )
    return found


def run(*words: str) -> str:
    done = subprocess.run(words, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_rules_pass_promtool_check() -> None:
    out = run(tool("promtool"), "check", "rules", str(DEPLOY / "prometheus/rules.yml"))
    assert "SUCCESS" in out


def test_each_alert_fires_on_its_series_and_stays_silent_on_a_healthy_one() -> None:
    out = run(tool("promtool"), "test", "rules", str(DEPLOY / "prometheus/rules_test.yml"))
    assert "SUCCESS" in out


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus/rules.yml").read_text())["groups"]
    alerts = {rule["alert"] for group in rules for rule in group["rules"] if "alert" in rule}
    tests = yaml.safe_load((DEPLOY / "prometheus/rules_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == fired


def test_the_alertmanager_config_passes_amtool() -> None:
    out = run(tool("amtool"), "check-config", str(DEPLOY / "alertmanager/alertmanager.yml"))
    assert "SUCCESS" in out
