"""What the first GPU run (and a user's first multi-GPU run) would hit, driven on CPU (issue 22).

* A wrapped model is freed once the last reference to it goes (no hook held from C++ keeps it alive):
  after training, generation, a checkpoint save, offload, and a forward whose backward never came.
* Every rank decides the same generation plan, whatever its own free memory says.
* Collectives use the model's device, never "the current CUDA device" (offload, object collectives).
* The version gate accepts the GPU machine's stack (torch 2.11, transformers 5.17, accelerate 1.15), and
  every torch attribute the package and gpu_check use exists in torch 2.11 (the committed manifest).
"""
from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dist_helpers import spawn
from models import batches, llama

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- the wrapper is freed
def _wrapped(**kwargs):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    model = llama(n_layer=2)
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kwargs), model


def _train(wrapper, steps=1):
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    for x in batches(steps, batch=2, seq=8):
        wrapper(input_ids=x, labels=x).loss.backward()
        wrapper.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def _generate(wrapper):
    from accel_flatshard.features.generation import set_generation_options

    x = batches(1, batch=1, seq=4)[0]
    for mode, budget in (("full", None), ("budget", 1), ("per_unit", None)):  # gather-once, kept units, per step
        set_generation_options(wrapper, generation_mode=mode, generation_budget_mb=budget and budget / 2**20)
        wrapper.module.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0)
    set_generation_options(wrapper, generation_mode="budget", generation_budget_mb=None, keep_frozen_gathered=True)
    with torch.no_grad():
        wrapper(input_ids=x)  # a frozen-model forward that keeps units gathered


def _checkpoint(wrapper, opt, tmp_path):
    from accel_flatshard.state import full_optim_state_dict, save_sharded_model, save_sharded_optimizer

    save_sharded_model(wrapper, str(tmp_path / "model"))
    save_sharded_optimizer(wrapper, opt, str(tmp_path / "optim"))
    wrapper.state_dict()
    full_optim_state_dict(wrapper, opt)
    with wrapper.summon_full_params():
        pass


def _forward_without_backward(wrapper):
    x = batches(1, batch=2, seq=8)[0]
    wrapper(input_ids=x, labels=x).loss  # graph built (multi-grad hooks registered), then dropped


def _everything(wrapper, tmp):
    opt = _train(wrapper)
    _generate(wrapper)
    _checkpoint(wrapper, opt, tmp)


SCENARIOS = {  # (what runs before del, offload)
    "trained": (lambda w, tmp: _train(w, 2), False),
    "generated": (lambda w, tmp: (_train(w), _generate(w)), False),
    "checkpoint_saved": (lambda w, tmp: _checkpoint(w, _train(w), tmp), False),
    "forward_without_backward": (lambda w, tmp: _forward_without_backward(w), False),
    "offload_trained_generated_saved": (_everything, True),
}


@pytest.mark.filterwarnings("ignore:accel_flatshard. generation")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_wrapped_model_is_freed_after_del(world_of_one, tmp_path, scenario):
    """Before the fix the post-accumulate-grad hook (held by the flat tensor's C++ side, invisible to the
    garbage collector) held its unit, hence the flat buffers, the module and the wrapper: every wrapped model
    of a sweep stayed resident (on a GPU: its shards and gradients)."""
    from accel_flatshard import CPUOffload

    run, offload = SCENARIOS[scenario]
    wrapper, model = _wrapped(cpu_offload=CPUOffload(offload_params=offload))
    run(wrapper, tmp_path)
    wrapper_ref, model_ref = weakref.ref(wrapper), weakref.ref(model)
    del wrapper, model
    gc.collect()
    assert wrapper_ref() is None and model_ref() is None, f"wrapped model still alive after: {scenario}"


