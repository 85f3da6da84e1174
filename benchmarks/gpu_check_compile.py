"""torch.compile with sharding on the GPU (issue 24): regional compile at W=1 on real CUDA streams.

    python benchmarks/gpu_check_compile.py [--out DIR]   # one GPU, ~1 min (inductor compiles the block once)
    python benchmarks/gpu_check_compile.py --device cpu  # CPU smoke of the same code (aot_eager backend: fast)

A Llama (use_cache=False) is wrapped at W=1 in a 1-rank process group (NCCL on CUDA) and compiled the way
``prepare`` does for ``use_regional_compilation: true`` (``accel_flatshard.compile_model``).  Checked:
* losses within --tol (relative) of the plain model compiled the same way, block by block, over --steps steps;
* dynamo compiles no new graph after step 1 and breaks no graph (counters), and no unit ran eagerly (warning);
* printed: the compiled step's time against the eager wrapped step (CUDA: events around the step);
* slow-GPU mode (``gpu_check_slow.py``): the compiled wrapped model, set back to its initial parameters with a
  fresh optimizer, trains again with the compute and side streams made to fall behind the host: the same
  losses, and no graph compiled (the compiled graphs are reused, nothing recompiles).
Each phase prints its time as it ends.  On the GPU machine a cold inductor cache compiles twice (the plain
model's block and the wrapped one; the FX graph cache makes the second mostly a hit) after the NCCL start-up:
gpu_check.sh gives this part 110 s and, when it is hit, says that this is what did not fit.
Exit status 1 on FAIL.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accel_flatshard import FullyShardedDataParallel, compile_model, transformer_auto_wrap_policy  # noqa: E402
from accel_flatshard.core._compat import dynamo_counters  # noqa: E402
from gpu_check_slow import lag, slow_gpu  # noqa: E402

T0 = time.perf_counter()


def phase(text: str) -> None:
    """One line per phase as it ends, with the time since the start: a timeout shows where it was."""
    print(f"  [{time.perf_counter() - T0:5.1f} s] {text}", flush=True)


def llama(small: bool):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    layers, hidden, vocab = (2, 64, 256) if small else (4, 512, 8192)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                                   vocab_size=vocab, use_cache=False, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def steps(model, data, device, opt=None) -> tuple:
    """Train on ``data``; the losses and the median step time (seconds) of the steps after the first."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for x in data:
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        lag()  # slow-GPU mode: the compute stream falls behind before backward and the optimizer
        loss.backward()
        lag()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # (synchronises)
        times.append(time.perf_counter() - t0)
    timed = sorted(times[1:] or times)
    return losses, timed[len(timed) // 2]


def run(device: torch.device, n_steps: int, tol: float, backend: str) -> bool:
    small = device.type != "cuda"
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256 if small else 8192, (2, 64 if small else 512), generator=g).to(device)
            for _ in range(n_steps)]
    ref = llama(small).to(device)
    for layer in ref.model.layers:  # the plain model, compiled the same way (each block's forward)
        layer.forward = torch.compile(layer.forward, backend=backend)
    ref_losses, _ = steps(ref, data, device)
    phase("plain model compiled per block and trained")

    def wrapped_llama():
        model = llama(small).to(device)
        return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))

    eager = wrapped_llama()
    _, eager_s = steps(eager, data, device)
    del eager
    phase("eager wrapped model trained")
    wrapped = wrapped_llama()
    with wrapped.summon_full_params():
        initial = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    compile_model(wrapped, regional=True, backend=backend)
    counters = dynamo_counters()
    counters.clear()
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, _ = steps(wrapped, data[:1], device, opt)
        graphs_after_first = counters["stats"]["unique_graphs"]
        rest, compiled_s = steps(wrapped, data[1:], device, opt)
    phase("wrapped model compiled (regional) and trained")
    losses = first + rest
    with torch.no_grad(), wrapped.summon_full_params(writeback=True):
        for n, p in wrapped.named_parameters():
            p.copy_(initial[n])
    graphs_before_slow = counters["stats"]["unique_graphs"]
    with slow_gpu(device):
        slow_losses, _ = steps(wrapped, data, device)
    slow_new_graphs = counters["stats"]["unique_graphs"] - graphs_before_slow
    phase("compiled wrapped model trained again in slow-GPU mode")
    slow_diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(slow_losses, ref_losses))
    breaks = sum(counters["graph_break"].values())
    eager_units = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    new_graphs = counters["stats"]["unique_graphs"] - graphs_after_first
    ldiff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses))
    ok = (ldiff <= tol and new_graphs == 0 and breaks == 0 and not eager_units and graphs_after_first > 0
          and slow_diff <= tol and slow_new_graphs == 0)
    print(f"  losses vs the plain model compiled per block: max rel diff {ldiff:.2e} (tol {tol:g}); slow-GPU mode "
          f"{slow_diff:.2e}, graphs compiled in it: {slow_new_graphs}: {'PASS' if ok else 'FAIL'}")
    print(f"  graphs compiled in step 1: {graphs_after_first}, after it: {new_graphs}; graph breaks: {breaks}; "
          f"units run eagerly: {eager_units or 'none'}")
    print(f"  step time: compiled {compiled_s * 1e3:.1f} ms vs eager wrapped {eager_s * 1e3:.1f} ms "
          f"({compiled_s / eager_s:.2f}x)")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))  # (for gpu_check.sh; nothing written)
    p.add_argument("--steps", type=int, default=None, help="default 6 on CUDA, 3 on CPU")
    p.add_argument("--tol", type=float, default=None, help="relative loss tolerance (default 2e-3 CUDA, 1e-5 CPU)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=5), device_id=device if cuda else None)
    phase("process group up")
    t0 = time.perf_counter()
    try:
        ok = run(device, args.steps or (6 if cuda else 3), args.tol or (2e-3 if cuda else 1e-5),
                 "inductor" if cuda else "aot_eager")
    finally:
        dist.destroy_process_group()
    print(f"gpu_check compile: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
