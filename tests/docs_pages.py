"""Where the documentation lives, for the tests that hold it to the code: README.md and one page per topic in docs/.

``docs_page("accelerate")`` is docs/accelerate.md (the options), ``docs_page("versions")`` docs/versions.md
(the version window and the patch table), ``docs_page("ARCHITECTURE")`` the architecture of record; ``README``
is the short README.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def docs_page(name: str) -> Path:
    """docs/<name>.md, which must exist (a test that reads a page that moved fails here, naming it)."""
    path = DOCS / f"{name}.md"
    assert path.is_file(), f"no docs page {path.relative_to(ROOT)}: did its content move?"
    return path


def all_doc_pages():
    """README.md and every page of docs/, in a fixed order."""
    return [README, *sorted(DOCS.glob("*.md"))]
