"""Static check: every torch attribute that accel_flatshard and gpu_check use exists in torch 2.11.

The GPU machine runs torch 2.11 (CUDA 13 build) while CI here installs torch 2.13 (CPU build): a name added
after 2.11 would first fail on the GPU.  This script finds, without importing anything of the package:

* attribute chains rooted at a torch import (``torch.cuda.Stream``, ``dist.all_gather_into_tensor`` with
  ``import torch.distributed as dist``, ``from torch.optim.optimizer import register_optimizer_step_post_hook``,
  lazy imports inside functions too) and the keyword arguments passed when such a chain is called;
* ``getattr(torch_chain, "name", default)`` / ``hasattr``: optional names (absent is fine: the code falls back);
* methods called on tensors and modules (``x.register_post_accumulate_grad_hook(...)``): every attribute name
  the sources use that ``torch.Tensor`` / ``torch.nn.Module`` of the installed torch has, checked on 2.11's
  ``torch.Tensor`` / ``torch.nn.Module``, with their keyword arguments.

It resolves them in torch's Python sources (``.py`` and ``.pyi``, read from the wheel's zip, never
imported): module-level definitions, imports (``from x import *`` with ``__all__``), submodules, class bodies
and their base classes.

    python tools/torch_api_check.py                  # CI: the uses against the committed manifest (no torch 2.11)
    python tools/torch_api_check.py --wheel W.whl    # resolve every use in the wheel, rewrite the manifest
    python tools/torch_api_check.py --download       # the same with `pip download --no-deps torch==2.11.0`

The manifest (``tools/torch_2_11_api.json``) records, for each use, whether torch 2.11 has it.  CI fails when
a required use is missing in 2.11, or when the sources use something the manifest does not list yet (then
rerun with ``--download``: ~530 MB, about 10 s from PyPI).  Exit status 1 on either.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "tools" / "torch_2_11_api.json"
TORCH_VERSION = "2.11.0"
# what runs on the GPU machine: the package, and gpu_check with the benchmark modules it imports
SOURCES = ["accel_flatshard", "benchmarks/gpu_check.py", "benchmarks/gpu_check_offload.py",
           "benchmarks/gpu_check_nccl.py", "benchmarks/offload_adamw.py"]
INSTANCE_CLASSES = {"torch.Tensor": "Tensor", "torch.nn.Module": "Module"}


# ---------------------------------------------------------------------- what the sources use
class Uses:
    """Chains used (``{chain: {"optional": bool, "keywords": set, "where": [file:line]}}``)."""

    def __init__(self) -> None:
        self.chains: Dict[str, dict] = {}
        self.attribute_names: Dict[str, Set[str]] = {}  # attribute name -> keywords of calls (any object)
        self.attribute_where: Dict[str, str] = {}
        self.from_instances: Set[str] = set()  # chains added by instance_uses only

    def add(self, chain: str, where: str, optional: bool = False, keywords: Iterable[str] = ()) -> None:
        entry = self.chains.setdefault(chain, {"optional": True, "keywords": set(), "where": []})
        entry["optional"] &= optional
        entry["keywords"].update(keywords)
        if len(entry["where"]) < 3 and where not in entry["where"]:
            entry["where"].append(where)


def _dotted(node: ast.AST) -> Optional[List[str]]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _torch_aliases(tree: ast.Module) -> Dict[str, str]:
    """Local name -> torch dotted path, from every import in the file (lazy ones too)."""
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def scan_file(path: Path, uses: Uses) -> None:
    rel = str(path.relative_to(REPO))
    tree = ast.parse(path.read_text(), filename=rel)
    aliases = _torch_aliases(tree)

    def chain_of(node: ast.AST) -> Optional[str]:
        parts = _dotted(node)
        if parts and parts[0] in aliases:
            return ".".join([aliases[parts[0]]] + parts[1:])
        return None

    for value in set(aliases.values()):
        if value != "torch":
            uses.add(value, rel)
    inner = set()  # Attribute nodes that are the value of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            func = node.func
            keywords = [k.arg for k in node.keywords if k.arg]
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                base = chain_of(node.args[0])
                if base is not None:
                    optional = func.id == "hasattr" or len(node.args) == 3
                    uses.add(f"{base}.{node.args[1].value}", where, optional=optional)
                continue
            chain = chain_of(func)
            if chain is not None:
                uses.add(chain, where, keywords=keywords)
            elif isinstance(func, ast.Attribute):
                uses.attribute_names.setdefault(func.attr, set()).update(keywords)
                uses.attribute_where.setdefault(func.attr, where)
        elif isinstance(node, ast.Attribute):
            chain = chain_of(node)
            if chain is not None and id(node) not in inner:
                uses.add(chain, where)
            elif chain is None:
                uses.attribute_names.setdefault(node.attr, set())
                uses.attribute_where.setdefault(node.attr, where)


def scan_sources(roots: Iterable[str] = SOURCES) -> Uses:
    uses = Uses()
    for root in roots:
        path = REPO / root
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        for f in files:
            scan_file(f, uses)
    return uses


def instance_uses(uses: Uses, has_attribute: Callable[[str, str], bool]) -> None:
    """Add ``torch.Tensor.<name>`` / ``torch.nn.Module.<name>`` for every attribute name the sources use that
    the reference torch's class has (``has_attribute(class_chain, name)``)."""
    for name, keywords in sorted(uses.attribute_names.items()):
        if name.startswith("__"):
            continue
        for cls in INSTANCE_CLASSES:
            if has_attribute(cls, name):
                if f"{cls}.{name}" not in uses.chains:
                    uses.from_instances.add(f"{cls}.{name}")
                uses.add(f"{cls}.{name}", uses.attribute_where[name], keywords=keywords)


