"""accel_flatshard: fully sharded data parallel (ZeRO-3) training with flat parameters, for Accelerate.

Importing the package also imports the modules that attach to every wrapped model through the registry
(``core/registry.py``): gather-once generation and frozen models, owner-computes matrix optimizers, bitsandbytes'
4-bit layers and 8-bit state, the ``FLATSHARD_PROFILE`` profiler.  None of them imports accelerate.
"""
from .features import generation, matrix_optim  # noqa: F401  (registry listeners, see above)
from .integrations import bitsandbytes_shards, patches  # noqa: F401  (patches: torch's state-dict API)
from .tools import profiling  # noqa: F401
from .core.fully_sharded import FullyShardedDataParallel
from .core.grad_norm import clip_grad_norm_
from .core.mixed_precision import MixedPrecision
from .core.offload import CPUOffload
from .core.options import BackwardPrefetch, FlatShardOptions
from .core.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from .features.chained_optimizer import ChainedOptimizer
from .features.compilation import compile_model

__all__ = ["Accelerator", "register", "FullyShardedDataParallel", "FlatShardOptions", "BackwardPrefetch",
           "MixedPrecision", "CPUOffload", "ChainedOptimizer", "clip_grad_norm_", "compile_model",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The Accelerate backend imports accelerate: load it only when asked for.
    if name in ("Accelerator", "register"):
        from .integrations import accelerate as _accelerate

        return getattr(_accelerate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
