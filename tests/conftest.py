"""Shared fixtures for the single-process tests."""
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank (this process) for the module's tests, unless one exists."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
