"""The Accelerate backend's configuration mapping, checks, register() and run.py (in process, fast)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import yaml

from launch_helpers import REPO
from models import gpt2

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402

from accel_flatshard import BackwardPrefetch  # noqa: E402
from accel_flatshard.integrations import config as cfg  # noqa: E402
from accel_flatshard.core.options import check_environment  # noqa: E402
from accel_flatshard.core.wrap import policy_of, select_units  # noqa: E402

# the launcher's yaml-key -> environment mapping for the keys used here (accelerate/utils/launch.py)
_ENV_NAME = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP", "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS"}


@pytest.fixture
def fsdp_env(monkeypatch):
    """Clean FSDP_* / FLATSHARD_* environment; returns a function that sets yaml-style keys and builds options."""
    def clear():
        for k in list(os.environ):
            if k.startswith(("FSDP_", "FLATSHARD_", "ACCELERATE_")) or k == "LOCAL_WORLD_SIZE":
                monkeypatch.delenv(k)

    clear()

    def options(mixed_precision: str = "no", env: dict = None, **fsdp_keys):
        clear()  # each call starts from a clean environment
        for key, value in fsdp_keys.items():
            name = _ENV_NAME.get(key, key.upper())
            monkeypatch.setenv(name, str(value).lower() if isinstance(value, bool) else str(value))
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        plugin = cfg.build_plugin_without_device(FullyShardedDataParallelPlugin)
        return cfg.options_from_plugin(plugin, mixed_precision)

    return options


def _unit_names(model: nn.Module, policy) -> list:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in select_units(model, policy)]


def test_sharding_strategies(fsdp_env):
    o = fsdp_env(fsdp_sharding_strategy="FULL_SHARD")
    assert (o.reshard_after_forward, o.fsdp_group_size) == (True, None)
    o = fsdp_env(fsdp_sharding_strategy="SHARD_GRAD_OP")
    assert (o.reshard_after_forward, o.fsdp_group_size) == (False, None)
    o = fsdp_env(fsdp_sharding_strategy="HYBRID_SHARD", env={"LOCAL_WORLD_SIZE": "4"})
    assert (o.reshard_after_forward, o.fsdp_group_size) == (True, 4)  # default: processes per node
    o = fsdp_env(fsdp_sharding_strategy="_HYBRID_SHARD_ZERO2", env={"FLATSHARD_FSDP_GROUP_SIZE": "2"})
    assert (o.reshard_after_forward, o.fsdp_group_size) == (False, 2)
    o = fsdp_env(fsdp_sharding_strategy="NO_SHARD", env={})
    assert o.fsdp_group_size == 1


def test_one_sharding_strategy_mapping_hybrid_included(fsdp_env):
    """yaml -> options (config), options -> the FSDP1 plugin (config) and -> the yaml the planner recommends (plan)
    are one mapping (core.options): shard groups smaller than the world are HYBRID_SHARD in both directions."""
    from accel_flatshard.core.options import FlatShardOptions, sharding_strategy
    from accel_flatshard.plan import Config
    from torch.distributed.fsdp import ShardingStrategy

    o = fsdp_env(fsdp_sharding_strategy="HYBRID_SHARD", env={"FLATSHARD_FSDP_GROUP_SIZE": "2"})
    assert (o.reshard_after_forward, o.fsdp_group_size) == (True, 2)
    assert sharding_strategy(o.reshard_after_forward, o.fsdp_group_size, 4) == "HYBRID_SHARD"
    assert Config(o).strategy(4) == "HYBRID_SHARD" and Config(o).strategy(2) == "FULL_SHARD"
    zero2 = FlatShardOptions(reshard_after_forward=False, fsdp_group_size=2)
    assert Config(zero2).strategy(4) == "_HYBRID_SHARD_ZERO2" and Config(zero2).strategy(2) == "SHARD_GRAD_OP"
    assert Config(FlatShardOptions(fsdp_group_size=1)).strategy(4) == "NO_SHARD"
    # an FSDP2 plugin whose options shard in groups of 2 over 4 ranks (parallelism_config dp_replicate 2 x dp_shard 2)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    cfg.normalize_plugin_to_fsdp1(plugin, o, world_size=4)
    assert plugin.fsdp_version == 1 and plugin.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    cfg.normalize_plugin_to_fsdp1(p := FullyShardedDataParallelPlugin(fsdp_version=2), o, world_size=2)
    assert p.sharding_strategy == ShardingStrategy.FULL_SHARD


def test_group_size_without_hybrid_is_an_error(fsdp_env):
    with pytest.raises(ValueError, match="FLATSHARD_FSDP_GROUP_SIZE=2 is set but fsdp_sharding_strategy is FULL_SHARD"):
        fsdp_env(fsdp_sharding_strategy="FULL_SHARD", env={"FLATSHARD_FSDP_GROUP_SIZE": "2"})
    with pytest.raises(ValueError, match="positive integer"):
        fsdp_env(fsdp_sharding_strategy="HYBRID_SHARD", env={"FLATSHARD_FSDP_GROUP_SIZE": "two"})


def test_prefetch_and_state_dict_type(fsdp_env):
    o = fsdp_env(fsdp_backward_prefetch="BACKWARD_POST", fsdp_forward_prefetch=True, fsdp_state_dict_type="SHARDED_STATE_DICT")
    assert o.backward_prefetch == BackwardPrefetch.BACKWARD_POST and o.forward_prefetch is True
    assert o.state_dict_type == "SHARDED_STATE_DICT"
    o = fsdp_env(fsdp_backward_prefetch="NO_PREFETCH", fsdp_state_dict_type="FULL_STATE_DICT")
    assert o.backward_prefetch is None and o.state_dict_type == "FULL_STATE_DICT"
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT is not supported"):
        fsdp_env(fsdp_state_dict_type="LOCAL_STATE_DICT")


def test_auto_wrap_policies(fsdp_env):
    model = gpt2()
    o = fsdp_env(fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP")  # classes from _no_split_modules
    assert _unit_names(model, policy_of(o, model)) == ["", "transformer.h.0", "transformer.h.1"]
    o = fsdp_env(fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP", fsdp_transformer_layer_cls_to_wrap="GPT2MLP")
    assert _unit_names(model, policy_of(o, model)) == ["", "transformer.h.0.mlp", "transformer.h.1.mlp"]
    o = fsdp_env(fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP", fsdp_transformer_layer_cls_to_wrap="GPT2Block,Nope")
    with pytest.raises(ValueError, match=r"\['Nope'\] not found in GPT2LMHeadModel.*GPT2Block"):
        policy_of(o, model)
    o = fsdp_env(fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=2000)
    units = _unit_names(model, policy_of(o, model))
    assert "transformer.h" not in units  # a ModuleList has no forward: never a unit
    assert "transformer.h.0.mlp.c_fc" in units
    o = fsdp_env(fsdp_auto_wrap_policy="NO_WRAP")
    assert policy_of(o, model) is None


def test_policy_objects_given_in_code(fsdp_env, monkeypatch):
    """A plugin built in code with torch's policy partials (as accelerate users write them) maps too."""
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    fsdp_env()  # clean environment
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # the plugin writes it: restore afterwards
    model = gpt2()
    for policy, expected in (
        (functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2MLP}), "transformer.h.0.mlp"),
        (functools.partial(size_based_auto_wrap_policy, min_num_params=2000), "transformer.h.0.mlp.c_fc"),
    ):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy=policy, sync_module_states=False,
                                                cpu_ram_efficient_loading=False)
        options = cfg.options_from_plugin(plugin)
        assert expected in _unit_names(model, policy_of(options, model))


