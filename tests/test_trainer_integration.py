"""The pieces that make Trainer / TrainingArguments stacks shard (in process, fast).

* FSDP2-style configs (``fsdp_version: 2``, what ``accelerate config`` writes by default) map to
  accel_flatshard options and leave a plugin that sends nobody down torch-FSDP2-only paths;
* the yamls in accelerate_configs/ are exactly what ``accelerate config`` writes on a CPU-only host;
* launched W > 1 processes never train unsharded: the launch environment picks accelerate's CPU
  state, and a backend-less state fails loudly;
* accelerate's free ``save_fsdp_model`` & co. are replaced where they are looked up and still call
  accelerate's own for models accel_flatshard does not shard.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import yaml

from launch_helpers import REPO

pytest.importorskip("accelerate")
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from torch.distributed.fsdp import ShardingStrategy  # noqa: E402

from accel_flatshard import BackwardPrefetch  # noqa: E402
from accel_flatshard.integrations import accelerate as acc_mod  # noqa: E402
from accel_flatshard.integrations import config as cfg  # noqa: E402
from accel_flatshard.integrations import patches  # noqa: E402
from accel_flatshard.integrations import state_io  # noqa: E402

CONFIGS = REPO / "accelerate_configs"


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("FSDP_", "FLATSHARD_", "ACCELERATE_")) or k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(k)
    return monkeypatch


def _plugin_from_yaml_keys(monkeypatch, fsdp_config: dict) -> FullyShardedDataParallelPlugin:
    """What the launcher does with a yaml's fsdp_config (FSDP_* variables), then the plugin as built here."""
    for key, value in fsdp_config.items():
        monkeypatch.setenv(key.upper(), str(value).lower() if isinstance(value, bool) else str(value))
    return cfg.build_plugin_without_device(FullyShardedDataParallelPlugin)


@pytest.mark.parametrize("reshard, strategy", [(True, ShardingStrategy.FULL_SHARD),
                                               (False, ShardingStrategy.SHARD_GRAD_OP)])
def test_fsdp2_config_maps_to_options_and_an_fsdp1_plugin(clean_env, reshard, strategy):
    plugin = _plugin_from_yaml_keys(clean_env, {"fsdp_version": 2, "fsdp_reshard_after_forward": reshard,
                                                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                "fsdp_cpu_ram_efficient_loading": True})
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is reshard
    options = cfg.options_from_plugin(plugin)
    assert options.reshard_after_forward is reshard and options.fsdp_group_size is None
    assert options.backward_prefetch == BackwardPrefetch.BACKWARD_PRE  # FSDP2's implicit prefetch
    assert options.state_dict_type == "SHARDED_STATE_DICT"  # FSDP2's default
    assert options.auto_wrap == "transformer" and options.sync_module_states  # (cpu_ram_efficient_loading)
    cfg.normalize_plugin_to_fsdp1(plugin, options)
    # accelerate's is_fsdp2 and the Trainer's `fsdp_version == 2` checks now see FSDP1
    assert plugin.fsdp_version == 1 and plugin.sharding_strategy == strategy
    assert cfg.options_from_plugin(plugin) == options  # and the plugin still means the same


def test_fsdp2_offload_is_accepted_and_kept_when_the_plugin_becomes_fsdp1(clean_env):
    """Issue 17: FSDP2's fsdp_offload_params (a CPUOffloadPolicy) means offload; after normalising the plugin
    to FSDP1 it reads as CPUOffload(offload_params=True), and it still means the same."""
    plugin = _plugin_from_yaml_keys(clean_env, {"fsdp_version": 2, "fsdp_offload_params": True})
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
    options = cfg.options_from_plugin(plugin)
    assert options.offload_params
    cfg.normalize_plugin_to_fsdp1(plugin, options)
    assert plugin.cpu_offload.offload_params and cfg.options_from_plugin(plugin) == options
    off = _plugin_from_yaml_keys(clean_env, {"fsdp_version": 2, "fsdp_offload_params": False})
    assert not cfg.options_from_plugin(off).offload_params


