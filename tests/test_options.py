"""The options module: each option declared once, the table rendered from it; unknown names and bad values fail on
every path."""
import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch.nn as nn

from accel_flatshard import FullyShardedDataParallel
from accel_flatshard.core import options

from docs_pages import ROOT, docs_page

OPTIONS_PAGE = docs_page("accelerate")


def test_the_table_is_rendered_from_the_declarations(capsys):
    """Each variable is declared once (its field's ``_setting``): the table is rendered from it, printed by
    ``accel-flatshard options``, which docs/accelerate.md names instead of holding a copy."""
    from accel_flatshard.tools.cli import main

    assert main(["options"]) == 0
    table = capsys.readouterr().out.rstrip("\n")
    assert table == options.markdown_table()
    # every option appears in it once, and nothing else
    assert re.findall(r"^\| `(FLATSHARD_\w+)`", table, re.M) == list(options.OPTIONS)
    page = OPTIONS_PAGE.read_text()
    assert "accel-flatshard options" in page and "| `FLATSHARD_" not in page
    declared = {f.metadata["env"]: (cls, f) for cls in (options.FlatShardOptions, options.ProcessSettings)
                for f in dataclasses.fields(cls) if f.metadata["env"]}
    assert list(declared) == list(options.OPTIONS)
    for name, (cls, f) in declared.items():
        option = options.OPTIONS[name]
        assert (option.default, option.doc) == (f.default, f.metadata["doc"]), name
        assert option.setting == (f.name if cls is options.FlatShardOptions else None), name


