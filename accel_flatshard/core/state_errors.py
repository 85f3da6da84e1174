"""What every checkpoint reader and writer shares: the errors a failed save or load raises (:data:`CHECKPOINT_ERRORS`:
the classes a rank raises when another rank's save or load failed, ``comm.agree_on_error``) and the dtype names
checkpoints record.  It imports nothing of the package: ``core/model_state.py`` (in-memory dicts, a layer below
``state/``) raises these errors too."""
from __future__ import annotations

import torch


class CheckpointError(RuntimeError):
    """A state dict or checkpoint cannot be saved or loaded; the message names the key or file and what differs."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code (e.g. a pickle referencing a non-allowed global)."""


CHECKPOINT_ERRORS = (CheckpointError, UnsafeCheckpointError)


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def str_to_dtype(name: str, source: str = "checkpoint") -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{source}: unknown dtype {name!r}")
    return value

