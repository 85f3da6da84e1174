"""The one adapter for the private torch APIs the package uses (checked on torch 2.11 - 2.13, the supported window).

Everything here is a private or semi-private torch API; keeping them in one place makes a torch upgrade
a one-file review.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch.utils._pytree import tree_flatten as _tree_flatten
from torch.utils._pytree import tree_map as _tree_map
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - sees every aten op (the memory planner)


def queue_end_of_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (torch FSDP uses the same engine call)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def inside_backward_pass() -> bool:
    """True while the autograd engine executes a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(tree: Any) -> List[torch.Tensor]:
    return [t for t in _tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    return _tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)


def profiler_enabled() -> bool:
    """Whether a torch (autograd / kineto) profiler is recording: record_function spans are skipped otherwise
    (about 0.1 us for this check against about 6 us for an unobserved record_function on a busy CPU)."""
    return torch._C._autograd._profiler_enabled()


def FakeTensorMode(**kwargs: Any) -> Any:  # noqa: N802 - torch's class
    """torch's fake tensors (shapes and dtypes, no data): the memory planner runs whole steps on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode

    return _FakeTensorMode(**kwargs)


def outside_dispatch_modes() -> Any:
    """A context in which no dispatch mode (fake tensors' included) is active: ops there run real kernels."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def fake_mode_with_scalars() -> Any:
    """Fake tensors whose ``.item()`` is symbolic (torch.optim's steps read their step counter)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def dynamo_counters() -> Any:
    """dynamo's event counters (``torch._dynamo.utils.counters``): ``counters["graph_break"]`` and
    ``counters["unimplemented"]`` map reasons to counts; ``counters["stats"]["unique_graphs"]`` counts compiled
    graphs (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return counters
