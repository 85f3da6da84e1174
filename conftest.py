"""The documentation's code blocks as tests: every ```python and ```bash block of README.md and docs/*.md.

Collected by Sybil (pyproject.toml's ``testpaths`` names README.md and docs/). A block runs unless an HTML comment
``<!-- skip: next "reason" -->`` right before it says why not (GPU only, several machines, long-running, a fragment
of a user's script); tests/test_docs.py checks that every such comment gives a reason. The blocks of one page run in
order in one namespace (python) in an empty folder, as one process of a launch of one rank (``RANK=0``,
``WORLD_SIZE=1``, a free ``MASTER_PORT``, as torchrun sets them), so ``dist.init_process_group("gloo")`` works; the
page's process group, environment and folder are undone after its last block. Bash blocks run in ``bash -e -o
pipefail`` with this interpreter's ``bin/`` first on ``PATH``. The run ends with one line per page: blocks run and
not run, and each reason.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent
DOC_PATTERNS = ["README.md", "docs/*.md"]
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(namespace) -> None:
    namespace["_saved"] = ({k: os.environ.get(k) for k in _RANK_ENV}, os.getcwd(), tempfile.mkdtemp(prefix="docs_"))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    os.chdir(namespace["_saved"][2])


def _teardown(namespace) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    env, cwd, folder = namespace["_saved"]
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.chdir(cwd)
    shutil.rmtree(folder, ignore_errors=True)


def _run_bash(example) -> None:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", str(example.parsed)], env=env,
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(f"bash block exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
                             f"--- stderr\n{result.stderr[-3000:]}")


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), CodeBlockParser(language="bash", evaluator=_run_bash), SkipParser()],
    patterns=DOC_PATTERNS, path=".", setup=_setup, teardown=_teardown,
).pytest()


_CODE_BLOCKS = set()  # node ids of the python / bash blocks (a skip comment is an example of its own)


def pytest_collection_modifyitems(items):
    for item in items:
        example = getattr(item, "example", None)
        if example is not None and not isinstance(example.region.evaluator, Skipper):
            _CODE_BLOCKS.add(item.nodeid)


def _is_doc(nodeid: str) -> bool:
    return nodeid in _CODE_BLOCKS


def pytest_terminal_summary(terminalreporter):
    run, not_run, failed = 0, [], 0
    for key in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(key, []):
            if not _is_doc(getattr(report, "nodeid", "")) or report.when not in ("call", "setup"):
                continue
            if key == "skipped":
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                where = report.nodeid.replace("::line:", ", line ").split(",column:")[0]
                not_run.append((where, reason.removeprefix("Skipped: ")))
            elif report.when == "call":
                run += 1
                failed += key != "passed"
    if not run and not not_run:
        return
    terminalreporter.write_sep("-", f"doc blocks: {run} run ({failed} failed), {len(not_run)} not run")
    for where, reason in sorted(not_run, key=lambda item: (item[0].split(",")[0], int(item[0].rpartition(" ")[2]))):
        terminalreporter.write_line(f"not run  {where}: {reason}")
