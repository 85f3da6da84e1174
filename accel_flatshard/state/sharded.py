"""Sharded checkpoints of a model and its optimizer with DCP: no gather on save, any world size on load.

Each rank writes only its own slices (with hybrid sharding only shard group 0 writes): parameter ``name`` under
the DCP key ``name``, buffers (rank 0) under theirs, optimizer state under ``state.<name>.<key>`` (0-dim state
such as ``step`` written once; a matrix optimizer's state held whole by the matrix's owner, ``matrix_optim.py``,
written by the owner as one chunk; state of a rank's piece only, bitsandbytes' block scales and tables, under
``state.<name>.<key>.shard<r>``, loaded only at the shard group size of the save).  DCP's metadata describes each
as a tensor of its true shape made of rectangular chunks (``dcp.py``), so a load at any world size or hybrid group
size reads, on each rank, only the chunks that overlap its own slices.  Directory layout::

    ckpt/
      __0_0.distcp  __1_0.distcp ...   tensor data, one file per rank (DCP, torch.save per chunk)
      .metadata                        DCP metadata (pickle; read only through an allow-list)
      flatshard.json                   ours, written last: format, world size, tensors, checksums (and for an
                                       optimizer its param groups and plain-Python state values)

How a save commits and a load checks: docs/architecture-details.md section 7; usage: docs/checkpoints.md.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import time
import warnings
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)

from ..core import comm
from ..core.model_state import ModelIndex, ParamInfo
from .optim import (LOCAL,
                    SCALAR,
                    SHARDED,
                    WHOLE,
                    check_groups,
                    decode_value,
                    encode_groups,
                    encode_value,
                    optimizer_groups,
                    sharded_local,
                    state_schema,
                    torch_state_dict)
from .atomic import commit_dir, new_tmp_dir, write_json_atomic
from .dcp import (dcp_load, dcp_save, plan_reads, storage_records, Entry, FlatLoadPlanner, FlatRange, FlatSavePlanner,
                  METADATA_FILE)
from ..core.state_errors import CHECKPOINT_ERRORS, CheckpointError, UnsafeCheckpointError, dtype_to_str, str_to_dtype


META_FILE = "flatshard.json"
FORMAT = "accel_flatshard.sharded"
FORMAT_VERSION = 1


def save_sharded_model(model: nn.Module, directory: str) -> None:
    """Write this rank's shards of every parameter (rank 0: the buffers) to ``directory`` (collective, atomic)."""
    group, entries, meta = model_entries(model)
    save_entries(group, directory, entries, meta)


# the options whose communication is lossy, recorded in a model checkpoint's flatshard.json (a checkpoint loads
# under any of them: the shards themselves are exact)
LOSSY_OPTIONS = ("quantized_all_gather", "quantized_reduce", "quant_block")


def model_entries(model: nn.Module) -> Tuple[Any, Dict[str, Entry], Dict[str, Any]]:
    """``(group, entries, meta)`` that :func:`save_entries` writes for ``model``: this rank's live slices (the
    asynchronous save copies them to host memory first, ``checkpoint/commit.py``)."""
    index = ModelIndex(model, "save_sharded_model")
    rank0 = index.group.world_rank == 0
    if index.extra and rank0:
        warnings.warn(f"save_sharded_model: non-tensor state {sorted(index.extra)} is not saved in sharded checkpoints",
                      stacklevel=3)
    entries: Dict[str, Entry] = {}
    if index.group.replica_index == 0:
        entries.update((name, _range(info, info.local())) for name, info in index.params.items())
    if rank0:
        entries.update((name, buf.detach()) for name, buf in index.buffers.items())
    options = getattr(model, "options", None)  # (the lossy communication it trained with, for the record)
    return index.group, entries, {
        "kind": "model", "model_class": type(index.module).__name__, "tensors": index.describe(),
        "flat_params": [{"numel": f.layout.unpadded_numel, "padded_numel": f.layout.padded_numel,
                         "dtype": dtype_to_str(f.dtype), "params": [s.fqn for s in f.layout.slots]}
                        for f in index.flat_params],
        "communication": {name: getattr(options, name, None) for name in LOSSY_OPTIONS}}


def save_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Write this rank's optimizer state pieces to ``directory`` (collective, atomic)."""
    group, entries, meta = optimizer_entries(model, optimizer)
    save_entries(group, directory, entries, meta)


def optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[Any, Dict[str, Entry], dict]:
    """``(group, entries, meta)`` of the optimizer state, as :func:`model_entries` for the model."""
    index = ModelIndex(model, "save_sharded_optimizer")
    groups = optimizer_groups(optimizer, index.by_param_id)
    schema = state_schema(groups, optimizer, index.group)
    entries: Dict[str, Entry] = {}
    tensors: Dict[str, Any] = {}
    values: Dict[str, Dict[str, Any]] = {}
    for info in (i for infos in groups for i in infos):
        for key, (kind, dtype, value) in schema.get(info.fqn, {}).items():
            name = f"state.{info.fqn}.{key}"
            if kind in (SHARDED, WHOLE):
                tensors[name] = dict(kind="state", param=info.fqn, key=key, shape=list(info.shape), dtype=dtype)
                own = optimizer.state.get(info.param, {}).get(key)
                if index.group.replica_index == 0 and kind == SHARDED:
                    entries[name] = _range(info, sharded_local(info, optimizer, key, dtype))
                elif index.group.replica_index == 0 and isinstance(own, torch.Tensor):  # the owner: one chunk
                    entries[name] = FlatRange(own.detach().reshape(-1), 0, info.shape)
            elif kind == LOCAL:  # every shard rank's own tensor, under a name of its own
                for r, shape in sorted(value.items()):
                    tensors[f"{name}.shard{r}"] = dict(kind="local", param=info.fqn, key=key, shard=r, shape=shape,
                                                       dtype=dtype)
                if index.group.replica_index == 0:
                    entries[f"{name}.shard{index.group.shard_rank}"] = optimizer.state[info.param][key].detach()
            elif kind == SCALAR:
                tensors[name] = {"kind": "scalar", "param": info.fqn, "key": key, "shape": [], "dtype": dtype}
                own = optimizer.state.get(info.param, {}).get(key)
                if isinstance(own, torch.Tensor):
                    entries[name] = own.detach().cpu()
            else:
                values.setdefault(info.fqn, {})[key] = encode_value(value, f"optimizer state {info.fqn!r}[{key!r}]")
    return index.group, entries, {
        "kind": "optimizer", "optimizer_class": type(optimizer).__name__, "model_class": type(index.module).__name__,
        "param_shapes": {n: list(i.shape) for n, i in index.params.items()}, "tensors": tensors, "values": values,
        "param_groups": encode_groups(optimizer, groups)}


def _range(info: ParamInfo, local: torch.Tensor) -> FlatRange:
    return FlatRange(local, info.piece.param_start, info.shape)


def _read_checkpoint(model: nn.Module, directory: str, kind: str, verify_checksums: bool,
                     targets: Callable[[ModelIndex, Dict[str, Any]], Dict[str, Entry]]
                     ) -> Tuple[Dict[str, Any], Dict[str, Entry]]:
    """Collective: open ``directory`` as a checkpoint of ``kind``, let ``targets(index, meta)`` check it against
    the model (raising CheckpointError) and name what to fill, then read it.  A problem on any rank is raised
    on every rank before anything is read.  Returns ``(meta, entries)``."""
    index = ModelIndex(model, f"load_sharded_{kind}")
    entries: Dict[str, Entry] = {}
    error: Optional[Exception] = None
    found, meta, md = directory, {"files": {}}, None
    try:
        found, meta, md = open_checkpoint(directory, kind)
        entries = targets(index, meta)
    except Exception as e:  # noqa: BLE001 - raised on every rank by load_entries
        error = e
    load_entries(index.group, found, meta, md, entries, verify_checksums, error)
    return meta, entries


