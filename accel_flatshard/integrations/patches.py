"""The one table of library symbols accel_flatshard replaces, process-wide, and the code that applies it.

Each :class:`Patch` names the symbol where it is defined (``owner`` module + ``attribute``), the other
modules known to bind it by name (``from accelerate.utils import save_fsdp_model`` in
``transformers.trainer`` makes a second binding that patching the owner does not reach), why it is
replaced, by what (a dotted path, resolved when installing, so this module imports none of the
replacements), and the library versions it was checked on.  :func:`install` applies the table and logs
one INFO line per binding it changes plus a summary; a target that is not found *by name* (a release
moved or renamed it) or that holds something else than the original (a release re-wrapped it) is
reported with the module, attribute and installed library version: a warning, or a RuntimeError for
the patches without which training or checkpoints would be wrong.  Never a silent no-op.
:func:`uninstall` puts every original back (tests).

Besides the named bindings, every already-imported module of the packages in ``scan_packages`` (and
``__main__``, a script that imported the name itself) that holds the original object is patched too:
the names are looked up by name first, the identity scan only adds bindings nobody listed.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Patch", "PATCHES", "install", "uninstall", "installed", "markdown_table"]

logger = logging.getLogger(__name__)

_MARK = "_accel_flatshard_patch"  # set on every replacement object: the Patch name it implements


@dataclass(frozen=True)
class Patch:
    """One replaced library symbol (see the module docstring)."""

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
    register_only: bool = False  # applied by register() only, not by every Accelerator
    introduced_in: str = ""  # library version that added the target: older ones have nothing to patch

    @property
    def package(self) -> str:
        return self.owner.split(".", 1)[0]


_FSDP_UTILS_WHY = ("torch FSDP's state_dict_type context finds no torch FSDP module in an accel_flatshard model "
                   "(KeyError: None); the Trainer's checkpoints, resume and merge-weights scripts call it")
_FSDP_FUNCTION_BINDINGS = ("accelerate.utils", "accelerate.accelerator", "transformers.trainer")

PATCHES: Tuple[Patch, ...] = (
    Patch("Accelerator", "accelerate", "Accelerator", "accel_flatshard.integrations.accelerate:Accelerator",
          "unmodified scripts (`from accelerate import Accelerator` after register()) shard with accel_flatshard",
          "accelerate 1.10.1, 1.15", also_bound_in=("accelerate.accelerator",), register_only=True),
    *(Patch(fn, "accelerate.utils.fsdp_utils", fn, f"accel_flatshard.integrations.fsdp_utils_shim:{fn}",
            _FSDP_UTILS_WHY, "accelerate 1.10.1, 1.15; transformers 4.57.6, 5.24",
            also_bound_in=_FSDP_FUNCTION_BINDINGS, scan_packages=("accelerate", "transformers", "trl", "peft"))
      for fn in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")),
    Patch("get_parameter_names", "transformers.trainer_pt_utils", "get_parameter_names",
          "accel_flatshard.integrations.trainer_trl_peft:seeing_through_wrapper",
          "the Trainer matches its weight-decay names against the prepared model's; the wrapper's only child is "
          "`module`, so every parameter would silently get no weight decay",
          "transformers 4.57.6, 5.24", also_bound_in=("transformers.trainer",), wraps_original=True,
          optional_owner=True),
    Patch("extract_model_from_parallel", "accelerate.utils.other", "extract_model_from_parallel",
          "accel_flatshard.integrations.trainer_trl_peft:seeing_through_wrapper",
          "PEFT/TRL/Trainer unwrap models with it (is_peft_model, unwrap_model); it knows only torch's wrappers",
          "accelerate 1.10.1, 1.15; transformers 4.57.6, 5.24; peft 0.17.1, 0.21; trl 0.24.0, 1.16",
          also_bound_in=("accelerate.utils", "accelerate.accelerator", "transformers.modeling_utils"),
          scan_packages=("accelerate", "transformers", "peft", "trl"), wraps_original=True),
    Patch("prepare_fsdp", "trl.models.utils", "prepare_fsdp", "accel_flatshard.integrations.trainer_trl_peft:sharding_reference_models",
          "TRL wraps reference/teacher models in torch FSDP itself; ours shards them with the policy's options",
          "trl 0.24.0, 1.16", also_bound_in=("trl.trainer.dpo_trainer",), scan_packages=("trl",),
          wraps_original=True, optional_owner=True),
    Patch("plugin_post_init", "accelerate.utils.dataclasses", "FullyShardedDataParallelPlugin.__post_init__",
          "accel_flatshard.integrations.config:post_init_without_device",
          "a FullyShardedDataParallelPlugin(...) built in user code raises 'no available devices' on a CPU host "
          "(sync_module_states prepares a GPU param_init_fn accel_flatshard never uses)",
          "accelerate 1.10.1, 1.15", wraps_original=True, essential=False, register_only=True),
    Patch("parallelism_config_check", "accelerate.parallelism_config", "ParallelismConfig._validate_accelerator",
          "accel_flatshard.integrations.config:validating_flatshard_layout",
          "accelerate refuses a parallelism_config unless torch FSDP2 or a multi-device type runs; accel_flatshard "
          "(MULTI_CPU on a CPU host, plugin presented as FSDP1) implements dp_replicate x dp_shard itself: its "
          "Accelerator gets accelerate's other checks as a multi-device state", "accelerate 1.10.1, 1.15",
          wraps_original=True, essential=False),
    Patch("trl_summon_full_params", "trl.distributed", "DistributedBackend.summon_full_params",
          "accel_flatshard.generation:trl_summon_full_params",
          "TRL's GRPO/RLOO wrap generate() in it; it finds no torch FSDP module in an accel_flatshard model and "
          "does nothing, so every decoding step would gather the whole model unit by unit (slow, not wrong)",
          "trl 1.16 (trl.distributed appeared in 1.6; before it GRPO calls torch's FSDP.summon_full_params, a "
          "no-op on our wrapper, and generate() still gathers once through the generate hook)",
          wraps_original=True, essential=False, optional_owner=True, introduced_in="1.6"),
)

# (module name, attribute path) -> original object, for every binding install() changed
_ORIGINALS: Dict[Tuple[str, str], Any] = {}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _resolve(dotted: str) -> Any:
    module, _, attr = dotted.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _container(module: Any, path: str) -> Tuple[Any, str]:
    """The object holding the last component of ``path`` in ``module`` (a class for "Class.method")."""
    *parents, leaf = path.split(".")
    holder = module
    for part in parents:
        holder = getattr(holder, part)
    return holder, leaf


def _get(holder: Any, leaf: str) -> Any:
    return holder.__dict__[leaf] if isinstance(holder, type) else getattr(holder, leaf)


def _report_missing(patch: Patch, where: str, what: str) -> None:
    message = (f"accel_flatshard: cannot patch {where}: {what} ({patch.package} {_version(patch.package)}; "
               f"the patch was checked on {patch.checked_on}). Why it is patched: {patch.why}. Install a version "
               "in the supported window (see README 'Supported versions') or report this at accel_flatshard.")
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


def _apply(patch: Patch, applied: List[str]) -> None:
    if _predates(patch):
        return
    owner = sys.modules.get(patch.owner)
    if owner is None:
        if patch.optional_owner and patch.package not in sys.modules:
            return  # the library is not in use in this process (install() runs again from each Accelerator)
        try:
            owner = importlib.import_module(patch.owner)
        except ImportError as exc:
            _report_missing(patch, f"{patch.owner}.{patch.attribute}", f"module {patch.owner} not importable: {exc}")
            return
    try:
        holder, leaf = _container(owner, patch.attribute)
        current = _get(holder, leaf)
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
    try:
        setattr(replacement, _MARK, patch.name)
    except (AttributeError, TypeError):  # a class: its identity is enough
        pass
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
    if patch.scan_packages:
        for name, module in list(sys.modules.items()):
            if module is None or name in patch.also_bound_in or name == patch.owner:
                continue
            if name.split(".", 1)[0] not in patch.scan_packages and name != "__main__":
                continue
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(patch.attribute) is original:
                _set(name, module, patch.attribute, original, replacement, applied)


def install(register: bool = False) -> List[str]:
    """Apply :data:`PATCHES` (the ``register_only`` ones too when ``register``); idempotent.

    Returns the ``module.attribute`` bindings changed by this call (each also logged at INFO).  Raises
    RuntimeError naming the binding when an essential target is missing; warns for the others.
    """
    applied: List[str] = []
    for patch in PATCHES:
        if patch.register_only and not register:
            continue
        _apply(patch, applied)
    for where in applied:
        logger.info("accel_flatshard: patched %s", where)
    if applied:
        logger.info("accel_flatshard: %d library bindings patched (%d patches in the table)", len(applied),
                    len(PATCHES))
    return applied


def installed() -> List[str]:
    """``module.attribute`` of every binding currently replaced."""
    return [f"{module}.{path}" for module, path in _ORIGINALS]


def uninstall() -> None:
    """Restore every original :func:`install` replaced (for tests)."""
    for (module_name, path), original in reversed(list(_ORIGINALS.items())):
        module = sys.modules.get(module_name)
        if module is not None:
            holder, leaf = _container(module, path)
            setattr(holder, leaf, original)
    _ORIGINALS.clear()


def markdown_table() -> str:
    """The table as markdown (README)."""
    rows = ["| symbol (defined in) | also replaced in | why | replacement | checked on |",
            "|---|---|---|---|---|"]
    for p in PATCHES:
        also = ", ".join(f"`{m}`" for m in p.also_bound_in) or "-"
        if p.scan_packages:
            also += f"; any imported `{'`/`'.join(p.scan_packages)}` module holding it"
        rows.append(f"| `{p.owner}.{p.attribute}` | {also} | {p.why} | `{p.replacement}` | {p.checked_on} |")
    return "\n".join(rows)


def find(name: str) -> Optional[Patch]:
    """The table entry called ``name``."""
    return next((p for p in PATCHES if p.name == name), None)