@pytest.mark.parametrize("fsdp, strategy", [("full_shard auto_wrap", ShardingStrategy.FULL_SHARD),
                                             ("shard_grad_op auto_wrap", ShardingStrategy.SHARD_GRAD_OP)])
def test_trainer_fsdp_argument_version_1_gets_the_strategy_asked_for(clean_env, fsdp, strategy):
    """TrainingArguments(fsdp="shard_grad_op", fsdp_config version 1) passes reshard_after_forward=SHARD_GRAD_OP;
    accelerate's FSDP1 plugin also fills its deprecated sharding_strategy with the default FULL_SHARD."""
    from accelerate.state import AcceleratorState, PartialState
    from transformers import TrainingArguments

    partial, full = PartialState._shared_state, AcceleratorState._shared_state
    saved = (dict(partial), dict(full))
    try:  # (TrainingArguments sets up accelerate's state in this process)
        plugin_args = TrainingArguments("unused", fsdp=fsdp, fsdp_config={"version": 1}, report_to=[]).fsdp_plugin_args
    finally:
        partial.clear(), full.clear()
        partial.update(saved[0]), full.update(saved[1])
    # the plugin's post-init on a host without a device, as the runner installs it
    building = type("Plugin", (FullyShardedDataParallelPlugin,),
                    {"__post_init__": cfg.post_init_without_device(FullyShardedDataParallelPlugin.__post_init__)})
    plugin = building(**plugin_args)
    assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD  # accelerate's default, whatever was asked
    options = cfg.options_from_plugin(plugin)
    assert options.reshard_after_forward is (strategy == ShardingStrategy.FULL_SHARD)
    # a launcher's FSDP_SHARDING_STRATEGY (from a yaml) is explicit: it stays what counts
    clean_env.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    assert cfg.options_from_plugin(plugin).reshard_after_forward is True


def test_fsdp2_options_that_cannot_be_honoured_name_the_key(clean_env):
    with pytest.raises(ValueError, match="fsdp_version 3"):
        cfg.fsdp_version(SimpleNamespace(fsdp_version=3))


def test_shipped_yamls_are_what_accelerate_config_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("questionnaire", CONFIGS / "questionnaire.py")
    questionnaire = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(questionnaire)
    for version, path in questionnaire.FILES.items():
        assert questionnaire.questionnaire_yaml(version, tmp_path / path.name) == path.read_text(), path.name
        raw = yaml.safe_load(path.read_text())
        assert raw["distributed_type"] == "FSDP" and raw["num_processes"] == 2
        assert raw["fsdp_config"]["fsdp_version"] == version


@pytest.mark.parametrize("name, reshard, state_dict_type", [("cpu_2proc_fsdp1", True, "FULL_STATE_DICT"),
                                                            ("cpu_2proc_fsdp2", True, "SHARDED_STATE_DICT")])
def test_questionnaire_yamls_map_to_options(clean_env, name, reshard, state_dict_type):
    fsdp_config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["fsdp_config"]
    options = cfg.options_from_plugin(_plugin_from_yaml_keys(clean_env, fsdp_config))
    assert (options.reshard_after_forward, options.state_dict_type, options.auto_wrap) == (reshard, state_dict_type,
                                                                                     "transformer")


@pytest.mark.parametrize("fsdp_env", [True, False], ids=["accelerate launch (ACCELERATE_USE_FSDP)",
                                                           "torchrun + TrainingArguments(fsdp=...)"])
def test_launch_without_cuda_uses_accelerates_cpu_state(clean_env, fsdp_env):
    """TrainingArguments builds accelerate's state before any Accelerator: it must be the CPU (gloo) state, also
    when FSDP is asked for only by a plugin object made later (TrainingArguments(fsdp=...), no yaml)."""
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    if fsdp_env:
        clean_env.setenv("ACCELERATE_USE_FSDP", "true")
    clean_env.setenv("WORLD_SIZE", "1")
    cfg.use_cpu_state_for_launch()
    assert "ACCELERATE_USE_CPU" not in os.environ  # a single process: nothing to change
    clean_env.setenv("WORLD_SIZE", "2")
    cfg.use_cpu_state_for_launch()
    assert os.environ["ACCELERATE_USE_CPU"] == "true"


