"""Part ``overlap`` of gpu_check.py: does the schedule hide its communication behind compute on real streams?

At W=1 there is no real communication, so each all-gather / reduce-scatter is emulated on the engine's side
streams by ``--comm-repeat`` device copies of the full buffer (their time is proportional to their bytes, like a
collective's).  torch.profiler records the kernels; reported: the fraction of side-stream time that overlaps
compute-stream kernels, the exposed communication (step time with emulated comm - without), and the ceiling
the schedule allows:

* the gathers before the first layer's compute cannot overlap anything: the gather stream waits for the previous
  step's optimizer, and the forward waits for them.  These are the first two of a step: the root's, and the
  first unit to compute (the input embedding's unit, or the first layer where the root holds the embedding:
  then it hides behind the embedding lookup only);
* the reductions after the last layer's backward cannot either: the last two of a step (the input embedding's
  unit or the first layer, and the root: its gradients are complete only when the whole backward is); nothing
  is computed after them before the optimizer, which waits for them.
ceiling = 1 - (bytes of those four) / (bytes of all emulated collectives), from the calls recorded (a copy's
time is proportional to its bytes).  PASS when the measured overlap >= ``--min-overlap-of-ceiling`` (0.6) x the
ceiling: below the ceiling because the side stream also waits for the compute stream at each reduction (the
gradient must exist) and copies and kernels share the memory bandwidth; a schedule that serialised
communication with compute would measure near 0.

Runs in its own process (gpu_check.sh), so none of the parity parts' settings (deterministic algorithms, no
TF32, the cuBLAS workspace config) slow its kernels.  On CPU (smoke) the same code runs at tiny size; there are
no device kernels to profile, so the overlap is reported as not measured.
"""
from __future__ import annotations

import copy
import json
import os
import time
import types
from typing import Dict, List, Tuple

import torch

from accel_flatshard import BackwardPrefetch


def emulate_comm(wrapped, repeat: int, calls: List[Tuple[str, int]]) -> None:
    """W=1: every gather / reduction costs ``repeat`` full-buffer copies on the engine's side stream; each call's
    kind and bytes copied are appended to ``calls``."""
    group = wrapped.shard_group

    def all_gather(self, outputs, shards, async_op=True, kind="", in_node=False):
        for output, shard in zip(outputs, shards):
            for _ in range(repeat):
                output.copy_(shard)  # W=1: shard and output have the same size
            calls.append(("gather", repeat * output.numel() * output.element_size()))
        return _done()

    def reduce_scatter(self, output, full, async_op=True):
        scratch = torch.empty_like(full)
        for _ in range(repeat):
            scratch.copy_(full)
        output.copy_(full[: output.numel()])
        calls.append(("reduce", (repeat + 1) * full.numel() * full.element_size()))
        return _done()

    group.all_gather = types.MethodType(all_gather, group)
    group.reduce_scatter = types.MethodType(reduce_scatter, group)


def _done():
    from accel_flatshard.core.comm import DONE

    return DONE


def ceiling(steps_calls: List[List[Tuple[str, int]]]) -> float:
    """1 - (first two gathers + last two reductions) / everything, over the recorded steps (module docstring)."""
    total = hidden_not = 0
    for calls in steps_calls:
        total += sum(b for _, b in calls)
        gathers = [b for k, b in calls if k == "gather"]
        reduces = [b for k, b in calls if k == "reduce"]
        hidden_not += sum(gathers[:2]) + sum(reduces[-2:])
    return 1.0 - hidden_not / total if total else 0.0


def _intervals_union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _intersection(u1, u2):
    i = j = 0
    total = 0.0
    while i < len(u1) and j < len(u2):
        lo, hi = max(u1[i][0], u2[j][0]), min(u1[i][1], u2[j][1])
        total += max(0.0, hi - lo)
        if u1[i][1] < u2[j][1]:
            i += 1
        else:
            j += 1
    return total


