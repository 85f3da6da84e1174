"""The package's shape: no import circles (also through lazy in-function imports, or a package's ``__init__`` that
runs before its module), torch.distributed collectives are called only in core/comm.py, the environment is read only
in core/options.py and integrations/config.py, the two process-wide optimizer hooks are the registry's, at most three
private attribute names are hung on objects the package does not own, no module is over 600 lines.  The folders'
order is tests/test_layers.py's."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "accel_flatshard"
NAME = "accel_flatshard"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """Package modules that ``name`` imports anywhere in its file (top level, in functions, under TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    out: Set[str] = set()

    def add(target: str) -> None:
        # the longest known module prefix (``from .x import y`` may name a module ``x.y`` or a symbol)
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(NAME):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - node.level + 1]
                module = ".".join(parent + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith(NAME):
                continue
            for alias in node.names:
                add(f"{module}.{alias.name}")
    return out


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    return graph


def _find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 30 and any(graph.values())  # the graph is really built
    cycle = _find_cycle(graph)
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_first_in_a_fresh_process():
    """Importing ``a.b`` runs ``a/__init__.py`` first: a package that eagerly imports a module importing ``a.b``
    back is a circle the static graph above does not see (checkpoint/__init__.py and state_dict/ -> format)."""
    names = sorted(n for n in _modules() if n != f"{NAME}.run" and not n.endswith("__main__"))  # (they run)
    script = ("import importlib, sys, traceback\n"
              f"for name in {names!r}:\n"
              "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'accel_flatshard']:\n"
              "        del sys.modules[loaded]\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except Exception:\n"
              "        print(name, traceback.format_exc(limit=-2))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_FSDP", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=PACKAGE.parent, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and not proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_collectives_only_in_comm():
    pattern = re.compile(r"\bdist\.(all_gather\w*|reduce_scatter\w*|all_reduce|broadcast\w*|barrier|monitored_barrier"
                         r"|isend|irecv|send|recv|new_group)\b|torch\.distributed\.(broadcast\w*|all_gather\w*|barrier)\b")
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).as_posix() not in ("core/comm.py", "core/p2p.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


def test_no_module_over_600_lines_and_each_opens_with_what_it_owns():
    too_long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > 600}
    assert not too_long, too_long
    no_docstring = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                    if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not no_docstring, no_docstring


def process_wide_hook_registrations(package: Path) -> List[str]:
    """Calls of torch's process-wide optimizer hook registrations (``register_optimizer_step_pre_hook`` /
    ``..._post_hook``) in the package."""
    return [f"{p.relative_to(package.parent)}:{node.lineno}" for p in sorted(package.rglob("*.py"))
            for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Call)
            and re.fullmatch(r"register_optimizer_step_(pre|post)_hook", ast.unparse(node.func).rpartition(".")[2])]


def test_two_process_wide_optimizer_hooks_at_most_both_the_registrys():
    # one before and one after every step, dispatching to the models whose parameters the optimizer holds
    assert [line.split(":")[0] for line in process_wide_hook_registrations(PACKAGE)] == \
        ["accel_flatshard/core/registry.py"] * 2


def test_the_hook_check_counts_registrations(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("import torch\ntorch.optim.optimizer.register_optimizer_step_post_hook(print)\n"
                                  "register_optimizer_step_pre_hook(print)\n")
    assert process_wide_hook_registrations(package) == ["pkg/m.py:2", "pkg/m.py:3"]


# Private attributes the package sets on objects it does not own (the user's modules, parameters, optimizers,
# accelerate's objects, other libraries' modules and classes): ``obj._flatshard_x = ...``, ``setattr(obj,
# "_flatshard_x", ...)``, ``obj.__dict__["_flatshard_x"] = ...`` or a constant naming one.  Those set on the
# package's own objects are listed here with the object.
OWN_OBJECTS = {"_flatshard_probe": "the functools.partial compile_model makes (features/compilation.py)"}


def private_attribute_names(package: Path) -> Set[str]:
    return {name for p in package.rglob("*.py") for name in re.findall(r"\b_flatshard_\w+", p.read_text())
            if name not in OWN_OBJECTS}


def test_at_most_three_private_attribute_names_on_objects_the_package_does_not_own():
    names = private_attribute_names(PACKAGE)
    assert len(names) <= 3, sorted(names)


def test_environment_read_only_in_options_and_config():
    # Every FLATSHARD_* variable goes through options.py; config.py reads accelerate's own (FSDP_*, WORLD_SIZE).
    pattern = re.compile(r"\bos\.environ\b|\bos\.getenv\b")
    readers = sorted({str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      if pattern.search(p.read_text())})
    assert readers == ["core/options.py", "integrations/config.py"], readers


# Called by name from outside the package: torch DCP's planner / storage interfaces, pickle, nn.Module.
ENTRY_POINTS = {"load_bytes", "write_data", "read_metadata", "read_data", "persistent_load", "extra_repr"}


def _names_used(paths) -> Set[str]:
    """Every name read (``x``, ``obj.x``, ``import x``) or spelled as a dotted path (``"module:function"``)."""
    names: Set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.name.rpartition(".")[2])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not any(c.isspace() for c in node.value):
                names.update(node.value.replace(":", ".").split("."))
    return names


