"""Every ``FLATSHARD_*`` environment variable: declared once here, read and validated only here.

Each :class:`Option` has a name, a type, a default, what it does, and a parser that validates a value;
:func:`get` returns the parsed value (or the default), :func:`check_environment` rejects unknown
``FLATSHARD_*`` names and bad values.  The wrapper (``FullyShardedDataParallel``) and the ``Accelerator``
both call :func:`check_environment` at construction, so a misspelt option fails loudly on every path
instead of doing nothing.  :func:`markdown_table` renders the README's option table (a test keeps the
two equal).  :func:`env_flag` is the one truthiness parser for boolean environment variables, also for
accelerate's own (``ACCELERATE_USE_FSDP``, ``FSDP_SYNC_MODULE_STATES``, ...), which are read where used.

Example::

    from accel_flatshard import options
    timeout_s = options.get("FLATSHARD_TIMEOUT_S")      # 1800.0 unless set
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

__all__ = ["DTYPES", "OPTIONS", "Option", "check_environment", "env_flag", "get", "markdown_table", "parse_bool"]

_TRUE = ("1", "true", "yes", "y", "on")
_FALSE = ("0", "false", "no", "n", "off")


def parse_bool(text: str) -> bool:
    """``1/true/yes/y/on`` -> True, ``0/false/no/n/off`` -> False (case-insensitive); else ``ValueError``."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def env_flag(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment variable ``name`` is set to a true value (unset or empty: False).

    For variables that are not ours (``ACCELERATE_*``, ``FSDP_*``): anything not true is False, as
    accelerate's own ``str_to_bool`` treats them."""
    environ = os.environ if environ is None else environ
    return str(environ.get(name, "")).strip().lower() in _TRUE


