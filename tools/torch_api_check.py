"""Static check: every torch attribute that accel_flatshard and gpu_check use exists in torch 2.11.

The GPU machine runs torch 2.11 (CUDA 13 build) while CI here installs torch 2.13 (CPU build): a name added
after 2.11 would first fail on the GPU.  This script finds, without importing anything of the package:

* attribute chains rooted at a torch import (``torch.cuda.Stream``, ``dist.all_gather_into_tensor`` with
  ``import torch.distributed as dist``, ``from torch.optim.optimizer import register_optimizer_step_post_hook``,
  lazy imports inside functions too) and the keyword arguments passed when such a chain is called;
* ``getattr(torch_chain, "name", default)`` / ``hasattr``: optional names (absent is fine: the code falls back);
* methods called on torch objects: on a receiver whose class is known (``torch.cuda.current_stream().wait_stream``,
  ``ev = torch.cuda.Event()`` then ``ev.record(s)``, ``t.untyped_storage().resize_(0)``, ``w = dist.all_reduce(...,
  async_op=True)`` then ``w.wait()``, a parameter annotated ``stream: torch.cuda.Stream``): the method must exist
  (in the installed torch too: a misspelt stream or event method is an error, even on code that runs only on
  a GPU); on any other receiver, every attribute name the sources use that one of ``INSTANCE_CLASSES`` (Tensor,
  Module, Stream, Event, UntypedStorage, Work, ProcessGroup) has in the installed torch, checked on 2.11's class;
* the keyword arguments of those calls, and the number of positional arguments of calls whose target is
  known (a torch chain or a known receiver's method): more than the signature takes is an error.

The files: ``gpu_check.sh`` is read for every benchmark script it runs, and those for the benchmark modules
they import (``sources()``), plus the package.

It resolves them in torch's Python sources (``.py`` and ``.pyi``, read from the wheel's zip, never
imported: ``tools/torch_sources.py``).

    python tools/torch_api_check.py                  # CI: the uses against the committed manifest (no torch 2.11)
    python tools/torch_api_check.py --wheel W.whl    # resolve every use in the wheel, rewrite the manifest
    python tools/torch_api_check.py --download       # the same with `pip download --no-deps torch==2.11.0`
    python tools/torch_api_check.py --installed      # every use against the installed torch (make test-latest)

The manifest (``tools/torch_2_11_api.json``) records, for each use, whether torch 2.11 has it.  CI fails when
a required use is missing in 2.11, or when the sources use something the manifest does not list yet (then
rerun with ``--download``: torch 2.11's CPU wheel for macOS arm64, ~80 MB from PyPI; its Python sources and
stubs are those of every platform's wheel).  Exit status 1 on either.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_sources import Resolver, Sources, dotted  # noqa: E402 - torch's sources, read (tools/torch_sources.py)

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "tools" / "torch_2_11_api.json"
TORCH_VERSION = "2.11.0"
GPU_CHECK = REPO / "benchmarks" / "gpu_check.sh"
# receivers of these classes carry no attributes of the package's own: a name they lack is misspelt
STRICT_CLASSES = ["torch.cuda.Stream", "torch.cuda.Event", "torch.UntypedStorage", "torch.distributed.Work",
                  "torch.distributed.ProcessGroup"]
# torch classes whose methods the sources call on objects (the installed torch says which names they have)
INSTANCE_CLASSES = ["torch.Tensor", "torch.nn.Module", "torch.cuda.Stream", "torch.cuda.Event", "torch.UntypedStorage",
                    "torch.distributed.Work", "torch.distributed.ProcessGroup"]
# calls whose result's class is known: the receiver of a method called on it (or on a name bound to it)
RETURNS = {"torch.cuda.current_stream": "torch.cuda.Stream", "torch.cuda.default_stream": "torch.cuda.Stream",
           "torch.cuda.Stream": "torch.cuda.Stream", "torch.cuda.Event": "torch.cuda.Event",
           "torch.UntypedStorage": "torch.UntypedStorage", "torch.distributed.new_group": "torch.distributed.ProcessGroup"}
METHOD_RETURNS = {"untyped_storage": "torch.UntypedStorage", "record_event": "torch.cuda.Event"}
ASYNC_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter",
                     "broadcast", "barrier", "all_gather_single", "reduce_scatter_single", "isend", "irecv")


def sources() -> List[str]:
    """What runs on the GPU machine: the package, every benchmark script gpu_check.sh runs, and the benchmark
    modules those import (transitively)."""
    bench = REPO / "benchmarks"
    todo = sorted(set(re.findall(r"benchmarks/(\w+)\.py", GPU_CHECK.read_text())))
    seen: List[str] = []
    while todo:
        name = todo.pop()
        path = bench / f"{name}.py"
        if name in seen or not path.exists():
            continue
        seen.append(name)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            todo += [n for n in names if (bench / f"{n}.py").exists()]
    return ["accel_flatshard"] + [f"benchmarks/{n}.py" for n in sorted(seen)]


# ---------------------------------------------------------------------- what the sources use
class Uses:
    """Chains used (``{chain: {"optional": bool, "keywords": set, "positional": set, "where": [file:line]}}``;
    ``positional``: the numbers of positional arguments of the calls whose target is known).  ``typed``: chains
    of methods called on a receiver of known class (the method must exist, in the installed torch too)."""

    def __init__(self) -> None:
        self.chains: Dict[str, dict] = {}
        self.attribute_names: Dict[str, Set[str]] = {}  # attribute name -> keywords of calls (any object)
        self.attribute_where: Dict[str, str] = {}
        self.from_instances: Set[str] = set()  # chains added by instance_uses only
        self.typed: Set[str] = set()

    def add(self, chain: str, where: str, optional: bool = False, keywords: Iterable[str] = (),
            positional: Optional[int] = None, typed: bool = False) -> None:
        entry = self.chains.setdefault(chain, {"optional": True, "keywords": set(), "positional": set(), "where": []})
        entry["optional"] &= optional
        entry["keywords"].update(keywords)
        if positional is not None:
            entry["positional"].add(positional)
        if typed:
            self.typed.add(chain)
        if len(entry["where"]) < 3 and where not in entry["where"]:
            entry["where"].append(where)


def _torch_aliases(tree: ast.Module) -> Dict[str, str]:
    """Local name -> torch dotted path, from every import in the file (lazy ones too)."""
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _positional(call: ast.Call) -> Optional[int]:
    """How many positional arguments ``call`` passes (None: unknown, a ``*args`` among them)."""
    return None if any(isinstance(a, ast.Starred) for a in call.args) else len(call.args)


def scan_file(path: Path, uses: Uses) -> None:
    rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    tree = ast.parse(path.read_text(), filename=rel)
    aliases = _torch_aliases(tree)

    def chain_of(node: ast.AST) -> Optional[str]:
        parts = dotted(node)
        if parts and parts[0] in aliases:
            return ".".join([aliases[parts[0]]] + parts[1:])
        return None

    def class_of(node: ast.AST, known: Dict[str, str]) -> Optional[str]:
        """The torch class of what ``node`` evaluates to, where it is certain; else None."""
        if isinstance(node, ast.Name):
            return known.get(node.id)
        if isinstance(node, ast.Call):
            chain = chain_of(node.func)
            if chain in RETURNS:
                return RETURNS[chain]
            if chain is not None and chain.startswith("torch.distributed.") and chain.rsplit(".", 1)[1] in \
                    ASYNC_COLLECTIVES and any(k.arg == "async_op" and isinstance(k.value, ast.Constant)
                                              and k.value.value is True for k in node.keywords):
                return "torch.distributed.Work"
            if chain is None and isinstance(node.func, ast.Attribute) and node.func.attr in METHOD_RETURNS:
                return METHOD_RETURNS[node.func.attr]
        chain = chain_of(node)
        if chain == "torch.distributed.group.WORLD":
            return "torch.distributed.ProcessGroup"
        return None

    def known_names(scope: ast.AST) -> Dict[str, str]:
        """Names of ``scope`` (a function, or the module) bound to a known torch class: by assignment from a
        call of known result, or by annotation (``stream: torch.cuda.Stream``).  A name bound to something else
        anywhere in the scope is not known (no flow analysis)."""
        known: Dict[str, str] = {}
        other: Set[str] = set()
        args = scope.args if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        for arg in (args.posonlyargs + args.args + args.kwonlyargs) if args else []:
            cls = chain_of(arg.annotation) if arg.annotation is not None else None
            (known.__setitem__(arg.arg, cls) if cls in STRICT_CLASSES else other.add(arg.arg))
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                cls = class_of(node.value, {})
                name = node.targets[0].id
                if cls is not None and known.get(name, cls) == cls and name not in other:
                    known[name] = cls
                else:
                    other.add(name)
        return {n: c for n, c in known.items() if n not in other}

    for value in set(aliases.values()):
        if value != "torch":
            uses.add(value, rel)
    inner = set()  # Attribute nodes that are the value of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    owner: Dict[int, Dict[str, str]] = {}  # node id -> known names of its innermost scope
    for scope in scopes:  # (outer scopes first: inner ones overwrite)
        names = known_names(scope)
        for node in ast.walk(scope):
            owner[id(node)] = names
    called = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            func = node.func
            keywords = [k.arg for k in node.keywords if k.arg]
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                base = chain_of(node.args[0])
                if base is not None:
                    optional = func.id == "hasattr" or len(node.args) == 3
                    uses.add(f"{base}.{node.args[1].value}", where, optional=optional)
                continue
            chain = chain_of(func)
            if chain is not None:
                uses.add(chain, where, keywords=keywords, positional=_positional(node))
            elif isinstance(func, ast.Attribute):
                uses.attribute_names.setdefault(func.attr, set()).update(keywords)
                uses.attribute_where.setdefault(func.attr, where)
        elif isinstance(node, ast.Attribute):
            chain = chain_of(node)
            receiver = class_of(node.value, owner.get(id(node), {})) if chain is None else None
            if chain is not None and id(node) not in inner:
                uses.add(chain, where)
            elif receiver is not None:  # a method (or attribute) of an object of known class
                call = called.get(id(node))
                uses.add(f"{receiver}.{node.attr}", where, typed=True,
                         keywords=[k.arg for k in call.keywords if k.arg] if call is not None else (),
                         positional=_positional(call) if call is not None else None)
            elif chain is None:
                uses.attribute_names.setdefault(node.attr, set())
                uses.attribute_where.setdefault(node.attr, where)


def scan_sources(roots: Optional[Iterable[str]] = None) -> Uses:
    uses = Uses()
    for root in roots if roots is not None else sources():
        path = REPO / root
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        for f in files:
            scan_file(f, uses)
    return uses


def instance_uses(uses: Uses, has_attribute: Callable[[str, str], bool]) -> None:
    """Add ``<class>.<name>`` for every attribute name the sources use on a receiver of unknown class that one of
    ``INSTANCE_CLASSES`` has in the reference torch (``has_attribute(class_chain, name)``), with the keywords of
    its calls (their positional arguments are not checked: another class's method of the same name may take
    others)."""
    for name, keywords in sorted(uses.attribute_names.items()):
        if name.startswith("__"):
            continue
        for cls in INSTANCE_CLASSES:
            if has_attribute(cls, name):
                if f"{cls}.{name}" not in uses.chains:
                    uses.from_instances.add(f"{cls}.{name}")
                uses.add(f"{cls}.{name}", uses.attribute_where[name], keywords=keywords)


def installed_class(cls: str) -> object:
    """``cls`` (a dotted chain) in the installed torch, imported."""
    import importlib

    module, _, name = cls.rpartition(".")
    return getattr(importlib.import_module(module), name)


def installed_has_attribute(cls: str, name: str) -> bool:
    """The reference: the installed torch (CI's), imported."""
    return hasattr(installed_class(cls), name)


# ---------------------------------------------------------------------- check / manifest
def resolve_uses(uses: Uses, resolver: Resolver, reference: Optional[Resolver] = None,
                 installed: Callable[[str, str], bool] = installed_has_attribute) -> Dict[str, dict]:
    """Each use's status in ``resolver``'s torch: "present", "absent", or "unchecked" where the same static
    resolution in ``reference`` (the installed torch, where the code runs) does not find it either (a name
    made at run time, e.g. C attributes missing from the stubs).  A method of a known receiver (``uses.typed``)
    that the installed class lacks (``installed``) is "absent": misspelt, in every torch.  Keywords and numbers
    of positional arguments likewise: absent where the reference decides it too."""
    out: Dict[str, dict] = {}
    for chain, use in sorted(uses.chains.items()):
        status, target = resolver.resolve(chain)
        ref_status, ref_target = reference.resolve(chain) if reference is not None else (status, target)
        entry = {"status": "unchecked" if ref_status != "present" and status != "present" else status}
        if chain in uses.typed and status != "present":
            cls, _, name = chain.rpartition(".")
            if not installed(cls, name):
                entry["status"] = "absent"
        keywords = {}
        for k in sorted(use["keywords"]):
            ok = resolver.keyword_ok(target, k)
            if reference is not None and reference.keyword_ok(ref_target, k) is not True:
                ok = ok or None
            keywords[k] = "present" if ok else "absent" if ok is False else "unchecked"
        if keywords:
            entry["keywords"] = keywords
        positional = {}
        for n in sorted(use["positional"]):
            ok = resolver.positional_ok(target, n)
            ref_ok = reference.positional_ok(ref_target, n) if reference is not None else ok
            ok = False if ref_ok is False else ok
            positional[str(n)] = "present" if ok else "absent" if ok is False else "unchecked"
        if positional:
            entry["positional"] = positional
        out[chain] = entry
    return out


def problems(uses: Uses, manifest: Dict[str, dict], same_reference: bool = True) -> Tuple[List[str], List[str]]:
    """(errors, notes): required uses absent in 2.11 or not in the manifest; optional ones absent (fallbacks).
    ``same_reference``: the installed torch is the one the manifest was made with; otherwise the instance
    methods it lists may differ (another torch's Tensor has other names) and those not listed are notes."""
    errors, notes = [], []
    rerun = f"is not in {MANIFEST.name}: rerun with --download"
    for chain, use in sorted(uses.chains.items()):
        where = ", ".join(use["where"])
        entry = manifest.get(chain)
        if entry is None:
            (errors if same_reference or chain not in uses.from_instances else notes).append(f"{chain} ({where}) {rerun}")
            continue
        if entry["status"] == "absent":
            if chain in uses.typed:
                errors.append(f"{chain} ({where}): no such method or attribute (torch {TORCH_VERSION} and installed)")
            else:
                (notes if use["optional"] else errors).append(f"{chain} ({where}) is absent in torch {TORCH_VERSION}"
                                                              + (": the code falls back" if use["optional"] else ""))
        for keyword in sorted(use["keywords"]):
            state = entry.get("keywords", {}).get(keyword)
            if state is None:
                errors.append(f"{chain}({keyword}=) ({where}) {rerun}")
            elif state == "absent":
                errors.append(f"{chain}({keyword}=) ({where}): torch {TORCH_VERSION} has no keyword {keyword!r}")
        for n in sorted(use["positional"]):
            state = entry.get("positional", {}).get(str(n))
            if state is None:
                errors.append(f"{chain} with {n} positional arguments ({where}) {rerun}")
            elif state == "absent":
                errors.append(f"{chain} with {n} positional arguments ({where}): takes fewer (torch {TORCH_VERSION})")
    return errors, notes


def check_installed(uses: Uses) -> int:
    """Resolve every use in the installed torch's own sources (the newest release, where make test-latest runs this):
    a required name, keyword or positional count it lacks is an error.  What the 2.11 manifest marks unchecked (a
    method name matched on a receiver that is not torch's, e.g. ``unit.gather(new_views=...)``, absent in CI's torch
    too) stays unchecked; the tests, which run on that torch, decide those."""
    import torch

    resolver = Resolver(Sources(Path(torch.__file__).parent))
    resolved = resolve_uses(uses, resolver)  # (without a reference every name it lacks reads "unchecked")
    known = json.loads(MANIFEST.read_text())["uses"]
    for chain, entry in resolved.items():
        reference = known.get(chain, {})
        if entry["status"] == "unchecked" and reference.get("status") != "unchecked":
            entry["status"] = resolver.resolve(chain)[0]
        for kind in ("keywords", "positional"):
            for key, state in entry.get(kind, {}).items():
                if state != "present" and reference.get(kind, {}).get(key) == "unchecked":
                    entry[kind][key] = "unchecked"
    errors, notes = problems(uses, resolved)
    version = torch.__version__
    for note in notes:
        print("note:", note.replace(f"torch {TORCH_VERSION}", f"torch {version}"))
    for error in errors:
        print("ERROR:", error.replace(f"torch {TORCH_VERSION}", f"torch {version}"))
    unchecked = sum(entry["status"] == "unchecked" for entry in resolved.values())
    print(f"torch {version} (installed) API check: {len(uses.chains)} uses, {unchecked} left to the tests; "
          f"{sum(len(u['keywords']) for u in uses.chains.values())} keywords and "
          f"{sum(len(u['positional']) for u in uses.chains.values())} positional counts; {len(errors)} problems: "
          f"{'PASS' if not errors else 'FAIL'}")
    return 1 if errors else 0


def download_wheel(directory: str) -> Path:
    """torch 2.11's CPU-only wheel from PyPI: the macOS arm64 one (~80 MB; the Linux x86_64 wheel on PyPI is the
    CUDA build).  Only its Python sources and stubs are read, the same in every platform's wheel."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--only-binary=:all:",
                    "--platform", "macosx_11_0_arm64", "--python-version", "3.11", f"torch=={TORCH_VERSION}",
                    "-d", directory], check=True)
    return next(Path(directory).glob("torch-*.whl"))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="torch 2.11 wheel (or an unpacked torch/ directory) to resolve in")
    parser.add_argument("--download", action="store_true", help="pip download the torch 2.11 wheel to a temp dir")
    parser.add_argument("--installed", action="store_true", help="check every use against the installed torch "
                        "(the newest release in make test-latest) instead of the 2.11 manifest")
    parser.add_argument("--verbose", action="store_true", help="list every use and its status")
    args = parser.parse_args(argv)
    uses = scan_sources()
    instance_uses(uses, installed_has_attribute)
    if args.installed:
        return check_installed(uses)
    if args.wheel or args.download:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = args.wheel or download_wheel(tmp)
            import torch

            reference = Resolver(Sources(Path(torch.__file__).parent))
            resolved = resolve_uses(uses, Resolver(Sources(wheel)), reference)
        MANIFEST.write_text(json.dumps({"torch": TORCH_VERSION, "source": Path(wheel).name, "reference": torch.__version__,
                                        "generated_by": "python tools/torch_api_check.py --download",
                                        "uses": resolved}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {MANIFEST.relative_to(REPO)} ({len(resolved)} uses resolved in {Path(wheel).name})")
    import torch

    saved = json.loads(MANIFEST.read_text())
    manifest = saved["uses"]
    errors, notes = problems(uses, manifest, same_reference=saved.get("reference") == torch.__version__)
    if args.verbose:
        for chain in sorted(uses.chains):
            print(f"  {manifest.get(chain, {}).get('status', 'not in manifest'):9s} {chain}")
    for note in notes:
        print("note:", note)
    for error in errors:
        print("ERROR:", error)
    by_class = {cls: sum(1 for c in uses.chains if c.rpartition(".")[0] == cls) for cls in INSTANCE_CLASSES}
    print(f"scanned: {', '.join(sources())}")
    print(f"torch {TORCH_VERSION} API check: {len(uses.chains)} uses ({len(uses.typed)} on receivers of known class; "
          f"methods per class: {', '.join(f'{c.rpartition(chr(46))[2]} {n}' for c, n in by_class.items())}); "
          f"{sum(len(u['keywords']) for u in uses.chains.values())} keywords and "
          f"{sum(len(u['positional']) for u in uses.chains.values())} positional counts checked; {len(errors)} problems: "
          f"{'PASS' if not errors else 'FAIL'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
