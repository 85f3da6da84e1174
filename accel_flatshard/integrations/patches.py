"""The one table of what accel_flatshard changes outside itself, process-wide, and the code that applies it
(docs/architecture-details.md section 6: what an entry names, scopes, errors, ``uninstall``).

Two kinds of :class:`Patch`: a replaced symbol, also in the modules known to bind it by name (``also_bound_in``) and in
any imported module of ``scan_packages`` (or ``__main__``) holding the original; an entry of a library's dict (``key``;
with ``wraps_original``, made from the entry it replaces).  A target moved or re-wrapped by a release is reported with
the module, attribute and library version: a warning, or a RuntimeError where training or checkpoints would be wrong.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from ..core import registry


logger = logging.getLogger(__name__)

_MARK = "_accel_flatshard_patch"  # set on every replacement object: the Patch name it implements


@dataclass(frozen=True)
class Patch:
    """One change outside the package (see the module docstring)."""

    name: str
    owner: str  # module that defines the symbol
    attribute: str  # attribute path in ``owner``: "save_fsdp_model" or "Class.method"
    replacement: str  # "module:attribute" of the replacement (or of a factory, see ``wraps_original``)
    why: str
    checked_on: str  # library versions the lookup places were read on
    also_bound_in: Tuple[str, ...] = ()  # modules that bind the name themselves (patched when imported)
    scan_packages: Tuple[str, ...] = ()  # packages whose imported modules may hold further bindings
    wraps_original: bool = False  # replacement is a factory called with the original
    essential: bool = True  # missing target -> RuntimeError (wrong results otherwise), else a warning
    optional_owner: bool = False  # owner not imported -> nothing to do (the library is not in use)
    scope: str = "accelerator"  # when it is applied (SCOPES)
    introduced_in: str = ""  # library version that added the target: older ones have nothing to patch
    key: str = ""  # ``attribute`` is a dict: the replacement is written under ``key``

    @property
    def package(self) -> str:
        return self.owner.split(".", 1)[0]

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.attribute}" + (f"[{self.key!r}]" if self.key else "")


# scope -> who applies its entries
SCOPES = {"register": "register()", "accelerator": "register(), every Accelerator",
          "fsdp_state": "an Accelerator on a host without CUDA",
          "process_group": "register(), every Accelerator (before accelerate sets up the process group)",
          "quantized": "the first wrap of a model with bitsandbytes 4-bit layers",
          "wrap": "the first wrap of any model"}


_FSDP_UTILS_WHY = ("torch FSDP's state_dict_type context finds no torch FSDP module in an accel_flatshard model "
                   "(KeyError: None); the Trainer's checkpoints, resume and merge-weights scripts call it")
_TORCH_API_WHY = ("torch's state-dict API (get_/set_model_state_dict, get_/set_optimizer_state_dict, "
                  "get_/set_state_dict: torchtitan, accelerate's FSDP2 path) found no torch FSDP module in an "
                  "accel_flatshard model: rank 1 raised 'model state_dict is empty' and rank 0 got full tensors; for a "
                  "prepared model each call runs accel_flatshard.state.torch_api (ShardedTensors of this rank's "
                  "pieces, no gather), any other model torch's own")
_FSDP_FUNCTION_BINDINGS = ("accelerate.utils", "accelerate.accelerator", "transformers.trainer")

PATCHES: Tuple[Patch, ...] = (
    Patch("Accelerator", "accelerate", "Accelerator", "accel_flatshard.integrations.accelerate:Accelerator",
          "unmodified scripts (`from accelerate import Accelerator` after register()) shard with accel_flatshard",
          "accelerate 1.10.1, 1.16", also_bound_in=("accelerate.accelerator",), scope="register"),
    *(Patch(fn, "accelerate.utils.fsdp_utils", fn, f"accel_flatshard.integrations.state_io:{fn}",
            _FSDP_UTILS_WHY, "accelerate 1.10.1, 1.16; transformers 4.57.6, 5.25",
            also_bound_in=_FSDP_FUNCTION_BINDINGS, scan_packages=("accelerate", "transformers", "trl", "peft"))
      for fn in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")),
    Patch("get_parameter_names", "transformers.trainer_pt_utils", "get_parameter_names",
          "accel_flatshard.integrations.trainer_trl_peft:seeing_through_wrapper",
          "the Trainer matches its weight-decay names against the prepared model's; the wrapper's only child is "
          "`module`, so every parameter would silently get no weight decay",
          "transformers 4.57.6, 5.25", also_bound_in=("transformers.trainer",), wraps_original=True,
          optional_owner=True),
    Patch("trainer_checkpoint_commit", "transformers.trainer", "Trainer._save_checkpoint",
          "accel_flatshard.integrations.trainer_trl_peft:committing_trainer_checkpoints",
          "a Trainer checkpoint of a sharded model is complete only once every rank wrote its files (a commit marker, "
          "written last); FLATSHARD_ASYNC_SAVE writes its model and optimizer in the background; save_total_limit "
          "never deletes the newest complete checkpoint", "transformers 4.57.6, 5.25", wraps_original=True,
          essential=False, optional_owner=True),
    Patch("get_last_checkpoint", "transformers.trainer_utils", "get_last_checkpoint",
          "accel_flatshard.integrations.trainer_trl_peft:newest_complete_trainer_checkpoint",
          "`resume_from_checkpoint=True` would pick the newest checkpoint folder even when its save was interrupted "
          "(no commit marker): it takes the newest complete one", "transformers 4.57.6, 5.25",
          also_bound_in=("transformers.trainer",), essential=False, optional_owner=True),
    Patch("extract_model_from_parallel", "accelerate.utils.other", "extract_model_from_parallel",
          "accel_flatshard.integrations.trainer_trl_peft:seeing_through_wrapper",
          "PEFT/TRL/Trainer unwrap models with it (is_peft_model, unwrap_model); it knows only torch's wrappers",
          "accelerate 1.10.1, 1.16; transformers 4.57.6, 5.25; peft 0.17.1, 0.21; trl 0.24.0, 1.16",
          also_bound_in=("accelerate.utils", "accelerate.accelerator", "transformers.modeling_utils"),
          scan_packages=("accelerate", "transformers", "peft", "trl"), wraps_original=True),
    Patch("prepare_fsdp", "trl.models.utils", "prepare_fsdp",
          "accel_flatshard.integrations.trainer_trl_peft:sharding_reference_models",
          "TRL wraps reference/teacher models in torch FSDP itself; ours shards them with the policy's options",
          "trl 0.24.0, 1.16", also_bound_in=("trl.trainer.dpo_trainer",), scan_packages=("trl",),
          wraps_original=True, optional_owner=True),
    Patch("trainer_save_model", "transformers.trainer", "Trainer.save_model",
          "accel_flatshard.integrations.trainer_trl_peft:saving_final_model_in_full",
          "under SHARDED_STATE_DICT (the README yaml) the Trainer's final `save_model()` wrote no weights, config or "
          "tokenizer and said nothing (transformers' rule for torch FSDP): it writes the full model, as under "
          "FULL_STATE_DICT; the Trainer's checkpoints keep their sharded layout", "transformers 4.57.6, 5.25",
          wraps_original=True, essential=False, optional_owner=True),
    Patch("trainer_optimizers_argument", "transformers.trainer", "Trainer._validate_args",
          "accel_flatshard.integrations.trainer_trl_peft:accepting_optimizers_when_sharding",
          "the Trainer refuses `optimizers=(optimizer, scheduler)` under FSDP (torch FSDP replaces the parameters an "
          "optimizer built beforehand holds); accel_flatshard keeps them, so the optimizer given is the one that "
          "steps (e.g. Muon and AdamW chained)", "transformers 5.25", wraps_original=True, essential=False,
          optional_owner=True, introduced_in="5.0"),
    Patch("plugin_post_init", "accelerate.utils.dataclasses", "FullyShardedDataParallelPlugin.__post_init__",
          "accel_flatshard.integrations.config:post_init_without_device",
          "a FullyShardedDataParallelPlugin(...) built in user code raises 'no available devices' on a CPU host "
          "(sync_module_states prepares a GPU param_init_fn accel_flatshard never uses)",
          "accelerate 1.10.1, 1.16", wraps_original=True, essential=False, scope="register"),
    Patch("partial_state_use_cpu", "accelerate.state", "PartialState.__init__",
          "accel_flatshard.integrations.config:partial_state_reading_use_cpu",
          "a script's `PartialState()` ignores ACCELERATE_USE_CPU (AcceleratorState reads it): on a host without CUDA "
          "it recorded distributed_type NO with 1 process while W ranks run", "accelerate 1.10.1, 1.16",
          wraps_original=True, essential=False, scope="register"),
    Patch("parallelism_config_check", "accelerate.parallelism_config", "ParallelismConfig._validate_accelerator",
          "accel_flatshard.integrations.config:validating_flatshard_layout",
          "accelerate refuses a parallelism_config unless torch FSDP2 or a multi-device type runs; accel_flatshard "
          "(MULTI_CPU on a CPU host, plugin presented as FSDP1) implements dp_replicate x dp_shard itself: its "
          "Accelerator gets accelerate's other checks as a multi-device state", "accelerate 1.10.1, 1.16",
          wraps_original=True, essential=False),
    Patch("trl_summon_full_params", "trl.distributed", "DistributedBackend.summon_full_params",
          "accel_flatshard.features.generation:trl_summon_full_params",
          "TRL's GRPO/RLOO wrap generate() in it; it finds no torch FSDP module in an accel_flatshard model and "
          "does nothing, so every decoding step would gather the whole model unit by unit (slow, not wrong)",
          "trl 1.16 (trl.distributed appeared in 1.6; before it GRPO calls torch's FSDP.summon_full_params, a "
          "no-op on our wrapper, and generate() still gathers once through the generate hook)",
          wraps_original=True, essential=False, optional_owner=True, introduced_in="1.6"),
    Patch("bitsandbytes_4bit_gathered_weights", "bitsandbytes.nn.modules", "fix_4bit_weight_quant_state_from_module",
          "accel_flatshard.integrations.bitsandbytes_shards:keeping_gathered_4bit_weights",
          "a 4-bit layer's forward finds the gathered view accel_flatshard installed as its weight without a quant "
          "state and registers a new Params4bit over it, replacing the sharded parameter (state dicts and "
          "checkpoints lose it); its CPU packing path (evaluation) rewrites data the next gather brings back: the "
          "view gets the layer's quant state in the instance dict, and the packing path is off for sharded layers",
          "bitsandbytes 0.50.2", wraps_original=True, optional_owner=True, scope="quantized"),
    Patch("accelerate_fsdp_state", "accelerate.state", "PartialState._shared_state",
          "accelerate.utils:DistributedType.FSDP",
          "on a host without CUDA the Accelerator switches accelerate's MULTI_CPU state to FSDP; PartialState keeps "
          "its own copy of the shared dict, which accelerate's gather/save helpers read", "accelerate 1.10.1, 1.16",
          key="distributed_type", scope="fsdp_state"),
    Patch("elastic_attempt_store", "torch.distributed.rendezvous", "_rendezvous_handlers",
          "accel_flatshard.core.elastic:scoping_store_per_attempt",
          "under torchelastic restarts (`--max_restarts` with the yaml's static rendezvous, or c10d's shared store) "
          "every attempt's workers share the agent's key-value store with no per-attempt prefix (torch >= 2.5): a "
          "restarted rank could read its dead peer's gloo address and fail or hang in init_process_group; each "
          "attempt gets a prefix its ranks agree on", "torch 2.11, 2.13", key="env", wraps_original=True,
          scope="process_group"),
    *(Patch(f"torch_state_dict{fn}", "torch.distributed.checkpoint.state_dict", fn,
            "accel_flatshard.state.torch_api:dispatching", _TORCH_API_WHY, "torch 2.13", wraps_original=True,
            scope="wrap")
      for fn in ("_get_model_state_dict", "_load_model_state_dict", "_get_optim_state_dict", "_load_optim_state_dict")),
)

# (module name, attribute path) -> original object, for every binding install() changed
_ORIGINALS: Dict[Tuple[str, str], Any] = {}
_UNDO: Dict[str, Callable[[], None]] = {}  # dict entries applied: name -> how uninstall() undoes it
INSTALLED: set = set()  # scopes installed (bitsandbytes_shards reads it: no call into this module once done)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _resolve(dotted: str) -> Any:
    module, _, attr = dotted.partition(":")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module))


def _container(module: Any, path: str) -> Tuple[Any, str]:
    """The object holding the last component of ``path`` in ``module`` (a class for "Class.method")."""
    *parents, leaf = path.split(".")
    return functools.reduce(getattr, parents, module), leaf


def _report_missing(patch: Patch, where: str, what: str) -> None:
    message = (f"accel_flatshard: cannot patch {where}: {what} ({patch.package} {_version(patch.package)}; "
               f"the patch was checked on {patch.checked_on}). Why it is patched: {patch.why}. Install a version "
               "in the supported window (see docs/versions.md) or report this at accel_flatshard.")
    if patch.essential:
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    logger.warning(message)


def _set(module_name: str, module: Any, path: str, original: Any, replacement: Any, applied: List[str]) -> None:
    holder, leaf = _container(module, path)
    _ORIGINALS.setdefault((module_name, path), original)
    setattr(holder, leaf, replacement)
    applied.append(f"{module_name}.{path}")


def _predates(patch: Patch) -> bool:
    """The installed library is older than the target (e.g. TRL before 1.6 has no ``trl.distributed``)."""
    if not patch.introduced_in:
        return False
    from packaging.version import Version

    installed = _version(patch.package)
    return installed != "not installed" and Version(installed) < Version(patch.introduced_in)


def _apply_key(patch: Patch, applied: List[str]) -> None:
    try:
        target, value = _resolve(f"{patch.owner}:{patch.attribute}"), _resolve(patch.replacement)
    except (ImportError, AttributeError) as exc:
        _report_missing(patch, patch.target, f"not found ({exc})")
        return
    current = target.get(patch.key)  # ``target`` is the dict
    if current is value or getattr(current, _MARK, None) == patch.name:
        return
    if patch.wraps_original:
        if current is None:
            _report_missing(patch, patch.target, "no such entry")
            return
        value = value(current)
        setattr(value, _MARK, patch.name)
    if patch.name not in _UNDO:
        had, before = patch.key in target, target.get(patch.key)
        _UNDO[patch.name] = lambda: target.update({patch.key: before}) if had else target.pop(patch.key, None)
    target[patch.key] = value
    applied.append(patch.target)


def _imports_in_progress() -> bool:
    """Whether some module's import is still running (its ``__spec__._initializing``): this call is inside it."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for module in list(sys.modules.values()))


