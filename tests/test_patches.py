"""The patch table (patches.py); the version window is tests/test_versions.py's."""
from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from pathlib import Path
import sys

import pytest

import accelerate
import accelerate.accelerator
import accelerate.utils
import accelerate.utils.fsdp_utils
import transformers.trainer

from accel_flatshard.integrations import patches
from docs_pages import docs_page
from accel_flatshard.integrations import state_io


@pytest.fixture
def clean_patches():
    patches.uninstall()
    yield
    patches.uninstall()


def test_install_reports_and_uninstall_restores_every_original(clean_patches, caplog):
    originals = {(m, a): getattr(sys.modules[m], a) for m, a in [
        ("accelerate", "Accelerator"), ("accelerate.utils", "save_fsdp_model"),
        ("transformers.trainer", "save_fsdp_model"), ("transformers.trainer", "get_parameter_names"),
        ("accelerate.utils", "extract_model_from_parallel")]}
    post_init = accelerate.utils.FullyShardedDataParallelPlugin.__dict__["__post_init__"]
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # (torch.distributed.rendezvous: a function)
    env_handler = rendezvous._rendezvous_handlers["env"]
    with caplog.at_level(logging.INFO, logger=patches.__name__):
        applied = patches.install(register=True)
    assert "transformers.trainer.save_fsdp_model" in applied and "accelerate.Accelerator" in applied
    assert transformers.trainer.save_fsdp_model is state_io.save_fsdp_model
    assert rendezvous._rendezvous_handlers["env"].__wrapped__ is env_handler  # (comm.scoping_store_per_attempt)
    for where in applied:  # one INFO line per binding, then a summary
        assert f"patched {where}" in caplog.text
    assert f"{len(applied)} library bindings patched" in caplog.text
    assert patches.install(register=True) == []  # idempotent
    patches.uninstall()
    for (m, a), original in originals.items():
        assert getattr(sys.modules[m], a) is original, f"{m}.{a}"
    assert accelerate.utils.FullyShardedDataParallelPlugin.__dict__["__post_init__"] is post_init
    assert rendezvous._rendezvous_handlers["env"] is env_handler


def test_table_lists_every_patch_install_applies(clean_patches):
    import trl.trainer.dpo_trainer  # noqa: F401  (so the TRL entry applies)

    applied = patches.install(register=True)
    for scope in set(patches.SCOPES) - {"register", "accelerator", "wrapper"}:
        applied += patches.install(scope)
    table_targets = set()
    for p in patches.PATCHES:
        table_targets.add(p.target)
        table_targets.update(f"{m}.{p.attribute}" for m in p.also_bound_in)
    attributes = {p.attribute for p in patches.PATCHES}
    for where in applied:
        # every binding is a table entry's owner or named binding, or (scan) an imported module's same name
        assert where in table_targets or where.rsplit(".", 1)[1] in attributes, where
    # only the entries that name the release their target came in may predate the installed library: TRL's seam
    # (trl.distributed, trl >= 1.6) and the Trainer's optimizers check (transformers >= 5.0); the oldest set has both
    later = [p.name for p in patches.PATCHES if p.introduced_in]
    assert len(later) <= 2, later
    # and an optional library that is not installed has nothing to patch (bitsandbytes: the [bnb] extra)
    absent = [p.name for p in patches.PATCHES if p.optional_owner and patches._version(p.package) == "not installed"]
    applicable = {p.target for p in patches.PATCHES
                  if not patches._predates(p) and patches._version(p.package) != "not installed"}
    assert len(applicable) >= len(patches.PATCHES) - len(later) - len(absent), (later, absent)
    assert applicable <= set(applied)
    markdown = patches.markdown_table()
    for p in patches.PATCHES:
        assert f"`{p.target}`" in markdown


def ours():
    """Names of the optimizer step hooks of this package registered with torch now."""
    from torch.optim import optimizer as torch_optimizer

    hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(), *torch_optimizer._global_optimizer_post_hooks.values()]
    return [h.__name__ for h in hooks if h.__module__.startswith("accel_flatshard")]


def test_the_plain_wrapper_installs_its_hooks_at_its_first_wrap(clean_patches, world_of_one):
    import torch
    from accel_flatshard import FullyShardedDataParallel

    assert ours() == []
    FullyShardedDataParallel(torch.nn.Linear(4, 4))
    assert ours() == ["refuse_step_during_backward", "owner_computes_step", "state_precision_of_full_parameters"]
    FullyShardedDataParallel(torch.nn.Linear(4, 4), cpu_offload=True)
    assert sorted(ours()) == ["owner_computes_step", "prefer_fused_host_adam", "refuse_step_during_backward",
                              "state_precision_of_full_parameters", "wait_for_copies_before_step"]


