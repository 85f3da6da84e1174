"""Profiling on torch.profiler: the engine's flatshard:: spans in the trace, the phase table built from the
profiler's events, FLATSHARD_PROFILE, and no record_function when no profiler runs."""
import json
import os
import contextlib
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.profiler import profile

import accel_flatshard.tools.profiling as profiler_module
from accel_flatshard.core import spans
from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.tools.profiling import PHASE_ROWS, phase_table, start_from_env, step_phases, stop_env_profiler
from accel_flatshard.core.device import CudaStreams, HostAdapter
from dist_helpers import spawn
from models import batches, gpt2

SPANS = {"flatshard::forward", "flatshard::backward", "flatshard::all_gather", "flatshard::wait_all_gather",
         "flatshard::reduce_scatter", "flatshard::wait_reduce_scatter"}
LEAVES = [k for k, _ in PHASE_ROWS if k not in ("step", "forward", "backward", "exposed_comm")]


def _wrap(**kwargs):
    model = gpt2()
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kwargs)


def _train(wrapped, optimizer, rank=0, world_size=1, steps=3, prof=None):
    for x in batches(steps):
        local = x.chunk(world_size)[rank]
        wrapped(local, labels=local).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if prof is not None:
            prof.step()


def _base(name):
    return name.split("[", 1)[0]


def _assert_steps_add_up(steps):
    for s in steps:
        assert s["step"] > 0 and s["forward"] > 0 and s["backward"] > 0 and s["optimizer"] > 0
        assert sum(s[k] for k in LEAVES) == pytest.approx(s["step"], rel=1e-3)  # the table sums to the step
        assert s["rs_wait"] <= s["backward"] and s["fwd_compute"] <= s["forward"]
        assert s["exposed_comm"] == pytest.approx(s["fwd_ag_wait"] + s["bwd_ag_wait"] + s["rs_wait"])


# ---------------------------------------------------------------------- torch.profiler trace (2 ranks)
def _profiled_worker(rank, world_size, trace_dir):
    wrapped = _wrap()
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    _train(wrapped, optimizer, rank, world_size, steps=1)  # the first step records the unit order
    with profile() as prof:
        _train(wrapped, optimizer, rank, world_size, steps=3)
    path = os.path.join(trace_dir, f"trace_rank{rank}.json")
    prof.export_chrome_trace(path)
    return path, step_phases(prof.events()), phase_table(prof.events()), [u.name for u in wrapped.units]


