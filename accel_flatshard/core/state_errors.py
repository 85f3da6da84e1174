"""What every checkpoint reader and writer shares: the errors a failed save or load raises, the dtype names
checkpoints record and :func:`agree` (every rank raises when one fails).  It imports only ``comm``: ``state_dict/``
(in-memory dicts, a layer below ``checkpoint/``) raises these errors too, and imports this module alone."""
from __future__ import annotations

from typing import Optional

import torch

from . import comm



class CheckpointError(RuntimeError):
    """A state dict or checkpoint cannot be saved or loaded; the message names the key or file and what differs."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code (e.g. a pickle referencing a non-allowed global)."""


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def str_to_dtype(name: str, source: str = "checkpoint") -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{source}: unknown dtype {name!r}")
    return value


def agree(group, error: Optional[BaseException]) -> None:
    """:func:`comm.agree_on_error` with this package's error classes."""
    comm.agree_on_error(group, error, (CheckpointError, UnsafeCheckpointError), CheckpointError)
