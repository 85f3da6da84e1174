"""Offline access (no process group) to sharded checkpoints and ``accelerator.save_state`` directories.

:func:`read_checkpoint_info` / :func:`read_full_tensors` / :func:`consolidate` for a sharded checkpoint;
:func:`read_save_state_info` / :func:`consolidate_save_state` for a ``save_state`` directory (accelerate's FSDP
layout): sharded checkpoints (``pytorch_model_fsdp_{i}/``, ``optimizer_{j}/``) or full ``torch.save`` files
(``pytorch_model_fsdp[_i].bin``, ``optimizer[_j].bin``), plus accelerate's own files.  Consolidated output is
Hugging Face's layout, read one output file's worth at a time, tied parameters once under their first name (as
``save_pretrained``), so ``from_pretrained`` works next to a ``config.json``.
"""
from __future__ import annotations

import contextlib
import glob
import math
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..core.sizes import parse_size
from .atomic import write_atomic, write_json_atomic
from ..core.state_errors import CheckpointError, dtype_to_str, str_to_dtype
from .sharded import META_FILE, load_entries, open_checkpoint, read_meta


SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _nbytes(desc: Dict[str, Any]) -> int:
    return math.prod(desc["shape"]) * torch.empty((), dtype=str_to_dtype(desc["dtype"])).element_size()


