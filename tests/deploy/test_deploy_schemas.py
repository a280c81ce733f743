"""The deployment files, checked offline by their own ecosystems' tools:

- examples/kubernetes/*.yaml against the Kubernetes API's OpenAPI schemas
  (``kubernetes-validate``, which ships them), strict: an unknown field fails;
- docker-compose.yml against the Compose Specification's JSON schema (the copy
  ``check-jsonschema`` vendors), and every service of every profile run (or,
  for PostgreSQL, matched) by a named test;
- deploy/grafana/dashboards/*.json type-checked by TypeScript against
  Grafana's published dashboard schema (``@grafana/schema`` from npm, of the
  Grafana version the compose file runs; ``scripts/test`` installs it with
  ``npm ci`` in tests/deploy/grafana). That schema types the dashboard, its
  panels, grid, links, field config and annotations; what only a Grafana
  server can check (the panel plugins' own option migrations, provisioning,
  rendering) is not checked here: no Grafana is installable on this machine.
  test_compose.py runs each panel's query against a real Prometheus.

Each check is shown to fail on a broken copy of the file, so it cannot pass
vacuously."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.server import pg

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "examples/kubernetes").glob("*.yaml"))
DASHBOARDS = sorted((REPO / "deploy/grafana/dashboards").glob("*.json"))
GRAFANA_CHECK = Path(__file__).resolve().parent / "grafana"
#: The oldest Kubernetes job.yaml is written for (the Job's uid label), and the newest schema.
KUBERNETES_VERSIONS = ("1.27", "1.37")
#: Each compose service by profile ("": none, started by a plain `up`), and the test
#: that runs its command from the file (or, for the database, the same PostgreSQL).
COMPOSE_SERVICES = {
    "": {"postgres": "tests/server/pg.py", "server": "tests/e2e/test_compose.py"},
    "demo": {"trainer": "tests/e2e/test_compose.py"},
    "monitoring": {
        "prometheus": "tests/e2e/test_compose.py",
        "alertmanager": "tests/e2e/test_compose.py",
        "grafana": "tests/deploy/test_deploy_schemas.py",
    },
    "ha": {"server-2": "tests/e2e/test_compose_ha.py", "balancer": "tests/e2e/test_compose_ha.py"},
}


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kubernetes_errors(doc: dict, version: str) -> str | None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return str(exc).splitlines()[0]
    return None


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_pass_the_kubernetes_api_schemas_strictly(version):
    checked = []
    for path in MANIFESTS:
        for doc in _documents(path):
            errors = _kubernetes_errors(doc, version)
            assert errors is None, f"{path.name} {doc['kind']} (Kubernetes {version}): {errors}"
            checked.append(doc["kind"])
    assert sorted(checked) == ["Deployment", "Job", "Service"]


def test_the_kubernetes_check_rejects_a_misspelt_field_and_a_wrong_type():
    [job] = _documents(REPO / "examples/kubernetes/job.yaml")
    misspelt = copy.deepcopy(job)
    pod = misspelt["spec"]["template"]["spec"]
    pod["restartpolicy"] = pod.pop("restartPolicy")
    assert _kubernetes_errors(misspelt, KUBERNETES_VERSIONS[-1]) is not None
    wrong = copy.deepcopy(job)
    wrong["spec"]["backoffLimit"] = "none"
    assert _kubernetes_errors(wrong, KUBERNETES_VERSIONS[-1]) is not None


def _check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    checker = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_compose_file_passes_the_compose_specification_schema(tmp_path):
    done = _check_compose(REPO / "docker-compose.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "docker-compose.yml"
    text = (REPO / "docker-compose.yml").read_text()
    broken.write_text(text.replace("depends_on:", "depends_onn:", 1))
    assert _check_compose(broken).returncode != 0


def test_every_compose_service_of_every_profile_is_run_by_a_test():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    by_profile: dict[str, set[str]] = {}
    for name, service in services.items():
        for profile in service.get("profiles", [""]):
            by_profile.setdefault(profile, set()).add(name)
    assert by_profile == {p: set(names) for p, names in COMPOSE_SERVICES.items()}
    for names in COMPOSE_SERVICES.values():
        for name, test in names.items():
            text = (REPO / test).read_text()
            if name == "postgres":  # the image's major version is the one the tests start
                assert services[name]["image"] == f"postgres:{_postgres_major()}"
                continue
            assert f'"{name}"' in text, f"{test} does not read the compose service {name!r}"


def _postgres_major() -> str:
    bindir = pg.find_bin()
    assert bindir is not None, "no PostgreSQL binaries (the tests' database)"
    out = subprocess.run([bindir / "initdb", "--version"], capture_output=True, text=True)
    match = re.search(r"\(PostgreSQL\) (\d+)", out.stdout)
    assert match, out.stdout
    return match.group(1)


def _tsc() -> Path:
    tsc = GRAFANA_CHECK / "node_modules/.bin/tsc"
    if not tsc.exists() or shutil.which("node") is None:
        message = "tests/deploy/grafana has no node_modules: `npm ci --prefix tests/deploy/grafana`"
        if os.environ.get("CI"):  # scripts/test installs it: never skipped there
            pytest.fail(message)
        pytest.skip(message)
    return tsc


def _typecheck(dashboards: dict[str, dict], folder: Path) -> subprocess.CompletedProcess[str]:
    """``tsc`` on one module per dashboard: its JSON as an object literal that
    ``satisfies`` Grafana's ``Dashboard`` type (unknown keys and wrong types fail)."""
    modules = GRAFANA_CHECK / "node_modules"
    for name, dashboard in dashboards.items():
        source = json.dumps(dashboard, indent=2)
        (folder / f"{name}.ts").write_text(
            'import type { Dashboard } from "@grafana/schema";\n'
            f"export const dashboard = {source} satisfies Dashboard;\n"
        )
    options = {
        "strict": True,
        "noEmit": True,
        "target": "es2020",
        "module": "commonjs",
        "moduleResolution": "node",
        "skipLibCheck": True,
        "baseUrl": ".",
        "paths": {name: [str(modules / name)] for name in ("@grafana/schema", "tslib")},
    }
    files = [f"{name}.ts" for name in dashboards]
    (folder / "tsconfig.json").write_text(json.dumps({"compilerOptions": options, "files": files}))
    return subprocess.run(
        [str(_tsc()), "-p", str(folder / "tsconfig.json")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=folder,
    )


def test_grafana_dashboards_type_check_against_grafanas_dashboard_schema(tmp_path):
    _tsc()
    assert DASHBOARDS, "no dashboard in deploy/grafana/dashboards"
    package = json.loads((GRAFANA_CHECK / "package.json").read_text())
    image = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["grafana"]
    assert image["image"] == f"grafana/grafana:{package['devDependencies']['@grafana/schema']}"
    dashboards = {path.stem: json.loads(path.read_text()) for path in DASHBOARDS}
    done = _typecheck(dashboards, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    panels = GRAFANA_CHECK / "node_modules/@grafana/schema/dist/esm/raw/composable"
    for name, dashboard in dashboards.items():
        for panel in dashboard["panels"]:  # a panel plugin that Grafana ships
            assert (panels / panel["type"] / "panelcfg").is_dir(), (name, panel["type"])


def test_the_grafana_check_rejects_a_misspelt_panel_field_and_a_missing_schema_version(
    tmp_path,
):
    _tsc()
    [path] = DASHBOARDS[:1]
    dashboard = json.loads(path.read_text())
    misspelt = copy.deepcopy(dashboard)
    misspelt["panels"][0]["titel"] = misspelt["panels"][0].pop("title")
    unversioned = copy.deepcopy(dashboard)
    del unversioned["schemaVersion"]
    for name, broken in (("misspelt", misspelt), ("unversioned", unversioned)):
        folder = tmp_path / name
        folder.mkdir()
        done = _typecheck({name: broken}, folder)
        assert done.returncode != 0 and "error TS" in done.stdout, (name, done.stdout)
