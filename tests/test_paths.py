"""How far a newcomer must read: the package modules that `prepare`, one training step and `save_state` run.

Each operation runs on 2 gloo ranks with a Python profiler hook that records every function call made inside
`accel_flatshard/`.  Two numbers per operation:

* the package modules entered (each module whose code runs), at most ``MAX_MODULES``;
* climbs: a call from module A into a function of module B where A does not import B (directly or through other
  package modules, lazy imports included), i.e. lower code calling back up into code above it.  There must be
  none.  Not climbs: callbacks that torch or accelerate make into our hooks (their caller is not our code), a
  callback a module hands down (a lambda or closure it passes as an argument), the registry's calls to the handlers
  and listeners registered with it, the objects :data:`HELD_OBJECTS` names, and attribute reads (property getters,
  dunder methods such as ``nn.Module.__getattr__``).

Run ``python tests/test_paths.py`` to print the modules and climbs of each path.
"""
from __future__ import annotations

import ast
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_helpers import spawn  # noqa: E402

PACKAGE = Path(__file__).resolve().parent.parent / "accel_flatshard"
# 10 before issue 33 split one concept per file (unit / schedule / outside_reads, checkpoint/format): files are
# smaller, the path enters more of them (prepare 12, a step 9, a SHARDED save_state 14 after the split).  Issue 50's
# registry: features attach to every model through it, so prepare enters each feature's wrap listener (the
# registry, generation, bitsandbytes, profiling; and issue 52's patch rows for torch's state-dict API, applied at the
# first wrap: patches, state/torch_api: 19) and a step each optimizer handler (matrix optimizers, bitsandbytes,
# offload: 15), one short check each
MAX_MODULES = 19
ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
       "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
       "FSDP_FORWARD_PREFETCH": "true"}


def _module_of(path: str) -> str:
    rel = Path(path).resolve().relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> Dict[str, Set[str]]:
    """Package module -> package modules it imports (any import statement, lazy ones included)."""
    graph: Dict[str, Set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_of(str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("accel_flatshard"))
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                if target.startswith("accel_flatshard"):
                    # `from . import options` imports the submodule, not what the package's __init__ imports
                    submodules = {f"{target}.{a.name}" for a in node.names}
                    deps.update(submodules)
                    if not all((PACKAGE.parent / (m.replace(".", "/") + ".py")).exists()
                               or (PACKAGE.parent / m.replace(".", "/")).is_dir() for m in submodules):
                        deps.add(target)
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def _reaches(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        out[start] = seen
    return out


def _attribute_reads() -> Set[object]:
    """Code objects of the package's property getters: reading ``wrapper.flat_params`` is not a call up."""
    codes = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("accel_flatshard"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                codes.update(p.fget.__code__ for p in vars(value).values()
                             if isinstance(p, property) and hasattr(p.fget, "__code__"))
    return codes


class CallRecorder:
    """``sys.setprofile`` hook: package modules entered, and package-to-package calls (caller, callee)."""

    def __init__(self) -> None:
        self.prefix = str(PACKAGE) + os.sep
        self.modules: List[str] = []
        self.edges: Set[Tuple[str, str, str]] = set()
        self.reads = _attribute_reads()

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(self.prefix):
            return
        callee = _module_of(frame.f_code.co_filename)
        if callee not in self.modules:
            self.modules.append(callee)
        caller = frame.f_back
        code = frame.f_code
        if code in self.reads or code.co_name.startswith("__") or "<l" in code.co_qualname:
            return  # an attribute read (property, __getattr__) or a callback handed down (lambda, closure)
        if caller is not None and caller.f_code.co_filename.startswith(self.prefix):
            source = _module_of(caller.f_code.co_filename)
            if source != callee:
                self.edges.add((source, callee, f"{caller.f_code.co_name} -> {frame.f_code.co_name}"))

    def __enter__(self) -> "CallRecorder":
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def _paths_worker(rank: int, world: int, save_dir: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.update(ENV)
    from accel_flatshard.integrations.accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    paths = {}
    with CallRecorder() as prepare:
        model, optimizer = accelerator.prepare(model, optimizer)
    paths["prepare"] = prepare
    for name in ("first step", "step"):  # the first step records the execution order; later ones prefetch
        with CallRecorder() as step:
            loss = model(x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        paths[name] = step
    with CallRecorder() as save:
        accelerator.save_state(save_dir)
    paths["save_state"] = save
    return {name: (rec.modules, sorted(rec.edges)) for name, rec in paths.items()}


@pytest.fixture(scope="module")
def paths():
    with tempfile.TemporaryDirectory() as save_dir:
        return spawn(2, _paths_worker, save_dir)[0]


# Calls up that are the design, not a climb: each (caller, callee) with its reason.
HELD_OBJECTS = {
    # the schedule hands each unit its engine (schedule -> unit -> engine); unit.py does not import engine.py so that
    # the longest import chain stays within 10 modules (tests/test_layers.py)
    ("accel_flatshard.core.unit", "accel_flatshard.core.engine"): "the unit's engine, given by the schedule",
    # the state-dict code finds a model's schedule in its registry record (core/registry.py): no lambda handed down
    ("accel_flatshard.core.model_state", "accel_flatshard.core.schedule"): "the record's schedule",
}


# Modules whose calls into others are callbacks by design: the registry dispatches to the handlers and listeners
# registered with it; the patch table calls the replacement factories it names (test_layers.py: never a module of a
# higher folder).
CALLBACK_CALLERS = ("accel_flatshard.core.registry", "accel_flatshard.integrations.patches")


def climbs(edges) -> List[str]:
    """Calls from a module into one it does not import, directly or not; the registry's calls to the handlers and
    listeners registered with it are callbacks (features attach through it), so are the patch table's calls of the
    replacements it names, and :data:`HELD_OBJECTS` lists the
    objects the design hands down."""
    reach = _reaches(import_graph())
    return [f"{a} -> {b} ({how})" for a, b, how in edges if b not in reach.get(a, set())
            and a not in CALLBACK_CALLERS and (a, b) not in HELD_OBJECTS]


@pytest.mark.parametrize("operation", ["prepare", "step", "save_state"])
def test_each_path_crosses_at_most_ten_modules_without_climbing_back_up(paths, operation):
    modules, edges = paths[operation]
    assert len(modules) <= MAX_MODULES, f"{operation} enters {len(modules)} modules: {modules}"
    assert not climbs(edges), f"{operation} climbs back up: {climbs(edges)}"


def test_the_recorder_sees_a_climb():
    """The measurement can fail: a lower module calling back into a module above it is reported."""
    edges = [("accel_flatshard.core.comm", "accel_flatshard.core.fully_sharded", "f -> g"),
             ("accel_flatshard.core.registry", "accel_flatshard.features.generation", "register -> _on_wrap"),
             ("accel_flatshard.core.unit", "accel_flatshard.core.engine", "unshard -> unshard")]
    assert climbs(edges) == ["accel_flatshard.core.comm -> accel_flatshard.core.fully_sharded (f -> g)"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        result = spawn(2, _paths_worker, directory)[0]
    for name, (modules, edges) in result.items():
        print(f"\n{name}: {len(modules)} modules")
        for m in modules:
            print("   ", m)
        for c in climbs(edges):
            print("    climb:", c)
