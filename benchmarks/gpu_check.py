"""CUDA checks of accel_flatshard (run part by part by gpu_check.sh; each part prints one verdict line).

    python benchmarks/gpu_check.py --part w1                  # one GPU: parity at W=1 (both modes)
    python benchmarks/gpu_check.py --part overlap --out DIR   # one GPU: comm/compute overlap at W=1
    python benchmarks/gpu_check.py --part nccl-1gpu           # one GPU: the engine's real NCCL collectives
    python benchmarks/gpu_check.py --part leak                # one GPU: a deleted wrapped model frees the device
    python benchmarks/gpu_check.py --part fake-w8 --out DIR   # one GPU: emulated W=8 memory vs FSDP2
    torchrun --nproc_per_node N benchmarks/gpu_check.py --part nccl   # N >= 2 GPUs: NCCL parity
    python benchmarks/gpu_check.py --device cpu --part w1 overlap nccl-1gpu leak fake-w8   # CPU smoke

Part w1: parity (fp32, TF32 off, deterministic kernels), as is and in slow-GPU mode (``gpu_check_slow.py``):
   GPT-2 and Llama, wrapped per block with several engine settings (the default prefetch schedule, no
   prefetch, no reshard, BACKWARD_POST with limit 1), train AdamW steps next to the plain model; losses and
   final parameters must agree (W=1: same math).  Mixed precision smoke: bf16 parameters, fp32 reduction:
   finite losses close to the fp32 run.
Part overlap (``gpu_check_overlap.py``, its own process): emulated communication on the side streams,
   profiled, against the ceiling the schedule allows.
Part nccl-1gpu (``gpu_check_nccl.py``): a 1-rank NCCL group with the W=1 shortcut off: the engine's
   all-gathers, reduce-scatters and hybrid replica all-reduces are real NCCL calls; the profiler shows on
   which stream each ran; parity as is and in slow-GPU mode.
Part leak (``leak``): wrapped models trained, generating, state-dict'ed (with and without offload) and
   then deleted leave no device memory allocated and no live wrapper.
Part fake-w8 (``fake_w8``): peak device memory while wrapping a host model (<= shards + one unit) and
   while training (<= shards + Adam + gathered units in flight + pending full gradients + what the plain
   model needs above its parameters with each gradient dropped as it is produced),
   and torch FSDP2's peak on the same model (informational: its failure does not fail the part).
Part nccl (``nccl_parity``): W >= 2 ranks on real NCCL vs the single-process run.
A part fails on a failed check or an exception (printed); the other parts of the same call still run.
Adding a part: a function ``fn(args, device) -> bool`` in ``PARTS`` (with the process group it needs),
and one ``part`` line in gpu_check.sh.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import os
import sys
import time
import traceback
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_check_slow import MODES, lag, slow_gpu  # noqa: E402

from accel_flatshard import (BackwardPrefetch,
                             CPUOffload,
                             FullyShardedDataParallel,
                             MixedPrecision,
                             transformer_auto_wrap_policy)
from accel_flatshard.core.engine import MAX_PENDING_REDUCTIONS  # noqa: E402


def small_model(family: str, seed: int = 0, layers: int = 3, hidden: int = 128, vocab: int = 1024,
                attn: str = "eager"):
    """Eager attention by default: deterministic backward, so W=1 parity can be tight."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=512,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation=attn)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                                   vocab_size=vocab, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn)
    if family == "llama-packed":  # each block a frozen attention and a trainable MLP: one packed all-gather
        for layer in model.model.layers:
            layer.self_attn.requires_grad_(False)
    return model


def train(model, data, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        lag()  # slow-GPU mode: the compute stream falls behind before the backward ...
        loss.backward()
        lag()  # ... and before the optimizer writes the parameters
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def wrap(model, **kw):
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kw)