def unreferenced_functions(package: Path, other_paths=()) -> List[str]:
    used = _names_used([*package.rglob("*.py"), *other_paths])
    return [f"{p.relative_to(package.parent)}:{node.lineno} {node.name}" for p in sorted(package.rglob("*.py"))
            for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name not in used and node.name not in ENTRY_POINTS and not node.name.startswith("__")]


def test_every_function_is_referenced_in_the_package_or_the_tests():
    tests = Path(__file__).resolve().parent
    autoload = PACKAGE.parent / "accel_flatshard_autoload.py"  # (torch's entry point: it calls into the package)
    assert unreferenced_functions(PACKAGE, [*tests.rglob("*.py"), autoload]) == []


def test_the_reference_check_finds_an_unused_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("def used():\n    pass\n\n\ndef unused():\n    used()\n")
    assert unreferenced_functions(package) == ["pkg/m.py:5 unused"]


def unit_state_writers(package: Path) -> List[str]:
    """Assignments to an attribute ``state`` (``unit.state = ...``, ``u.state, x = ...``, ``setattr(u, "state",
    ...)``) outside ``schedule.py``: the Schedule is the only writer of a unit's state.  ``unit.py`` may set
    ``self.state`` (its constructor's initial IDLE).  The package has no other ``.state`` attribute to write."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "schedule.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: List[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) > 1:
                if isinstance(node.args[1], ast.Constant) and node.args[1].value == "state":
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {ast.unparse(node)}")
            for target in (t for top in targets for t in ast.walk(top)):
                if isinstance(target, ast.Attribute) and target.attr == "state" and isinstance(target.ctx, ast.Store):
                    own = path.name == "unit.py" and isinstance(target.value, ast.Name) and target.value.id == "self"
                    if not own:
                        found.append(f"{path.relative_to(package.parent)}:{node.lineno} {ast.unparse(target)}")
    return found


def schedule_engine_reaches(package: Path) -> List[str]:
    """``x.schedule.engine`` (or ``schedule.engine``) outside unit.py, schedule.py and engine.py: other modules ask
    the Schedule (``device``, ``keep``, ``summon``...), never its engine."""
    return [f"{path.relative_to(package.parent)}:{node.lineno} {ast.unparse(node)}"
            for path in sorted(package.rglob("*.py")) if path.name not in ("unit.py", "schedule.py", "engine.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "engine"
            and (getattr(node.value, "attr", None) in ("_schedule", "schedule")
                 or getattr(node.value, "id", None) == "schedule")]


def test_the_schedule_is_the_only_writer_of_unit_state():
    assert unit_state_writers(PACKAGE) == []


def test_no_module_reaches_past_the_schedule_into_its_engine():
    assert schedule_engine_reaches(PACKAGE) == []


def test_the_unit_state_and_engine_checks_find_offenders(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "unit.py").write_text("class Unit:\n    def __init__(self):\n        self.state = 0\n")
    (package / "schedule.py").write_text("def go(unit, schedule):\n    unit.state = 1\n    schedule.engine.drain()\n")
    (package / "generation.py").write_text(
        "def summon(units, wrapper):\n    for u in units:\n        u.state, n = 2, 0\n"
        "    setattr(units[0], 'state', 3)\n    return wrapper.schedule.engine.device\n")
    assert unit_state_writers(package) == ["pkg/generation.py:3 u.state",
                                           "pkg/generation.py:4 setattr(units[0], 'state', 3)"]
    assert schedule_engine_reaches(package) == ["pkg/generation.py:5 wrapper.schedule.engine"]


def private_imports_across_packages(package: Path) -> List[str]:
    """``from x import _name`` where ``x`` is a module of another (sub)package than the importer's: a private name
    is its package's own.  ``_compat``, the package's one adapter of private torch APIs, is imported by design."""
    found = []
    for path in sorted(package.rglob("*.py")):
        importer_package = path.parent
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            target = path.parent
            for _ in range(node.level - 1):
                target = target.parent
            for part in (node.module or "").split("."):
                target = target / part if part else target
            module = target if target.is_dir() else target.parent  # the package of the imported module
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and alias.name != "_compat" and module != importer_package and \
                        (node.module or "").split(".")[-1] != "_compat":
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {alias.name} from "
                                 f"{'.' * node.level}{node.module or ''}")
    return found


def test_no_private_name_is_imported_across_a_package_boundary():
    assert private_imports_across_packages(PACKAGE) == []


def test_the_private_import_check_finds_one(tmp_path):
    package = tmp_path / "pkg"
    (package / "plan").mkdir(parents=True)
    (package / "wrapper.py").write_text("def _helper():\n    pass\n")
    (package / "plan" / "trace.py").write_text("def _copy():\n    pass\n")
    (package / "plan" / "run.py").write_text("from ..wrapper import _helper\nfrom .trace import _copy\n"
                                             "from .._compat import fake_world\n")
    assert private_imports_across_packages(package) == ["pkg/plan/run.py:1 _helper from ..wrapper"]