def installed_has_attribute(cls: str, name: str) -> bool:
    """The reference: the installed torch (CI's), imported."""
    import torch

    obj = {"torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module}[cls]
    return hasattr(obj, name)


# ---------------------------------------------------------------------- torch's sources
class Sources:
    """torch's ``.py`` / ``.pyi`` files by path, from a wheel (zip) or an installed tree (a directory)."""

    def __init__(self, location: Path) -> None:
        self.location = location
        if location.is_dir():
            root = location.parent
            self.files = {str(p.relative_to(root)): p for p in location.rglob("*.py*") if p.suffix in (".py", ".pyi")}
            self._read = lambda name: self.files[name].read_text(errors="replace")
        else:
            archive = zipfile.ZipFile(location)
            self.files = {n: n for n in archive.namelist() if n.startswith("torch/") and n.endswith((".py", ".pyi"))}
            self._read = lambda name: archive.read(name).decode("utf-8", "replace")

    def module_files(self, module: str) -> List[str]:
        base = module.replace(".", "/")
        found = [f for f in (base + "/__init__.py", base + "/__init__.pyi", base + ".py", base + ".pyi") if f in self.files]
        return found

    def is_package(self, module: str) -> bool:
        base = module.replace(".", "/")
        return base + "/__init__.py" in self.files or base + "/__init__.pyi" in self.files

    def read(self, name: str) -> str:
        return self._read(name)


class _Module:
    def __init__(self, name: str, is_package: bool) -> None:
        self.name, self.is_package = name, is_package
        self.names: Dict[str, tuple] = {}  # name -> ("def", [nodes]) | ("class", node) | ("value",) | ("ref", module, name) | ("module", m)
        self.stars: List[str] = []
        self.all: Optional[List[str]] = None
        self.dynamic = False  # module-level __getattr__


def _walk_body(body: List[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, through if/try/with blocks (not into functions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)) or type(stmt).__name__ == "TryStar":
            for field in ("body", "orelse", "finalbody"):
                yield from _walk_body(getattr(stmt, field, []) or [])
            for handler in getattr(stmt, "handlers", []):
                yield from _walk_body(handler.body)


def _scope_names(body: List[ast.stmt], module: str, is_package: bool) -> Tuple[Dict[str, tuple], List[str], Optional[List[str]]]:
    names: Dict[str, tuple] = {}
    stars: List[str] = []
    exported: Optional[List[str]] = None
    for stmt in _walk_body(body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            previous = names.get(stmt.name)
            nodes = previous[1] if previous and previous[0] == "def" else []
            names[stmt.name] = ("def", nodes + [stmt])
        elif isinstance(stmt, ast.ClassDef):
            names[stmt.name] = ("class", stmt, module)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name) and t.id not in names:
                        names[t.id] = ("value",)
            value = stmt.value
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and value is not None:
                try:
                    listed = [n for n in ast.literal_eval(value)]
                except (ValueError, TypeError, SyntaxError):
                    listed = []
                exported = (exported or []) + listed if isinstance(stmt, ast.AugAssign) else listed
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):  # __all__.extend([...])
            func = stmt.value.func
            if _dotted(func) == ["__all__", "extend"] and stmt.value.args:
                try:
                    exported = (exported or []) + list(ast.literal_eval(stmt.value.args[0]))
                except (ValueError, TypeError, SyntaxError):
                    pass
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.asname:
                    names[a.asname] = ("module", a.name)
                else:
                    top = a.name.split(".")[0]
                    names.setdefault(top, ("module", top))
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level:
                parts = module.split(".")
                keep = len(parts) - stmt.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([stmt.module] if stmt.module else []))
            else:
                base = stmt.module or ""
            for a in stmt.names:
                if a.name == "*":
                    stars.append(base)
                else:
                    names[a.asname or a.name] = ("ref", base, a.name)
    return names, stars, exported


