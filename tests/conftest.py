"""Shared fixtures and the suite's order and threads.

* One intra-op thread: the tests' tensors are tiny, and on this 2-core machine OpenMP's second thread costs
  far more than it brings (~500 us vs ~3 us per tiny op under load).  The spawned ranks and the launched
  scripts run with one thread too (dist_helpers, launch_helpers).
* Order: the in-process unit tests first, then the files that spawn gloo ranks, then those that
  ``accelerate launch`` or run other subprocesses (``_tier``), so that a mistake in the unit-level code fails
  in seconds.  Within a tier, files keep pytest's order and a file's tests stay together (module fixtures
  are set up once).
"""
import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)


def _tier(path) -> int:
    """0: in-process; 1: spawns gloo ranks (dist_helpers); 2: launches processes (accelerate launch, scripts)."""
    try:
        source = path.read_text()
    except OSError:
        return 0
    if "launch_helpers" in source or "subprocess" in source:
        return 2
    return 1 if "dist_helpers" in source else 0


def pytest_configure(config):
    # here rather than in pyproject.toml, whose every change rebuilds the venv (Makefile)
    config.addinivalue_line("markers", "ci: run by CI (make test-ci) and make test-all, not by make test: "
                                       "launch-heavy cases whose code paths the default run also reaches")
    config.addinivalue_line("markers", "pinned_env: true only of make test's pinned venv (constraints/pinned.txt); "
                                       "make test-latest, which installs the newest releases, deselects it")


def pytest_collection_modifyitems(session, config, items):
    tiers = {}
    for item in items:
        tiers.setdefault(item.path, _tier(item.path))
    items.sort(key=lambda item: tiers[item.path])  # stable: pytest's order within a tier


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank (this process) for the module's tests, unless one exists."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def ddp_references(request, tmp_path_factory):
    """The session's shared accelerate-DDP reference launch (launch_helpers.ddp_reference)."""
    from launch_helpers import REFERENCES, SharedReferences

    needed = {name for item in request.session.items for name in item.fixturenames if name in REFERENCES}
    return SharedReferences(tmp_path_factory.mktemp("ddp_references"), sorted(needed))
