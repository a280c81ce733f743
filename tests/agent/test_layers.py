"""The agent's packages form layers: each imports only those below it, and no
module imports another that imports it back (directly or not).

Read from the source (tests/layering.py): every ``import`` counts, also those
inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

from tests.layering import import_cycles, import_graph

#: Lowest first. Modules at the top of nand/agent outside this list are shared
#: by all (identity, sink, safety); readout is the watch's read-only members,
#: watch wires everything, api is the entry point.
LAYERS = ["transport", "output", "detect", "step", "rerun", "readout", "watch", "api"]
SHARED = {"identity", "sink", "safety", "patches", "__init__"}


def graph() -> dict[str, set[str]]:
    return import_graph("nand.agent")


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
    cycles = import_cycles(graph())
    assert not cycles, f"import cycles through: {cycles}"


def test_the_check_sees_a_known_import():
    # The graph is read right: watch wires the layers, so it imports each.
    assert {"detect.hooks", "step.build", "output.session"} <= graph()["watch"]
