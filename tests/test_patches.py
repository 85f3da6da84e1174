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
    assert rendezvous._rendezvous_handlers["env"].__wrapped__ is env_handler  # (elastic.scoping_store_per_attempt)
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
    for scope in set(patches.SCOPES) - {"register", "accelerator"}:
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


def test_writes_outside_the_package_are_entries_that_uninstall_undoes(clean_patches):
    """accelerate's shared state is a table entry: listed by install(), undone by uninstall()."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    shared = dict(PartialState._shared_state)
    assert patches.install("fsdp_state") == ["accelerate.state.PartialState._shared_state['distributed_type']"]
    assert PartialState._shared_state["distributed_type"] is DistributedType.FSDP
    patches.uninstall()
    assert dict(PartialState._shared_state) == shared


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
