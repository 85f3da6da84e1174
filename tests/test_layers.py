"""The package's layers are its folders (docs/ARCHITECTURE.md, "Layers"), lowest first:

    core -> features -> state -> plan -> integrations -> tools -> the package's root modules (``__init__``, ``run``)

A module imports only from its own folder or from lower ones (any import statement, lazy ones included: the graph
of test_layout.py), names no module of a higher folder in a string (``"accel_flatshard.integrations.x:f"``), and the
longest chain of internal imports stays within :data:`MAX_CHAIN` modules.  A new folder is placed here and in the
document.

Run ``python tests/test_layers.py [REPO_ROOT]`` to print the upward imports and the longest chain.
"""
from __future__ import annotations

import ast
import functools
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Set

sys.path.insert(0, os.path.dirname(__file__))
import test_layout  # noqa: E402

FOLDERS = ["core", "features", "state", "plan", "integrations", "tools"]  # lowest first; the root's modules: top
MAX_CHAIN = 10


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS):  # a folder's module, or the folder itself
        if parts[1] not in FOLDERS:
            raise KeyError(f"{module}: folder {parts[1]!r} has no layer; add it to tests/test_layers.py FOLDERS "
                           "and docs/ARCHITECTURE.md")
        return FOLDERS.index(parts[1])
    return len(FOLDERS)  # accel_flatshard itself, accel_flatshard.run


def _name(index: int) -> str:
    return FOLDERS[index] if index < len(FOLDERS) else "root"


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``importer (folder) -> imported (folder)`` for every import into a higher folder."""
    return [f"{a} ({_name(layer_of(a))}) -> {b} ({_name(layer_of(b))})"
            for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]


_DOTTED = re.compile(r"\baccel_flatshard\.(\w+)")


def upward_names(package: Path) -> List[str]:
    """Strings in a module that name a module of a higher folder (an import by name: ``importlib``, a patch
    table's ``"module:function"``)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        importer = test_layout._module_name(path) if package == test_layout.PACKAGE else \
            ".".join(["accel_flatshard", *path.relative_to(package).with_suffix("").parts]).replace(".__init__", "")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in _DOTTED.finditer(node.value):
                    folder = match.group(1)
                    if folder in FOLDERS and FOLDERS.index(folder) > layer_of(importer):
                        found.append(f"{importer} names accel_flatshard.{folder} (line {node.lineno})")
    return found


def longest_chain(graph: Dict[str, Set[str]]) -> List[str]:
    """The longest path of imports (the graph has no circles: test_layout.py)."""
    @functools.lru_cache(maxsize=None)
    def longest(module: str) -> tuple:
        return max(((module, *longest(m)) for m in graph.get(module, ())), key=len, default=(module,))

    return list(max((longest(m) for m in graph), key=len))


def test_every_module_has_a_layer():
    for module in test_layout._graph():
        layer_of(module)


def test_no_import_runs_into_a_higher_folder():
    assert upward_imports(test_layout._graph()) == [], "move the code down, or the importer up"


def test_no_module_names_a_module_of_a_higher_folder():
    assert upward_names(test_layout.PACKAGE) == []


def test_the_longest_import_chain_is_short():
    chain = longest_chain(test_layout._graph())
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def test_a_planted_upward_import_is_reported():
    graph = {"accel_flatshard.core.comm": {"accel_flatshard.integrations.accelerate", "accel_flatshard.core.options"},
             "accel_flatshard.state.optim": {"accel_flatshard.core.comm"}}
    assert upward_imports(graph) == [
        "accel_flatshard.core.comm (core) -> accel_flatshard.integrations.accelerate (integrations)"]


def test_a_planted_upward_name_is_reported(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "hooks.py").write_text('"""x"""\nTARGET = "accel_flatshard.features.generation:go"\n'
                                                 'OK = "accel_flatshard.core.comm:agree"\n')
    assert upward_names(tmp_path) == ["accel_flatshard.core.hooks names accel_flatshard.features (line 2)"]


def test_a_long_chain_is_measured():
    graph = {str(i): {str(i + 1)} for i in range(12)}
    assert len(longest_chain(graph)) == 13


if __name__ == "__main__":
    if len(sys.argv) > 1:  # another checkout: the layout test's graph of its package
        test_layout.PACKAGE = Path(sys.argv[1]).resolve() / "accel_flatshard"
    graph = test_layout._graph()
    found = upward_imports(graph) + upward_names(test_layout.PACKAGE)
    print(f"{len(found)} imports or names run from a lower folder to a higher one ({test_layout.PACKAGE}):")
    for line in found:
        print("   ", line)
    chain = longest_chain(graph)
    print(f"longest import chain: {len(chain)} modules: " + " -> ".join(chain))
