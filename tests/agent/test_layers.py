"""The agent's packages form layers: each imports only those below it, and no
module imports another that imports it back (directly or not).

Read from the source with ``ast``: every ``import`` counts, also those inside
functions and under ``TYPE_CHECKING`` (a type-only import of a higher layer
still means the lower one knows about it).
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "nand" / "agent"

#: Lowest first. Modules at the top of nand/agent outside this list are shared
#: by all (identity, sink, safety); readout is the watch's read-only members,
#: watch wires everything, api is the entry point.
LAYERS = ["transport", "output", "detect", "step", "rerun", "readout", "watch", "api"]
SHARED = {"identity", "sink", "safety", "patches", "__init__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(AGENT).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def imports_of(path: Path) -> set[str]:
    """The nand.agent modules ``path`` imports, as names relative to nand.agent."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("nand.agent."):
                found.add(name.removeprefix("nand.agent."))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in AGENT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        # "detect.hooks.Hooks" -> "detect.hooks": keep the longest known module prefix
        targets = set()
        for imported in imports_of(path):
            parts = imported.split(".")
            for cut in range(len(parts), 0, -1):
                candidate = ".".join(parts[:cut])
                if candidate in modules:
                    targets.add(candidate)
                    break
        edges[name] = targets - {name}
    return edges


def layer(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def test_no_layer_imports_a_layer_above_it():
    wrong = []
    for module, targets in graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if here is None and module not in SHARED:
                wrong.append(f"{module}: not in a layer")
            elif here is None and there is not None:
                wrong.append(f"shared {module} imports {target}")
            elif here is not None and there is not None and there > here:
                wrong.append(f"{module} imports {target}, a layer above it")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_module_imports_itself_back():
    edges = graph()
    cycles = []

    def visit(start: str, node: str, seen: set[str]) -> None:
        for target in edges.get(node, ()):
            if target == start:
                cycles.append(start)
            elif target not in seen:
                seen.add(target)
                visit(start, target, seen)

    for module in edges:
        visit(module, module, {module})
    assert not cycles, f"import cycles through: {sorted(set(cycles))}"


def test_the_check_sees_a_known_import():
    # The graph is read right: watch wires the layers, so it imports each.
    assert {"detect.hooks", "step.build", "output.session"} <= graph()["watch"]