class Resolver:
    """Does ``chain`` exist in the torch whose sources are given?  Answers "present", "absent" or "dynamic"
    (the last module before the miss defines ``__getattr__``: not decidable statically)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._modules: Dict[str, Optional[_Module]] = {}

    def module(self, name: str) -> Optional[_Module]:
        if name not in self._modules:
            self._modules[name] = None  # (cycles: a module being read has no names yet)
            files = self.sources.module_files(name)
            if not files:
                return None
            mod = _Module(name, self.sources.is_package(name))
            for f in files:  # .py first, then the .pyi stub (C extensions: only the stub)
                try:
                    tree = ast.parse(self.sources.read(f))
                except SyntaxError:
                    continue
                names, stars, exported = _scope_names(tree.body, name, mod.is_package)
                for key, value in names.items():
                    mod.names.setdefault(key, value)
                mod.stars += stars
                mod.all = exported if exported is not None else mod.all
                mod.dynamic |= "__getattr__" in names
            self._modules[name] = mod
        return self._modules[name]

    def lookup(self, module: str, name: str, seen: Optional[Set[Tuple[str, str]]] = None) -> Optional[tuple]:
        """What ``module.name`` is: ("module", m) | ("class", node, m) | ("def", nodes) | ("value",) | ("dynamic",)."""
        seen = seen if seen is not None else set()
        if (module, name) in seen:
            return None
        seen.add((module, name))
        mod = self.module(module)
        if mod is None:
            return None
        entry = mod.names.get(name)
        if entry is not None:
            if entry[0] == "ref":
                _, base, attr = entry
                if self.sources.module_files(f"{base}.{attr}"):
                    return ("module", f"{base}.{attr}")
                return self.lookup(base, attr, seen)
            return entry
        if self.sources.module_files(f"{module}.{name}"):
            return ("module", f"{module}.{name}")
        for star in mod.stars:
            star_mod = self.module(star)
            if star_mod is None or (star_mod.all is not None and name not in star_mod.all):
                continue
            if star_mod.all is None and name.startswith("_"):
                continue
            found = self.lookup(star, name, seen)
            if found is not None:
                return found
        return ("dynamic",) if mod.dynamic else None

    def class_member(self, cls: tuple, name: str, depth: int = 0) -> Optional[tuple]:
        _, node, module = cls
        names, _, _ = _scope_names(node.body, module, False)
        if name in names:
            return names[name]
        metaclass = [k.value for k in node.keywords if k.arg == "metaclass"]  # (class properties: group.WORLD)
        for base in list(node.bases) + metaclass:
            parts = _dotted(base)
            if not parts or depth > 20:
                continue
            target = self.resolve_parts(module, parts)
            if target is not None and target[0] == "class":
                found = self.class_member(target, name, depth + 1)
                if found is not None:
                    return found
        return None

    def resolve_parts(self, module: str, parts: List[str]) -> Optional[tuple]:
        """``parts`` as written in ``module``'s source (first part: a name of that module)."""
        current = self.lookup(module, parts[0])
        for part in parts[1:]:
            if current is None:
                return None
            kind = current[0]
            if kind == "module":
                current = self.lookup(current[1], part)
            elif kind == "class":
                current = self.class_member(current, part)
            else:  # a value or a function: deeper attributes are not checked
                return current
        return current

    def resolve(self, chain: str) -> Tuple[str, Optional[tuple]]:
        parts = chain.split(".")
        if parts[0] != "torch":
            return "absent", None
        current: Optional[tuple] = ("module", "torch")
        for part in parts[1:]:
            if current is None:
                break
            kind = current[0]
            if kind == "module":
                current = self.lookup(current[1], part)
            elif kind == "class":
                current = self.class_member(current, part)
            elif kind == "dynamic":
                return "dynamic", None
            else:
                return "present", current
        if current is None:
            return "absent", None
        return ("dynamic", None) if current[0] == "dynamic" else ("present", current)

    def keyword_ok(self, target: Optional[tuple], keyword: str) -> Optional[bool]:
        """Whether a call of ``target`` accepts ``keyword`` (None: not decidable, e.g. a value or no __init__)."""
        if target is None:
            return None
        if target[0] == "class":
            if any("dataclass" in ast.unparse(d) or "NamedTuple" in ast.unparse(d) for d in target[1].decorator_list) or \
                    any("NamedTuple" in ast.unparse(b) for b in target[1].bases):
                fields = [s.target.id for s in target[1].body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                return keyword in fields
            answers = [self.keyword_ok(self.class_member(target, m), keyword) for m in ("__init__", "__new__")]
            return True if True in answers else False if False in answers else None
        if target[0] != "def":
            return None
        for fn in target[1]:
            args = fn.args
            if args.kwarg is not None or keyword in [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]:
                return True
        return False


# ---------------------------------------------------------------------- check / manifest
def resolve_uses(uses: Uses, resolver: Resolver, reference: Optional[Resolver] = None) -> Dict[str, dict]:
    """Each use's status in ``resolver``'s torch: "present", "absent", or "unchecked" where the same static
    resolution in ``reference`` (the installed torch, where the code runs) does not find it either (a name
    made at run time, e.g. C attributes missing from the stubs; a method of another class than Tensor's)."""
    out: Dict[str, dict] = {}
    for chain, use in sorted(uses.chains.items()):
        status, target = resolver.resolve(chain)
        ref_status, ref_target = reference.resolve(chain) if reference is not None else (status, target)
        entry = {"status": "unchecked" if ref_status != "present" and status != "present" else status}
        keywords = {}
        for k in sorted(use["keywords"]):
            ok = resolver.keyword_ok(target, k)
            if reference is not None and reference.keyword_ok(ref_target, k) is not True:
                ok = ok or None
            keywords[k] = "present" if ok else "absent" if ok is False else "unchecked"
        if keywords:
            entry["keywords"] = keywords
        out[chain] = entry
    return out


def problems(uses: Uses, manifest: Dict[str, dict], same_reference: bool = True) -> Tuple[List[str], List[str]]:
    """(errors, notes): required uses absent in 2.11 or not in the manifest; optional ones absent (fallbacks).
    ``same_reference``: the installed torch is the one the manifest was made with; otherwise the instance
    methods it lists may differ (another torch's Tensor has other names) and those not listed are notes."""
    errors, notes = [], []
    for chain, use in sorted(uses.chains.items()):
        where = ", ".join(use["where"])
        entry = manifest.get(chain)
        if entry is None:
            (errors if same_reference or chain not in uses.from_instances else notes).append(
                f"{chain} ({where}) is not in {MANIFEST.name}: rerun with --download")
            continue
        if entry["status"] == "absent":
            (notes if use["optional"] else errors).append(
                f"{chain} ({where}) is absent in torch {TORCH_VERSION}" + (": the code falls back" if use["optional"] else ""))
        for keyword in sorted(use["keywords"]):
            state = entry.get("keywords", {}).get(keyword)
            if state is None:
                errors.append(f"{chain}({keyword}=) ({where}) is not in {MANIFEST.name}: rerun with --download")
            elif state == "absent":
                errors.append(f"{chain}({keyword}=) ({where}): torch {TORCH_VERSION} has no keyword {keyword!r}")
    return errors, notes


def download_wheel(directory: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"torch=={TORCH_VERSION}",
                    "-d", directory], check=True)
    return next(Path(directory).glob("torch-*.whl"))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="torch 2.11 wheel (or an unpacked torch/ directory) to resolve in")
    parser.add_argument("--download", action="store_true", help="pip download the torch 2.11 wheel to a temp dir")
    parser.add_argument("--verbose", action="store_true", help="list every use and its status")
    args = parser.parse_args(argv)
    uses = scan_sources()
    instance_uses(uses, installed_has_attribute)
    if args.wheel or args.download:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = args.wheel or download_wheel(tmp)
            import torch

            reference = Resolver(Sources(Path(torch.__file__).parent))
            resolved = resolve_uses(uses, Resolver(Sources(wheel)), reference)
        MANIFEST.write_text(json.dumps({"torch": TORCH_VERSION, "source": Path(wheel).name, "reference": torch.__version__,
                                        "generated_by": "python tools/torch_api_check.py --download",
                                        "uses": resolved}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {MANIFEST.relative_to(REPO)} ({len(resolved)} uses resolved in {Path(wheel).name})")
    import torch

    saved = json.loads(MANIFEST.read_text())
    manifest = saved["uses"]
    errors, notes = problems(uses, manifest, same_reference=saved.get("reference") == torch.__version__)
    if args.verbose:
        for chain in sorted(uses.chains):
            print(f"  {manifest.get(chain, {}).get('status', 'not in manifest'):9s} {chain}")
    for note in notes:
        print("note:", note)
    for error in errors:
        print("ERROR:", error)
    print(f"torch {TORCH_VERSION} API check: {len(uses.chains)} uses, {len(errors)} problems: "
          f"{'PASS' if not errors else 'FAIL'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
