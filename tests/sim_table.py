"""The mutation table derived from the code: every call that orders work across streams, broken in turn.

Sites (:func:`find_sites`): a walk of ``accel_flatshard/`` with ``ast`` lists every call of

* the device adapter's ``wait_stream``, ``wait_event``, ``record``, ``synchronize``, ``record_stream``,
  ``on``, ``collective``, ``to_device`` and ``to_host``;
* the engine's ``begin_step``, ``wait_unshard``, ``finish_reduces``, ``drain`` and ``wait_for`` (a collective's
  completion, ``handles.py``; ``_wait`` where it is imported under that name),

wherever it is called (a unit's ``wait_unshard`` included).  A site is named by file, enclosing function and
the call's rank among the calls of that name there (``engine.py::Engine.reshard::record_stream#0``), not by
line, so edits elsewhere do not rename it.

Mutations (:func:`mutate`): a wait, synchronize, record_stream, record or engine call is removed (its
arguments are still evaluated; an event ``record`` returns is one that covers no work); ``on`` and
``collective`` get the compute stream instead of their stream; ``to_device`` / ``to_host`` run on the
compute stream.  Each mutation is applied to a copy of the package (one copy, one file rewritten at a time).

Which tests (:func:`record_coverage`): the simulated tests (:data:`POOL`) run once, unmutated, on a copy
whose every site notes when it runs (:func:`instrument`): a site's candidates are the tests that executed
it, fastest first.  A mutation is
caught when one of them fails (``pytest -x``: the first failure ends the run; a test that hangs fails by
its timeout).  The runs are forked from one process that imported torch and transformers once.

A site no test catches must be an entry of :data:`EXCEPTIONS` with its reason (printed with the table);
anything else fails.  ``python tests/sim_table.py`` runs the whole table (CI: ``.ci/run``).
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "accel_flatshard"
TESTS = REPO / "tests"

# the simulated single-process tests (tests/test_sim_w2.py spawns processes: not a candidate; of a file that
# also launches processes, only its simulated tests, by node id)
POOL = ["tests/test_streams.py", "tests/test_offload_sim.py", "tests/test_sim_paths.py", "tests/test_matrix_optim_sim.py",
        "tests/test_async_save.py::test_cuda_snapshot_copies_on_a_side_stream_that_the_next_update_waits_for"]

REMOVE = {"wait_stream", "wait_event", "synchronize", "record_stream", "record",
          "begin_step", "wait_unshard", "finish_reduces", "drain", "wait_for", "_wait"}
COMPUTE_STREAM_ARG = {"on", "collective"}
ON_COMPUTE_STREAM = {"to_device", "to_host"}
ORDERING_CALLS = REMOVE | COMPUTE_STREAM_ARG | ON_COMPUTE_STREAM

# site -> why no simulated test can catch its mutation (printed with the table)
EXCEPTIONS: Dict[str, str] = {
    "core/device.py::CudaStreams.record_stream::record_stream#0":
        "the simulator's adapter replaces this body (it registers the tensor with the simulator); every "
        "call of the adapter's record_stream is a site of its own",
    "state/commit.py::snapshot_entries::record_stream#0":
        "redundant for every entry today: the compute stream waits for the copies' event right after "
        "(snapshot_entries' wait_event), so a source allocated on the compute stream (shards, optimizer state, "
        "full-state-dict clones) and dropped by the host is already ordered after its copy; it protects only a "
        "source allocated on another stream",
    "core/engine.py::Engine.reduce_grad::collective#0":
        "hpZ's first stage (reduce_scatter_inside_machine, deferred or not) needs a node group of 2 or more ranks and a "
        "column group across machines: the one-process simulator has neither (its hpZ stand-in is a node of one rank); "
        "tests/test_accumulation_links.py and tests/test_traffic.py run it over gloo at W=4 as 2 machines x 2 ranks, "
        "not on CUDA streams",
    "core/engine.py::Engine.reduce_grad.across_machines::record_stream#0":
        "hpZ's second stage (reduce_scatter_across_machines) reads the first stage's sums on the replica stream: the "
        "same reason as collective#0 (the one-process stand-in cannot reduce in two stages)",
    "core/engine.py::Engine.finish_reduces::record_stream#0":
        "redundant today: the carried sum is read next by the syncing micro-step's reduction, on a side stream that "
        "waits for the compute stream first, and reduce_grad's record_stream#0 records that stream, its last use; "
        "the simulator confirms it (removed, the deferred hybrid scenario still passes)",
}


@dataclass(frozen=True)
class Site:
    file: str  # relative to accel_flatshard/
    function: str  # enclosing class/function names, dotted ("<module>" at top level)
    name: str  # the called method
    rank: int  # among the calls of ``name`` in ``function``, in source order
    line: int
    end_line: int
    text: str  # the call, as written

    @property
    def id(self) -> str:
        return f"{self.file}::{self.function}::{self.name}#{self.rank}"

    @property
    def mutation(self) -> str:
        if self.name in REMOVE:
            return "removed"
        if self.name in COMPUTE_STREAM_ARG:
            return "compute stream instead of its stream"
        return "run on the compute stream"


def _called_name(call: ast.Call) -> Optional[str]:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _calls(tree: ast.AST) -> List[Tuple[str, ast.Call, ast.AST]]:
    """(enclosing function, call node, parent node) of every ordering call, in source order."""
    found: List[Tuple[str, ast.Call, ast.AST]] = []

    def visit(node: ast.AST, scope: List[str], parent: ast.AST) -> None:
        if isinstance(node, ast.Call) and _called_name(node) in ORDERING_CALLS:
            found.append((".".join(scope) or "<module>", node, parent))
        inner = scope + [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
        for child in ast.iter_child_nodes(node):
            visit(child, inner, node)

    visit(tree, [], tree)
    found.sort(key=lambda f: (f[1].lineno, f[1].col_offset))
    return found


def find_sites(package: Path = PACKAGE) -> List[Site]:
    sites: List[Site] = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        ranks: Dict[Tuple[str, str], int] = {}
        for function, call, _ in _calls(ast.parse(source)):
            name = _called_name(call)
            rank = ranks.get((function, name), 0)
            ranks[(function, name)] = rank + 1
            sites.append(Site(str(path.relative_to(package)), function, name, rank, call.lineno, call.end_lineno,
                              " ".join(ast.get_source_segment(source, call).split())))
    return sites


# ---------------------------------------------------------------------- mutations
_HELPERS = '''

def _sim_table_compute_stream(stream):  # (mutation table) the compute (default) stream of ``stream``'s device
    if stream is None:
        return None
    sim = getattr(stream, "sim", None)
    if sim is not None:
        return sim.default_stream(stream.index)
    import torch
    return torch.cuda.default_stream(stream.device)


def _sim_table_on_compute_stream(adapter, run):  # (mutation table) run a copy on the compute stream
    if not adapter.stream_ordered:
        return run()
    with adapter.on(adapter.api.default_stream(adapter.device.index)):
        return run()


def _sim_table_unrecorded_event(adapter):  # (mutation table) an event that covers no work
    return adapter.api.Event() if getattr(adapter, "stream_ordered", False) else None
'''


def _offset(line_starts: List[int], line: int, col: int) -> int:
    return line_starts[line - 1] + col


def mutate(source: str, site: Site) -> str:
    """``source`` (the file of ``site``) with the site's call broken; raises if the site is not there."""
    matches = [(call, parent) for function, call, parent in _calls(ast.parse(source))
               if function == site.function and _called_name(call) == site.name]
    if len(matches) <= site.rank:
        raise LookupError(f"site {site.id} not found")
    call, parent = matches[site.rank]
    data = source.encode()
    line_starts = [0]
    for line in data.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def span(node: ast.AST) -> Tuple[int, int]:
        return (_offset(line_starts, node.lineno, node.col_offset),
                _offset(line_starts, node.end_lineno, node.end_col_offset))

    def text(node: ast.AST) -> str:
        start, end = span(node)
        return data[start:end].decode()

    if site.name == "record" and not isinstance(parent, ast.Expr):  # an event that covers nothing
        target, replacement = call, f"_sim_table_unrecorded_event({text(call.func.value)})"
    elif site.name in REMOVE:
        # the arguments are still evaluated (``synchronize(self._free_events.popleft())`` still pops)
        values = [text(a) for a in call.args] + [text(k.value) for k in call.keywords if k.arg is not None]
        if values and len(values) == len(call.args) + len(call.keywords):
            target, replacement = call, "(" + ", ".join(values) + ",)"
        else:
            target, replacement = (parent, "pass") if isinstance(parent, ast.Expr) else (call, "None")
    elif site.name in COMPUTE_STREAM_ARG:
        target = call.args[0]
        replacement = f"_sim_table_compute_stream({text(target)})"
    else:
        receiver = text(call.func.value)
        target, replacement = call, f"_sim_table_on_compute_stream({receiver}, lambda: {text(call)})"
    start, end = span(target)
    return (data[:start] + replacement.encode() + data[end:]).decode() + _HELPERS


