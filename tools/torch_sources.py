"""torch's sources read without importing them: does a dotted name (``torch.cuda.Stream.wait_stream``) exist in a
given torch, and does a call of it accept a keyword or a number of positional arguments?  For
``tools/torch_api_check.py`` (the torch 2.11 API check): it resolves the names in a wheel's ``.py`` / ``.pyi`` files
(read from the zip) or an installed tree: module-level definitions, imports (``from x import *`` with
``__all__``), submodules, class bodies and their base classes.
"""
from __future__ import annotations

import ast
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple


def dotted(node: ast.AST) -> Optional[List[str]]:
    """``a.b.c`` as ["a", "b", "c"] (None: not a dotted name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None



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
            if dotted(func) == ["__all__", "extend"] and stmt.value.args:
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
            found = names[name]
            return ("method", found[1]) if found[0] == "def" else found  # (a method: self is not an argument)
        metaclass = [k.value for k in node.keywords if k.arg == "metaclass"]  # (class properties: group.WORLD)
        for base in list(node.bases) + metaclass:
            parts = dotted(base)
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
        if target[0] not in ("def", "method"):
            return None
        for fn in target[1]:
            args = fn.args
            if args.kwarg is not None or keyword in [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]:
                return True
        return False


    def positional_ok(self, target: Optional[tuple], count: int) -> Optional[bool]:
        """Whether a call of ``target`` accepts ``count`` positional arguments (None: not decidable).  A method's
        ``self`` / ``cls`` is not counted; any overload (``.pyi``) that takes them will do."""
        if target is None:
            return None
        if target[0] == "class":
            if any("dataclass" in ast.unparse(d) for d in target[1].decorator_list) or \
                    any("NamedTuple" in ast.unparse(b) for b in target[1].bases):
                return None
            answers = [self.positional_ok(self.class_member(target, m), count) for m in ("__init__", "__new__")]
            return True if True in answers else False if False in answers else None
        if target[0] not in ("def", "method"):
            return None
        for fn in target[1]:
            args = fn.args
            names = [a.arg for a in args.posonlyargs + args.args]
            static = any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list)
            bound = 1 if target[0] == "method" and names and not static else 0
            if args.vararg is not None or len(names) - bound >= count:
                return True
        return False
