"""docs/ARCHITECTURE.md (and its continuation, docs/architecture-details.md) stays true: every file, class, function and member it names in backticks exists.

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
# split to keep each page under 400 lines (tests/test_docs.py): sections 5 to 8 continue here
DOCS = [DOC, ROOT / "docs" / "architecture-details.md"]


def doc_text() -> str:
    """The whole architecture document: both pages, in order."""
    return "\n".join(path.read_text() for path in DOCS)

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
    spans = [span for k, span in named(doc_text(), index) if k == kind]
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
    text = doc_text()
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


def module_paragraphs(text: str) -> List[Tuple[List[str], str]]:
    """Section 2's bullets: (the files a bullet opens with, the bullet's text)."""
    section = text.split("## 2. Modules", 1)[1].split("\n## 3.", 1)[0]
    bullets, current = [], None
    for line in section.splitlines():
        if line.startswith("- `"):
            current = [line]
            bullets.append(current)
        elif line.startswith("  ") and current is not None:
            current.append(line)
        else:
            current = None
    out = []
    for lines in bullets:
        body = " ".join(lines)
        head = body.split(":", 1)[0]
        files = []
        for span in _SPAN.findall(head):
            path = span if span.startswith("accel_flatshard") else f"accel_flatshard/{span}"
            if span.endswith(".py"):
                files.append(path)
            if path.startswith("accel_flatshard/plan/") and not files[-1:] == [path]:
                files.append(path)
        if files:
            out.append((files, body))
    return out


def misplaced(text: str, root: Path = ROOT) -> List[str]:
    """Functions, classes and members a module's paragraph names that its own module(s) do not define (a name from
    another module is written ``module.Name``, a module attribute, checked in that module)."""
    problems = []
    for files, body in module_paragraphs(text):
        paths = [root / f for f in files]
        own = Index([p for p in paths if p.exists()])
        for kind, span in named(body, own):
            if kind in ("function", "class", "member") and not exists(kind, span, own, root):
                problems.append(f"{', '.join(files)}: {span}")
    return problems


def test_each_module_paragraph_names_what_its_module_defines():
    assert len(module_paragraphs(DOC.read_text())) >= 30
    assert misplaced(DOC.read_text()) == []


def test_the_per_module_check_finds_a_function_in_the_wrong_module(tmp_path):
    (tmp_path / "accel_flatshard").mkdir()
    (tmp_path / "accel_flatshard" / "a.py").write_text("def here():\n    pass\n")
    (tmp_path / "accel_flatshard" / "b.py").write_text("def there():\n    pass\n")
    text = ("## 2. Modules\n\n- `accel_flatshard/a.py`: `here()` and `there()`,\n  and `b.there()`.\n"
            "- `accel_flatshard/b.py`: `there()`.\n\n## 3. Next\n")
    assert misplaced(text, tmp_path) == ["accel_flatshard/a.py: there()"]


def layer_table(text: str) -> List[str]:
    """Section 1's table, in its order: the folder each row names (``core`` for `` `core/` ``), ``root`` for the
    package's root modules."""
    section = text.split("## 1. Layers", 1)[1].split("\n## 2.", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    out = []
    for row in rows[2:]:  # (the header and its rule)
        cell = row.strip("|").split("|")[0].strip()
        if cell == "root":
            out.append("root")
        else:
            spans = _SPAN.findall(cell)
            assert len(spans) == 1 and spans[0].endswith("/"), f"a layer row names one folder, `x/`: {row}"
            out.append(spans[0].rstrip("/"))
    return out


def test_the_layer_table_lists_the_folders_of_the_layer_test_in_order():
    from test_layers import FOLDERS  # (tests/ is on sys.path under pytest)

    assert layer_table(DOC.read_text()) == [*FOLDERS, "root"]


def test_the_layer_table_check_finds_a_wrong_order():
    from test_layers import FOLDERS

    text = DOC.read_text()
    rows = [line for line in text.split("## 1. Layers", 1)[1].split("\n## 2.", 1)[0].splitlines()
            if line.startswith("| `core/`") or line.startswith("| `features/`")]
    assert len(rows) == 2
    swapped = text.replace(rows[0], "\0").replace(rows[1], rows[0]).replace("\0", rows[1])
    assert layer_table(swapped) == ["features", "core", *FOLDERS[2:], "root"] != [*FOLDERS, "root"]
    planted = "## 1. Layers\n\n| folder | owns |\n|---|---|\n| `state/` | x |\n| `core/` | y |\n| root | z |\n\n## 2. M\n"
    assert layer_table(planted) == ["state", "core", "root"]
