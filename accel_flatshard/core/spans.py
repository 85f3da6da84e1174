"""The engine's ``flatshard::*`` record_function spans and the collectives' byte markers, which a running
torch.profiler records next to the real ops (``tools/profiling.py`` turns them into the phase table).  When no
profiler runs each call is one flag check."""
from __future__ import annotations

import contextlib
from typing import Optional

from torch.autograd.profiler import record_function

from ._compat import profiler_enabled

_NULL_CONTEXT = contextlib.nullcontext()


def span(name: str, label: str = "") -> contextlib.AbstractContextManager:
    """``record_function("flatshard::name[label]")`` while a torch profiler runs; else one shared no-op."""
    if not profiler_enabled():
        return _NULL_CONTEXT
    return record_function(f"flatshard::{name}[{label}]" if label else f"flatshard::{name}")


def begin_span(name: str) -> Optional[record_function]:
    """Open a span that a later hook closes with :func:`end_span` (forward / backward phases)."""
    return record_function(f"flatshard::{name}").__enter__() if profiler_enabled() else None


def end_span(handle: Optional[record_function]) -> None:
    if handle is not None:
        handle.__exit__(None, None, None)


def mark_sent(kind: str, intra: int, inter: int) -> None:
    """A zero-length ``flatshard::sent[kind|intra|inter]`` marker of the bytes one collective sends from this rank
    (inside / across machines), which :func:`step_phases` sums per step; nothing when no profiler runs."""
    if profiler_enabled():
        with record_function(f"flatshard::sent[{kind}|{intra}|{inter}]"):
            pass