def test_partial_state_made_first_reads_use_cpu(clean_env):
    """A script's PartialState() (before any Accelerator) gets the CPU path when ACCELERATE_USE_CPU is set, as
    AcceleratorState does; accelerate's own ignores the variable."""
    from accelerate.state import PartialState

    seen = []
    init = cfg.partial_state_reading_use_cpu(lambda self, cpu=False, **kwargs: seen.append((cpu, kwargs)))
    init(None, backend="gloo")
    clean_env.setenv("ACCELERATE_USE_CPU", "true")
    init(None, backend="gloo")
    init(None, cpu=True)
    assert seen == [(False, {"backend": "gloo"}), (True, {"backend": "gloo"}), (True, {})]
    assert "cpu" in __import__("inspect").signature(PartialState.__init__).parameters  # the argument it wraps


def test_several_launched_processes_never_train_unsharded(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    state = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)
    with pytest.raises(RuntimeError, match=r"2 processes were launched.*DistributedType.NO.*unsharded copy"):
        acc_mod._refuse_unsharded_launch(state)
    acc_mod._refuse_unsharded_launch(SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2))
    clean_env.setenv("WORLD_SIZE", "1")
    acc_mod._refuse_unsharded_launch(state)  # truly one process: allowed (with a warning elsewhere)


def test_accelerate_fsdp_functions_replaced_where_looked_up(monkeypatch):
    import accelerate.utils
    import accelerate.utils.fsdp_utils
    import transformers.trainer

    patches.install()
    for name in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer"):
        ours = getattr(state_io, name)
        assert getattr(accelerate.utils, name) is ours
        assert getattr(accelerate.utils.fsdp_utils, name) is ours
        assert getattr(transformers.trainer, name) is ours, name
    # transformers asks the signature whether adapter_only is supported
    from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

    assert get_fsdp_ckpt_kwargs() == {"adapter_only": True}

    # a model accel_flatshard does not shard goes to accelerate's own function, arguments unchanged
    calls = []
    monkeypatch.setitem(state_io._ORIGINALS, "save_fsdp_model", lambda *a, **k: calls.append((a, k)))
    plain, accelerator = nn.Linear(2, 2), SimpleNamespace(_models=[])
    state_io.save_fsdp_model("plugin", accelerator, plain, "out", model_index=1)
    assert calls == [(("plugin", accelerator, plain, "out"), {"model_index": 1, "adapter_only": False, "use_dcp": True})]


def test_accelerates_file_names():
    """The names accelerate.utils.fsdp_utils writes for each state dict type and model / optimizer index."""
    names = state_io.accelerate_names
    assert [names(state_io.FSDP_MODEL_NAME, i) for i in (0, 1)] == [
        ("pytorch_model_fsdp_0", "pytorch_model_fsdp.bin"), ("pytorch_model_fsdp_1", "pytorch_model_fsdp_1.bin")]
    assert [names(state_io.OPTIMIZER_NAME, i) for i in (0, 1)] == [
        ("optimizer_0", "optimizer.bin"), ("optimizer_1", "optimizer_1.bin")]


def test_backend_less_state_is_set_up_again_with_a_warning(clean_env):
    """A PartialState made without a backend before the Accelerator (W > 1 processes): reset, so that the
    Accelerator sets it up on the CPU path; the warning says what was read wrongly before."""
    from accelerate.state import AcceleratorState, PartialState

    partial, full = PartialState._shared_state, AcceleratorState._shared_state
    saved = (dict(partial), dict(full))
    try:
        partial.clear()
        partial.update(distributed_type=DistributedType.NO, num_processes=1)
        clean_env.setenv("WORLD_SIZE", "1")
        acc_mod._reset_state_set_up_without_backend()
        assert partial["distributed_type"] == DistributedType.NO  # one process: left alone
        clean_env.setenv("WORLD_SIZE", "2")
        with pytest.warns(UserWarning, match=r"without a backend.*TrainingArguments.world_size"):
            acc_mod._reset_state_set_up_without_backend()
        assert partial == {} and full == {}
    finally:
        partial.clear(), full.clear()
        partial.update(saved[0]), full.update(saved[1])