def test_hooks_and_writes_outside_the_package_are_entries_that_uninstall_undoes(clean_patches, monkeypatch):
    """The optimizer step hooks, offload's fused default and accelerate's shared state are table entries: listed by
    install(), undone by uninstall()."""
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    monkeypatch.setattr("accel_flatshard.core.offload._FAST_HOST_STEP_WARNED", False)
    shared = dict(PartialState._shared_state)
    assert ours() == []
    applied = [where for scope in ("wrapper", "offload", "frozen", "fsdp_state") for where in patches.install(scope)]
    assert sorted(applied) == ["accelerate.state.PartialState._shared_state['distributed_type']", *(
        f"torch.optim.optimizer.register_optimizer_step_{when}_hook({name})" for when, name in [
            ("post", "release_frozen_units"), ("pre", "owner_computes_step"), ("pre", "prefer_fused_host_adam"),
            ("pre", "refuse_step_during_backward"), ("pre", "state_precision_of_full_parameters"),
            ("pre", "wait_for_copies_before_step")])]
    assert sorted(ours()) == ["owner_computes_step", "prefer_fused_host_adam", "refuse_step_during_backward",
                              "release_frozen_units", "state_precision_of_full_parameters",
                              "wait_for_copies_before_step"]
    assert PartialState._shared_state["distributed_type"] is DistributedType.FSDP
    # offload onto a GPU: a stock AdamW steps fused (a stand-in for the offloaded parameters' host buffers)
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)
    param._flatshard_offload = type("Offload", (), {"streams": type("S", (), {"stream_ordered": True})()})()
    opt = torch.optim.AdamW([param])
    with pytest.warns(UserWarning, match="fused=True"):
        opt.step()
    assert opt.param_groups[0]["fused"] is True and opt._step_supports_amp_scaling
    patches.uninstall()
    assert ours() == [] and dict(PartialState._shared_state) == shared
    assert opt.param_groups[0]["fused"] is None and "_step_supports_amp_scaling" not in opt.__dict__


def test_missing_essential_target_is_an_error_naming_it(clean_patches, monkeypatch):
    monkeypatch.delattr(transformers.trainer, "save_fsdp_model")
    with pytest.raises(RuntimeError, match=r"transformers\.trainer\.save_fsdp_model.*no longer binds") as info:
        patches.install()
    assert f"accelerate {accelerate.__version__}" in str(info.value)


def test_missing_owner_attribute_is_named(clean_patches, monkeypatch):
    monkeypatch.delattr(accelerate.utils.fsdp_utils, "load_fsdp_optimizer")
    with pytest.raises(RuntimeError, match=r"accelerate\.utils\.fsdp_utils\.load_fsdp_optimizer: no such attribute"):
        patches.install()


def test_rewrapped_binding_is_reported_not_skipped(clean_patches, monkeypatch):
    monkeypatch.setattr(transformers.trainer, "get_parameter_names", lambda *a, **k: [])
    with pytest.raises(RuntimeError, match=r"transformers\.trainer\.get_parameter_names.*moved or re-wrapped"):
        patches.install()


def test_missing_non_essential_target_warns_with_the_version(clean_patches, monkeypatch):
    monkeypatch.delattr(accelerate.utils.FullyShardedDataParallelPlugin, "__post_init__")
    with pytest.warns(RuntimeWarning, match=r"FullyShardedDataParallelPlugin\.__post_init__: no such attribute "
                                            rf"\(accelerate {accelerate.__version__}"):
        patches.install(register=True)


def test_docs_list_every_patch_as_the_table_renders_it():
    page = docs_page("versions").read_text()
    assert patches.markdown_table() in page, "regenerate the table in docs/versions.md: patches.markdown_table()"


def test_patch_of_a_symbol_newer_than_the_installed_library_is_skipped_quietly(clean_patches, monkeypatch):
    # trl.distributed appeared in trl 1.6; on older TRL the entry has nothing to patch and must not warn
    entry = next(p for p in patches.PATCHES if p.name == "trl_summon_full_params")
    monkeypatch.setattr(patches, "PATCHES", (dataclasses.replace(entry, introduced_in="999.0"),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patches.install(register=True) == []