def test_check_environment_has_one_call_site():
    """The environment is checked in ``_variables`` (both ``from_environment``), which every path passes."""
    import ast

    calls = []
    for path in sorted(Path(PACKAGE).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and "check_environment" in (getattr(node.func, "attr", None),
                                                                      getattr(node.func, "id", None)):
                calls.append(path.relative_to(PACKAGE).as_posix())
    assert calls == ["core/options.py"], calls


def test_defaults_and_parsing(monkeypatch):
    for name in options.OPTIONS:
        monkeypatch.delenv(name, raising=False)
    assert options.get("FLATSHARD_TIMEOUT_S") == 1800.0
    assert options.get("FLATSHARD_STATE_DICT_TIMEOUT_S") == 5.0
    assert options.get("FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE") is False  # the one default (comm.py uses it)
    assert options.get("FLATSHARD_GLOO_P2P") is None  # auto: on with gloo
    assert options.get("FLATSHARD_PROFILE") is None and options.get("FLATSHARD_PROFILE_EVERY") == 10
    monkeypatch.setenv("FLATSHARD_GLOO_P2P", "off")
    monkeypatch.setenv("FLATSHARD_PROFILE", "1")
    monkeypatch.setenv("FLATSHARD_REDUCE_DTYPE", "BF16")
    assert options.get("FLATSHARD_GLOO_P2P") is False and options.get("FLATSHARD_PROFILE") == ""
    monkeypatch.setenv("FLATSHARD_PROFILE", "/tmp/x")
    assert options.get("FLATSHARD_PROFILE") == "/tmp/x" and str(options.get("FLATSHARD_REDUCE_DTYPE")) == "torch.bfloat16"
    assert options.env_flag("FLATSHARD_GLOO_P2P") is False and options.env_flag("NOT_SET_ANYWHERE_123") is False
    monkeypatch.setenv("SOME_FLAG", " Yes ")
    assert options.env_flag("SOME_FLAG") is True


@pytest.mark.parametrize("name,value,allowed", [
    ("FLATSHARD_GLOO_P2P", "maybe", "1, true"),
    ("FLATSHARD_TIMEOUT_S", "-3", "positive number"),
    ("FLATSHARD_PROFILE_EVERY", "ten", "positive integer"),
    ("FLATSHARD_REDUCE_DTYPE", "fp8", "fp32, bf16, fp16"),
])
def test_bad_value_fails_on_the_plain_wrapper(world_of_one, monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        FullyShardedDataParallel(nn.Linear(4, 4))
    message = str(info.value)
    assert f"{name}={value!r}" in message and allowed in message


def test_unknown_name_fails_on_the_plain_wrapper(world_of_one, monkeypatch):
    monkeypatch.setenv("FLATSHARD_GRUOP_SIZE", "2")
    with pytest.raises(ValueError, match=r"(?s)FLATSHARD_GRUOP_SIZE.*known ones.*FLATSHARD_FSDP_GROUP_SIZE"):
        FullyShardedDataParallel(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="FLATSHARD_GRUOP_SIZE"):  # also with an options object (the Accelerator's)
        FullyShardedDataParallel(nn.Linear(4, 4), options=options.FlatShardOptions())
    monkeypatch.delenv("FLATSHARD_GRUOP_SIZE")
    model = FullyShardedDataParallel(nn.Linear(4, 4))  # and without it the same call works
    assert model.flat_params


# ---------------------------------------------------------------------- one name per setting
# Every setting: (its accelerate yaml source, its FLATSHARD_* variable, the wrapper argument that sets it, the
# modules that read it).  The wrapper argument is the setting's own name (FullyShardedDataParallel(model, **settings)),
# except where torch FSDP's spelling is accepted too; "-" where the Accelerator owns it.
SETTINGS = {
    "reshard_after_forward": ("fsdp_sharding_strategy", None, "reshard_after_forward", ["core/fully_sharded.py"]),
    "fsdp_group_size": ("fsdp_sharding_strategy", "FLATSHARD_FSDP_GROUP_SIZE", "fsdp_group_size", ["core/comm.py"]),
    "backward_prefetch": ("fsdp_backward_prefetch", None, "backward_prefetch", ["core/schedule.py"]),
    "forward_prefetch": ("fsdp_forward_prefetch", None, "forward_prefetch", ["core/schedule.py"]),
    "limit_all_gathers": (None, "FLATSHARD_LIMIT_ALL_GATHERS", "limit_all_gathers", ["core/engine.py"]),
    "offload_params": ("fsdp_offload_params", None, "offload_params (torch's cpu_offload too)", ["core/engine.py"]),
    "mixed_precision": ("mixed_precision (top level)", None, "mixed_precision",
                        ["core/engine.py", "core/schedule.py", "core/fully_sharded.py"]),
    "sync_module_states": ("fsdp_sync_module_states", None, "sync_module_states", ["core/fully_sharded.py"]),
    "pack_all_gathers": (None, "FLATSHARD_PACK_ALL_GATHERS", "pack_all_gathers", ["core/fully_sharded.py"]),
    "quantized_all_gather": (None, "FLATSHARD_QUANTIZED_ALL_GATHER", "quantized_all_gather", ["core/engine.py"]),
    "quantized_reduce": (None, "FLATSHARD_QUANTIZED_REDUCE", "quantized_reduce", ["core/engine.py"]),
    "quant_block": (None, "FLATSHARD_QUANT_BLOCK", "quant_block", ["core/engine.py"]),
    "gloo_p2p": (None, "FLATSHARD_GLOO_P2P", "gloo_p2p", ["core/comm.py"]),
    "reduce_scatter_via_all_reduce": (None, "FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE", "reduce_scatter_via_all_reduce",
                                      ["core/comm.py"]),
    "timeout_s": (None, "FLATSHARD_TIMEOUT_S", "timeout_s", ["core/comm.py"]),
    "ranks_per_node": (None, "FLATSHARD_RANKS_PER_NODE", "ranks_per_node", ["core/comm.py"]),
    "node_local_backward_gather": (None, "FLATSHARD_NODE_LOCAL_BACKWARD_GATHER", "node_local_backward_gather",
                                   ["core/comm.py"]),
    "keep_gathered_across_micro_batches": (None, "FLATSHARD_KEEP_GATHERED_ACROSS_MICRO_BATCHES",
                                           "keep_gathered_across_micro_batches", ["core/schedule.py"]),
    "defer_cross_machine_reduce": (None, "FLATSHARD_DEFER_CROSS_MACHINE_REDUCE", "defer_cross_machine_reduce",
                                   ["core/schedule.py", "core/fully_sharded.py"]),
    "generation_mode": (None, "FLATSHARD_GENERATION_MODE", "generation_mode", ["features/generation.py"]),
    "generation_budget_mb": (None, "FLATSHARD_GENERATION_BUDGET_MB", "generation_budget_mb", ["features/generation.py"]),
    "keep_frozen_gathered": (None, "FLATSHARD_KEEP_FROZEN_GATHERED", "keep_frozen_gathered",
                             ["features/generation.py"]),
    "auto_wrap": ("fsdp_auto_wrap_policy", None, "-", ["core/wrap.py"]),
    "layer_cls_names": ("fsdp_transformer_layer_cls_to_wrap", None, "-", ["core/wrap.py"]),
    "min_num_params": ("fsdp_min_num_params", None, "-", ["core/wrap.py"]),
    "custom_policy": ("fsdp_auto_wrap_policy", None, "-", ["core/wrap.py"]),
    "activation_checkpointing": ("fsdp_activation_checkpointing", None, "-", ["integrations/accelerate.py"]),
    "state_dict_type": ("fsdp_state_dict_type", None, "-", ["plan/run.py"]),
}
# the variables that configure the process or the Accelerator, not a model (ProcessSettings): its field, the module
# that reads it (by the variable's name or the field's)
PROCESS_VARIABLES = {"FLATSHARD_STATE_DICT_TIMEOUT_S": ("state_dict_timeout_s", "core/model_state.py"),
                     "FLATSHARD_PROFILE": ("profile", "tools/profiling.py"),
                     "FLATSHARD_PROFILE_EVERY": ("profile_every", "tools/profiling.py"),
                     "FLATSHARD_ASYNC_SAVE": ("async_save", "integrations/accelerate.py"),
                     "FLATSHARD_REDUCE_DTYPE": ("reduce_dtype", "integrations/config.py")}
PACKAGE = os.path.join(str(ROOT), "accel_flatshard")


def _attributes_read(relative: str) -> set:
    import ast

    with open(os.path.join(PACKAGE, relative)) as f:
        tree = ast.parse(f.read())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}


def test_every_setting_has_one_name_from_its_yaml_key_or_variable_to_its_reader():
    from accel_flatshard.core.options import FIELDS, FlatShardOptions, setting_sources

    assert set(FIELDS) == set(SETTINGS), "a new option is a FlatShardOptions field and a row here"
    sources = setting_sources()
    for name, (yaml, variable, argument, readers) in SETTINGS.items():
        assert sources[name]["env"] == variable, name
        assert (sources[name]["yaml"] or "").startswith(yaml or ""), (name, sources[name]["yaml"])
        if variable and variable not in PROCESS_VARIABLES:
            assert options.OPTIONS[variable].setting == name, variable
        if argument != "-":
            assert argument.split(" ")[0] == name  # the wrapper argument is the setting's name
            FlatShardOptions.from_environment({}, **{name: getattr(FlatShardOptions(), name)})
        for module in readers:
            assert name in _attributes_read(module), f"{module} does not read {name}"
    process = {f.name: f.metadata["env"] for f in dataclasses.fields(options.ProcessSettings)}
    assert {variable: name for name, variable in process.items()} == {v: n for v, (n, _) in PROCESS_VARIABLES.items()}
    for variable, (name, module) in PROCESS_VARIABLES.items():
        assert options.OPTIONS[variable].setting is None
        with open(os.path.join(PACKAGE, module)) as f:
            assert variable in f.read() or name in _attributes_read(module), f"{module} does not read {variable}"
    assert {o.name for o in options.OPTIONS.values() if o.setting} | set(PROCESS_VARIABLES) == set(options.OPTIONS)


def test_the_wrapper_takes_every_setting_by_its_name_and_refuses_others(world_of_one):
    wrapped = FullyShardedDataParallel(nn.Linear(4, 4), limit_all_gathers=1, forward_prefetch=False,
                                       generation_mode="full")
    assert (wrapped.options.limit_all_gathers, wrapped.options.forward_prefetch) == (1, False)
    assert wrapped.shard_group.via_p2p == (wrapped.options.gloo_p2p is not False)
    # the options object is the wrapper's alone: the schedule and engine took the values they read
    schedule, engine = wrapped.schedule, wrapped.schedule.engine
    assert not any(hasattr(x, "options") for x in (wrapped.shard_group, schedule, engine))
    assert (engine.limit_all_gathers, schedule.forward_prefetch) == (1, False)
    with pytest.raises(TypeError, match=r"unknown accel_flatshard option\(s\) \['max_inflight'\]"):
        FullyShardedDataParallel(nn.Linear(4, 4), max_inflight=1)


def test_a_variable_sets_its_settings_default_and_an_argument_wins(world_of_one, monkeypatch):
    monkeypatch.setenv("FLATSHARD_LIMIT_ALL_GATHERS", "3")
    assert FullyShardedDataParallel(nn.Linear(4, 4)).options.limit_all_gathers == 3
    assert FullyShardedDataParallel(nn.Linear(4, 4), limit_all_gathers=1).options.limit_all_gathers == 1