def _bytes_on_disk(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------- sharded checkpoints
def read_checkpoint_info(directory: str) -> Dict[str, Any]:
    """What a checkpoint holds: ``kind``, ``world_size``, ``shard_size``, ``model_class``, ``tensors`` (name ->
    shape, dtype, kind), ``total_bytes`` (tensor bytes), ``file_bytes`` (on disk), ... (no tensor data read)."""
    directory, meta = read_meta(directory)
    info = {"directory": directory, **{k: meta.get(k) for k in (
        "kind", "world_size", "shard_size", "model_class", "optimizer_class", "saved_at", "torch_version", "tensors",
        "param_groups")}}
    info["total_bytes"] = sum(_nbytes(desc) for desc in meta["tensors"].values())
    info["file_bytes"] = _bytes_on_disk(directory)  # (a checkpoint directory holds files only)
    return info


def _read(directory: str, meta: Dict[str, Any], md: Any, names: List[str], verify: bool) -> Dict[str, torch.Tensor]:
    out = {n: torch.empty(meta["tensors"][n]["shape"], dtype=str_to_dtype(meta["tensors"][n]["dtype"])) for n in names}
    load_entries(None, directory, meta, md, out, verify)
    return out


def read_full_tensors(directory: str, names: Optional[Sequence[str]] = None, max_batch_bytes: float = 1 << 30,
                      verify_checksums: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` from a sharded checkpoint, in checkpoint order (or that of ``names``), read
    in batches of about ``max_batch_bytes``."""
    directory, meta, md = open_checkpoint(directory)
    batch, size = [], 0
    for name in list(meta["tensors"]) if names is None else list(names):
        if name not in meta["tensors"]:
            raise CheckpointError(f"{name!r} is not in the checkpoint")
        n = _nbytes(meta["tensors"][name])
        if batch and size + n > max_batch_bytes:
            yield from _read(directory, meta, md, batch, verify_checksums).items()
            batch, size = [], 0
        batch.append(name)
        size += n
    if batch:
        yield from _read(directory, meta, md, batch, verify_checksums).items()


def consolidate(checkpoint_dir: str, out_dir: str, max_shard_size: Union[int, str] = "5GB",
                verify_checksums: bool = True) -> List[str]:
    """Write a sharded model checkpoint as Hugging Face safetensors into ``out_dir``; returns the files.  Example::

        consolidate("ckpt/model", "hf_out")
        config.save_pretrained("hf_out")
        model = AutoModelForCausalLM.from_pretrained("hf_out")
    """
    directory, meta, md = open_checkpoint(checkpoint_dir, "model")
    shapes = {k: torch.empty(d["shape"], dtype=str_to_dtype(d["dtype"]), device="meta")
              for k, d in meta["tensors"].items()}
    return _write_hf_safetensors(out_dir, shapes, lambda names: _read(directory, meta, md, names, verify_checksums),
                                 max_shard_size)


def _write_hf_safetensors(out_dir: str, shapes: Dict[str, torch.Tensor],
                          read: Callable[[List[str]], Dict[str, torch.Tensor]],
                          max_shard_size: Union[int, str]) -> List[str]:
    """Hugging Face layout in ``out_dir``, split by ``huggingface_hub``.  ``shapes``: name -> a tensor of the right
    shape and dtype (meta is fine), in output order; ``read(names)`` returns one output file's real tensors.  Every
    file is written atomically; stale files of an earlier split are removed."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(shapes, max_shard_size=parse_size(max_shard_size))
    os.makedirs(out_dir, exist_ok=True)
    files = []
    for fname, names in split.filename_to_tensors.items():
        tensors = {k: v.contiguous() for k, v in read(names).items()}
        write_atomic(os.path.join(out_dir, fname), lambda tmp, t=tensors: save_file(t, tmp, metadata={"format": "pt"}))
        files.append(fname)
        del tensors  # memory stays near one output file
    if split.is_sharded:
        write_json_atomic(os.path.join(out_dir, INDEX_NAME),
                          {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2)
        files.append(INDEX_NAME)
    shards = glob.glob(os.path.join(out_dir, "model-*-of-*.safetensors"))
    for name in ({SAFE_NAME, INDEX_NAME} | {os.path.basename(p) for p in shards}) - set(files):  # stale ones
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name))
    return [os.path.join(out_dir, f) for f in files]


# ---------------------------------------------------------------------- save_state directories
_SHARDED_MODEL = re.compile(r"pytorch_model_fsdp_\d+$")
_SHARDED_OPTIM = re.compile(r"optimizer_\d+$")
# FSDP's full file; accelerate's layout without FSDP (DDP, single process) names models like this
_FULL_MODEL = re.compile(r"(pytorch_model_fsdp(_\d+)?\.bin|pytorch_model(_\d+)?\.bin|model(_\d+)?\.safetensors)$")
_FULL_OPTIM = re.compile(r"optimizer(_\d+)?\.bin$")


def _kind_of(name: str, is_dir: bool) -> Optional[str]:
    if is_dir:
        return "model" if _SHARDED_MODEL.match(name) else "optimizer" if _SHARDED_OPTIM.match(name) else None
    return "model" if _FULL_MODEL.match(name) else "optimizer" if _FULL_OPTIM.match(name) else None


def is_save_state_dir(directory: str) -> bool:
    """A directory without ``flatshard.json`` that holds a model or optimizer written by ``save_state``."""
    if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, META_FILE)):
        return False
    # model.safetensors alone is a save_pretrained directory; save_state always writes an optimizer or RNG
    # states next to it, and under FSDP its own model names
    return any(n.startswith(("pytorch_model_fsdp", "random_states_")) or
               _kind_of(n, os.path.isdir(os.path.join(directory, n))) == "optimizer" for n in os.listdir(directory))


def read_save_state_info(directory: str) -> Dict[str, Any]:
    """``models`` and ``optimizers`` (each: name, path, layout ``sharded``/``full``, and for models the
    tensors), ``other`` (accelerate's files: name -> bytes), from a ``save_state`` directory."""
    if not is_save_state_dir(directory):
        raise CheckpointError(f"{directory}: not a directory written by accelerator.save_state (no "
                              "pytorch_model_fsdp_*/, optimizer_*/, pytorch_model_fsdp*.bin or optimizer*.bin in it)")
    out: Dict[str, Any] = {"directory": os.path.normpath(directory), "models": [], "optimizers": [], "other": {}}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        kind = _kind_of(name, os.path.isdir(path))
        if kind is None:
            out["other"][name] = _bytes_on_disk(path)
            continue
        entry: Dict[str, Any] = {"name": name, "path": path, "layout": "sharded" if os.path.isdir(path) else "full",
                                 "file_bytes": _bytes_on_disk(path)}
        if entry["layout"] == "sharded":
            info = read_checkpoint_info(path)  # raises for an incomplete directory
            keys = ("world_size", "model_class", "optimizer_class", "tensors", "total_bytes")
            entry.update({k: info.get(k) for k in keys})
        elif kind == "model":
            tensors = _load_full(path)
            entry["tensors"] = {k: {"shape": list(v.shape), "dtype": dtype_to_str(v.dtype)}
                                for k, v in tensors.items() if isinstance(v, torch.Tensor)}
            entry["total_bytes"] = sum(v.numel() * v.element_size() for v in _unique(tensors).values())
        out["models" if kind == "model" else "optimizers"].append(entry)
    return out


def consolidate_save_state(directory: str, out_dir: str, max_shard_size: Union[int, str] = "5GB",
                           verify_checksums: bool = True) -> List[str]:
    """Write the model of a ``save_state`` directory (sharded or full) as safetensors into ``out_dir``."""
    models = read_save_state_info(directory)["models"]
    if len(models) != 1:
        listing = ", ".join(m["name"] for m in models) or "none"
        example = os.path.join(directory, models[0]["name"]) if models else directory
        raise CheckpointError(f"{directory}: holds {len(models)} models ({listing}); consolidate one of them, e.g. "
                              f"`accel-flatshard consolidate {example} OUT`")
    if models[0]["layout"] == "sharded":
        return consolidate(models[0]["path"], out_dir, max_shard_size=max_shard_size, verify_checksums=verify_checksums)
    tensors = _unique(_load_full(models[0]["path"]))
    return _write_hf_safetensors(out_dir, tensors, lambda names: {k: tensors[k] for k in names}, max_shard_size)


def _load_full(path: str) -> Dict[str, Any]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(f"{path}: cannot be read as a state dict ({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: holds a {type(sd).__name__}, expected a state dict")
    return sd


def _unique(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Tensors, each storage once under its first name (tied weights, as ``save_pretrained`` writes them)."""
    seen, out = set(), {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)
        if v.numel() == 0 or key not in seen:  # empty tensors share data_ptr 0 without being tied
            seen.add(key)
            out[k] = v
    return out
