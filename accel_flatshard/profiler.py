"""Profiling hooks of the engine.  Off by default: the null profiler's span is a shared no-op."""
from __future__ import annotations

import contextlib


class _NullProfiler:
    enabled = False

    def span(self, name: str, label: str = ""):
        return contextlib.nullcontext()


NULL_PROFILER = _NullProfiler()