SETTINGS = {
    "default (prefetch)": {},  # forward prefetch + BACKWARD_PRE: the defaults
    "no-prefetch": {"forward_prefetch": False, "backward_prefetch": None},
    "no-reshard": {"reshard_after_forward": False},
    "post-limit1": {"forward_prefetch": False, "backward_prefetch": BackwardPrefetch.BACKWARD_POST,
                    "limit_all_gathers": 1},
}


def parity(device, steps: int, tol: float) -> bool:
    ok = True
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 1024, (4, 64), generator=g).to(device) for _ in range(steps)]
    for family in ("gpt2", "llama"):
        ref = small_model(family).to(device)
        ref_losses = train(ref, data)
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        for mode, slow in MODES:
            with slow_gpu(device, slow):
                for name, kw in SETTINGS.items():
                    wrapped = wrap(small_model(family).to(device), **kw)
                    losses = train(wrapped, data)
                    with wrapped.summon_full_params():
                        pdiff = max((p.detach() - ref_params[n]).abs().max().item()
                                    for n, p in wrapped.named_parameters())
                    ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
                    good = ldiff <= tol and pdiff <= tol
                    ok &= good
                    print(f"  parity {mode:8s} {family:5s} {name:20s} max|dloss|={ldiff:.2e} max|dparam|={pdiff:.2e} "
                          f"{'PASS' if good else 'FAIL'}", flush=True)
                # mixed precision smoke test: bf16 compute, fp32 reduction and master weights
                mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                losses = train(wrap(small_model(family).to(device), mixed_precision=mp), data)
                good = all(l == l and abs(l - r) < 0.05 * abs(r) + 0.05 for l, r in zip(losses, ref_losses))
                ok &= good
                print(f"  bf16   {mode:8s} {family:5s} losses {[round(l, 4) for l in losses]} vs fp32 "
                      f"{[round(l, 4) for l in ref_losses]} {'PASS' if good else 'FAIL'}", flush=True)
    return ok


def llama_1b(meta: bool = True, layers: int = 22, hidden: int = 2048, vocab: int = 32000):
    """TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632, 4 KV heads): 1.10 B parameters."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 512),
                                   vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def activations_without_grads(model, x, device) -> int:
    """What a plain forward+backward needs above its parameters when every gradient is dropped as it is
    produced (a post-accumulate-grad hook sets it to None): the activations saved for backward plus the
    backward's transients (the gradient being produced, the logits' gradient).  Not "peak minus all
    gradients": the plain model's peak is at the head's backward, when almost no gradient exists yet, so
    subtracting all of them undercounts the activations by about the gradients' size (~2 GB on the 1.1 B
    Llama in fp32).  A sharded model holds the same activations and transients at the same point, plus what
    the other terms of the bounds count (shards, gathered units, pending full gradients).  On CPU torch's
    dispatch-level MemTracker measures the same (the parameters tracked, then subtracted)."""
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in model.parameters() if p.requires_grad]
    if device.type != "cuda":
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        needed = cpu_peak(lambda: model(input_ids=x, labels=x).loss.backward(), model, x) - params
        for h in hooks:
            h.remove()
        return needed
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    model(input_ids=x, labels=x).loss.backward()
    torch.cuda.synchronize(device)
    needed = torch.cuda.max_memory_allocated(device) - base
    for h in hooks:
        h.remove()
    return needed


def cpu_peak(run, *tracked) -> int:
    """CPU: the peak bytes of the tensors alive while ``run()`` runs (torch's MemTracker, at dispatch level):
    those it allocates and those of ``tracked`` (modules, optimizers, tensors that exist already)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        run()
    return max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())


def _verdict(good: bool, measured: bool) -> str:
    """A memory check's verdict: on CPU nothing is measured (no device allocator), which is not a pass."""
    return ("PASS" if good else "FAIL") if measured else "not measured (CPU)"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 100 * 2**20 else f"{n / 2**20:.2f} MiB"


