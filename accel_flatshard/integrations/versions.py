"""The supported library version window, and the check :func:`accel_flatshard.register` runs.

Lower bounds are the oldest set CI tests (``.ci/oldest.sh``; the same in ``pyproject.toml``), except torch 2.11:
the GPU machine's, checked by ``tools/torch_api_check.py`` (docs/versions.md); upper bounds are the
newest tested: ``make test-latest`` (``.ci/latest.sh``) installs the newest releases, and ``constraints/newest.txt``
records the set it last passed with (``tests/test_versions.py`` keeps the window above it and above ``make test``'s
pins).  Below the window is an error (package, version and pip command); above it a warning.
"""
from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import Dict, List, Optional, Tuple


# package -> (oldest tested, newest tested)
SUPPORTED: Dict[str, Tuple[str, str]] = {
    "torch": ("2.11.0", "2.15"),
    "accelerate": ("1.10.1", "1.16"),
    "transformers": ("4.57.6", "5.25"),
    "trl": ("0.24.0", "1.16"),
    "peft": ("0.17.1", "0.21"),
}
# packages the Accelerate backend cannot run without; the others are checked only when installed
_REQUIRED = ("torch", "accelerate")


def release(version: str) -> Tuple[int, ...]:
    """(major, minor, patch) of a version string ("2.13.0+cpu" -> (2, 13, 0)); pre-release tags ignored."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(part) for part in match.groups() if part is not None) if match else ()


def window_position(name: str, version: str) -> str:
    """Where ``version`` of ``name`` lies in its window: "below", "inside" or "above" (compared at the upper bound's
    precision: 1.15.3 is inside a window ending at 1.15)."""
    low, high = SUPPORTED[name]
    if release(version) < release(low):
        return "below"
    return "above" if release(version)[: len(release(high))] > release(high) else "inside"


def window_text() -> str:
    """One line per package: the supported window."""
    return ", ".join(f"{name} {low} to {high}.x" for name, (low, high) in SUPPORTED.items())


def check_versions(installed: Optional[Dict[str, Optional[str]]] = None) -> List[str]:
    """Raise below the window, warn above it; returns the warnings given.  ``installed`` (tests): name ->
    version or None (not installed); default: the installed distributions."""
    problems: List[str] = []
    given: List[str] = []
    for name, (low, high) in SUPPORTED.items():
        if installed is not None:
            version = installed.get(name)
        else:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = None
        if version is None:
            if name in _REQUIRED:
                problems.append(f"{name} is not installed: pip install '{name}>={low}'")
            continue
        position = window_position(name, version)
        if position == "below":
            problems.append(f"{name} {version} is older than the oldest supported {low}: "
                            f"pip install -U '{name}>={low}'")
        elif position == "above":
            message = (f"accel_flatshard: {name} {version} is newer than the newest tested {high}.x; it is "
                       f"untested (the patched library internals may have moved). If anything fails, "
                       f"pip install '{name}<={high}.99' and report it.")
            warnings.warn(message, UserWarning, stacklevel=3)
            given.append(message)
    if problems:
        raise RuntimeError("accel_flatshard: library versions outside the supported window ("
                           + window_text() + "): " + "; ".join(problems))
    return given
