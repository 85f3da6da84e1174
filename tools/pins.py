"""The test environments' library versions: the pins `make test` installs, the newest set CI tests, the window.

Three records, each checked against the others:

* ``constraints/pinned.txt``: every distribution of the environment the suite was last run in (a ``pip freeze``),
  passed to pip as ``-c`` by ``make test``, so the README's test command installs the same set on any later day;
* ``constraints/newest.txt``: the newest releases of the windowed libraries that ``make test-latest``
  (``.ci/latest.sh``) installed and passed with, the last time it passed;
* the supported window, ``accel_flatshard/integrations/versions.py``'s ``SUPPORTED``: its upper bounds must
  cover both files (``tests/test_versions.py``).

    python tools/pins.py freeze constraints/pinned.txt   # rewrite the pins from the running environment
    python tools/pins.py report                          # installed vs pins vs window (make test-latest)
    python tools/pins.py record constraints/newest.txt   # after a passing newest-set run: what it installed

``report`` never fails because a library moved: a release above the window is printed as a report line naming
the package and version (raise the window and the pins once the newest-set run passes); a release below the
window is an error (the package refuses it at run time too).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
PINNED = REPO / "constraints" / "pinned.txt"
NEWEST = REPO / "constraints" / "newest.txt"
# besides the window's libraries, what the pins name: reported with them
ALSO_REPORTED = ("datasets", "huggingface_hub", "safetensors", "tokenizers", "bitsandbytes")


def read_pins(path: Path) -> Dict[str, str]:
    """``{normalised name: version}`` of a ``name==version`` file (comments and blank lines skipped)."""
    pins: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path}: {line!r} is not 'name==version'")
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    """PEP 503's normalised project name (``huggingface-hub`` and ``huggingface_hub`` are one project)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _window() -> Dict[str, tuple]:
    sys.path.insert(0, str(REPO))
    from accel_flatshard.integrations.versions import SUPPORTED

    return SUPPORTED


def installed(names: List[str]) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def report(pins: Dict[str, str]) -> List[str]:
    """Print installed vs pinned vs window for the windowed libraries and :data:`ALSO_REPORTED`; returns the
    report lines of libraries above the window ("REPORT: ..."), which the caller prints last."""
    from accel_flatshard.integrations.versions import release, window_position

    window = _window()
    names = list(window) + list(ALSO_REPORTED)
    above = []
    print(f"{'library':16s} {'installed':14s} {'pinned':14s} window")
    for name, version in installed(names).items():
        low, high = window.get(name, (None, None))
        pinned = pins.get(normalise(name), "-")
        where = window_position(name, version) if low and version else ""
        moved = "" if version is None or pinned == "-" or release(version) == release(pinned) else " (moved)"
        span = f"{low} to {high}.x {where}" if low else "-"
        print(f"{name:16s} {version or 'absent':14s} {pinned:14s} {span}{moved}")
        if where == "above":
            above.append(f"REPORT: {name} {version} is above the tested window ({low} to {high}.x): run "
                         f"`make test-latest`; once it passes raise SUPPORTED in "
                         f"accel_flatshard/integrations/versions.py and `python tools/pins.py record "
                         f"constraints/newest.txt`")
    return above


def freeze(path: Path) -> None:
    """Write every installed distribution but accel_flatshard itself, sorted, with a header."""
    dists = {normalise(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    dists.pop("accel-flatshard", None)
    for tool in ("pip", "setuptools", "wheel"):
        dists.pop(tool, None)
    lines = [f"{name}=={version.split('+')[0]}" for name, version in sorted(dists.items())]
    path.write_text("# `make test`'s environment (pip -c): rewrite with `python tools/pins.py freeze "
                    "constraints/pinned.txt`\n# from a venv that passed `make test`, then commit it with the "
                    "window (tests/test_versions.py checks both).\n" + "\n".join(lines) + "\n")
    print(f"wrote {path} ({len(lines)} pins)")


def record(path: Path) -> None:
    """Write the installed versions of the windowed libraries (and ALSO_REPORTED) as a newest-set record."""
    found = {n: v for n, v in installed(list(_window()) + list(ALSO_REPORTED)).items() if v}
    lines = [f"{normalise(n)}=={v.split('+')[0]}" for n, v in found.items()]
    path.write_text("# The newest releases `make test-latest` installed and passed with (written by `python tools/"
                    "pins.py record`);\n# the window's upper bounds must cover them (tests/test_versions.py).\n"
                    + "\n".join(lines) + "\n")
    print(f"wrote {path}: {', '.join(lines)}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("freeze", "report", "record"))
    parser.add_argument("path", nargs="?", type=Path)
    args = parser.parse_args(argv)
    if args.command == "freeze":
        freeze(args.path or PINNED)
    elif args.command == "record":
        record(args.path or NEWEST)
    else:
        sys.path.insert(0, str(REPO))
        for line in report(read_pins(args.path or PINNED)):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