def load_sharded_model(model: nn.Module, directory: str, strict: bool = True, verify_checksums: bool = True) -> None:
    """Load a checkpoint of :func:`save_sharded_model`, saved at any world size, into ``model`` (collective).

    Checks first, and raises on every rank naming key or file: keys (``strict``: none missing, none unexpected;
    else missing ones keep their values), shapes and dtypes, file sizes, DCP metadata safety, and the checksums of
    the bytes this rank reads (unless ``verify_checksums=False``).
    """
    def targets(index: ModelIndex, meta: Dict[str, Any]) -> Dict[str, Entry]:
        saved: Dict[str, Any] = meta["tensors"]
        expected = index.describe()
        # a tied parameter may have been saved under another of its names
        stored = {k: next((a for a in index.params[k].aliases if a in saved), k) if k in index.params else k
                  for k in expected}
        problems: List[str] = []
        missing = [k for k in expected if stored[k] not in saved]
        unexpected = [k for k in saved if k not in set(stored.values())]
        if strict and missing:
            problems.append(f"missing in the checkpoint: {missing}")
        if strict and unexpected:
            problems.append(f"in the checkpoint but not in the model: {unexpected}")
        for key, e in expected.items():
            s = saved.get(stored[key])
            if s is not None and (list(s["shape"]) != list(e["shape"]) or s["dtype"] != e["dtype"]):
                problems.append(f"{key}: checkpoint has shape {tuple(s['shape'])} dtype {s['dtype']}, "
                                f"the model expects shape {tuple(e['shape'])} dtype {e['dtype']}")
        if problems:
            cls = type(index.module).__name__
            note = (f" (saved from {meta['model_class']}, loading into {cls}: wrong model?)"
                    if meta.get("model_class") and meta["model_class"] != cls else "")
            raise CheckpointError(f"checkpoint does not match the model{note}; saved at world size "
                                  f"{meta.get('world_size')}:\n  " + "\n  ".join(problems))
        entries = {stored[n]: _range(i, i.local()) for n, i in index.params.items() if stored[n] in saved}
        entries.update((n, buf) for n, buf in index.buffers.items() if n in saved)
        return entries

    _read_checkpoint(model, directory, "model", verify_checksums, targets)


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                           verify_checksums: bool = True) -> None:
    """Load optimizer state saved by :func:`save_sharded_optimizer` at any world size (collective).

    The optimizer must have the same param groups, by parameter name, as the one that saved; its hyperparameters
    (lr, betas, ...) are restored.  Existing state tensors of the right size are filled in place (the state is not
    held twice); if reading fails half-way (a corrupt file), the optimizer state may be partly loaded.
    """
    names: List[List[str]] = []

    def targets(index: ModelIndex, meta: Dict[str, Any]) -> Dict[str, Entry]:
        names.extend([i.fqn for i in infos] for infos in optimizer_groups(optimizer, index.by_param_id))
        check_groups(meta.get("param_groups", []), names)
        known = {n for g in names for n in g}
        entries: Dict[str, Entry] = {}
        problems: List[str] = []
        for name, desc in meta["tensors"].items():
            fqn = desc.get("param")
            if fqn not in known:
                problems.append(f"{name}: state of {fqn!r}, which is not a parameter of this optimizer")
                continue
            info = index.params[fqn]
            dtype = str_to_dtype(desc["dtype"], name)
            if desc["kind"] == "state":
                # (its dtype is the optimizer's: bitsandbytes' 8-bit codes are uint8; its load_state_dict casts)
                if tuple(desc["shape"]) != info.shape:
                    problems.append(f"{name}: checkpoint shape {tuple(desc['shape'])}, parameter {info.shape}")
                else:
                    entries[name] = _range(info, _target(optimizer, info, desc["key"], dtype))
            elif desc["kind"] == "local":  # this shard rank's own, at the saved shard group size only
                saved = meta.get("shard_size")
                if saved != index.group.shard_size:
                    problems.append(f"{name}: state of each rank's piece (e.g. bitsandbytes' block scales), saved with "
                                    f"a shard group of {saved} ranks: it loads only at that size, not "
                                    f"{index.group.shard_size}")
                elif desc["shard"] == index.group.shard_rank:
                    entries[name] = torch.empty(desc["shape"], dtype=dtype, device=info.flat.device)
            elif desc["kind"] == "scalar":
                entries[name] = torch.empty((), dtype=dtype)
            else:
                problems.append(f"{name}: unknown entry kind {desc['kind']!r}")
        if problems:
            raise CheckpointError("optimizer checkpoint does not match the optimizer:\n  " + "\n  ".join(problems))
        return entries

    meta, entries = _read_checkpoint(model, directory, "optimizer", verify_checksums, targets)
    state = {fqn: {key: decode_value(v) for key, v in vals.items()} for fqn, vals in meta.get("values", {}).items()}
    for name, desc in meta["tensors"].items():
        if name not in entries:
            continue  # another shard rank's local state
        entry = entries[name]
        state.setdefault(desc["param"], {})[desc["key"]] = entry.local if isinstance(entry, FlatRange) else entry
    optimizer.load_state_dict(torch_state_dict(optimizer, names, state, meta["param_groups"]))


def _target(optimizer: torch.optim.Optimizer, info: ParamInfo, key: str, dtype: torch.dtype) -> torch.Tensor:
    """The tensor to load a sharded state entry into: the existing state tensor when it fits (loads in
    place, no second copy of the optimizer state), else a new one."""
    current = optimizer.state.get(info.param, {}).get(key)
    if isinstance(current, torch.Tensor) and current.dtype == dtype and current.numel() == info.piece.length \
            and current.is_contiguous():
        return current if current.dim() == 1 else current.view(-1)
    return torch.empty(info.piece.length, dtype=dtype, device=info.flat.device)


