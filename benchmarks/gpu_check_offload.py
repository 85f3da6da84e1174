"""CUDA check of CPU offload (``fsdp_offload_params: true``, issue 17), run by gpu_check.sh.

    python benchmarks/gpu_check_offload.py --part w1 --out DIR        # one GPU, real streams, W=1
    python benchmarks/gpu_check_offload.py --part fake-w8 --out DIR   # one GPU, emulated W=8, 1.1B Llama
    python benchmarks/gpu_check_offload.py --device cpu --part w1|fake-w8   # CPU smoke of the same code

Part w1 (NCCL, W=1, the engine's real side streams and pinned host buffers):
1. Parity: Llama and GPT-2 wrapped per block with offload train AdamW (host step) next to the plain
   model on the GPU; losses and parameters within --tol.  bf16 mixed precision with offload next to the
   same wrapper without offload; gradient accumulation (no_sync and per micro-step) next to without.
2. Placement: after wrapping and after every step the device holds only the module buffers and inputs
   (no shard, gradient or optimizer state); peak device memory with offload <= the bound
   (gathered units in flight + unreduced full gradients + shard copies + activations) and < without.
3. Host AdamW step (fused, CPU) on 40M parameters against the same step on the GPU without offload.
Part fake-w8 (torch's fake process group, 8 emulated ranks, TinyLlama-1.1B shape): training peak with
offload <= the bound above; printed next to the peak without offload and torch FSDP2 with
CPUOffloadPolicy on the same model.
Exit status 1 if a parity or a memory check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_check  # noqa: E402
from gpu_check import _mib, _verdict, activations_without_grads, llama_1b, small_model, train, wrap  # noqa: E402
from gpu_check_slow import MODES, lag, slow_gpu  # noqa: E402
from offload_adamw import run as adamw_run  # noqa: E402

from accel_flatshard import CPUOffload, MixedPrecision  # noqa: E402
from accel_flatshard.core.engine import MAX_PENDING_REDUCTIONS  # noqa: E402

OFFLOAD = CPUOffload(offload_params=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device) -> int:
    _sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def device_bound(wrapped, activations: int) -> dict:
    """What the device may hold at most while an offloaded model trains (nothing persistent), term by term:
    * gathered: the root (gathered for the whole step) and ``max_inflight + 1`` layers (the gather limit,
      plus the one being waited for);
    * full grads: ``MAX_PENDING_REDUCTIONS + 1`` full gradients of the largest unit (the pending ones, plus
      the one being produced);
    * shard copies: for each of those gathers and reductions a device copy of its shard, fp32 plus the compute
      dtype (the host shard's upload and its cast; the reduced shard and its cast before the copy to the host);
    * activations: what the plain model needs above its parameters with each gradient dropped as it is
      produced (``gpu_check.activations_without_grads``: activations + backward transients; not "peak minus
      all gradients", which is ~2 GB too small on the 1.1 B Llama: at the head's backward, the peak, almost no
      gradient exists yet)."""
    engine = wrapped.schedule.engine
    unit_bytes = [sum(f.layout.padded_numel * f.unsharded.element_size() for f in u.flat_params) for u in wrapped.units]
    shard_bytes = [sum(f.layout.shard_numel * 4 * 2 for f in u.flat_params) for u in wrapped.units]
    root = unit_bytes[[u.is_root for u in wrapped.units].index(True)]
    layer = max([b for b, u in zip(unit_bytes, wrapped.units) if not u.is_root] or [0])
    parts = {
        "gathered": root + (engine.limit_all_gathers + 1) * layer,
        "full grads": (MAX_PENDING_REDUCTIONS + 1) * max(unit_bytes),
        "shard copies": (engine.limit_all_gathers + MAX_PENDING_REDUCTIONS + 2) * max(shard_bytes),
        "activations": activations,
    }
    parts["total"] = sum(parts.values())
    return parts


def _accumulate(model, data, how: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for x in data:
        for i, m in enumerate(x.chunk(2)):
            ctx = model.no_sync() if how == "no_sync" and i == 0 else contextlib.nullcontext()
            with ctx:
                loss = model(input_ids=m, labels=m).loss / 2
                lag()  # slow-GPU mode: the compute stream falls behind before backward and the optimizer
                loss.backward()
            losses.append(loss.item())
        lag()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _parity(device, data, tol: float, refs: dict, mode: str) -> bool:
    ok = True
    for family in ("gpt2", "llama"):
        ref_losses, ref_params = refs[family]
        wrapped = wrap(small_model(family).to(device), cpu_offload=OFFLOAD)
        on_device = [n for n, p in wrapped.named_parameters() if p.device.type != "cpu"]
        losses = train(wrapped, data)
        with wrapped.summon_full_params():
            pdiff = max((p.detach().cpu() - ref_params[n]).abs().max().item() for n, p in wrapped.named_parameters())
        ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        good = ldiff <= tol and pdiff <= tol and not on_device
        ok &= good
        print(f"  parity {mode:8s} {family:5s} max|dloss|={ldiff:.2e} max|dparam|={pdiff:.2e} params on device: "
              f"{len(on_device)} {'PASS' if good else 'FAIL'}", flush=True)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plain_bf16 = train(wrap(small_model("llama").to(device), mixed_precision=mp), data)
    off_bf16 = train(wrap(small_model("llama").to(device), mixed_precision=mp, cpu_offload=OFFLOAD), data)
    ldiff = max(abs(a - b) for a, b in zip(plain_bf16, off_bf16))
    good = ldiff <= max(tol, 1e-3)
    ok &= good
    print(f"  bf16 offload vs bf16 on device ({mode}): max|dloss|={ldiff:.2e} {'PASS' if good else 'FAIL'}", flush=True)
    for how in ("no_sync", "per_micro_step"):
        a = _accumulate(wrap(small_model("llama").to(device)), data, how)
        b = _accumulate(wrap(small_model("llama").to(device), cpu_offload=OFFLOAD), data, how)
        ldiff = max(abs(x - y) for x, y in zip(a, b))
        good = ldiff <= tol
        ok &= good
        print(f"  accumulation {how:15s} offload vs not ({mode}): max|dloss|={ldiff:.2e} {'PASS' if good else 'FAIL'}",
              flush=True)
    return ok


def w1(device, steps: int, tol: float) -> bool:
    ok = True
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 1024, (4, 64), generator=g).to(device) for _ in range(steps)]
    print("[offload w1 1/3] parity (host AdamW step) vs the plain model on the device, as is and slow-GPU",
          flush=True)
    refs = {}
    for family in ("gpt2", "llama"):
        ref = small_model(family).to(device)
        refs[family] = (train(ref, data), {n: p.detach().cpu() for n, p in ref.named_parameters()})
    for mode, slow in MODES:
        with slow_gpu(device, slow):
            ok &= _parity(device, data, tol, refs, mode)
    print("[offload w1 2/3] placement and device peak memory", flush=True)
    ok &= memory(device, small_model("llama", layers=4, hidden=512).to(device), data, steps)

    print("[offload w1 3/3] AdamW step: host (offload) vs device (no offload)", flush=True)
    numel = 40_000_000 if device.type == "cuda" else 400_000
    rows = [adamw_run(v, numel, 3, "cpu") for v in ("for-loop", "foreach", "fused")]
    if device.type == "cuda":
        rows.append(adamw_run("fused", numel, 3, "cuda"))
    for row in rows:
        print(f"  AdamW {row['variant']:8s} on {row['device']}: {row['step_ms']:.1f} ms ({numel / 1e6:.1f}M params)",
              flush=True)
    return ok


def memory(device, model, data, steps: int) -> bool:
    """Peak device memory with offload against the bound and against the same wrapper without offload;
    between steps nothing of the model but its buffers stays on the device."""
    cuda = device.type == "cuda"
    plain = copy.deepcopy(model)
    activations = activations_without_grads(plain, data[0], device)
    del plain
    results = {}
    for offload in (True, False):
        gc.collect()  # the previous row's wrapped model and optimizer (reference cycles) go before measuring
        start = _allocated(device)
        wrapped = wrap(copy.deepcopy(model), cpu_offload=CPUOffload(offload_params=offload))
        buffers = sum(b.numel() * b.element_size() for b in wrapped.buffers())
        resident = [_allocated(device) - start]
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=True if offload or cuda else None)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for x in data[:steps]:
            wrapped(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            resident.append(_allocated(device) - start)
        peak = (torch.cuda.max_memory_allocated(device) if cuda else 0) - start
        results[offload] = (peak, resident, buffers, device_bound(wrapped, activations))
        del wrapped, opt
    peak, resident, buffers, bound = results[True]
    # between steps offload keeps nothing of the model on the device but its buffers (rotary tables); 1 MiB for
    # the allocator's rounding and the inputs
    good_resident = (not cuda) or max(resident) <= buffers + 2**20
    # the peak: device_bound's terms (each justified there), and below the same wrapper without offload
    good_peak = (not cuda) or (peak <= bound["total"] and peak < results[False][0])
    print(f"  resident on device after wrap / each step: {[_mib(r) for r in resident]} (buffers {_mib(buffers)}): "
          f"{_verdict(good_resident, cuda)}", flush=True)
    print(f"  peak with offload {_mib(peak)} <= bound {_mib(bound['total'])} "
          f"({', '.join(f'{k} {_mib(v)}' for k, v in bound.items() if k != 'total')}); without offload "
          f"{_mib(results[False][0])}: {_verdict(good_peak, cuda)}", flush=True)
    return good_resident and good_peak


def fake_w8(device, world: int, steps: int, batch: int, seq: int, small: bool) -> bool:
    """Emulated W ranks on the 1.1B Llama: offload's device peak vs the bound, vs no offload, vs FSDP2."""
    cuda = device.type == "cuda"
    kw = dict(layers=2, hidden=128, vocab=1024) if small else {}
    x = torch.randint(0, kw.get("vocab", 32000), (batch, seq), device=device)
    host_model = llama_1b(meta=False, **kw)
    plain = copy.deepcopy(host_model).to(device)
    n_params = sum(p.numel() for p in plain.parameters())
    activations = activations_without_grads(plain, x, device)
    del plain
    gc.collect()
    print(f"  model: {n_params / 1e9:.2f} B parameters, W={world} (fake); activations {_mib(activations)}", flush=True)
    start = _allocated(device)
    wrapped = gpu_check.FullyShardedDataParallel(host_model, auto_wrap_policy=gpu_check.transformer_auto_wrap_policy(host_model),
                                                 device_id=device, cpu_offload=OFFLOAD)
    resident = _allocated(device) - start
    buffers = sum(b.numel() * b.element_size() for b in wrapped.buffers())
    bound = device_bound(wrapped, activations)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-5, fused=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        wrapped(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    peak = (torch.cuda.max_memory_allocated(device) if cuda else 0) - start
    after = _allocated(device) - start
    # device_bound's terms (each justified there); resident: the buffers only, 1 MiB for the allocator's rounding
    good = (not cuda) or (peak <= bound["total"] and max(resident, after) <= buffers + 2**20)
    print(f"  ours, offload: peak {_mib(peak)} <= bound {_mib(bound['total'])} "
          f"({', '.join(f'{k} {_mib(v)}' for k, v in bound.items() if k != 'total')}); resident after wrap "
          f"{_mib(resident)}, after steps {_mib(after)} (buffers {_mib(buffers)}): {_verdict(good, cuda)}; "
          f"{step_s * 1e3:.0f} ms/step", flush=True)
    del wrapped, opt, host_model
    gc.collect()  # (reference cycles) before FSDP2's peak is measured
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        model = llama_1b(meta=True, **kw)
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p.data, std=0.02)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        start = _allocated(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        fsdp2 = (torch.cuda.max_memory_allocated(device) if cuda else 0) - start
        print(f"  FSDP2 CPUOffloadPolicy: peak {_mib(fsdp2)} (same model, W={world} fake)", flush=True)
    except Exception as exc:  # noqa: BLE001 - the comparison is informational, our checks above decide
        print(f"  FSDP2 CPUOffloadPolicy: not measured ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
    return good


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["w1", "fake-w8"], default="w1")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tol", type=float, default=None, help="parity tolerance (default 1e-4 cuda, 1e-6 cpu)")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.part == "fake-w8":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
        try:
            ok = fake_w8(device, args.world, 2 if cuda else 1, args.batch if cuda else 1, args.seq if cuda else 16,
                         small=not cuda)
        finally:
            dist.destroy_process_group()
        print("gpu_check offload fake-w8:", "PASS" if ok else "FAIL", flush=True)
        return 0 if ok else 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, timeout=datetime.timedelta(minutes=5),
                            device_id=device if cuda else None)
    try:
        ok = w1(device, args.steps, args.tol if args.tol is not None else (1e-4 if cuda else 1e-6))
    finally:
        dist.destroy_process_group()
    print("gpu_check offload w1:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