def _trace_overlap(path: str) -> Tuple[float, float, Dict]:
    """(overlap fraction, comm time in us, busy us per stream) from a chrome trace's device kernels."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream: Dict = {}
    for e in kernels:
        by_stream.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"]))
    busy = {s: sum(b - a for a, b in _intervals_union(iv)) for s, iv in by_stream.items()}
    # the compute stream: the one with the most *kernel* time (GEMMs); the emulated collectives are device
    # copies (gpu_memcpy) and may well keep their side stream busier than the compute stream
    kernel_time: Dict = {}
    for e in kernels:
        if e.get("cat") == "kernel":
            stream = e.get("args", {}).get("stream", e.get("tid"))
            kernel_time[stream] = kernel_time.get(stream, 0) + e["dur"]
    if not kernel_time:
        return 0.0, 0.0, busy
    compute_stream = max(kernel_time, key=kernel_time.get)
    compute = _intervals_union(by_stream[compute_stream])
    comm = _intervals_union([iv for s, ivs in by_stream.items() if s != compute_stream for iv in ivs])
    comm_time = sum(b - a for a, b in comm)
    return (_intersection(comm, compute) / comm_time if comm_time else 0.0), comm_time, busy


def overlap(gpu_check, device, out_dir: str, repeat: int, steps: int, min_of_ceiling: float) -> bool:
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    vocab = 8192 if cuda else 256
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (8, 512) if cuda else (2, 16), generator=g).to(device) for _ in range(steps + 2)]
    base = (gpu_check.small_model("llama", layers=8, hidden=1024, vocab=vocab, attn="sdpa") if cuda
            else gpu_check.small_model("llama", layers=2, hidden=64, vocab=vocab))
    kw = {"forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE}
    timings, steps_calls, prof = {}, [], None
    for label, rep in (("no comm", 0), ("emulated comm", repeat)):
        model = gpu_check.wrap(copy.deepcopy(base).to(device), **kw)
        calls: List[Tuple[str, int]] = []
        if rep:
            emulate_comm(model, rep, calls)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for x in data[:2]:
            step(x)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        if rep and cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for x in data[2:]:
                    calls.clear()
                    step(x)
                    steps_calls.append(list(calls))
                sync()
        else:
            for x in data[2:]:
                calls.clear()
                step(x)
                steps_calls.append(list(calls)) if rep else None
            sync()
        timings[label] = (time.perf_counter() - t0) / steps
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    top = ceiling(steps_calls)
    exposed = timings["emulated comm"] - timings["no comm"]
    print(f"  emulated collectives per step: {len(steps_calls[0])}; ceiling the schedule allows (all but the "
          f"first two gathers and the last two reductions): {100 * top:.0f}% of the communication", flush=True)
    if not cuda:
        print(f"  step: no comm {timings['no comm']*1e3:.1f} ms, emulated comm {timings['emulated comm']*1e3:.1f} ms; "
              "overlap: not measured on CPU (no device kernels to profile)", flush=True)
        return top > 0
    path = os.path.join(out_dir, "overlap_trace.json")
    prof.export_chrome_trace(path)
    frac, comm_time, busy = _trace_overlap(path)
    print(f"  streams busy (us over {steps} steps): {busy}", flush=True)
    print(f"  step: no comm {timings['no comm']*1e3:.1f} ms, emulated comm {timings['emulated comm']*1e3:.1f} ms; "
          f"comm per step {comm_time/steps/1e3:.1f} ms, exposed {exposed*1e3:.1f} ms", flush=True)
    print(f"  peak max_memory_allocated {torch.cuda.max_memory_allocated()/2**20:.0f} MiB; trace: {path}", flush=True)
    good = frac >= min_of_ceiling * top
    print(f"  overlap of comm with compute kernels {100 * frac:.0f}% >= {min_of_ceiling:.2f} x ceiling "
          f"{100 * top:.0f}% = {100 * min_of_ceiling * top:.0f}%: {'PASS' if good else 'FAIL'}", flush=True)
    return good