# ---------------------------------------------------------------------- runs (forked from this process)
def _pytest_args(node_ids: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
    return ["-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", "-c", str(REPO / "pyproject.toml"),
            "--rootdir", str(REPO), *extra, *node_ids]


def _forked(copy_root: Path, run, timeout_s: float) -> Tuple[str, float]:
    """Run ``run()`` (returning an exit code) in a child that imports the package from ``copy_root``;
    returns ("passed" | "failed" | "hang" | "error:<code>", seconds)."""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 70
        try:
            sys.path.insert(0, str(copy_root))
            sys.path.insert(1, str(TESTS))
            for name, module in list(sys.modules.items()):  # a parent that imported the checkout's package
                where = getattr(module, "__file__", None) or ""  # (or test modules that hold its classes)
                if name.split(".")[0] == "accel_flatshard" or where.startswith(str(TESTS)):
                    del sys.modules[name]
            import accel_flatshard

            assert Path(accel_flatshard.__file__).parent == copy_root / "accel_flatshard", accel_flatshard.__file__
            code = run()
        except BaseException:  # noqa: BLE001 - reported as an error code
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))
    deadline = start + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang", time.monotonic() - start
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    outcome = {0: "passed", 1: "failed"}.get(code, f"error:{code}")
    return outcome, time.monotonic() - start


