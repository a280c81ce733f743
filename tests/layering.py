"""The import graph of one of nand's packages, read from the source with ``ast``.

Shared by the layering tests of the agent (tests/agent/test_layers.py) and
the server (tests/server/test_layers.py). Every ``import`` counts, also those
inside functions and under ``TYPE_CHECKING``: a type-only import of a higher
layer still means the lower one knows about it.
"""

from __future__ import annotations

import ast
from pathlib import Path

NAND = Path(__file__).resolve().parents[1] / "nand"


def module_name(path: Path, root: Path) -> str:
    """``root/detect/hooks.py`` -> ``detect.hooks``; a package's ``__init__`` is its name."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def imports_of(path: Path, package: str) -> set[str]:
    """The modules of ``package`` (``nand.agent``) that ``path`` imports, as names
    relative to it (``detect.hooks`` or, for ``from x import y``, ``detect.hooks.Hooks``)."""
    prefix = package + "."
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(name.removeprefix(prefix) for name in names if name.startswith(prefix))
    return found


def import_graph(package: str, skip: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of it that it imports (not
    itself); directories named in ``skip`` (migrations) are left out."""
    root = NAND.joinpath(*package.split(".")[1:])
    modules = {module_name(p, root): p for p in root.rglob("*.py") if not set(skip) & set(p.parts)}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges[name] = {
            known
            for imported in imports_of(path, package)
            if (known := _longest_module(imported, modules)) is not None
        } - {name}
    return edges


def _longest_module(imported: str, modules: dict[str, Path]) -> str | None:
    """``detect.hooks.Hooks`` -> ``detect.hooks``: the longest known module prefix."""
    parts = imported.split(".")
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in modules:
            return candidate
    return None


def import_cycles(edges: dict[str, set[str]]) -> list[str]:
    """The modules from which an import path leads back to themselves."""
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
    return sorted(set(cycles))