def _apply(patch: Patch, applied: List[str]) -> None:
    if _predates(patch):
        return
    if patch.key:
        _apply_key(patch, applied)
        return
    owner = sys.modules.get(patch.owner)
    if owner is None:
        if patch.optional_owner and patch.package not in sys.modules:
            return  # the library is not in use in this process (install() runs again from each Accelerator)
        try:
            owner = importlib.import_module(patch.owner)
        except ImportError as exc:
            if patch.optional_owner and _imports_in_progress():
                # Registered from inside an import (accel_flatshard_autoload runs while accelerate's __init__ is
                # still loading): the owner's own imports meet that half-loaded module.  Not missing, not yet
                # importable: install() runs again from each Accelerator, which reports it if it still fails.
                return
            _report_missing(patch, f"{patch.owner}.{patch.attribute}", f"module {patch.owner} not importable: {exc}")
            return
    try:
        holder, leaf = _container(owner, patch.attribute)
        current = holder.__dict__[leaf] if isinstance(holder, type) else getattr(holder, leaf)  # (not inherited)
    except (AttributeError, KeyError):
        _report_missing(patch, f"{patch.owner}.{patch.attribute}", "no such attribute")
        return
    if getattr(current, _MARK, None) == patch.name:
        original, replacement = _ORIGINALS.get((patch.owner, patch.attribute), current), current
    else:
        original = current
        target = _resolve(patch.replacement)
        replacement = target(original) if patch.wraps_original else target
        if replacement is not original:
            _set(patch.owner, owner, patch.attribute, original, replacement, applied)
    with contextlib.suppress(AttributeError, TypeError):  # a class: its identity is enough
        setattr(replacement, _MARK, patch.name)
    for name in patch.also_bound_in:
        module = sys.modules.get(name)
        if module is None:
            continue  # not imported: it binds the (patched) owner's value when it loads
        if not hasattr(module, patch.attribute):
            _report_missing(patch, f"{name}.{patch.attribute}", "this module no longer binds the name")
            continue
        bound = getattr(module, patch.attribute)
        if bound is replacement or getattr(bound, _MARK, None) == patch.name:
            continue
        if bound is not original:
            _report_missing(patch, f"{name}.{patch.attribute}",
                            f"it holds {bound!r}, not {patch.owner}.{patch.attribute} (moved or re-wrapped)")
            continue
        _set(name, module, patch.attribute, original, replacement, applied)
    for name, module in list(sys.modules.items()) if patch.scan_packages else ():
        if (module is None or name in patch.also_bound_in or name == patch.owner
                or (name.split(".", 1)[0] not in patch.scan_packages and name != "__main__")):
            continue
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(patch.attribute) is original:
            _set(name, module, patch.attribute, original, replacement, applied)