_PROBE = '''

def _sim_table_hit(site, value):  # (mutation table) the site was executed: noted for the running test
    import sys
    getattr(sys, "_sim_table_hits", set()).add(site)
    return value
'''


def instrument(source: str, sites: Sequence[Site]) -> str:
    """``source`` with every call of ``sites`` wrapped in ``_sim_table_hit(site_id, <call>)``."""
    wanted = {(site.function, site.name, site.rank): site for site in sites}
    data = source.encode()
    line_starts = [0]
    for line in data.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    inserts = []  # (offset, order, text): applied from the end so that offsets stay valid
    ranks: Dict[Tuple[str, str], int] = {}
    for function, call, _ in _calls(ast.parse(source)):
        name = _called_name(call)
        rank = ranks.get((function, name), 0)
        ranks[(function, name)] = rank + 1
        site = wanted.get((function, name, rank))
        if site is not None:
            inserts.append((_offset(line_starts, call.lineno, call.col_offset), 1, f"_sim_table_hit({site.id!r}, "))
            inserts.append((_offset(line_starts, call.end_lineno, call.end_col_offset), 0, ")"))
    for offset, _, text in sorted(inserts, reverse=True):
        data = data[:offset] + text.encode() + data[offset:]
    return data.decode() + _PROBE


def record_coverage(copy_root: Path, out: Path, sites: Sequence[Site], node_ids: Sequence[str] = (),
                    timeout_s: float = 1800) -> Dict:
    """Run the pool once on a copy whose sites note when they run; writes and returns
    ``{"tests": {nodeid: {"seconds": s, "sites": [site id, ...]}}, "failed": [...]}``."""
    files = sorted({site.file for site in sites})
    for file in files:
        target = copy_root / "accel_flatshard" / file
        target.write_text(instrument(target.read_text(), [s for s in sites if s.file == file]))

    def run() -> int:
        import pytest

        sys._sim_table_hits = set()
        record: Dict[str, Dict] = {}
        failed: List[str] = []

        class Recorder:
            @pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_protocol(self, item, nextitem):
                sys._sim_table_hits = set()
                start = time.monotonic()
                yield
                record[item.nodeid] = {"seconds": time.monotonic() - start, "sites": sorted(sys._sim_table_hits)}

            def pytest_runtest_logreport(self, report):
                if report.failed:
                    failed.append(report.nodeid)

        args = _pytest_args(node_ids or [str(REPO / p) for p in POOL])
        args.remove("-x")
        code = pytest.main(args, plugins=[Recorder()])
        out.write_text(json.dumps({"tests": record, "failed": failed}))
        return int(code)

    try:
        outcome, _ = _forked(copy_root, run, timeout_s)
    finally:
        for file in files:
            shutil.copyfile(PACKAGE / file, copy_root / "accel_flatshard" / file)
    if not out.exists():
        raise RuntimeError(f"the coverage run of the simulated tests ended with {outcome} and no record")
    return json.loads(out.read_text())