# ---------------------------------------------------------------------- ranks agree on the generation plan
def _two_ranks_with_different_free_memory(rank, world):
    """Rank 0 sees room for the whole model, rank 1 for half of it (two GPUs with different other tenants).
    Returns each rank's plan, its generated tokens and the plain model's on the same prompts, and the CUDA
    device the object collectives ran on."""
    import contextlib

    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.core import comm, device
    from accel_flatshard.features import generation

    model, reference = llama(n_layer=4), llama(n_layer=4)
    wrapper = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    total = sum(generation.unit_bytes(u) for u in wrapper.units)
    device.free_bytes = lambda where: 4 * total if rank == 0 else total  # budget: free // 2
    plan = [u.name for u in generation.control_of(wrapper).plan()]
    plans = comm.all_gather_object(dist.group.WORLD, plan)
    assert plans[0] == plans[1], f"ranks planned differently (they would hang in generate): {plans}"
    prompts = batches(1, batch=2, seq=3 + 2 * rank, seed=rank)[0]  # ranks end their sequences at other steps
    tokens = wrapper.module.generate(prompts, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = reference.generate(prompts, max_new_tokens=6, do_sample=False, pad_token_id=0)

    # object collectives over the group of a model on cuda:(rank + 1), the current CUDA device being 0: a
    # stand-in torch.cuda.device / current_device records where torch would put their tensors
    current = [0]

    @contextlib.contextmanager
    def cuda_device(device):
        previous, current[0] = current[0], torch.device(device).index
        try:
            yield
        finally:
            current[0] = previous

    torch.cuda.device, torch.cuda.current_device = cuda_device, lambda: current[0]
    seen = []
    for name in ("all_gather_object", "broadcast_object_list", "barrier"):
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _original=original, _name=name, **k: (seen.append((_name, current[0])),
                                                                            _original(*a, **k))[1])
    group = comm.ShardGroup()
    group.bind_device(torch.device("cuda", rank + 1))
    comm.all_gather_object(group.world_group, rank)
    comm.broadcast_object(group.world_group, "x")
    comm.barrier(group.world_group)
    return {"plan": plan, "tokens": tokens.tolist(), "expected": expected.tolist(), "object_devices": seen}


@pytest.mark.filterwarnings("ignore:accel_flatshard. generation")
def test_ranks_with_different_free_memory_agree_on_the_generation_plan():
    """Before the fix rank 0 kept every unit (gather-once, no synced_gpus) and rank 1 half of them (gathers at
    every decoding step): different collective sequences, a hang.  Now the smallest budget decides on both."""
    results = spawn(2, _two_ranks_with_different_free_memory, timeout_s=60)
    assert results[0]["plan"] == results[1]["plan"] and 0 < len(results[0]["plan"]) < 7  # of 7 units
    for r in results:
        assert r["tokens"] == r["expected"]
        assert r["object_devices"] == [(name, results.index(r) + 1)
                                       for name in ("all_gather_object", "broadcast_object_list", "barrier")]


# ---------------------------------------------------------------------- the norm's device under offload
class _NcclGroupStandIn:
    """A ShardGroup over NCCL for a model on ``device``; records the device of the norm's all-reduce."""

    uses_nccl, uses_gloo, shard_rank = True, False, 0

    def __init__(self, device):
        self.device, self.all_reduced_on = device, []

    def all_reduce(self, tensor, op=None):
        self.all_reduced_on.append(tensor.device)
        raise StopIteration  # (the stand-in device holds no values: stop after the collective is issued)


@pytest.mark.parametrize("explicit", [True, False], ids=["device_given", "device_of_group"])
def test_offloaded_grad_norm_is_all_reduced_on_the_models_device(monkeypatch, explicit):
    """Under offload the gradients are on the host; before the fix the norm then went to
    torch.cuda.current_device() (every rank on cuda:0 without set_device) instead of the model's device."""
    from accel_flatshard import clip_grad_norm_

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model_device = torch.device("meta")  # stands in for cuda:LOCAL_RANK (no tensor values needed)
    group = _NcclGroupStandIn(model_device)
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)  # on the host, as offload keeps it
    from accel_flatshard.core import registry
    monkeypatch.setattr(registry, "record_of_param", lambda p: SimpleNamespace(shard_group=group) if p is param else None)
    with pytest.raises(StopIteration):
        clip_grad_norm_([param], 1.0, group=group, device=model_device if explicit else None)
    assert group.all_reduced_on == [model_device]


