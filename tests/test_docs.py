"""The documentation's shape: a short README that opens with the two commands, pages of at most 400 lines, no
broken internal link or anchor (images included), and a reason on every code block that is not run.

The blocks themselves run through Sybil (conftest.py at the repository root); this file checks what Sybil does
not: that a ``skip`` comment carries its reason and stands right before a python or bash block.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import List, Set

from docs_pages import DOCS, README, ROOT, all_doc_pages, docs_page

README_MAX_LINES = 200
PAGE_MAX_LINES = 400

_FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_SKIP = re.compile(r"<!--[ \t]*skip:(.*?)-->")


def without_fences(text: str) -> str:
    """The text with fenced blocks blanked (a ``#`` line there is a comment, not a heading)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked (they hold no links)."""
    return _INLINE_CODE.sub("``", without_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but ``-`` and ``_`` removed, spaces
    to hyphens."""
    heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    heading = heading.replace("`", "").replace("*", "").strip().lower()
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    seen: Counter = Counter()
    out = set()
    for heading in _HEADING.findall(without_fences(path.read_text())):
        base = slug(heading)
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def broken_links(path: Path, root: Path = ROOT) -> List[str]:
    problems = []
    for target in _LINK.findall(without_code(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not internal
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{where} (no such anchor)")
    return problems


def test_the_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert text.startswith("# accel_flatshard\n") and first_block
    assert text.index(first_block.group(0)) < text.index("\n## ")  # before any section
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make example", "make test"]


def test_no_docs_page_is_over_400_lines():
    long = {p.name: n for p in DOCS.glob("*.md") if (n := len(p.read_text().splitlines())) > PAGE_MAX_LINES}
    assert long == {}


def test_from_the_readme_alone():
    """The example, an unmodified script under the runner, and the checkpoint page one click away."""
    text = README.read_text()
    assert "make example" in text
    assert "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml -m accel_flatshard.run" in text
    assert "](docs/checkpoints.md)" in text or "](docs/checkpoints.md#" in text
    assert "(docs/ARCHITECTURE.md)" in text


def test_the_figures_are_referenced_where_they_belong():
    assert "(docs/figures/step_timeline.png)" in README.read_text()
    assert "(figures/plan.png)" in docs_page("planner").read_text()
    assert "(figures/bench.png)" in docs_page("performance").read_text()


def test_no_internal_link_or_anchor_is_broken():
    """Every relative link and image of README.md and docs/*.md names a file that exists and, after ``#``, a heading
    of that page. Until the figures' PNGs are merged (docs/figures/, made separately) the three figure paths are the
    only expected failures."""
    problems = [problem for path in all_doc_pages() for problem in broken_links(path)]
    assert problems == []


def test_every_block_not_run_says_why():
    """A ``skip`` comment is ``<!-- skip: next "reason" -->`` right before a python or bash block."""
    problems = []
    for path in all_doc_pages():
        text = path.read_text()
        for match in _SKIP.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            if not re.fullmatch(r' next "[^"]{10,}" ', match.group(1)):
                problems.append(f"{where}: not of the form next \"reason\"")
            elif not re.match(r"\n```(python|bash)\n", text[match.end():]):
                problems.append(f"{where}: not right before a python or bash block")
    assert problems == []


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading (x)\n")
    page.write_text("# Title\n\n[ok](other.md#a-code-heading-x) [ok](#title) ![img](missing.png) [bad](other.md#nope)"
                    " [bad](#gone) [web](https://example.org)\n```bash\n[not a link](nowhere.md)\n```\n")
    problems = [p.split(": ", 1)[1] for p in broken_links(page, tmp_path)]
    assert problems == ["missing.png (no such file)", "other.md#nope (no such anchor)", "#gone (no such anchor)"]