def _positive_int(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError("must be a positive integer")
    return number


def _positive_float(text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        number = 0.0
    if not number > 0:  # also NaN
        raise ValueError("must be a positive number")
    return number


# accepted dtype names (also of accelerate's top-level mixed_precision)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.strip().lower()]
    except KeyError:
        raise ValueError("expected one of fp32, bf16, fp16") from None


def _profile(text: str) -> Optional[str]:
    """Off (``None``), the table only (``""``) or a directory for the traces."""
    value = text.strip()
    if value.lower() in _FALSE:
        return None
    return "" if value.lower() in _TRUE else value


GENERATION_MODES = ("budget", "full", "per_unit")


def _generation_mode(text: str) -> str:
    value = text.strip().lower().replace("-", "_")
    if value not in GENERATION_MODES:
        raise ValueError(f"expected one of {', '.join(GENERATION_MODES)}")
    return value


def _budget_bytes(text: str) -> Optional[int]:
    """``auto`` -> None (half the free memory when generation starts), else MiB -> bytes."""
    value = text.strip().lower()
    if value == "auto":
        return None
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if not mib >= 0:
        raise ValueError("expected 'auto' or a size in MiB >= 0")
    return int(mib * 2**20)


@dataclass(frozen=True)
class Option:
    name: str
    type: str  # as shown in the README table
    default: Any  # the value when unset or empty
    default_text: str  # the default as the README shows it
    doc: str
    parse: Callable[[str], Any]


OPTIONS: Dict[str, Option] = {o.name: o for o in (
    Option("FLATSHARD_GROUP_SIZE", "int > 0", None, "processes per node (`LOCAL_WORLD_SIZE`)",
           "Accelerator: ranks per shard group under `fsdp_sharding_strategy` HYBRID_SHARD / _HYBRID_SHARD_ZERO2 "
           "(an error with any other strategy)", _positive_int),
    Option("FLATSHARD_LIMIT_ALL_GATHERS", "int > 0", None, "2",
           "Accelerator: most all-gathers in flight per model (the wrapper's `limit_all_gathers`)", _positive_int),
    Option("FLATSHARD_REDUCE_DTYPE", "fp32 \\| bf16 \\| fp16", None, "the mixed-precision dtype",
           "Accelerator: dtype of the gradient reduction under mixed precision (no effect without it)", _dtype),
    Option("FLATSHARD_GLOO_P2P", "bool", None, "1 on gloo, else 0",
           "all-gather and reduce-scatter as batched isend/irecv straight into / out of the buffers "
           "(faster than gloo's collectives, see Speed)", parse_bool),
    Option("FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE", "bool", False, "0",
           "with `FLATSHARD_GLOO_P2P=0` (or nccl): reduce gradients by all-reduce + slice instead of "
           "reduce-scatter", parse_bool),
    Option("FLATSHARD_TIMEOUT_S", "float > 0", 1800.0, "1800",
           "timeout in seconds of the shard / replica process groups accel_flatshard creates (hybrid sharding)",
           _positive_float),
    Option("FLATSHARD_STATE_DICT_TIMEOUT_S", "float > 0", 5.0, "5",
           "seconds rank 0 waits for the other ranks when the unwrapped model's `state_dict()` (collective) "
           "gathers, before failing", _positive_float),
    Option("FLATSHARD_PROFILE", "directory \\| bool", None, "off",
           "profile every wrapped model with torch.profiler: a directory gets one Chrome trace and phase table "
           "per rank; `1`: print the phase table only", _profile),
    Option("FLATSHARD_PROFILE_EVERY", "int > 0", 10, "10",
           "with `FLATSHARD_PROFILE`: write / print every N optimizer steps (the last N - 1 steps recorded)",
           _positive_int),
    Option("FLATSHARD_GENERATION_MODE", "budget \\| full \\| per_unit", "budget", "budget",
           "units kept gathered during `generate()`: `budget` keeps as many as `FLATSHARD_GENERATION_BUDGET_MB` "
           "allows (the whole model: one gather per call), `full` all, `per_unit` none (one gather per unit per "
           "token, warned once)", _generation_mode),
    Option("FLATSHARD_GENERATION_BUDGET_MB", "auto \\| MiB >= 0", None, "auto",
           "gathered bytes one `generate()` may hold per rank; `auto`: half the free device memory when it "
           "starts", _budget_bytes),
    Option("FLATSHARD_KEEP_FROZEN_GATHERED", "bool", False, "0",
           "no-grad forwards of a model (e.g. a frozen reference model) keep its units gathered until the next "
           "optimizer step", parse_bool),
)}


def _parse(option: Option, text: str) -> Any:
    try:
        return option.parse(text)
    except ValueError as exc:
        raise ValueError(
            f"accel_flatshard: environment variable {option.name}={text!r} is invalid ({exc}); "
            f"allowed: {option.type.replace(chr(92), '')} (default {option.default_text}: {option.doc})"
        ) from None


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of option ``name`` (its default when unset or empty); ``ValueError`` if invalid."""
    option = OPTIONS[name]
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    if text is None or text.strip() == "":
        return option.default
    return _parse(option, text)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise ``ValueError`` for an unknown ``FLATSHARD_*`` variable or an invalid value of a known one."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("FLATSHARD_") and k not in OPTIONS)
    if unknown:
        known = "\n".join(f"  {o.name} ({o.type.replace(chr(92), '')}): {o.doc}" for o in OPTIONS.values())
        raise ValueError(
            f"accel_flatshard: unknown environment variable(s) {unknown} (misspelt?); the known ones are:\n{known}"
        )
    for name in OPTIONS:
        get(name, environ)


def markdown_table() -> str:
    """The README's option table (name | type | default | what it does), rendered from :data:`OPTIONS`."""
    rows: Tuple[str, ...] = tuple(
        f"| `{o.name}` | {o.type} | {o.default_text} | {o.doc} |" for o in OPTIONS.values()
    )
    return "\n".join(("| variable | type | default | what it does |", "|---|---|---|---|") + rows)
