"""Offline access to sharded checkpoints (no process group): inspect, read full tensors, consolidate.

``consolidate`` turns a sharded *model* checkpoint into the Hugging Face layout: ``model.safetensors``,
or ``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json`` when the tensors
exceed ``max_shard_size`` (split by ``huggingface_hub.split_torch_state_dict_into_shards``).  Tensors are read a file's worth at a time, so memory stays near one output
file.  Tied parameters are written once, under their first name (as ``save_pretrained`` does), so
``from_pretrained`` on a directory holding this and ``config.json`` works.

Example::

    consolidate("ckpt/model", "hf_out", max_shard_size="2GB")
    info = read_checkpoint_info("ckpt/model"); info["world_size"], info["total_bytes"]
"""
from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ._dcp_io import load_entries, open_checkpoint
from ..state_dict.types import CheckpointError, str_to_dtype
from ._files import read_meta, resolve_checkpoint_dir
from .atomic import write_atomic, write_json_atomic

__all__ = ["read_checkpoint_info", "read_full_tensors", "consolidate", "write_hf_safetensors", "parse_size"]

SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def parse_size(size: Union[int, str], name: str = "size") -> int:
    """``"5GB"`` -> 5 * 10^9, ``"500MiB"`` or ``"80G"`` -> binary multiples, ``"1e9"`` or ``123`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.e+]+)\s*([KMGT]?)(i?)(B?)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse {name} {size!r}: expected a size such as 80GiB, 5GB, 500MiB or a number of bytes")
    number, prefix, binary, b = m.groups()
    power = "KMGT".index(prefix.upper()) + 1 if prefix else 0
    return int(float(number) * (1000 if b and not binary else 1024) ** power)


def read_checkpoint_info(directory: str) -> Dict[str, Any]:
    """What a checkpoint holds, from its JSON metadata (no tensor data read).

    Returns ``kind``, ``world_size``, ``shard_size``, ``model_class``, ``tensors`` (name -> shape,
    dtype, kind), ``total_bytes`` (tensor bytes) and ``file_bytes`` (bytes on disk).
    """
    directory = resolve_checkpoint_dir(directory)
    meta = read_meta(directory)
    total = 0
    for desc in meta["tensors"].values():
        total += math.prod(desc["shape"]) * torch.empty((), dtype=str_to_dtype(desc["dtype"])).element_size()
    file_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                     if os.path.isfile(os.path.join(directory, f)))
    return {
        "directory": directory,
        "kind": meta["kind"],
        "world_size": meta["world_size"],
        "shard_size": meta.get("shard_size"),
        "model_class": meta.get("model_class"),
        "optimizer_class": meta.get("optimizer_class"),
        "saved_at": meta.get("saved_at"),
        "torch_version": meta.get("torch_version"),
        "tensors": meta["tensors"],
        "param_groups": meta.get("param_groups"),
        "total_bytes": total,
        "file_bytes": file_bytes,
    }


def read_full_tensors(directory: str, names: Optional[Sequence[str]] = None, max_batch_bytes: int = 1 << 30,
                      verify_checksums: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` from a sharded checkpoint, in checkpoint order, offline.

    Tensors are read in batches of about ``max_batch_bytes``.  Example::

        for name, t in read_full_tensors("ckpt/model"):
            print(name, t.shape)
    """
    directory, meta, md = open_checkpoint(directory, meta_kind(directory))
    wanted = list(meta["tensors"]) if names is None else list(names)
    for batch in _batches(meta, wanted, max_batch_bytes):
        yield from _read_batch(directory, meta, md, batch, verify_checksums).items()


def meta_kind(directory: str) -> str:
    return read_meta(resolve_checkpoint_dir(directory))["kind"]


def _nbytes(desc: Dict[str, Any]) -> int:
    return math.prod(desc["shape"]) * torch.empty((), dtype=str_to_dtype(desc["dtype"])).element_size()


def _batches(meta: Dict[str, Any], names: Sequence[str], limit: int) -> List[List[str]]:
    batches: List[List[str]] = []
    current: List[str] = []
    size = 0
    for name in names:
        if name not in meta["tensors"]:
            raise CheckpointError(f"{name!r} is not in the checkpoint")
        n = _nbytes(meta["tensors"][name])
        if current and size + n > limit:
            batches.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        batches.append(current)
    return batches


def _read_batch(directory: str, meta: Dict[str, Any], md: Any, names: List[str], verify: bool) -> Dict[str, torch.Tensor]:
    out = {}
    for name in names:
        desc = meta["tensors"][name]
        out[name] = torch.empty(desc["shape"], dtype=str_to_dtype(desc["dtype"]))
    load_entries(None, directory, meta, md, {k: v for k, v in out.items() if v.numel()}, verify)
    return out


def consolidate(checkpoint_dir: str, out_dir: str, max_shard_size: Union[int, str] = "5GB",
                verify_checksums: bool = True) -> List[str]:
    """Write a sharded model checkpoint as Hugging Face safetensors into ``out_dir``; returns the files.

    Example::

        consolidate("ckpt/model", "hf_out")
        config.save_pretrained("hf_out")
        model = AutoModelForCausalLM.from_pretrained("hf_out")
    """
    directory, meta, md = open_checkpoint(checkpoint_dir, "model")
    shapes = {k: torch.empty(d["shape"], dtype=str_to_dtype(d["dtype"]), device="meta") for k, d in meta["tensors"].items()}
    return write_hf_safetensors(out_dir, shapes, lambda names: _read_batch(directory, meta, md, names, verify_checksums),
                                max_shard_size)


def write_hf_safetensors(out_dir: str, shapes: Dict[str, torch.Tensor], read: Callable[[List[str]], Dict[str, torch.Tensor]],
                         max_shard_size: Union[int, str]) -> List[str]:
    """Hugging Face layout in ``out_dir``: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (split by ``huggingface_hub``).  ``shapes``: name -> a tensor of the right
    shape and dtype (meta is fine), in output order; ``read(names)`` returns one output file's real tensors, so
    memory stays near one output file.  Every file is written atomically; stale files of an earlier split go."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(shapes, max_shard_size=parse_size(max_shard_size))
    os.makedirs(out_dir, exist_ok=True)
    files = []
    for fname, names in split.filename_to_tensors.items():
        tensors = {k: v.contiguous() for k, v in read(names).items()}
        write_atomic(os.path.join(out_dir, fname), lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        files.append(fname)
        del tensors
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        write_json_atomic(os.path.join(out_dir, INDEX_NAME), index, indent=2)
        files.append(INDEX_NAME)
    stale = {SAFE_NAME, INDEX_NAME} | {os.path.basename(p) for p in glob.glob(os.path.join(out_dir, "model-*-of-*.safetensors"))}
    for name in stale - set(files):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            os.remove(path)
    return [os.path.join(out_dir, f) for f in files]