def test_torch_profiler_trace_has_the_engine_spans_and_the_table_adds_up(tmp_path):
    results = spawn(2, _profiled_worker, str(tmp_path))
    paths = set()
    for rank, (path, steps, table, unit_names) in enumerate(results):
        paths.add(path)
        with open(path) as f:
            trace = json.load(f)  # valid JSON, written by torch.profiler
        spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("flatshard::")]
        assert SPANS <= {_base(e["name"]) for e in spans}
        assert any(e["name"].startswith("aten::") for e in trace["traceEvents"])  # next to the real ops
        # every block's gathers and reductions are labelled with the unit's name
        labels = {e["name"].split("[", 1)[1].rstrip("]") for e in spans
                  if _base(e["name"]) in ("flatshard::wait_all_gather", "flatshard::reduce_scatter")}
        assert {n for n in unit_names if n != "<root>"} <= labels
        # the final reduce-scatter waits happen inside backward
        backward = [e for e in spans if e["name"] == "flatshard::backward"]
        assert len(backward) == 3 and len([e for e in spans if e["name"] == "flatshard::forward"]) == 3
        for wait in (e for e in spans if _base(e["name"]) == "flatshard::wait_reduce_scatter"):
            assert any(b["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= b["ts"] + b["dur"] + 1 for b in backward)
        assert len(steps) == 3  # delimited by the optimizer steps
        _assert_steps_add_up(steps)
        for row in ("step (wall)", "fwd all-gather wait", "forward compute", "bwd all-gather wait",
                    "reduce-scatter wait", "rate-limit wait", "optimizer step", "exposed comm"):
            assert row in table
    assert paths == {str(tmp_path / "trace_rank0.json"), str(tmp_path / "trace_rank1.json")}  # one per rank


# ---------------------------------------------------------------------- no profiler: no record_function
def test_spans_cost_one_flag_check_when_no_profiler_runs(world_of_one):
    wrapped = _wrap()
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    _train(wrapped, optimizer, steps=1)
    with mock.patch.object(spans, "record_function", wraps=spans.record_function) as rf, \
            mock.patch.object(spans, "profiler_enabled", wraps=spans.profiler_enabled) as check:
        _train(wrapped, optimizer, steps=2)
        assert check.call_count > 0 and rf.call_count == 0  # the engine asks, and creates no span
        assert spans.span("all_gather", "x") is spans.span("wait_all_gather")  # one shared no-op
        with profile():
            _train(wrapped, optimizer, steps=1)
        assert rf.call_count > 0


# ---------------------------------------------------------------------- the rate-limit wait is its own phase
def _event(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_phase_table_from_events_puts_the_rate_limit_wait_in_its_own_row():
    us = [  # microseconds, as torch.profiler reports them
        _event("flatshard::forward", 0, 10_000),
        _event("flatshard::all_gather[h.0]", 100, 600),
        _event("flatshard::all_gather_rate_limit", 1_000, 4_000),
        _event("flatshard::wait_all_gather[h.0]", 4_000, 5_000),
        _event("flatshard::backward", 12_000, 30_000),
        _event("flatshard::all_gather_rate_limit", 13_000, 15_000),
        _event("flatshard::reduce_scatter[h.0]", 16_000, 17_000),
        _event("flatshard::wait_reduce_scatter[h.0]", 28_000, 30_000),
        _event("Optimizer.step#AdamW.step", 31_000, 35_000),
        _event("aten::mm", 6_000, 9_000),
    ]
    (s,) = step_phases(us)
    assert s["step"] == 35.0 and s["forward"] == 10.0 and s["backward"] == 18.0 and s["optimizer"] == 4.0
    assert s["fwd_rate_limit"] == 3.0 and s["bwd_rate_limit"] == 2.0  # not compute
    assert s["fwd_compute"] == 10.0 - 0.5 - 3.0 - 1.0 and s["bwd_compute"] == 18.0 - 2.0 - 1.0 - 2.0
    assert s["other"] == 3.0 and sum(s[k] for k in LEAVES) == s["step"]
    assert "| 3.0 |" in phase_table([s]).split("rate-limit wait")[1].split("\n")[0]


class _SlowEvents:
    """``torch.cuda`` stand-in on the host whose events complete late (as behind a busy CUDA compute stream)."""

    def current_stream(self, device=None):
        return self

    def Stream(self, **kwargs):  # noqa: N802 - torch.cuda's names
        return self

    Event = Stream

    def stream(self, stream):
        return contextlib.nullcontext()

    def record(self, stream=None):
        pass

    def synchronize(self):
        time.sleep(0.01)

    def wait_stream(self, other):
        pass

    wait_event = wait_stream


class _SlowFreeStreams(CudaStreams):
    """The CUDA adapter on host tensors whose freed buffers complete late: its all-gather rate limit then makes the
    host wait."""

    def __init__(self, device):
        super().__init__(device, api=_SlowEvents())

    record_stream = HostAdapter._nothing  # (host tensors)


def test_engine_rate_limit_wait_is_reported_as_its_own_phase(world_of_one):
    wrapped = _wrap()
    wrapped.schedule.engine.attach(_SlowFreeStreams(torch.device("cpu")))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    _train(wrapped, optimizer, steps=1)
    with profile() as prof:
        _train(wrapped, optimizer, steps=2)
    waits = [e for e in prof.events() if e.name == "flatshard::all_gather_rate_limit"]
    assert waits
    steps = step_phases(prof.events())
    _assert_steps_add_up(steps)
    total = sum(s["fwd_rate_limit"] + s["bwd_rate_limit"] for s in steps)
    assert total >= 0.9 * 10.0 * len(waits) and total == pytest.approx(sum(e.time_range.elapsed_us() for e in waits) / 1e3)
    for s in steps:  # compute excludes the host waits
        assert s["fwd_compute"] <= s["forward"] - s["fwd_rate_limit"] + 1e-6


# ---------------------------------------------------------------------- FLATSHARD_PROFILE
def test_env_profile_writes_torch_traces_and_the_table(world_of_one, monkeypatch, tmp_path, capsys):
    for value in ("", "0", "off"):
        monkeypatch.setenv("FLATSHARD_PROFILE", value)
        assert start_from_env(0) is None
    monkeypatch.setenv("FLATSHARD_PROFILE", str(tmp_path))
    monkeypatch.setenv("FLATSHARD_PROFILE_EVERY", "2")
    try:
        wrapped = _wrap()  # starts the process' profiler
        assert profiler_module._ENV_PROFILER is not None and start_from_env(0) is profiler_module._ENV_PROFILER
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)  # built after: the global hook still steps
        _train(wrapped, optimizer, steps=4)
    finally:
        stop_env_profiler()
    assert capsys.readouterr().out.count("accel_flatshard profile, rank 0") == 2  # after steps 2 and 4
    with open(tmp_path / "flatshard_trace_rank0.json") as f:
        names = [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    assert SPANS <= {_base(n) for n in names}
    assert len([n for n in names if n.startswith("ProfilerStep#")]) == 1  # N - 1 steps recorded per cycle
    with open(tmp_path / "flatshard_phases_rank0.md") as f:
        assert "| step (wall) |" in f.read()


def test_env_profile_refuses_to_start_beside_another_profiler(monkeypatch):
    monkeypatch.setenv("FLATSHARD_PROFILE", "1")
    with profile():
        with pytest.raises(RuntimeError, match="FLATSHARD_PROFILE is set but a torch.profiler is already running"):
            start_from_env(0)
    assert profiler_module._ENV_PROFILER is None