def test_flags_mixed_precision_and_refusals(fsdp_env, monkeypatch):
    o = fsdp_env(fsdp_activation_checkpointing=True, fsdp_cpu_ram_efficient_loading=True, fsdp_sync_module_states=False)
    assert o.activation_checkpointing
    assert o.sync_module_states  # ranks > 0 hold no weights: rank 0 must broadcast
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"  # transformers reads it: left as the launcher set it
    o = fsdp_env("bf16")
    assert (o.mixed_precision.param_dtype, o.mixed_precision.reduce_dtype, o.mixed_precision.buffer_dtype) == (torch.bfloat16,) * 3
    o = fsdp_env("bf16", env={"FLATSHARD_REDUCE_DTYPE": "fp32"})
    assert (o.mixed_precision.param_dtype, o.mixed_precision.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_env("no").mixed_precision is None
    assert not fsdp_env().offload_params and not fsdp_env().offload_params
    o = fsdp_env(fsdp_offload_params=True)  # issue 17: accepted (shards, gradients, optimizer state on the host)
    assert o.offload_params and o.offload_params


def test_unknown_fsdp_version_and_unknown_env(fsdp_env, monkeypatch):
    with pytest.raises(ValueError, match="fsdp_version 3.*1 and 2"):
        fsdp_env(fsdp_version=3)
    monkeypatch.setenv("FSDP_VERSION", "1")
    monkeypatch.setenv("FLATSHARD_GRUOP_SIZE", "2")
    with pytest.raises(ValueError, match=r"(?s)FLATSHARD_GRUOP_SIZE.*known ones.*FLATSHARD_FSDP_GROUP_SIZE"):
        check_environment()
    # the Accelerator checks before touching any accelerate state
    from accel_flatshard.integrations.accelerate import Accelerator

    with pytest.raises(ValueError, match="FLATSHARD_GRUOP_SIZE"):
        Accelerator()


def test_refuses_models_wrapped_by_torch():
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.nn.parallel import DistributedDataParallel

    from accel_flatshard.core.fully_sharded import check_not_wrapped

    for cls, word in ((TorchFSDP, "FSDP1"), (DistributedDataParallel, "DistributedDataParallel")):
        fake = cls.__new__(cls)  # isinstance is all the check needs; building either needs a process group
        nn.Module.__init__(fake)
        outer = nn.Sequential(nn.Linear(2, 2), fake)
        with pytest.raises(ValueError, match=f"submodule '1' is already wrapped by .*{word}"):
            check_not_wrapped(outer)
    check_not_wrapped(gpt2())  # a plain model passes


def test_yaml_configs_load_and_map(fsdp_env):
    """The shipped yamls pass accelerate's own loader and map to the intended options."""
    from accelerate.commands.config.config_args import load_config_from_file

    expect = {"cpu_2proc": (2, "FULL_SHARD", None), "gpu_1node_8": (8, "FULL_SHARD", None),
              "gpu_2node_hybrid": (16, "HYBRID_SHARD", 8)}
    for name, (procs, strategy, group) in expect.items():
        path = REPO / "accelerate_configs" / f"{name}.yaml"
        loaded = load_config_from_file(str(path))
        assert loaded.distributed_type == "FSDP" and loaded.num_processes == procs
        raw = yaml.safe_load(path.read_text())["fsdp_config"]
        assert raw["fsdp_version"] == 1 and raw["fsdp_sharding_strategy"] == strategy
        keys = {k: v for k, v in raw.items() if k not in ("fsdp_use_orig_params",)}
        o = fsdp_env("bf16" if name.startswith("gpu") else "no", env={"LOCAL_WORLD_SIZE": "8"}, **keys)
        assert o.fsdp_group_size == group and o.auto_wrap == "transformer"


def test_node_local_backward_gather_is_turned_on_by_its_variable_under_accelerate(fsdp_env):
    """accelerate drops unknown fsdp_config keys: FLATSHARD_NODE_LOCAL_BACKWARD_GATHER is the way from a launch; the
    ranks per machine are the launcher's LOCAL_WORLD_SIZE unless FLATSHARD_RANKS_PER_NODE says otherwise."""
    o = fsdp_env(env={"FLATSHARD_NODE_LOCAL_BACKWARD_GATHER": "1", "LOCAL_WORLD_SIZE": "8"})
    assert o.node_local_backward_gather and o.ranks_per_node == 8
    o = fsdp_env(env={"FLATSHARD_NODE_LOCAL_BACKWARD_GATHER": "1", "FLATSHARD_RANKS_PER_NODE": "4",
                      "LOCAL_WORLD_SIZE": "8"})
    assert o.ranks_per_node == 4
    o = fsdp_env(fsdp_node_local_backward_gather=True)  # (a yaml key accelerate would drop: no effect)
    assert not o.node_local_backward_gather and o.ranks_per_node is None


def _run(args, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLATSHARD_", "ACCELERATE_", "FSDP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, **kw)


def test_run_registers_and_runs_script(tmp_path):
    """`python -m accel_flatshard.run script.py ARGS`: script runs as __main__ with its own argv, and the
    accelerate.Accelerator it imports is ours (both import paths); -m MODULE works too."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, sys\n"
        "import accelerate, accelerate.accelerator\n"
        "from accelerate import Accelerator\n"
        "from sibling import VALUE\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv, 'cls': Accelerator.__module__,\n"
        "                  'same': accelerate.accelerator.Accelerator is Accelerator, 'sibling': VALUE}))\n")
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    proc = _run(["-m", "accel_flatshard.run", str(script), "--lr", "1e-3", "pos"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"name": "__main__", "argv": [str(script), "--lr", "1e-3", "pos"],
                   "cls": "accel_flatshard.integrations.accelerate", "same": True, "sibling": 7}
    env_path = f"{tmp_path}{os.pathsep}{REPO}"
    proc = subprocess.run([sys.executable, "-m", "accel_flatshard.run", "-m", "probe", "x"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": env_path}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["name"] == "__main__" and out["argv"][1:] == ["x"] and out["same"]
    proc = _run(["-m", "accel_flatshard.run", "missing_script.py"])
    assert proc.returncode == 2 and "no such script" in proc.stderr
