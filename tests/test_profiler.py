"""The profiler: Chrome-trace export, the per-step table, the environment switch, and no work when off."""
import json
import os
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
import accel_flatshard.profiler as profiler_module
from accel_flatshard.profiler import NULL_PROFILER, Profiler, _in_flight, profiler_for
from dist_helpers import spawn
from models import batches, gpt2

ENGINE_SPANS = {"all_gather_issue", "all_gather_wait", "reduce_scatter_issue", "reduce_scatter_wait"}
PHASES = {"step", "forward", "backward", "optimizer"}


def _wrap(profiler=None, **kwargs):
    model = gpt2()
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), profiler=profiler,
                                    **kwargs)


def _train(wrapped, optimizer, rank=0, world_size=1, steps=3):
    for x in batches(steps):
        local = x.chunk(world_size)[rank]
        wrapped(local, labels=local).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process (so mocks see every call)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- chrome trace (2 ranks)
def _profiled_worker(rank, world_size, trace_dir):
    prof = Profiler(warmup=1)
    wrapped = _wrap(prof)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    prof.attach(wrapped, optimizer)
    prof.attach(wrapped, optimizer)  # idempotent
    _train(wrapped, optimizer, rank, world_size, steps=3)
    path = prof.export_chrome_trace(os.path.join(trace_dir, "trace_rank{rank}.json"))
    return path, prof.summary(), prof.stats(), prof.step_count, [u.name for u in wrapped.units]


def _x_events(trace, name):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].split(" ")[0] == name]


