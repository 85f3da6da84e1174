"""The mutation table derived from the code (tests/sim_table.py): its sites, its runner, and the whole table.

By default: every ordering call of the package is a site whose mutation applies (a refactor that moves
code keeps it in the table; a new call joins it by itself), the exceptions name existing sites, and the
runner catches one representative break and lets a harmless one pass.  ``slow`` (and CI, .ci/run): the
whole table, which fails if any site is uncaught without a listed reason.
"""
import subprocess
import sys

import pytest

import sim_table
from sim_table import EXCEPTIONS, ORDERING_CALLS, find_sites, instrument, mutate

SCRIPT = str(sim_table.TESTS / "sim_table.py")


def test_every_ordering_call_is_a_site_whose_break_applies():
    sites = find_sites()
    by_file = {}
    for site in sites:
        by_file.setdefault(site.file, []).append(site)
    assert {s.name for s in sites} == ORDERING_CALLS  # every kind of ordering call is used (else: a stale kind)
    assert len({s.id for s in sites}) == len(sites)
    for file, file_sites in by_file.items():
        source = (sim_table.PACKAGE / file).read_text()
        compile(instrument(source, file_sites), file, "exec")
        for site in file_sites:
            broken = mutate(source, site)
            assert broken != source + sim_table._HELPERS, site.id
            compile(broken, file, "exec")
    assert set(EXCEPTIONS) <= {s.id for s in sites}, "an exception names no site: update sim_table.EXCEPTIONS"
    print(f"{len(sites)} ordering call sites in {len(by_file)} files, {len(EXCEPTIONS)} excepted")


def test_a_site_is_named_by_function_and_rank_not_by_line():
    source = "class A:\n    def f(self, s):\n        s.synchronize(e)\n\n        s.synchronize(s.record(x))\n"
    tree_sites = sim_table._calls(sim_table.ast.parse(source))
    assert [sim_table._called_name(c) for _, c, _ in tree_sites] == ["synchronize", "synchronize", "record"]
    site = sim_table.Site("m.py", "A.f", "synchronize", 1, 5, 5, "s.synchronize(s.record(x))")
    assert "        (s.record(x),)\n" in mutate(source, site)  # removed, its argument still evaluated
    moved = "\n\n" + source  # two lines further down: the same site
    assert "(s.record(x),)" in mutate(moved, site)
    record = sim_table.Site("m.py", "A.f", "record", 0, 5, 5, "s.record(x)")
    assert "s.synchronize(_sim_table_unrecorded_event(s))" in mutate(source, record)  # an event of nothing
    on = "def g(s, t):\n    with s.on(t):\n        pass\n"
    assert "with s.on(_sim_table_compute_stream(t)):" in mutate(on, sim_table.Site("m.py", "g", "on", 0, 2, 2, ""))


def test_the_runner_catches_a_break_and_passes_a_harmless_one():
    result = subprocess.run([sys.executable, SCRIPT, "--representative"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


@pytest.mark.slow
def test_the_derived_mutation_table():
    """Every ordering call of the package, broken in turn, fails a simulated test (or is excepted)."""
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=3600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
