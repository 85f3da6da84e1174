"""The package's layers (docs/ARCHITECTURE.md, "Layers"), lowest first: no import runs into a higher layer.

An import from a module of layer i to one of layer j > i (any import statement, lazy ones included: the graph of
test_layout.py) runs upward, and fails the test unless :data:`ALLOWED` lists it with its reason.  Every module must
have a layer: a new module is placed here and in the document.

Run ``python tests/test_layers.py [REPO_ROOT]`` to print the upward imports (of another checkout with REPO_ROOT).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, List, Set

sys.path.insert(0, os.path.dirname(__file__))
import test_layout  # noqa: E402

# lowest first; a module's layer is that of its longest matching prefix (names relative to accel_flatshard)
LAYERS = [
    ("foundations", ["_compat", "options", "sizes", "mixed_precision", "patches", "profiler", "chained_optimizer",
                     "checkpoint.atomic", "integrations.versions", "quantize"]),
    ("storage and collectives", ["flat_param", "comm", "device", "offload", "checkpoint.format"]),  # format: errors
    ("state in memory", ["state_dict"]),  # the wrapper hands it its schedule at install
    ("engine", ["engine"]),
    ("units and schedule", ["unit", "schedule", "outside_reads", "wrap", "grad_norm", "matrix_optim", "quantization"]),
    ("wrapper", ["fully_sharded", "generation", "compilation"]),
    ("checkpoints on disk", ["checkpoint"]),
    ("the planner", ["plan"]),  # the library: prepare's memory check calls it
    ("integrations", ["integrations"]),
    ("tools and entry points", ["plan.__main__", "plan.launch", "cli", "run", ""]),  # "": the package's __init__
]

# importer -> imported: why this import may run upward (none today; an entry needs a reason a reviewer accepts)
ALLOWED: Dict[str, str] = {}


def layer_of(module: str) -> int:
    name = module[len(test_layout.NAME) + 1:] if module != test_layout.NAME else ""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or name.startswith(prefix + ".") or (prefix == "" and name == "")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise KeyError(f"{module} has no layer: add it to tests/test_layers.py LAYERS and docs/ARCHITECTURE.md")
    return best


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``importer -> imported`` for every import into a higher layer."""
    return [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
            for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]


def test_every_module_has_a_layer():
    assert [m for m in test_layout._graph() if layer_of(m) < 0] == []


def test_no_import_runs_into_a_higher_layer():
    upward = upward_imports(test_layout._graph())
    unexplained = [line for line in upward if line.split(" (")[0] + " -> " + line.split(" -> ")[1].split(" (")[0]
                   not in ALLOWED]
    assert unexplained == [], "imports into a higher layer (move the code down, or list it in ALLOWED with why)"


def test_an_import_into_a_higher_layer_is_reported():
    graph = {"accel_flatshard.comm": {"accel_flatshard.fully_sharded", "accel_flatshard.options"}}
    assert upward_imports(graph) == [
        "accel_flatshard.comm (storage and collectives) -> accel_flatshard.fully_sharded (wrapper)"]


if __name__ == "__main__":
    if len(sys.argv) > 1:  # another checkout: the layout test's graph of its package
        test_layout.PACKAGE = Path(sys.argv[1]).resolve() / "accel_flatshard"
    found = upward_imports(test_layout._graph())
    print(f"{len(found)} imports run from a lower layer to a higher one ({test_layout.PACKAGE}):")
    for line in found:
        print("   ", line)
