"""Offline reading of a directory written by ``accelerator.save_state`` (accelerate's FSDP layout).

Such a directory holds, per prepared model ``i`` and optimizer ``j``, either sharded checkpoints
(``pytorch_model_fsdp_{i}/``, ``optimizer_{j}/``: our DCP directories, SHARDED_STATE_DICT) or full
files (``pytorch_model_fsdp[_i].bin``, ``optimizer[_j].bin``: ``torch.save`` of name-keyed dicts,
FULL_STATE_DICT), plus accelerate's own files (``scheduler.bin``, ``random_states_*.pkl``, ...).
:func:`read_save_state_info` lists them; :func:`consolidate_save_state` writes its model as Hugging
Face safetensors.

Example::

    info = read_save_state_info("out/step_100")
    [m["name"] for m in info["models"]]          # ['pytorch_model_fsdp_0']
    consolidate_save_state("out/step_100", "hf_out")
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Union

import torch

from ..state_dict.types import CheckpointError, dtype_to_str
from ._files import META_FILE

__all__ = ["is_save_state_dir", "read_save_state_info", "consolidate_save_state"]

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
    names = os.listdir(directory)
    return any(n.startswith(("pytorch_model_fsdp", "random_states_")) or
               _kind_of(n, os.path.isdir(os.path.join(directory, n))) == "optimizer" for n in names)


def read_save_state_info(directory: str) -> Dict[str, Any]:
    """``models`` and ``optimizers`` (each: name, path, layout ``sharded``/``full``, and for models the
    tensors), ``other`` (accelerate's files: name -> bytes), from a ``save_state`` directory."""
    from .consolidate import read_checkpoint_info

    if not is_save_state_dir(directory):
        raise CheckpointError(f"{directory}: not a directory written by accelerator.save_state (no "
                              "pytorch_model_fsdp_*/, optimizer_*/, pytorch_model_fsdp*.bin or optimizer*.bin in it)")
    out: Dict[str, Any] = {"directory": os.path.normpath(directory), "models": [], "optimizers": [], "other": {}}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        kind = _kind_of(name, os.path.isdir(path))
        if kind is None:
            out["other"][name] = _size(path)
            continue
        entry: Dict[str, Any] = {"name": name, "path": path, "layout": "sharded" if os.path.isdir(path) else "full",
                                 "file_bytes": _size(path)}
        if entry["layout"] == "sharded":
            info = read_checkpoint_info(path)  # raises for an incomplete directory
            entry.update(world_size=info["world_size"], model_class=info.get("model_class"),
                         optimizer_class=info.get("optimizer_class"), tensors=info["tensors"],
                         total_bytes=info["total_bytes"])
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
    from .consolidate import consolidate, write_hf_safetensors

    info = read_save_state_info(directory)
    models = info["models"]
    if len(models) != 1:
        listing = ", ".join(m["name"] for m in models) or "none"
        raise CheckpointError(f"{directory}: holds {len(models)} models ({listing}); consolidate one of them, e.g. "
                              f"`accel-flatshard consolidate {os.path.join(directory, models[0]['name']) if models else directory} OUT`")
    model = models[0]
    if model["layout"] == "sharded":
        return consolidate(model["path"], out_dir, max_shard_size=max_shard_size, verify_checksums=verify_checksums)
    tensors = _unique(_load_full(model["path"]))
    return write_hf_safetensors(out_dir, tensors, lambda names: {k: tensors[k] for k in names}, max_shard_size)


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


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
