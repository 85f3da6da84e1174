"""Every yaml in accelerate_configs/ launched the plain way, WITHOUT ``-m accel_flatshard.run`` (issue 30):
``accelerate launch --config_file <yaml> train.py`` on this host without CUDA must run accel_flatshard's backend
(or fail naming the runner), never accelerate's own FSDP, which crashes here (FSDP1 yamls: ``sync_module_states``
is not supported on CPU) or trains one unsharded copy per process with exit code 0 (FSDP2 yamls).

The mechanism is ``accel_flatshard_autoload`` (torch's ``torch.backends`` entry point, pyproject.toml).  The script
(tests/scripts/runnerless_train.py) imports accelerate before anything else and never accel_flatshard.  The GPU
yamls run with their process count cut to 2 on one machine (what this host can run).  Default run: the README yaml
and ``accelerate config``'s FSDP2 yaml; ``ci``: the others (the same code path).
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from launch_helpers import REPO, SCRIPTS, launch, read_json

CONFIGS = REPO / "accelerate_configs"
SCRIPT = SCRIPTS / "runnerless_train.py"
NOTICE = "an FSDP launch without `-m accel_flatshard.run`"
DEFAULT = ("cpu_2proc.yaml", "cpu_2proc_fsdp2.yaml")
# what this host can run of the GPU yamls: one machine, 2 processes
OVERRIDES = {"gpu_1node_8.yaml": {"num_processes": 2},
             "gpu_2node_hybrid.yaml": {"num_processes": 2, "num_machines": 1, "main_process_ip": "127.0.0.1"}}


def _yamls():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert set(DEFAULT) | set(OVERRIDES) <= set(names), names
    return [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.ci) for n in names]


def test_the_autoload_entry_point_is_installed():
    """Without it the launches below run accelerate's own FSDP.  (A stale ``accel_flatshard.egg-info`` in the
    checkout, first on sys.path, hides it: reinstall with ``pip install -e .``.)"""
    assert [e.value for e in entry_points(group="torch.backends") if e.name == "accel_flatshard"] == [
        "accel_flatshard_autoload:autoload"]


@pytest.mark.parametrize("env, armed", [({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}, True),
                                        ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "1"}, False),
                                        ({"ACCELERATE_USE_FSDP": "false", "WORLD_SIZE": "2"}, False),
                                        ({"WORLD_SIZE": "4"}, False)])
def test_autoload_acts_only_in_a_launched_fsdp_run_of_several_processes(monkeypatch, env, armed):
    import sys

    import accel_flatshard_autoload as autoload

    for key in ("ACCELERATE_USE_FSDP", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = len(sys.meta_path)
    autoload.autoload()
    autoload.autoload()  # once only
    finders = [f for f in sys.meta_path if isinstance(f, autoload._WhenAccelerateIsLoaded)]
    assert len(finders) == int(armed) and len(sys.meta_path) == before + int(armed)
    if armed:
        import accelerate.accelerator  # noqa: F401
        import accel_flatshard.integrations.accelerate  # noqa: F401

        # accelerate and accel_flatshard's Accelerator are loaded in this process: it finds nothing, registers
        # nothing (the Accelerator module is there: the runner's or the script's own import sets things up)
        assert finders[0].find_spec("json") is None and finders[0].done


def test_a_script_that_imports_an_accel_flatshard_module_before_accelerate_registers_after_that_import():
    """``state_io`` imports accelerate at its top: the autoload must not register while it is half loaded (the
    patch table then resolved its functions, not yet defined: AttributeError), but at the script's next import."""
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}
    script = ("import accel_flatshard.integrations.state_io, accelerate\n"
              "print(accelerate.Accelerator.__module__)\n"
              "import json.tool\n"
              "print(accelerate.Accelerator.__module__)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["accelerate.accelerator", "accel_flatshard.integrations.accelerate"], proc.stdout


def test_a_script_that_imports_transformers_first_registers_without_a_warning_and_patches_the_trainer_later():
    """``make example``'s import order (transformers, then accelerate): the autoload registers while accelerate's
    ``__init__`` is still loading, when ``transformers.trainer`` cannot import yet.  Its patches are not missing: no
    "cannot patch" warning then, and the next ``install()`` (each Accelerator's) applies them."""
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}
    script = ("import transformers, accelerate\n"
              "print(accelerate.Accelerator.__module__)\n"
              "from accel_flatshard.integrations import patches\n"
              "import transformers.trainer as t\n"
              "print(getattr(t.Trainer._save_checkpoint, patches._MARK, None))\n"
              "patches.install()\n"
              "print(getattr(t.Trainer._save_checkpoint, patches._MARK, None))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot patch" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.split() == ["accel_flatshard.integrations.accelerate", "None", "trainer_checkpoint_commit"]


@pytest.mark.parametrize("name", _yamls())
def test_yaml_launched_without_the_runner_trains_sharded_with_accel_flatshard(name, tmp_path):
    config = yaml.safe_load((CONFIGS / name).read_text())
    config.update(OVERRIDES.get(name, {}))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    world = config["num_processes"]
    proc = launch(path, SCRIPT, ["--output_json", str(tmp_path / "result.json")], timeout=600)
    run = read_json(tmp_path / "result.json")
    assert run["accelerator_class"] == "accel_flatshard.integrations.accelerate.Accelerator", run
    assert run["distributed_type"] == "DistributedType.FSDP" and run["num_processes"] == world, run
    shard = world // config.get("parallelism_config", {}).get("parallelism_config_dp_replicate_size", 1)
    total, local = run["total_numel"], run["local_numel"]
    assert len(local) == world and all(total / shard <= n <= total / shard * 1.05 for n in local), (local, total)
    assert all(loss == loss for loss in run["losses"]), run["losses"]  # finite
    # the user is told which backend runs, once per process
    assert (proc.stdout + proc.stderr).count(NOTICE) == world, (proc.stdout + proc.stderr)[-3000:]
