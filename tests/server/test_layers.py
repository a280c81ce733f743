"""The server's packages form layers, as the agent's do (tests/agent/test_layers.py):
storage ← schemas ← analysis ← metrics ← agents, http, notify. Each imports only
the layers below it; the three at the top are peers that do not import each
other; no module imports another that imports it back.

Read from the source (tests/layering.py): every ``import`` counts, also those
inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast

from tests.layering import NAND, import_cycles, import_graph, module_name

SERVER = NAND / "server"

#: Lowest first; the packages (or top-level modules) of one layer are peers.
LAYERS: list[set[str]] = [
    {"storage"},
    {"schemas"},
    {"analysis"},
    {"metrics"},
    {"agents", "http", "notify"},
]
#: Imported by every layer, importing none: the settings and their helpers.
SHARED = {"settings", "observe", "collector", "__init__"}
#: What builds a server from the layers: free to import any of them.
WIRING = {"http.app", "embedded", "__main__", "preflight"}


def graph() -> dict[str, set[str]]:
    return import_graph("nand.server", skip=("migrations",))


def layer(module: str) -> int | None:
    top = module.split(".")[0]
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_no_layer_imports_a_layer_above_it_or_a_peer() -> None:
    wrong = []
    for module, targets in graph().items():
        if module in WIRING:
            continue
        here = layer(module)
        if here is None and module not in SHARED:
            wrong.append(f"{module}: not in a layer")
            continue
        for target in targets:
            there = layer(target)
            if here is None and there is not None:
                wrong.append(f"shared {module} imports {target}")
            elif here is not None and target in WIRING:
                wrong.append(f"{module} imports {target}, which wires the server")
            elif here is not None and there is not None and there > here:
                wrong.append(f"{module} imports {target}, a layer above it")
            elif there == here and module.split(".")[0] != target.split(".")[0]:
                wrong.append(f"{module} imports {target}, a peer")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_module_imports_itself_back() -> None:
    cycles = import_cycles(graph())
    assert not cycles, f"import cycles through: {cycles}"


def test_the_check_sees_known_imports() -> None:
    # The graph is read right: the writer stores through its handlers, the
    # app wires the ingest and the notifier.
    edges = graph()
    assert {"agents.stores", "storage.runlock"} <= edges["agents.writer"]
    assert {"agents.ingest", "notify.notifier"} <= edges["http.app"]


#: The two ways to build each read: every rank row loaded (views), or the
#: database's counts for a big run (bigrun, rankpage).
PATHS = {
    ("views", "run_summary"),
    ("views", "verdict"),
    ("views", "run_detail"),
    ("bigrun", "verdict"),
    ("bigrun", "run_detail"),
    ("rankpage", "run_summary"),
}


def path_callers() -> dict[str, set[str]]:
    """``module.function`` of PATHS -> the server modules that use it."""
    users: dict[str, set[str]] = {}
    for path in SERVER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in PATHS
            ):
                user = module_name(path, SERVER)
                users.setdefault(f"{node.value.id}.{node.attr}", set()).add(user)
    return users


def big_run_readers() -> set[str]:
    return {
        module_name(path, SERVER)
        for path in SERVER.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "big_run_ranks"
    }


def test_only_the_read_facade_chooses_between_the_small_and_the_big_run_path() -> None:
    # A caller asks analysis.reads for a summary, a verdict or a run's detail;
    # it never compares a run with big_run_ranks nor takes one path itself.
    assert big_run_readers() == {"analysis.reads"}
    callers = path_callers()
    assert {"analysis.reads"} <= callers["views.verdict"] & callers["bigrun.verdict"]
    outside = {
        f"{path} in {module}"
        for path, modules in callers.items()
        for module in modules
        if not module.startswith("analysis.")
    }
    assert not outside, sorted(outside)