def candidates(site: Site, coverage: Dict) -> List[str]:
    """Tests that executed ``site``, fastest first."""
    hits = [(info["seconds"], nodeid) for nodeid, info in coverage["tests"].items() if site.id in info["sites"]]
    return [nodeid for _, nodeid in sorted(hits)]


@dataclass
class Row:
    id: str
    text: str
    outcome: str  # "caught" | "caught (hang)" | "survived" | "not executed" | "excepted" | "error:<code>"
    by: Optional[str]  # the test that failed (when caught)
    tried: int  # candidate tests
    seconds: float

    def line(self) -> str:
        by = self.by.split("::", 1)[-1] if self.by else ""
        return f"{self.outcome:>13}  {self.id:<66} {self.seconds:5.1f} s  {by}"


def run_mutation(copy_root: Path, file: str, source: str, selection: Sequence[str],
                 timeouts: Dict[str, float], timeout_s: float) -> Tuple[str, Optional[str], float]:
    """Write ``source`` as ``file`` of the copy, run pytest on ``selection`` (-x; a test with an entry in
    ``timeouts`` fails after that many seconds) in a child, restore the copy.
    Returns (outcome, the first test that failed, seconds)."""
    target = copy_root / "accel_flatshard" / file
    original = target.read_text()
    result = copy_root / "first_failure.txt"
    result.unlink(missing_ok=True)
    try:
        target.write_text(source)

        def run() -> int:
            import pytest

            class Plugin:
                def pytest_collection_modifyitems(self, items):
                    for item in items:
                        if item.nodeid in timeouts:
                            item.add_marker(pytest.mark.timeout(timeouts[item.nodeid]))

                def pytest_runtest_logreport(self, report):
                    if report.failed and not result.exists():
                        result.write_text(report.nodeid)

            sys.stdout = sys.stderr = open(os.devnull, "w")  # the table prints its own rows
            return int(pytest.main(_pytest_args(selection), plugins=[Plugin()]))

        outcome, seconds = _forked(copy_root, run, timeout_s=timeout_s)
    finally:
        target.write_text(original)
    by = result.read_text() if result.exists() else None
    return outcome, by, seconds