def test_cuda_free_memory_counts_the_allocators_cached_blocks(monkeypatch):
    """mem_get_info sees blocks the caching allocator reserved but no tensor uses as taken; they are free to
    the next allocation (the generation budget is half of this)."""
    from accel_flatshard.core.device import free_bytes

    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (asked.append(d), (1000, 8000))[1])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: (asked.append(d), 700)[1])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: (asked.append(d), 200)[1])
    device = torch.device("cuda", 1)
    assert free_bytes(device) == 1000 + 700 - 200 and asked == [device] * 3


# ---------------------------------------------------------------------- torch 2.11: the version gate, the API
def test_version_gate_accepts_the_gpu_machines_stack():
    """The GPU machine: torch 2.11.0+cu130, transformers 5.17.0, accelerate 1.15.0 (peft, no trl)."""
    from accel_flatshard.integrations.versions import check_versions

    assert check_versions({"torch": "2.11.0+cu130", "transformers": "5.17.0", "accelerate": "1.15.0",
                           "peft": "0.21.2", "trl": None}) == []
    with pytest.raises(RuntimeError, match="torch 2.10.0 is older"):
        check_versions({"torch": "2.10.0", "accelerate": "1.15.0"})


def _api_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_api_check", REPO / "tools" / "torch_api_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_torch_use_exists_in_torch_2_11(capsys):
    """CI's half of tools/torch_api_check.py: every torch name the package and gpu_check use is in the
    committed manifest (resolved in the torch 2.11 wheel's sources) and present there, or optional.  (Which
    instance attribute names count as Tensor / Module methods is read from the installed torch, CI's 2.13.)"""
    assert _api_check().main([]) == 0, capsys.readouterr().out


def test_api_check_reports_what_2_11_lacks():
    check = _api_check()
    uses = check.Uses()
    uses.add("torch.distributed.all_gather_single", "a.py:1")  # required: absent in 2.11
    uses.add("torch.distributed.reduce_scatter_single", "a.py:2", optional=True)  # getattr(..., None): falls back
    uses.add("torch.cuda.Stream", "a.py:3", keywords=["priority", "no_such_keyword"])
    uses.add("torch.not_in_the_manifest", "a.py:4")
    manifest = {"torch.distributed.all_gather_single": {"status": "absent"},
                "torch.distributed.reduce_scatter_single": {"status": "absent"},
                "torch.cuda.Stream": {"status": "present", "keywords": {"priority": "present",
                                                                        "no_such_keyword": "absent"}}}
    errors, notes = check.problems(uses, manifest)
    assert len(errors) == 3 and len(notes) == 1
    text = "\n".join(errors)
    assert "all_gather_single (a.py:1) is absent" in text and "has no keyword 'no_such_keyword'" in text
    assert "not_in_the_manifest (a.py:4) is not in" in text and "falls back" in notes[0]


def test_api_resolver_agrees_with_the_installed_torch():
    """The static resolver, run on the installed torch's own sources, against that torch imported: what it
    finds exists, what it cannot find does not (or is one of the names made at run time)."""
    import importlib

    check = _api_check()
    resolver = check.Resolver(check.Sources(Path(torch.__file__).parent))
    present = ["torch.distributed.all_gather_into_tensor", "torch.cuda.Stream",
               "torch.autograd.graph.register_multi_grad_hook", "torch.Tensor.register_post_accumulate_grad_hook",
               "torch.Tensor.record_stream", "torch.distributed.group.WORLD", "torch.distributed.ReduceOp.MIN",
               "torch.nn.Module.register_forward_pre_hook", "torch.float32", "torch.zeros", "torch.optim.AdamW",
               "torch.distributed.checkpoint.FileSystemWriter", "torch.utils._pytree.tree_map"]
    for chain in present:
        assert resolver.resolve(chain)[0] == "present", chain
    assert resolver.resolve("torch.distributed.all_gather_single")[0] == (  # torch >= 2.13 only
        "present" if hasattr(dist, "all_gather_single") else "absent")
    for chain in ("torch.cuda.NoSuchStream", "torch.distributed.all_gather_everything", "torch.Tensor.no_such_method"):
        assert resolver.resolve(chain)[0] == "absent", chain
    _, target = resolver.resolve("torch.nn.Module.register_forward_pre_hook")
    assert resolver.keyword_ok(target, "with_kwargs") and resolver.keyword_ok(target, "no_such") is False

    def exists(chain):
        obj, parts = torch, chain.split(".")
        for i, part in enumerate(parts[1:], 1):
            if not hasattr(obj, part):
                try:
                    obj = importlib.import_module(".".join(parts[: i + 1]))
                    continue
                except ImportError:
                    return False
            obj = getattr(obj, part)
        return True

    uses = check.scan_sources()
    check.instance_uses(uses, check.installed_has_attribute)
    statuses = {chain: resolver.resolve(chain)[0] for chain in uses.chains}
    assert [c for c, s in statuses.items() if s == "present" and not exists(c)] == []
    assert len([c for c, s in statuses.items() if s == "present"]) > 200


