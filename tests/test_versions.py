"""The supported version window (integrations/versions.py) against the test environments' records.

``make test`` installs ``constraints/pinned.txt`` (pip ``-c``), so the window test reads those pins, never what a
registry serves today: a release that comes out after the commit cannot fail the README's test command.  The
newest set ``make test-latest`` passed with is ``constraints/newest.txt``; the window must cover it, so the window
cannot fall behind the tested releases without a test saying so.  The lower bounds are ``.ci/oldest.sh``'s pins.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

from accel_flatshard.integrations import versions
from docs_pages import docs_page

REPO = Path(__file__).resolve().parents[1]


def _pins_tool():
    spec = importlib.util.spec_from_file_location("pins", REPO / "tools" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pins = _pins_tool()


def _windowed(record: dict) -> dict:
    """The window's libraries in a pins record: ``{name: version}`` (every one must be there)."""
    found = {name: record.get(pins.normalise(name)) for name in versions.SUPPORTED}
    missing = [name for name, version in found.items() if version is None]
    assert not missing, f"the record lists no version of {missing}"
    return found


def test_versions_below_the_window_fail_with_the_pip_command():
    installed = {name: high + ".0" for name, (_, high) in versions.SUPPORTED.items()}
    assert versions.check_versions(installed) == []
    with pytest.raises(RuntimeError, match=r"accelerate 1\.9\.0 is older than the oldest supported 1\.10\.1: "
                                           r"pip install -U 'accelerate>=1\.10\.1'"):
        versions.check_versions({**installed, "accelerate": "1.9.0"})
    with pytest.raises(RuntimeError, match="torch is not installed"):
        versions.check_versions({**installed, "torch": None})
    assert versions.check_versions({**installed, "trl": None}) == []  # optional library


def test_versions_above_the_window_warn_untested():
    installed = {name: low for name, (low, _) in versions.SUPPORTED.items()}
    installed["torch"] = "2.13.0+cpu"
    assert versions.check_versions(installed) == []
    high = versions.SUPPORTED["transformers"][1]
    newer = f"{high.split('.')[0]}.{int(high.split('.')[1]) + 5}.0"
    with pytest.warns(UserWarning, match=rf"transformers {re.escape(newer)} is newer than the newest tested "
                                         rf"{re.escape(high)}\.x"):
        versions.check_versions({**installed, "transformers": newer})
    assert versions.check_versions({**installed, "accelerate": "1.15.7"}) == []  # a patch release of 1.15


def test_make_test_pins_are_inside_the_window():
    """The versions `make test` installs: inside the window, so the README's test command passes on any day."""
    assert versions.check_versions(_windowed(pins.read_pins(pins.PINNED))) == []


def test_the_window_test_reads_the_pins_not_the_newest_releases(monkeypatch):
    """A release above the window installed (or served by the registry) after the commit: the pin test above still
    passes, while the installed-set check would warn."""
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0.0")
    assert versions.check_versions(_windowed(pins.read_pins(pins.PINNED))) == []
    with pytest.warns(UserWarning, match="newer than the newest tested"):
        versions.check_versions()


def test_the_window_covers_the_newest_set_make_test_latest_passed_with():
    """constraints/newest.txt is what .ci/latest.sh installed and passed with: each is inside the window (the upper
    bound equals it or stands above it)."""
    newest = _windowed(pins.read_pins(pins.NEWEST))
    assert {n: versions.window_position(n, v) for n, v in newest.items()} == dict.fromkeys(newest, "inside")


def test_the_window_starts_at_the_oldest_set_ci_pins():
    """.ci/oldest.sh's pins are the window's lower bounds (torch aside: 2.11 is the GPU machine's, checked statically
    by tools/torch_api_check.py), and pyproject.toml's."""
    oldest = dict(re.findall(r'"([\w-]+)==([\w.]+)"', re.search(r"OLDEST=\((.*?)\)", (REPO / ".ci" / "oldest.sh")
                                                                  .read_text()).group(1)))
    assert oldest == {n: low for n, (low, _) in versions.SUPPORTED.items() if n != "torch"}
    project = (REPO / "pyproject.toml").read_text()
    for name, (low, _) in versions.SUPPORTED.items():
        assert re.search(rf'"{name}>={re.escape(low.removesuffix(".0") if name == "torch" else low)}', project), name


@pytest.mark.pinned_env
def test_the_installed_environment_is_the_pins():
    """`make test`'s venv holds the pinned versions (not run by make test-latest, which installs the newest)."""
    pinned = pins.read_pins(pins.PINNED)
    installed = {name: importlib.metadata.version(name).split("+")[0] for name in versions.SUPPORTED}
    assert installed == {name: pinned[pins.normalise(name)] for name in versions.SUPPORTED}
    assert versions.check_versions() == []


def test_report_names_a_library_above_the_window(monkeypatch, capsys):
    """tools/pins.py report (make test-latest): a library above the window is a report line naming the package and
    version, not an error."""
    monkeypatch.setattr(pins, "installed", lambda names: {n: ("5.99.0" if n == "transformers" else None) for n in names})
    lines = pins.report(pins.read_pins(pins.PINNED))
    assert len(lines) == 1 and lines[0].startswith("REPORT: transformers 5.99.0 is above the tested window")
    assert "transformers     5.99.0" in capsys.readouterr().out


def test_docs_versions_table_is_the_window_and_the_records():
    """docs/versions.md "Supported versions": per library the oldest tested (the window's lower bound), the newest tested
    (constraints/newest.txt) and what make test installs (constraints/pinned.txt)."""
    readme = docs_page("versions").read_text()
    pinned, newest = pins.read_pins(pins.PINNED), pins.read_pins(pins.NEWEST)
    for name, (low, _) in versions.SUPPORTED.items():
        row = re.search(rf"^\| {name} \| (.*?) \| (.*?) \| (.*?) \|$", readme, re.M)
        assert row, f"docs/versions.md has no versions row for {name}"
        assert low in row[1] and row[2] == newest[name] and row[3].split(" ")[0] == pinned[name], row[0]