# ---------------------------------------------------------------------- the directory: flatshard.json, checksums
def resolve_checkpoint_dir(path: str) -> str:
    """``path`` if it holds a complete checkpoint; else a complete ``<path>.old-*`` left by a crash between the
    two renames of :func:`commit_dir` (with a warning); else an error saying what is there."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        held = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
        hf = any(n.endswith(".safetensors") for n in names) and "config.json" in names
        kind = ("a Hugging Face model directory: load it with from_pretrained" if hf
                else "a save may have been interrupted, or this is not a sharded checkpoint")
        raise CheckpointError(f"{path}: not a complete accel_flatshard checkpoint ({META_FILE} is missing; it holds "
                              f"{held}: {kind})")
    leftovers = sorted(d for d in glob.glob(glob.escape(path) + ".old-*") if os.path.isfile(os.path.join(d, META_FILE)))
    if leftovers:
        warnings.warn(f"{path} is missing but a complete previous checkpoint is at {leftovers[-1]} "
                      "(a save was interrupted while replacing it); loading that", stacklevel=3)
        return leftovers[-1]
    tmps = glob.glob(glob.escape(path) + ".tmp-*")
    hint = f"; incomplete saves found: {tmps}" if tmps else ""
    raise CheckpointError(f"{path}: checkpoint directory does not exist{hint}")


def read_meta(directory: str, kind: Optional[str] = None) -> Tuple[str, Dict[str, Any]]:
    """The resolved directory and sanity-checked ``flatshard.json`` (of ``kind``, when given) of a checkpoint."""
    directory = resolve_checkpoint_dir(directory)
    path = os.path.join(directory, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: not an accel_flatshard checkpoint (format={found!r}, expected {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    for field in ("kind", "world_size", "tensors", "files", "dcp_metadata"):
        if field not in meta:
            raise CheckpointError(f"{path}: field {field!r} is missing")
    if kind is not None and meta["kind"] != kind:
        raise CheckpointError(f"{directory}: this is a checkpoint of kind {meta['kind']!r}, expected kind {kind!r}")
    return directory, meta


def _crc32_of_file(path: str, block: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(block):
            crc = zlib.crc32(data, crc)
    return crc


def _verify_items(directory: str, files: Dict[str, Any], crcs: Dict[Tuple[str, int, int], int],
                  needed: List[Tuple[str, int, int]]) -> List[str]:
    """The problems of the needed ``(file, offset, length)`` items: files not listed, missing or not of their
    recorded size, items without a recorded checksum.  (The CRC itself is checked while reading.)"""
    problems: List[str] = []
    for name in sorted({name for name, _, _ in needed}):
        path = os.path.join(directory, name)
        if name not in files:
            problems.append(f"{path}: not listed in {META_FILE} (the checkpoint was modified)")
        elif not os.path.isfile(path):
            problems.append(f"{path}: missing")
        elif (size := os.path.getsize(path)) != files[name]["size"]:
            problems.append(f"{path}: size is {size} bytes, expected {files[name]['size']} (truncated or modified)")
    return problems + [f"{os.path.join(directory, name)}: no checksum recorded for bytes [{offset}, {offset + length})"
                       for name, offset, length in needed if name in files and (name, offset, length) not in crcs]


# ---------------------------------------------------------------------- DCP metadata, unpickled safely
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {(_DCP_METADATA_MODULE, name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # called with a layout name, e.g. "torch.strided"
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"))}


class _AllowListUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, torch dtypes/Size/layout and paths; refuses anything else."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to load global '{module}.{name}'; a DCP metadata file may only "
            "reference DCP's metadata classes and torch dtypes (the file may be crafted to run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source}: persistent ids are not allowed in DCP metadata")


def load_metadata_safely(path: str) -> Metadata:
    """Read DCP's ``.metadata`` pickle through the allow-list unpickler and check its structure."""
    try:
        with open(path, "rb") as f:
            md = _AllowListUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: DCP metadata file is missing (the checkpoint is incomplete)") from None
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or corrupt pickle
        raise CheckpointError(f"{path}: cannot read DCP metadata ({e!r}); the file is corrupt or truncated") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: expected a DCP Metadata object, found {type(md).__name__}")
    if not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: state_dict_metadata is {type(md.state_dict_metadata).__name__}, expected dict")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{path}: bad metadata entry {key!r}: {type(entry).__name__}")
        if isinstance(entry, TensorStorageMetadata):
            props = entry.properties
            if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
                raise CheckpointError(f"{path}: entry {key!r} has no valid dtype")
            if not all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks):
                raise CheckpointError(f"{path}: entry {key!r} has malformed chunks")
    for index, (rel, _, _) in storage_records(md, path).items():
        if os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise CheckpointError(f"{path}: storage record for {index.fqn!r} points outside the checkpoint: {rel!r}")
    return md


