"""Every order in which code creates and resets accelerate's state works under accel_flatshard (issue 30).

accelerate's own scripts (``test_utils/scripts/external_deps/test_metrics.py``), the Trainer and users create an
``Accelerator``, reset ``AcceleratorState`` (with or without ``reset_partial_state``), create a ``PartialState``
first, or create two Accelerators.  Each sequence runs on 2 gloo ranks with an FSDP launch environment, as under
``accelerate launch --config_file <fsdp yaml> -m accel_flatshard.run`` (``register()`` called) and as a script that
imports accel_flatshard's Accelerator itself; after each Accelerator, the state must be FSDP over both ranks with
its plugin, and a model given to ``prepare`` must come back sharded and train exactly like the unsharded model.

The last test runs accelerate's own ``test_metrics.py`` unmodified under the runner (it crashed with
``AcceleratorState object has no attribute fsdp_plugin`` after its first reset).
"""
from __future__ import annotations

import os
from pathlib import Path

import accelerate
import pytest
import torch
import torch.nn as nn

from dist_helpers import spawn
from launch_helpers import CPU_FSDP_YAML, launch

TEST_METRICS = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "external_deps" / "test_metrics.py"
SEQUENCES = {
    "create, reset, create": ["acc", "reset", "acc"],
    "create, reset with partial state, create": ["acc", "reset_partial", "acc"],
    "PartialState first": ["partial", "acc"],
    "PartialState first, reset, create": ["partial", "acc", "reset", "acc"],
    "two Accelerators": ["acc", "acc"],
    "reset twice in a row, create": ["acc", "reset", "reset_partial", "acc", "reset", "acc"],
}


def _fsdp_launch_env(monkeypatch) -> None:
    """What ``accelerate launch`` exports for the README yaml (the keys that matter here)."""
    for k in list(os.environ):
        if k.startswith(("FSDP_", "FLATSHARD_", "ACCELERATE_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "true")


def _check_sharded_step(accelerator) -> dict:
    """prepare + one SGD step; the sharded model's loss and updated weights equal the unsharded model's."""
    from accel_flatshard import FullyShardedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    data = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    ref_model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    ref_model.load_state_dict(model.state_dict())
    ref_loss = ref_model(data).square().mean()
    ref_loss.backward()
    expected = {k: (p - 0.1 * p.grad).detach() for k, p in ref_model.named_parameters()}

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    loss = prepared(data).square().mean()  # every rank the same batch: the reduced gradient is this one
    accelerator.backward(loss)
    optimizer.step()
    full = accelerator.get_state_dict(prepared)
    local = sum(p.numel() for p in prepared.parameters())
    total = sum(p.numel() for p in ref_model.parameters())
    weights_diff = None
    if accelerator.is_main_process:
        assert full.keys() == expected.keys(), (sorted(full), sorted(expected))
        weights_diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    return {"wrapped": isinstance(prepared, FullyShardedDataParallel), "local": local, "total": total,
            "loss_diff": abs(loss.item() - ref_loss.item()), "weights_diff": weights_diff}


def _run_sequence(rank: int, world: int, steps: list, via_register: bool) -> list:
    if via_register:
        from accel_flatshard import register

        register()
        from accelerate import Accelerator  # what an unmodified script gets under the runner
    else:
        from accel_flatshard.integrations.accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    seen = []
    for step in steps:
        if step == "partial":
            state = PartialState()
            seen.append({"partial": str(state.distributed_type), "processes": state.num_processes})
        elif step == "reset":
            AcceleratorState._reset_state()
        elif step == "reset_partial":
            AcceleratorState._reset_state(reset_partial_state=True)
        else:
            accelerator = Accelerator()
            state = accelerator.state
            plugin = getattr(state, "fsdp_plugin", None)
            seen.append({"type": str(state.distributed_type), "processes": state.num_processes,
                         "plugin": plugin is not None, "fsdp": state.distributed_type == DistributedType.FSDP,
                         **_check_sharded_step(accelerator)})
    return seen


@pytest.mark.parametrize("via_register", [True, False], ids=["runner", "imported"])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_state_sequence_gives_sharded_accelerators(monkeypatch, name, via_register):
    _fsdp_launch_env(monkeypatch)
    per_rank = spawn(2, _run_sequence, SEQUENCES[name], via_register)
    accelerators = [s for s in per_rank[0] if "type" in s]
    assert len(accelerators) == SEQUENCES[name].count("acc")
    for rank_seen in per_rank:
        for seen in rank_seen:
            if "partial" in seen:
                # under the runner a PartialState made first is the gloo state over both ranks; a script that
                # imports the Accelerator has it set up again by the Accelerator (with a warning)
                assert seen["processes"] == (2 if via_register else 1), seen
                continue
            assert seen["fsdp"] and seen["plugin"] and seen["processes"] == 2, seen
            assert seen["wrapped"] and seen["local"] <= seen["total"] / 2 * 1.05, seen  # 1/W (+ alignment padding)
            assert seen["loss_diff"] <= 1e-6, seen
    for seen in accelerators:
        assert seen["weights_diff"] <= 1e-6, seen


@pytest.mark.ci
def test_accelerates_own_test_metrics_passes_under_the_runner(tmp_path):
    """accelerate's test_metrics.py (creates an Accelerator, resets AcceleratorState, creates the next one, ...)
    unmodified under `-m accel_flatshard.run`.  Its ``evaluate`` import is only used on GPUs (MRPC): a stub
    stands in when the package is not installed."""
    assert TEST_METRICS.exists(), TEST_METRICS
    env = {}
    try:
        import evaluate  # noqa: F401
    except ImportError:
        (tmp_path / "evaluate.py").write_text("def load(*args, **kwargs):\n    raise RuntimeError('stub')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), str(tmp_path)])
    proc = launch(CPU_FSDP_YAML, TEST_METRICS, via_run=True, env=env, check=False, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Test that `drop_last` is taken into account" in output, output[-4000:]
    assert "no attribute" not in output
