"""Sharded model checkpoints with torch.distributed.checkpoint: no gather, any world size on load.

Each rank writes only its own slices (with hybrid sharding only shard group 0 writes; buffers are
written by rank 0).  DCP's metadata describes every parameter as a normal tensor of its true shape
made of rectangular chunks (a rank's 1-D range of a flattened parameter is at most ``2*ndim - 1``
chunks).  Loading at any world size or hybrid group size reads, on each rank, only the chunks that
overlap its own slices.

Directory layout::

    ckpt/
      __0_0.distcp  __1_0.distcp ...   tensor data, one file per rank (DCP, torch.save per chunk)
      .metadata                        DCP metadata (pickle; read only through an allow-list)
      flatshard.json                   ours, written last: format, world size, tensors, checksums

Example::

    save_sharded_model(model, "ckpt/step_100")           # every rank
    load_sharded_model(model, "ckpt/step_100")           # every rank, any world size
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch.nn as nn

from ._dcp_io import load_entries, open_checkpoint, save_entries
from ..state_dict.index import ModelIndex, quiesce
from ..state_dict.types import CheckpointError, dtype_to_str
from ._planner import Entry, FlatRange

__all__ = ["save_sharded_model", "load_sharded_model"]


def save_sharded_model(model: nn.Module, directory: str) -> None:
    """Write this rank's shards of every parameter (and rank 0 the buffers) to ``directory``.

    Collective.  Atomic: the data goes to ``<directory>.tmp-<random>``, which replaces ``directory``
    only once complete.  Example::

        save_sharded_model(model, "ckpt/model")
    """
    quiesce(model, "save_sharded_model")
    index = ModelIndex(model)
    if index.extra and index.world_rank == 0:
        warnings.warn(f"save_sharded_model: non-tensor state {sorted(index.extra)} is not saved in sharded checkpoints",
                      stacklevel=2)
    entries: Dict[str, Entry] = {}
    if index.replica_index == 0:
        for name, info in index.params.items():
            entries[name] = FlatRange(info.local(), info.piece.param_start, info.shape)
    if index.world_rank == 0:
        for name, buf in index.buffers.items():
            entries[name] = buf.detach()
    meta = {
        "kind": "model",
        "model_class": type(index.module).__name__,
        "tensors": index.describe(),
        "flat_params": [
            {"numel": f.layout.unpadded_numel, "padded_numel": f.layout.padded_numel,
             "dtype": dtype_to_str(f.dtype), "params": [s.fqn for s in f.layout.slots]}
            for f in model.flat_params
        ],
    }
    save_entries(index.group, directory, entries, meta)


def load_sharded_model(model: nn.Module, directory: str, strict: bool = True, verify_checksums: bool = True) -> None:
    """Load a checkpoint written by :func:`save_sharded_model` at any world size into ``model``.

    Collective.  Each rank reads only the saved chunks that overlap its own slices.  Checks first
    (and raises on every rank, naming key or file): keys (``strict``: none missing, none unexpected;
    otherwise missing ones keep their values), shapes and dtypes, file sizes and checksums of the
    bytes this rank reads (``verify_checksums=False`` skips the checksums), DCP metadata safety.

    Example::

        load_sharded_model(model, "ckpt/model")
    """
    quiesce(model, "load_sharded_model")
    index = ModelIndex(model)
    entries: Dict[str, Entry] = {}
    error: Optional[Exception] = None
    directory_found, meta, md = directory, {"files": {}}, None
    try:
        directory_found, meta, md = open_checkpoint(directory, "model")
        problem = _compare(index, meta, strict)
        if problem is not None:
            error = CheckpointError(problem)
        else:
            saved = meta["tensors"]
            for name, info in index.params.items():
                if name in saved and info.numel:
                    entries[name] = FlatRange(info.local(), info.piece.param_start, info.shape)
            for name, buf in index.buffers.items():
                if name in saved and buf.numel():
                    entries[name] = buf
    except Exception as e:  # noqa: BLE001 - raised on every rank by load_entries
        error = e
    load_entries(index.group, directory_found, meta, md, entries, verify_checksums, error)


def _compare(index: ModelIndex, meta: Dict[str, Any], strict: bool) -> Optional[str]:
    """Problems between the model and the checkpoint's tensor list, as one message (None if none)."""
    saved: Dict[str, Any] = meta["tensors"]
    expected = index.describe()
    # a tied parameter may have been saved under another of its names
    for name, info in index.params.items():
        if name not in saved:
            for alias in info.aliases[1:]:
                if alias in saved:
                    saved[name] = saved.pop(alias)
                    break
    problems: List[str] = []
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if strict and missing:
        problems.append(f"missing in the checkpoint: {missing}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {unexpected}")
    for key in expected:
        if key in saved:
            s, e = saved[key], expected[key]
            if list(s["shape"]) != list(e["shape"]) or s["dtype"] != e["dtype"]:
                problems.append(f"{key}: checkpoint has shape {tuple(s['shape'])} dtype {s['dtype']}, "
                                f"the model expects shape {tuple(e['shape'])} dtype {e['dtype']}")
    if not problems:
        return None
    cls = type(index.module).__name__
    note = ""
    if meta.get("model_class") and meta["model_class"] != cls:
        note = f" (saved from {meta['model_class']}, loading into {cls}: wrong model?)"
    return (f"checkpoint does not match the model{note}; saved at world size {meta.get('world_size')}:\n  "
            + "\n  ".join(problems))