def test_chrome_trace_is_valid_json_with_the_engine_events(tmp_path):
    results = spawn(2, _profiled_worker, str(tmp_path))
    for rank, (path, summary, stats, steps, unit_names) in enumerate(results):
        assert path == str(tmp_path / f"trace_rank{rank}.json")
        with open(path) as f:
            trace = json.load(f)  # valid JSON
        assert trace["displayTimeUnit"] == "ms"
        events = trace["traceEvents"]
        assert events and all({"name", "ph", "pid", "tid"} <= e.keys() for e in events)
        for e in events:
            assert e["ph"] in ("X", "M")
            assert e["pid"] == rank and isinstance(e["tid"], int)
            if e["ph"] == "X":
                assert isinstance(e["ts"], float) and e["dur"] >= 0 and e["cat"]
        names = {e["name"].split(" ")[0] for e in events if e["ph"] == "X"}
        assert PHASES | ENGINE_SPANS <= names
        assert {"all_gather", "reduce_scatter"} <= names  # the in-flight lanes
        meta = {e["args"].get("name") for e in events if e["ph"] == "M"}
        assert f"rank {rank}" in meta and "all-gather in flight (0)" in meta and "reduce-scatter in flight (0)" in meta
        assert len(_x_events(trace, "step")) == steps == 3
        # every block's gathers and reductions are labelled with the unit's name
        labels = {e["args"]["unit"] for e in _x_events(trace, "all_gather_wait") + _x_events(trace, "reduce_scatter_issue")}
        assert {n for n in unit_names if n != "<root>"} <= labels
        # collectives run inside the phases, and the final reduce-scatter wait inside backward
        for step in _x_events(trace, "step"):
            lo, hi = step["ts"], step["ts"] + step["dur"] + 1
            inside = [e for e in events if e["ph"] == "X" and e.get("tid") == step["tid"] and lo <= e["ts"] < hi]
            assert {e["name"].split(" ")[0] for e in inside} >= {"forward", "backward", "optimizer", "all_gather_wait"}
        backward = _x_events(trace, "backward")
        for wait in _x_events(trace, "reduce_scatter_wait"):
            assert any(b["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= b["ts"] + b["dur"] + 1 for b in backward)
        assert stats["step"] > 0 and stats["forward"] > 0 and stats["backward"] > 0 and stats["optimizer"] > 0
        assert stats["rs_wait"] <= stats["backward"] and stats["fwd_compute"] <= stats["forward"]
    summary = results[0][1]
    for row in ("step (wall)", "fwd all-gather wait", "forward compute", "bwd all-gather wait", "reduce-scatter wait",
                "optimizer step", "exposed comm"):
        assert row in summary
    assert summary.startswith("accel_flatshard profile, rank 0: steps 2-3")


# ---------------------------------------------------------------------- off: no work
def test_profiling_off_reads_no_clock_and_allocates_no_context(one_rank):
    wrapped = _wrap()  # default: NULL_PROFILER
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    _train(wrapped, optimizer, steps=1)  # record the unit order first
    contexts = []
    real_span = NULL_PROFILER.span

    def spy(name, label=""):
        contexts.append(real_span(name, label))
        return contexts[-1]

    with mock.patch.object(NULL_PROFILER, "span", side_effect=spy) as span, \
            mock.patch("time.perf_counter_ns", wraps=time.perf_counter_ns) as clock_ns, \
            mock.patch("time.perf_counter", wraps=time.perf_counter) as clock:
        _train(wrapped, optimizer, steps=2)
    assert span.call_count > 0  # the engine does call it ...
    assert len({id(c) for c in contexts}) == 1  # ... and gets the same shared no-op context every time
    assert clock_ns.call_count == 0 and clock.call_count == 0


def test_disabled_profiler_records_nothing(one_rank):
    prof = Profiler(enabled=False)
    wrapped = _wrap(prof)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    prof.attach(wrapped, optimizer)
    with mock.patch("time.perf_counter_ns", wraps=time.perf_counter_ns) as clock_ns:
        _train(wrapped, optimizer, steps=2)
    assert clock_ns.call_count == 0
    assert prof.step_count == 0 and not prof.steps and "no complete step" in prof.summary()


def test_profiling_on_reads_the_clock_twice_per_span(one_rank):
    prof = Profiler()
    wrapped = _wrap(prof)
    prof.detach()  # the constructor attached phase hooks; count the engine's spans alone
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    with mock.patch.object(prof, "span", wraps=prof.span) as span, \
            mock.patch("time.perf_counter_ns", wraps=time.perf_counter_ns) as clock_ns:
        _train(wrapped, optimizer, steps=1)
        prof.step()
    assert span.call_count > 0 and clock_ns.call_count == 2 * span.call_count + 1  # + the end of the step
    assert prof.step_count == 1


# ---------------------------------------------------------------------- one rank: table, manual steps, env
def test_manual_phases_and_print_every(one_rank, capsys, tmp_path):
    prof = Profiler(print_every=2, warmup=0, trace_dir=str(tmp_path / "traces"))
    wrapped = _wrap(prof, reshard_after_forward=False)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    prof.attach(wrapped)  # no optimizer: steps end with optimizer_step() / step()
    for x in batches(4):
        wrapped(x, labels=x).loss.backward()
        with prof.optimizer_step():
            optimizer.step()
        optimizer.zero_grad()
    assert prof.step_count == 4
    out = capsys.readouterr().out
    assert out.count("accel_flatshard profile, rank 0") == 2  # after steps 2 and 4
    with open(tmp_path / "traces" / "flatshard_trace_rank0.json") as f:
        assert len(_x_events(json.load(f), "step")) == 4
    stats = prof.stats()
    assert stats["optimizer"] > 0 and stats["bwd_ag_wait"] == 0.0  # nothing re-gathered in backward
    prof.detach()
    wrapped(x, labels=x).loss.backward()
    prof.step()
    assert prof.step_count == 5 and prof.steps[-1]["forward"] == 0.0  # hooks removed, engine spans remain


def test_from_env(monkeypatch, tmp_path):
    for value in (None, "", "0", "off"):
        if value is None:
            monkeypatch.delenv("FLATSHARD_PROFILE", raising=False)
        else:
            monkeypatch.setenv("FLATSHARD_PROFILE", value)
        assert Profiler.from_env() is None
    monkeypatch.setenv("FLATSHARD_PROFILE", "1")
    prof = Profiler.from_env()
    assert prof.enabled and prof.trace_dir is None and prof.print_every == 10
    monkeypatch.setenv("FLATSHARD_PROFILE", str(tmp_path))
    monkeypatch.setenv("FLATSHARD_PROFILE_EVERY", "3")
    prof = Profiler.from_env()
    assert prof.trace_dir == str(tmp_path) and prof.print_every == 3


def test_env_profiler_hooks_every_optimizer_and_writes_traces(one_rank, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(profiler_module, "_ENV_PROFILER", None)
    monkeypatch.delenv("FLATSHARD_PROFILE", raising=False)
    assert profiler_for(None) is NULL_PROFILER
    assert NULL_PROFILER.attach(object()) is NULL_PROFILER  # the wrapper may call it unconditionally
    monkeypatch.setenv("FLATSHARD_PROFILE", str(tmp_path))
    monkeypatch.setenv("FLATSHARD_PROFILE_EVERY", "2")
    prof = profiler_for(None)
    assert isinstance(prof, Profiler) and profiler_for(None) is prof  # one per process
    given = Profiler()
    assert profiler_for(given) is given
    # what FullyShardedDataParallel does with it: pass it to the engine, then attach(self)
    wrapped = _wrap(prof)
    prof.attach(wrapped)
    try:
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)  # built after: global hooks still see it
        _train(wrapped, optimizer, steps=2)
    finally:
        prof.detach()  # global optimizer hooks must not leak into other tests
    assert prof.step_count == 2
    assert "accel_flatshard profile, rank 0" in capsys.readouterr().out
    with open(tmp_path / "flatshard_trace_rank0.json") as f:
        assert len(_x_events(json.load(f), "step")) == 2


def test_in_flight_pairs_issues_with_their_waits():
    ev = lambda name, label, t0, t1: (name, label, t0, t1, 0, None)  # noqa: E731
    events = [
        ev("all_gather_issue", "a", 0, 1), ev("all_gather_issue", "b", 2, 3),
        ev("all_gather_wait", "b", 4, 5),  # waits by name, out of order
        ev("all_gather_issue", "c", 6, 7),
        ev("all_gather_wait", "", 8, 9),  # unnamed: the oldest outstanding one (a)
        ev("reduce_scatter_issue", "b", 10, 11), ev("reduce_scatter_issue", "a", 12, 13),
        ev("reduce_scatter_wait", "", 14, 20),  # completes both
    ]
    assert list(_in_flight(events)) == [
        ("all_gather", "b", 2, 5), ("all_gather", "a", 0, 9),
        ("reduce_scatter", "b", 10, 20), ("reduce_scatter", "a", 12, 20),
    ]


def test_export_without_distributed(tmp_path):
    prof = Profiler(track_memory=False)
    with prof.phase("forward"):
        with prof.span("all_gather_wait", "block"):
            pass
    prof.step()
    path = prof.export_chrome_trace(str(tmp_path))  # a directory: default file name
    assert os.path.basename(path) == "flatshard_trace_rank0.json"
    with open(path) as f:
        trace = json.load(f)
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"step", "forward", "all_gather_wait block"}
    with pytest.raises(ValueError):
        with prof.phase("bogus"):
            pass