# ---------------------------------------------------------------------- writing and reading a directory
def save_entries(group, directory: str, entries: Dict[str, Entry], meta: Dict[str, Any]) -> None:
    """Collective: write ``entries`` (this rank's share) and ``meta`` as a complete checkpoint at ``directory``.
    ``group``: the model's ShardGroup (None: one process); rank 0 adds format, world size and checksums to
    ``meta`` and writes it last."""
    world = None if group is None else group.world_group
    rank, size = (0, 1) if group is None else (group.world_rank, group.world_size)
    tmp = comm.broadcast_object(world, new_tmp_dir(directory) if rank == 0 else None)
    try:
        gathered = comm.all_gather_object(world, dcp_save(entries, tmp, FlatSavePlanner(), world))
        status = None
        if rank == 0:
            try:
                md_path = os.path.join(tmp, METADATA_FILE)
                write_json_atomic(os.path.join(tmp, META_FILE), {
                    "format": FORMAT, "format_version": FORMAT_VERSION, **meta, "world_size": size,
                    "shard_size": group.shard_size if group is not None else 1,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch_version": torch.__version__,
                    "files": {name: f for rank_files in gathered for name, f in rank_files.items()},
                    "dcp_metadata": {"file": METADATA_FILE, "size": os.path.getsize(md_path),
                                     "crc32": _crc32_of_file(md_path)},
                })
                commit_dir(tmp, directory)
            except Exception as e:  # noqa: BLE001 - reported on every rank
                status = f"rank 0 could not finish {directory}: {type(e).__name__}: {e}"
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # (gone already once committed)
    failed = comm.agree_on_failure(world, status)  # (only rank 0 can fail here)
    if failed:
        raise CheckpointError(f"saving {directory} failed (the previous checkpoint there is untouched): {failed[0][1]}")


def open_checkpoint(directory: str, kind: Optional[str] = None) -> Tuple[str, Dict[str, Any], Metadata]:
    """The complete checkpoint's directory, its ``flatshard.json`` (of ``kind``, if given) and safe ``.metadata``."""
    directory, meta = read_meta(directory, kind)
    info = meta["dcp_metadata"]
    md_path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(md_path):
        raise CheckpointError(f"{md_path}: DCP metadata file is missing")
    if (size := os.path.getsize(md_path)) != info.get("size"):
        raise CheckpointError(f"{md_path}: {size} bytes, {META_FILE} says {info.get('size')} (truncated or replaced)")
    if _crc32_of_file(md_path) != info.get("crc32"):
        raise CheckpointError(f"{md_path}: checksum mismatch (corrupt, or from another save)")
    md = load_metadata_safely(md_path)
    for key, desc in meta["tensors"].items():
        if int(torch.Size(desc["shape"]).numel()) == 0:
            continue
        entry = md.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{md_path}: has no tensor {key!r} that {META_FILE} lists")
        if list(entry.size) != list(desc["shape"]) or dtype_to_str(entry.properties.dtype) != desc["dtype"]:
            raise CheckpointError(
                f"{md_path}: {key!r} is {tuple(entry.size)} {entry.properties.dtype}, but {META_FILE} says "
                f"{tuple(desc['shape'])} {desc['dtype']} (files from different saves?)")
    return directory, meta, md


def load_entries(group, directory: str, meta: Dict[str, Any], md: Optional[Metadata], entries: Dict[str, Entry],
                 verify_checksums: bool = True, error: Optional[Exception] = None) -> None:
    """Collective: fill ``entries`` from the checkpoint; ``error`` (a problem found earlier on this
    rank) is raised on every rank instead of loading."""
    world = None if group is None else group.world_group
    # zero-element pieces take no part in DCP reads (but are still state)
    entries = {k: v for k, v in entries.items() if (v.local if isinstance(v, FlatRange) else v).numel()}
    if error is None:
        try:
            crcs = {(name, o, n): c for name, entry in meta["files"].items() for o, n, c in entry.get("items", [])}
            records = storage_records(md, directory)
            needed = sorted({records[r.storage_index] for r in plan_reads(entries, md)})
            problems = _verify_items(directory, meta["files"], crcs, needed)
            if problems:
                error = CheckpointError("checkpoint files are damaged:\n  " + "\n  ".join(problems))
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
    # raises on every rank unless every rank got through the checks (crcs is set)
    comm.agree_on_error(world, error, CHECKPOINT_ERRORS, CheckpointError)
    dcp_load(entries, directory, md, FlatLoadPlanner(), world, crcs if verify_checksums else None)
