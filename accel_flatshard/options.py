"""Every ``FLATSHARD_*`` environment variable: declared once here, read and validated only here.

:data:`OPTIONS` declares each (name, type, default, doc, parser); :func:`get` returns its parsed value
(``options.get("FLATSHARD_TIMEOUT_S")``: 1800.0 unless set); :func:`check_environment`, called by the wrapper
and the ``Accelerator``, rejects unknown ``FLATSHARD_*`` names and bad values, so a misspelt option fails
loudly.  :func:`markdown_table` renders the README's option table; :func:`env_flag` parses boolean variables,
accelerate's own too (``ACCELERATE_USE_FSDP``, ...), which are read where used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

import torch

__all__ = ["DTYPES", "GENERATION_MODES", "OPTIONS", "Option", "check_environment", "env_flag", "get", "markdown_table"]

_BOOLS = {**dict.fromkeys(("1", "true", "yes", "y", "on"), True),
          **dict.fromkeys(("0", "false", "no", "n", "off"), False)}
# accepted dtype names (also of accelerate's top-level mixed_precision)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
GENERATION_MODES = ("budget", "full", "per_unit")


def env_flag(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment variable ``name`` is set to a true value; anything else (unset, empty, not a
    boolean) is False, as accelerate's ``str_to_bool`` treats its own variables."""
    return _BOOLS.get(str((os.environ if environ is None else environ).get(name, "")).strip().lower(), False)


def _parser(convert: Callable[[str], Any], expected: str, valid: Callable[[Any], bool] = lambda _: True) -> Callable:
    """A parser: ``convert`` of the stripped text where it succeeds and is ``valid``, else ValueError(expected)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text.strip())
        except (ValueError, KeyError, OverflowError):
            raise ValueError(expected) from None
        if not valid(value):  # (a NaN is not valid either: it compares False)
            raise ValueError(expected)
        return value
    return parse


_bool = _parser(lambda text: _BOOLS[text.lower()], f"expected one of {', '.join(_BOOLS)}")
_positive_int = _parser(int, "must be a positive integer", lambda n: n >= 1)
_positive_float = _parser(float, "must be a positive number", lambda x: x > 0)


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
           "(an error with any other strategy); with an accelerate `parallelism_config`, whose `dp_shard_size` "
           "sets the groups, it may only repeat that size", _positive_int),
    Option("FLATSHARD_LIMIT_ALL_GATHERS", "int > 0", None, "2",
           "Accelerator: most all-gathers in flight per model (the wrapper's `limit_all_gathers`)", _positive_int),
    Option("FLATSHARD_REDUCE_DTYPE", "fp32 | bf16 | fp16", None, "the mixed-precision dtype",
           "Accelerator: dtype of the gradient reduction under mixed precision (no effect without it)",
           _parser(lambda text: DTYPES[text.lower()], "expected one of fp32, bf16, fp16")),
    Option("FLATSHARD_GLOO_P2P", "bool", None, "1 on gloo, else 0", "all-gather and reduce-scatter as batched "
           "isend/irecv straight into / out of the buffers (faster than gloo's collectives, see Speed)", _bool),
    Option("FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE", "bool", False, "0", "with `FLATSHARD_GLOO_P2P=0` (or nccl): "
           "reduce gradients by all-reduce + slice instead of reduce-scatter", _bool),
    Option("FLATSHARD_TIMEOUT_S", "float > 0", 1800.0, "1800", "timeout in seconds of the shard / replica process "
           "groups accel_flatshard creates (hybrid sharding)", _positive_float),
    Option("FLATSHARD_STATE_DICT_TIMEOUT_S", "float > 0", 5.0, "5", "seconds rank 0 waits for the other ranks when "
           "the unwrapped model's `state_dict()` (collective) gathers, before failing", _positive_float),
    Option("FLATSHARD_PROFILE", "directory | bool", None, "off",  # None: off, "": the table only, else a directory
           "profile every wrapped model with torch.profiler: a directory gets one Chrome trace and phase table "
           "per rank; `1`: print the phase table only",
           lambda text: {True: "", False: None}.get(_BOOLS.get(text.strip().lower()), text.strip())),
    Option("FLATSHARD_PROFILE_EVERY", "int > 0", 10, "10", "with `FLATSHARD_PROFILE`: write / print every N "
           "optimizer steps (the last N - 1 steps recorded)", _positive_int),
    Option("FLATSHARD_GENERATION_MODE", "budget | full | per_unit", "budget", "budget",
           "units kept gathered during `generate()`: `budget` keeps as many as `FLATSHARD_GENERATION_BUDGET_MB` "
           "allows (the whole model: one gather per call), `full` all, `per_unit` none (one gather per unit per "
           "token, warned once)", _parser(lambda text: text.lower().replace("-", "_"), "expected one of "
                                          + ", ".join(GENERATION_MODES), GENERATION_MODES.__contains__)),
    Option("FLATSHARD_GENERATION_BUDGET_MB", "auto | MiB >= 0", None, "auto",
           "gathered bytes one `generate()` may hold per rank; `auto`: half the free device memory when it "
           "starts", _parser(lambda text: None if text.lower() == "auto" else int(float(text) * 2**20),
                             "expected 'auto' or a size in MiB >= 0", lambda n: n is None or n >= 0)),
    Option("FLATSHARD_ASYNC_SAVE", "bool", False, "0",
           "`save_state` (Accelerator, Trainer) returns once the model and optimizer state is copied to host memory "
           "and writes the files in the background (README Checkpoints); `save_state(..., async_save=...)` "
           "overrides it", _bool),
    Option("FLATSHARD_KEEP_FROZEN_GATHERED", "bool", False, "0", "no-grad forwards of a model (e.g. a frozen "
           "reference model) keep its units gathered until the next optimizer step", _bool),
)}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of option ``name`` (its default when unset or empty); ``ValueError`` if invalid."""
    option = OPTIONS[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None or text.strip() == "":
        return option.default
    try:
        return option.parse(text)
    except ValueError as exc:
        raise ValueError(f"accel_flatshard: environment variable {name}={text!r} is invalid ({exc}); allowed: "
                         f"{option.type} (default {option.default_text}: {option.doc})") from None


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise ``ValueError`` for an unknown ``FLATSHARD_*`` variable or an invalid value of a known one."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("FLATSHARD_") and k not in OPTIONS)
    if unknown:
        known = "\n".join(f"  {o.name} ({o.type}): {o.doc}" for o in OPTIONS.values())
        raise ValueError(f"accel_flatshard: unknown environment variable(s) {unknown} (misspelt?); the known ones "
                         f"are:\n{known}")
    for name in OPTIONS:
        get(name, environ)


def markdown_table() -> str:
    """The README's option table (name | type | default | what it does), rendered from :data:`OPTIONS`."""
    rows = [f"| `{o.name}` | {o.type.replace('|', chr(92) + '|')} | {o.default_text} | {o.doc} |"
            for o in OPTIONS.values()]
    return "\n".join(["| variable | type | default | what it does |", "|---|---|---|---|", *rows])