def copy_package(root: Path) -> Path:
    shutil.copytree(PACKAGE, root / "accel_flatshard", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _one_thread() -> None:
    """Every run on one intra-op thread: on a loaded 2-core machine two OpenMP threads per process spin
    for each tiny op (measured: 3 us per op on one thread, 500 us on two)."""
    import torch

    torch.set_num_threads(1)


def run_table(sites: Optional[Sequence[Site]] = None, hand_rows: Sequence = (), log=print) -> List[Row]:
    """The table (every site, or ``sites``; then the hand-kept ``hand_rows``): coverage, then one
    mutation per row."""
    _one_thread()
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported once, shared by every forked run
    import pytest  # noqa: F401

    sites = list(sites if sites is not None else find_sites())
    rows: List[Row] = []
    with tempfile.TemporaryDirectory(prefix="sim_table_") as tmp:
        root = copy_package(Path(tmp))
        start = time.monotonic()
        coverage = record_coverage(root, root / "coverage.json", find_sites())
        if coverage["failed"]:
            raise RuntimeError(f"simulated tests fail without any mutation: {coverage['failed']}")
        log(f"coverage: {len(coverage['tests'])} simulated tests in {time.monotonic() - start:.0f} s")
        timeouts = {t: 3 * info["seconds"] + 10 for t, info in coverage["tests"].items()}
        for site in sites:
            tests = candidates(site, coverage)
            if site.id in EXCEPTIONS:
                rows.append(Row(site.id, site.text, "excepted", None, 0, 0.0))
            elif not tests:
                rows.append(Row(site.id, site.text, "not executed", None, 0, 0.0))
            else:
                source = mutate((root / "accel_flatshard" / site.file).read_text(), site)
                limit = sum(timeouts[t] for t in tests) + 120
                outcome, by, seconds = run_mutation(root, site.file, source, [str(REPO / t) for t in tests],
                                                    timeouts, limit)
                rows.append(Row(site.id, site.text, _verdict(outcome, by), by, len(tests), seconds))
            log(rows[-1].line())
        for mutation in hand_rows:
            source = apply_hand_row(mutation, (root / "accel_flatshard" / mutation.file).read_text())
            selection = [str(REPO / mutation.tests_file), "-k", " or ".join(f"({k})" for k in mutation.tests)]
            outcome, by, seconds = run_mutation(root, mutation.file, source, selection, timeouts, 900)
            rows.append(Row(f"(by hand) {mutation.name}", mutation.original.strip(), _verdict(outcome, by), by,
                            0, seconds))
            log(rows[-1].line())
    return rows


def apply_hand_row(mutation, source: str) -> str:
    from test_sim_mutations import apply

    return apply(mutation, source)


def _verdict(outcome: str, by: Optional[str]) -> str:
    """A test that failed, hung or crashed the interpreter (a signal: freed memory read) catches the row;
    any other exit (pytest usage error, the copy not importable) is reported as it is."""
    if outcome == "failed" and by is not None:
        return "caught"
    if outcome == "hang":
        return "caught (hang)"
    if outcome.startswith("error:-"):
        return f"caught (crash, signal {outcome[7:]})"
    return {"passed": "survived"}.get(outcome, outcome)


def summary(rows: Sequence[Row]) -> Tuple[str, List[Row]]:
    """The printed verdict and the rows that fail the table (uncaught without a reason)."""
    caught = [r for r in rows if r.outcome.startswith("caught")]
    excepted = [r for r in rows if r.outcome == "excepted"]
    bad = [r for r in rows if not r.outcome.startswith("caught") and r.outcome != "excepted"]
    hand = sum(r.id.startswith("(by hand)") for r in rows)
    lines = [f"ordering call sites: {len(rows) - hand} found, {len(caught) - sum(r.id.startswith('(by hand)') for r in caught)}"
             f" caught, {len(excepted)} excepted; hand-kept rows: {hand}; uncaught: {len(bad)}"]
    lines += [f"  excepted {r.id}: {EXCEPTIONS[r.id]}" for r in excepted]
    lines += [f"  UNCAUGHT ({r.outcome}) {r.id}: {r.text}" for r in bad]
    return "\n".join(lines), bad


REPRESENTATIVE = ("core/engine.py::Engine.reduce_grad::wait_stream#0", "core/device.py::CudaStreams.record_stream::record_stream#0",
                  "tests/test_streams.py::test_fp16_gradients_are_divided_before_and_after_the_sum[8-30720.0-cuda]")


def representative() -> int:
    """Two rows on one fast test, without the coverage run: the reduce-scatter stream not waiting for the
    gradient must be caught; a break of code the simulator never runs must survive (the runner reports
    only real failures)."""
    _one_thread()
    import transformers.models.llama.modeling_llama  # noqa: F401

    caught_id, harmless_id, test = REPRESENTATIVE
    sites = {s.id: s for s in find_sites()}
    outcomes = {}
    with tempfile.TemporaryDirectory(prefix="sim_table_") as tmp:
        root = copy_package(Path(tmp))
        for site_id in (caught_id, harmless_id):
            site = sites[site_id]
            source = mutate((root / "accel_flatshard" / site.file).read_text(), site)
            outcome, by, seconds = run_mutation(root, site.file, source, [str(REPO / test)], {}, 600)
            outcomes[site_id] = _verdict(outcome, by)
            print(f"{outcomes[site_id]:>13}  {site_id}  {seconds:.1f} s")
    return 0 if outcomes == {caught_id: "caught", harmless_id: "survived"} else 1


def main(argv: Sequence[str] = ()) -> int:
    """``python tests/sim_table.py [SUBSTRING ...]``: the whole table, or the sites whose id contains one
    of the substrings (then without the hand-kept rows); ``--representative``: :func:`representative`."""
    sys.path.insert(0, str(TESTS))
    if "--representative" in argv:
        return representative()
    from test_sim_mutations import MUTATIONS

    only = [a for a in argv if not a.startswith("-")]
    all_sites = find_sites()
    sites = [s for s in all_sites if not only or any(o in s.id for o in only)]
    start, cpu = time.monotonic(), _children_cpu()
    rows = run_table(sites, () if only else MUTATIONS)
    text, bad = summary(rows)
    stale = sorted(set(EXCEPTIONS) - {s.id for s in all_sites})
    if stale:
        text += f"\n  STALE exceptions (no such site): {stale}"
    print(text)
    print(f"mutation table: {time.monotonic() - start:.0f} s wall, {_children_cpu() - cpu:.0f} s CPU "
          f"(load average {os.getloadavg()[0]:.1f})")
    return 1 if bad or stale else 0


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