def install(scope: str = "accelerator", register: bool = False) -> List[str]:
    """Apply the entries of ``scope`` (and ``"register"``'s and ``"process_group"``'s when ``register``);
    idempotent.  Returns the targets this call changed (see the module
    docstring for errors)."""
    scopes = {scope} | ({"register", "process_group"} if register else set())
    applied: List[str] = []
    for patch in PATCHES:
        if patch.scope in scopes:
            _apply(patch, applied)
    INSTALLED.update(scopes)
    for where in applied:
        logger.info("accel_flatshard: patched %s", where)
    if applied:
        logger.info("accel_flatshard: %d library bindings patched (%d patches in the table)", len(applied),
                    len(PATCHES))
    return applied


def uninstall() -> None:
    """Undo every change :func:`install` made (for tests)."""
    for (module_name, path), original in reversed(list(_ORIGINALS.items())):
        module = sys.modules.get(module_name)
        if module is not None:
            holder, leaf = _container(module, path)
            setattr(holder, leaf, original)
    _ORIGINALS.clear()
    for undo in reversed(list(_UNDO.values())):
        undo()
    _UNDO.clear()
    INSTALLED.clear()


def _at_first_wrap(record: Any) -> None:
    """After any model is wrapped (``registry.on_wrap``): the "wrap" scope's entries, once."""
    if "wrap" not in INSTALLED:
        install("wrap")


registry.on_wrap(after=_at_first_wrap)


def markdown_table() -> str:
    """The table as markdown (docs/versions.md)."""
    rows = ["| target (defined in) | also replaced in | why | replacement | checked on | applied by |",
            "|---|---|---|---|---|---|"]
    for p in PATCHES:
        also = ", ".join(f"`{m}`" for m in p.also_bound_in) or "-"
        if p.scan_packages:
            also += f"; any imported `{'`/`'.join(p.scan_packages)}` module holding it"
        rows.append(f"| `{p.target}` | {also} | {p.why} | `{p.replacement}` | {p.checked_on} | {SCOPES[p.scope]} |")
    return "\n".join(rows)
