"""Integrations with training frameworks.  ``accelerate``: the Accelerate backend (imported lazily, so
``import accel_flatshard`` does not import accelerate)."""
from __future__ import annotations

from typing import Any

__all__ = ["Accelerator", "register"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import accelerate as _accelerate

        return getattr(_accelerate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