def test_api_check_scans_every_script_gpu_check_runs():
    """Every benchmark script gpu_check.sh runs (and the benchmark modules they import) is scanned."""
    import re

    scanned = _api_check().sources()
    run = set(re.findall(r"benchmarks/\w+\.py", (REPO / "benchmarks" / "gpu_check.sh").read_text()))
    assert {"benchmarks/gpu_check_compile.py", "benchmarks/gpu_check_plan.py"} <= run
    assert run <= set(scanned), run - set(scanned)
    assert {"accel_flatshard", "benchmarks/gpu_check_slow.py", "benchmarks/gpu_check_overlap.py",
            "benchmarks/offload_adamw.py"} <= set(scanned)


BAD_GPU_CODE = """
import torch
import torch.distributed as dist


def step(side: torch.cuda.Stream, t):
    done = torch.cuda.Event()
    done.record(side, True)                          # Event.record takes one stream
    torch.cuda.current_stream().wait_evnt(done)      # misspelt: Stream.wait_event
    side.wait_stream(torch.cuda.current_stream())    # right
    t.untyped_storage().resize_(0, 1)                # UntypedStorage.resize_ takes one size
    work = dist.all_reduce(t, async_op=True)
    work.wait_for_it()                               # Work has wait(), not wait_for_it()
    torch.zeros(2, 3, 4)                             # right: *size
    torch.cuda.synchronize(None, 1)                  # synchronize takes one device
"""


def test_api_check_catches_bad_positional_arguments_and_wrong_stream_event_methods(tmp_path):
    """Code that runs only on a GPU: a wrong method on a stream, an event, a storage or a work handle, and too
    many positional arguments, are errors (resolved here against the installed torch)."""
    check = _api_check()
    source = tmp_path / "bad_gpu_code.py"
    source.write_text(BAD_GPU_CODE)
    uses = check.Uses()
    check.scan_file(source, uses)
    installed = check.Resolver(check.Sources(Path(torch.__file__).parent))
    errors, _ = check.problems(uses, check.resolve_uses(uses, installed, installed))
    text = "\n".join(errors)
    assert "torch.cuda.Stream.wait_evnt (bad_gpu_code.py:9): no such method" in text
    assert "torch.distributed.Work.wait_for_it (bad_gpu_code.py:13): no such method" in text
    assert "torch.cuda.Event.record with 2 positional arguments (bad_gpu_code.py:8): takes fewer" in text
    assert "torch.UntypedStorage.resize_ with 2 positional arguments (bad_gpu_code.py:11): takes fewer" in text
    assert "torch.cuda.synchronize with 2 positional arguments (bad_gpu_code.py:15): takes fewer" in text
    assert len(errors) == 5, text  # wait_stream, zeros(2, 3, 4) and the rest are right



def test_api_check_against_the_installed_torch_fails_on_a_name_it_lacks(capsys):
    """tools/torch_api_check.py --installed (make test-latest runs it on the newest torch): the package's uses pass,
    a use the installed torch lacks is an error naming it."""
    check = _api_check()
    uses = check.scan_sources()
    check.instance_uses(uses, check.installed_has_attribute)
    assert check.check_installed(uses) == 0, capsys.readouterr().out
    uses.add("torch.distributed.no_such_collective", "a.py:1")
    uses.add("torch.distributed.all_reduce", "a.py:2", keywords=["no_such_keyword"])
    assert check.check_installed(uses) == 1
    out = capsys.readouterr().out
    assert "no_such_collective (a.py:1) is absent in torch" in out and "has no keyword 'no_such_keyword'" in out
