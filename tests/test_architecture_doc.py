"""docs/ARCHITECTURE.md stays true: every file, class, function and member it names in backticks exists.

What the document names, by the form of a backticked span:

* a file: ``x.py`` or ``dir/`` (under the repository root or ``accel_flatshard/``), or ``dir/file.md`` and such;
* a class: ``CamelCase`` (Python's builtins excepted); ``Class.member`` / ``Class.method()``: a member of it (a
  method, class attribute or ``self.member`` assignment);
* a function: ``name()`` (a module-level function or a method of the package);
* a module attribute: ``module.NAME`` or ``module.function()`` where ``module`` is a package module's last name.

Other spans (options, library names, values) are not checked.
"""
from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "accel_flatshard"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

_SPAN = re.compile(r"`([^`\n]+)`")
_NAME = re.compile(r"^(?P<head>[A-Za-z_]\w*)(?:\.(?P<member>\w+))?(?P<call>\(\))?$")
_CLASS = re.compile(r"^_?[A-Z]\w*[a-z]\w*$")  # CamelCase (not an ALL_CAPS constant)
_FILE = re.compile(r"^[\w./-]+$")


class Index:
    """The package's classes (with their members), functions and module-level names, from its source."""

    def __init__(self, paths) -> None:
        self.classes: Dict[str, Set[str]] = {}
        self.functions: Set[str] = set()
        self.modules: Dict[str, Set[str]] = {}  # a module's last name -> its module-level names
        for path in paths:
            tree = ast.parse(path.read_text())
            name = path.parent.name if path.name == "__init__.py" else path.stem
            top = self.modules.setdefault(name, set())
            for node in tree.body:
                top.update(_bound(node))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.add(node.name)
                elif isinstance(node, ast.ClassDef):
                    members = self.classes.setdefault(node.name, set())
                    for item in node.body:
                        members.update(_bound(item))
                    for sub in ast.walk(node):  # self.member = ... in its methods
                        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                                and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                            members.add(sub.attr)


def _bound(node: ast.AST) -> Set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


def package_index() -> Index:
    return Index([*PACKAGE.rglob("*.py"), ROOT / "accel_flatshard_autoload.py"])


def named(text: str, index: Index) -> List[Tuple[str, str]]:
    """``(kind, span)`` for every span of ``text`` that names a file, class, function, member or module attribute."""
    out = []
    for span in _SPAN.findall(text):
        if _FILE.match(span) and (span.endswith((".py", "/")) or ("/" in span and "." in span.rpartition("/")[2])):
            out.append(("file", span))
            continue
        match = _NAME.match(span)
        if not match:
            continue
        head, member, call = match["head"], match["member"], match["call"]
        if _CLASS.match(head) and not hasattr(builtins, head):
            out.append(("member" if member else "class", span))
        elif head[0].islower() and member is None and call:
            out.append(("function", span))
        elif head[0].islower() and member is not None and head in index.modules:
            out.append(("module attribute", span))
    return out


def exists(kind: str, span: str, index: Index, root: Path = ROOT) -> bool:
    if kind == "file":
        return (root / span).exists() or (root / "accel_flatshard" / span).exists()
    match = _NAME.match(span)
    head, member = match["head"], match["member"]
    if kind == "class":
        return head in index.classes
    if kind == "member":
        return member in index.classes.get(head, ())
    if kind == "function":
        return head in index.functions
    return member in index.modules[head]


def stale(kind: str) -> List[str]:
    index = package_index()
    spans = [span for k, span in named(DOC.read_text(), index) if k == kind]
    assert len(spans) >= 3, f"the document names fewer than 3 of kind {kind}: the parser is broken"
    return [span for span in spans if not exists(kind, span, index)]


def test_every_file_it_names_exists():
    assert stale("file") == []


def test_every_class_it_names_exists():
    assert stale("class") == []


def test_every_function_it_names_exists():
    assert stale("function") == []


def test_every_class_member_it_names_exists():
    assert stale("member") == []


def test_every_module_attribute_it_names_exists():
    assert stale("module attribute") == []


def test_every_package_module_has_a_paragraph():
    text = DOC.read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
               if f"`{p.relative_to(ROOT)}`" not in text and f"`{p.relative_to(PACKAGE)}`" not in text]
    assert missing == []


def test_the_readme_links_to_it():
    assert "(docs/ARCHITECTURE.md)" in (ROOT / "README.md").read_text()


def test_the_check_reports_stale_names(tmp_path):
    """The check can fail: a renamed file, class, function, method or module attribute is reported."""
    (tmp_path / "mod.py").write_text("class Real:\n    def __init__(self):\n        self.x = 1\n\n    def go(self):\n"
                                     "        pass\n\n\ndef helper():\n    pass\n\n\nLIMIT = 2\n")
    index = Index([tmp_path / "mod.py"])
    text = ("`mod.py` `gone.py` `Real` `Gone` `Real.go()` `Real.x` `Real.gone()` `helper()` `gone()` `mod.LIMIT` "
            "`mod.GONE` `RuntimeError` `torch.cuda` `IDLE` `async_op=True`")
    found = [(kind, span, exists(kind, span, index, tmp_path)) for kind, span in named(text, index)]
    assert found == [
        ("file", "mod.py", True), ("file", "gone.py", False), ("class", "Real", True), ("class", "Gone", False),
        ("member", "Real.go()", True), ("member", "Real.x", True), ("member", "Real.gone()", False),
        ("function", "helper()", True), ("function", "gone()", False), ("module attribute", "mod.LIMIT", True),
        ("module attribute", "mod.GONE", False),
    ]
