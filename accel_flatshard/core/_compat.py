"""The one adapter for the private torch APIs the package uses (checked on torch 2.11 - 2.15, the supported window):
in one place, a torch upgrade is a one-file review."""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch.utils._pytree import tree_flatten as _tree_flatten, tree_map as _tree_map
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - sees every aten op (the memory planner)


def queue_end_of_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (torch FSDP uses the same engine call)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def inside_backward_pass() -> bool:
    """True while the autograd engine executes a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def clamp_all_(tensors: List[torch.Tensor], low: float, high: float) -> None:
    """Clamp every tensor in place with torch's multi-tensor kernels (``clip_grad_value_`` uses the same)."""
    torch._foreach_clamp_min_(tensors, low)
    torch._foreach_clamp_max_(tensors, high)


def can_set_data(param: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``param.data = value`` is allowed (torch refuses it across tensor types, e.g. meta to CPU)."""
    return torch._has_compatible_shallow_copy_type(param, value)


def storage_key(tensor: torch.Tensor) -> int:
    """An id of ``tensor``'s storage, shared by every view of it, as long as the storage lives (the planner)."""
    return tensor.untyped_storage()._cdata


def tensors_in(tree: Any) -> List[torch.Tensor]:
    return [t for t in _tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    return _tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)


def profiler_enabled() -> bool:
    """Whether a torch (autograd / kineto) profiler is recording: record_function spans are skipped otherwise
    (about 0.1 us for this check against about 6 us for an unobserved record_function on a busy CPU)."""
    return torch._C._autograd._profiler_enabled()


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (the memory planner's): it has no data to look at."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(tensor)


def FakeTensorMode(**kwargs: Any) -> Any:  # noqa: N802 - torch's class
    """torch's fake tensors (shapes and dtypes, no data): the memory planner runs whole steps on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode

    return _FakeTensorMode(**kwargs)


def outside_dispatch_modes() -> Any:
    """A context in which no dispatch mode (fake tensors' included) is active: ops there run real kernels."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def dynamo_counters() -> Any:
    """dynamo's event counters: ``["graph_break"]`` and ``["unimplemented"]`` map reasons to counts,
    ``["stats"]["unique_graphs"]`` counts compiled graphs (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return counters


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Change a live process group's timeout (``timeout``: a timedelta); torch has no public call for it."""
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timeout, group)


def fake_world(world_size: int, backend: str) -> Any:
    """A fresh world of ``world_size`` fake ranks (this process is rank 0), its groups named ``backend`` (comm.py
    picks collectives by it); the caller's world is set aside meanwhile (c10d's ``_world`` and tables)."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

    if backend not in dist.Backend.backend_list:
        dist.Backend.register_backend(backend, _create_fake_pg, extended_api=True, devices=["cpu", "cuda"])
    tables = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")

    @contextlib.contextmanager
    def world() -> Any:
        saved = {name: getattr(c10d, name) for name in tables + ("_group_count", "_world")}
        for name in tables:
            setattr(c10d, name, {})
        c10d._world, c10d._group_count = c10d._World(), 10**9 + saved["_group_count"]
        try:
            dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=world_size)
            yield
        finally:
            for name in c10d._pg_names.values():
                c10d._unregister_process_group(name)
            for name, value in saved.items():
                setattr(c10d, name, value)
    return world()


def step_without_hooks(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()`` without the optimizer step hooks, global or its own: torch wraps each optimizer class's
    ``step`` once (``Optimizer.profile_hook_step``, marked ``hooked``) and keeps the original as ``__wrapped__``.
    The matrix optimizers' owner-side optimizer (``matrix_optim.py``) is an implementation detail: its step is not a
    step of the user's (the profiler would count it, the frozen-units hook would run twice)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step(optimizer)


# ---------------------------------------------------------------------- ShardedTensor (torch's state-dict API)
def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``ShardedTensor`` (torch FSDP1's SHARDED_STATE_DICT values; DCP reads and writes it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def sharded_tensor(local: List[Any], boxes: List[Any], shape: Any, dtype: torch.dtype, group: Any) -> Any:
    """A ``ShardedTensor`` of global ``shape`` over ``group`` from its every box ``(offsets, sizes, global rank,
    device)`` (all ranks', known here: no collective) and this rank's ``(offsets, tensor)`` (the tensors are kept,
    not copied)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    mds = [ShardMetadata(list(off), list(size), f"rank:{rank}/{device}") for off, size, rank, device in boxes]
    by_offsets = {tuple(md.shard_offsets): md for md, box in zip(mds, boxes) if box[2] == torch.distributed.get_rank()}
    shards = [Shard(tensor, by_offsets[tuple(off)]) for off, tensor in local]
    meta = ShardedTensorMetadata(mds, torch.Size(shape), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=group)


def local_boxes(value: Any) -> List[Any]:
    """``(offsets, sizes, tensor)`` of each of this rank's shards of a ``ShardedTensor``."""
    return [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor) for s in value.local_shards()]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """torch's own: give a fresh optimizer its state (a step on zero gradients at lr 0), as its state-dict API does."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