def fake_w8(device, world: int, steps: int, batch: int, seq: int, small: bool) -> bool:
    """Emulated W ranks (torch's fake process group: collectives are no-ops, memory is real).

    1. Wrap a host-built model for the GPU: peak device memory during wrapping <= shards + one unit.
    2. AdamW steps: peak max_memory_allocated <= analytical bound
         shards (param + grad + 2 Adam states, fp32, / W) + gathered units in flight
         (root + (limit_all_gathers + 1) units) + full gradients pending ((max_pending + 1) units)
         + activations (``activations_without_grads``: the plain model's peak above its parameters with every
         gradient dropped as it is produced).  Each measurement starts after gc.collect(): the previous one's
         wrapped model and optimizer are gone before the peak counter is reset.
    3. The same on torch FSDP2 (fully_shard per decoder layer + root), printed side by side.
    """
    cuda = device.type == "cuda"
    kw = dict(layers=2, hidden=128, vocab=1024) if small else {}
    ok = True
    x = torch.randint(0, kw.get("vocab", 32000), (batch, seq), device=device)

    def peak_reset():
        gc.collect()  # the previous measurement's wrapped model and optimizer (reference cycles) go first
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() if cuda else 0

    def peak():
        return torch.cuda.max_memory_allocated() if cuda else 0

    # activations of the plain model, measured layer-for-layer the same (one process, no sharding)
    host_model = llama_1b(meta=False, **kw)
    plain = copy.deepcopy(host_model).to(device)
    n_params = sum(p.numel() for p in plain.parameters())
    activations = activations_without_grads(plain, x, device)
    del plain
    print(f"  model: {n_params / 1e9:.2f} B parameters; activations + backward transients (plain model, each "
          f"gradient dropped as produced): {_mib(activations)}", flush=True)

    # 1. wrapping a host (CPU) model onto the GPU
    base = peak_reset()
    wrapped = FullyShardedDataParallel(host_model, auto_wrap_policy=transformer_auto_wrap_policy(host_model),
                                       device_id=device, limit_all_gathers=2)
    unit_bytes = [sum(f.layout.padded_numel * f.unsharded.element_size() for f in u.flat_params) for u in wrapped.units]
    shard_bytes = sum(f.local_shard.numel() * f.local_shard.element_size() for f in wrapped.flat_params)
    wrap_peak = peak() - base
    # the shards stay, one unit is materialised on the device at a time, 1 MiB for the allocator's rounding
    good = (not cuda) or wrap_peak <= shard_bytes + max(unit_bytes) + 2**20
    ok &= good
    print(f"  wrap from host: device peak {_mib(wrap_peak)} <= shards {_mib(shard_bytes)} + largest unit "
          f"{_mib(max(unit_bytes))}: {_verdict(good, cuda)} (whole model: {_mib(n_params * 4)})", flush=True)

    # 2. training steps
    engine = wrapped.schedule.engine
    root_bytes = unit_bytes[[u.is_root for u in wrapped.units].index(True)]
    layer_bytes = max(b for b, u in zip(unit_bytes, wrapped.units) if not u.is_root)
    # The bound, term by term: fp32 shards, their gradients and AdamW's two states (4 x shards, all resident);
    # the root unit (gathered for the whole step) and at most limit_all_gathers + 1 layers gathered at once (the
    # gather limit, plus the one being waited for); at most MAX_PENDING_REDUCTIONS + 1 full gradients of the
    # largest unit (the pending ones, plus the one being produced); and what the plain model needs above its
    # parameters with its gradients dropped as produced (activations + backward transients, measured).
    bound = (4 * shard_bytes + root_bytes + (engine.limit_all_gathers + 1) * layer_bytes
             + (MAX_PENDING_REDUCTIONS + 1) * max(unit_bytes) + activations)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-5, foreach=False)
    base = peak_reset()

    def step():
        wrapped(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ours_s = (time.perf_counter() - t0) / steps
    ours = peak() if cuda else cpu_peak(step, wrapped, opt, x, *[f.unsharded for f in wrapped.flat_params])
    good = ours <= bound  # (CPU: the step after the first, MemTracker; checked too)
    ok &= good
    print(f"  ours : peak max_memory_allocated {_mib(ours)} <= bound {_mib(bound)} (shards+Adam {_mib(4 * shard_bytes)}, "
          f"root {_mib(root_bytes)}, {engine.limit_all_gathers + 1} x layer {_mib(layer_bytes)}, "
          f"{MAX_PENDING_REDUCTIONS + 1} x grad {_mib(max(unit_bytes))}, activations {_mib(activations)}): "
          f"{'PASS' if good else 'FAIL'}{'' if cuda else ' (CPU: MemTracker)'}; {ours_s * 1e3:.0f} ms/step", flush=True)
    del wrapped, opt, host_model, engine

    # 3. torch FSDP2 on the same model (informational: our checks above decide the verdict)
    try:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        model = llama_1b(meta=True, **kw)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device=device)
        for p in model.parameters():
            torch.nn.init.normal_(p.data, std=0.02) if p.is_floating_point() else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
        peak_reset()
        for _ in range(steps):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(f"  FSDP2: peak max_memory_allocated {_mib(peak())} (same model, W={world} fake)", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"  FSDP2: not measured ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
    return ok


def nccl_parity(steps: int, tol: float, cuda: bool = True) -> bool:
    """Under torchrun with W >= 2 GPUs: every rank trains its slice; losses and parameters must match a
    single-process run on the global batch (computed on every rank); as is and in slow-GPU mode."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 1024, (2 * world, 64), generator=g) for _ in range(steps)]
    ok = True
    for family in ("gpt2", "llama"):
        ref = small_model(family).to(device)
        ref_losses = train(ref, [x.to(device) for x in data])
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        for mode, slow in MODES:
            with slow_gpu(device, slow):
                # model on this rank's GPU *without* torch.cuda.set_device (the engine must use its device's streams)
                wrapped = wrap(small_model(family).to(device), forward_prefetch=True,
                               backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
                opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.01)
                losses = []
                for x in data:
                    local = x.chunk(world)[rank]  # CPU input: moved to the device at the root
                    loss = wrapped(input_ids=local, labels=local).loss
                    lag()  # slow-GPU mode: the compute stream falls behind before backward and the optimizer
                    loss.backward()
                    lag()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    mean = loss.detach().clone()
                    dist.all_reduce(mean)
                    losses.append(mean.item() / world)
            with wrapped.summon_full_params():
                pdiff = max((p.detach() - ref_params[n]).abs().max().item() for n, p in wrapped.named_parameters())
            ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            good = ldiff <= tol and pdiff <= tol
            ok &= good
            if rank == 0:
                print(f"  nccl W={world} {mode:8s} {family:5s} max|dloss|={ldiff:.2e} max|dparam|={pdiff:.2e} "
                      f"{'PASS' if good else 'FAIL'}", flush=True)
    return ok


def leak(device, steps: int) -> bool:
    """Wrapped models that trained, generated and gave a full state dict (with and without offload) are freed
    by ``del``: no live wrapper or module, and (CUDA) memory_allocated back where it was before wrapping."""
    cuda = device.type == "cuda"
    ok = True
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 1024, (4, 64), generator=g).to(device) for _ in range(steps)]

    def allocated() -> int:
        gc.collect()
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)

    # warm-up: what the first matmuls allocate for good (cuBLAS workspaces) must not count as a leak
    plain = small_model("llama", layers=4, hidden=256).to(device)
    train(plain, data[:1])
    plain.generate(data[0][:2, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    del plain
    for offload in (False, True):
        before = allocated()
        model = small_model("llama", layers=4, hidden=256).to(device)
        wrapped = wrap(model, cpu_offload=CPUOffload(offload_params=offload))
        shards = wrapped.sharded_bytes()
        train(wrapped, data)
        wrapped.module.generate(data[0][:2, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        wrapped.state_dict()
        held = allocated() - before
        refs = (weakref.ref(wrapped), weakref.ref(model))
        del wrapped, model
        left = allocated() - before
        alive = [r() is not None for r in refs]
        good = not any(alive) and left <= 2**20  # (a leak without offload holds at least its shards there)
        ok &= good
        print(f"  {'offload' if offload else 'plain':7s}: shards {_mib(shards)}; device memory held before del "
              f"{_mib(held)}, after del {left} bytes; wrapper/module alive after del: {alive}: "
              f"{'PASS' if good else 'FAIL'}", flush=True)
    return ok


@contextlib.contextmanager
def one_rank_group(device):
    """A process group of this process alone: NCCL on CUDA (bound to ``device``), gloo on CPU."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=5), device_id=device if cuda else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_group(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _exact_math(device) -> None:
    """W=1 parity: no TF32, deterministic kernels."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def part_w1(args, device) -> bool:
    _exact_math(device)
    with one_rank_group(device):
        print("[w1] parity at W=1, as is and in slow-GPU mode", flush=True)
        return parity(device, args.steps, args.tol)


def part_overlap(args, device) -> bool:
    """Its own process (gpu_check.sh): no exact-math setting of the parity parts reaches its timings."""
    import gpu_check_overlap

    with one_rank_group(device):
        print("[overlap] emulated communication on the side streams vs compute", flush=True)
        return gpu_check_overlap.overlap(sys.modules[__name__], device, args.out, args.comm_repeat, args.steps,
                                         args.min_overlap_of_ceiling)


def part_nccl_1gpu(args, device) -> bool:
    import gpu_check_nccl

    _exact_math(device)
    with one_rank_group(device):
        return gpu_check_nccl.nccl_one_gpu(sys.modules[__name__], device, args.steps, args.tol, args.out)


def part_leak(args, device) -> bool:
    with one_rank_group(device):
        return leak(device, 2)


def part_fake_w8(args, device) -> bool:
    cuda = device.type == "cuda"
    with fake_group(args.world):
        return fake_w8(device, args.world, 3 if cuda else 1, args.batch if cuda else 1, args.seq if cuda else 16,
                       small=not cuda)


def part_nccl(args, device) -> bool:
    """Launched by torchrun (W >= 2)."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    try:
        return nccl_parity(args.steps, args.tol if cuda else 1e-4, cuda)  # W>=2: other summation order
    finally:
        dist.destroy_process_group()


# name -> fn(args, device) -> bool; gpu_check.sh runs each in its own process (see "Adding a part" above)
PARTS = {"w1": part_w1, "overlap": part_overlap, "nccl-1gpu": part_nccl_1gpu, "leak": part_leak,
         "fake-w8": part_fake_w8, "nccl": part_nccl}


def run_part(name: str, args, device) -> bool:
    """One part, guarded: an exception is printed and fails this part only; one verdict line."""
    t0 = time.perf_counter()
    try:
        ok = bool(PARTS[name](args, device))
    except Exception:  # noqa: BLE001 - reported, and the next part still runs
        traceback.print_exc()
        ok = False
    if dist.is_initialized():  # (a part that raised inside its group)
        dist.destroy_process_group()
    if name != "nccl" or int(os.environ.get("RANK", 0)) == 0:
        print(f"gpu_check {name}: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices=list(PARTS), default=["w1"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: smoke run of the same code on gloo / the fake process group, tiny sizes")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 5 cuda, 2 cpu)")
    p.add_argument("--tol", type=float, default=None, help="parity tolerance (default 1e-4 cuda, 1e-6 cpu)")
    p.add_argument("--comm-repeat", type=int, default=8)
    p.add_argument("--min-overlap-of-ceiling", type=float, default=0.6,
                   help="overlap: PASS when the measured overlap >= this x the schedule's ceiling")
    p.add_argument("--world", type=int, default=8, help="fake-w8: emulated ranks")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    args.tol = args.tol if args.tol is not None else (1e-4 if cuda else 1e-6)
    args.steps = args.steps if args.steps is not None else (5 if cuda else 2)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda and args.part != ["nccl"]:
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    results = [run_part(name, args, device) for name in args.part]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
