"""The link-emulating bench (benchmarks/netlink.py, benchmarks/link_bench.py) at a tiny size, so it cannot rot: the
shaped link carries what it is shaped to, a run reports every engine with the bytes that crossed machines, and no
namespace outlives a run, finished or interrupted.  Needs root, ``ip`` and ``tc`` (CI runs as root): skipped with
the reason otherwise."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import netlink  # noqa: E402  (benchmarks/netlink.py)

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                reason="link emulation needs root with ip and tc (CI runs as root)")
BENCH = [sys.executable, str(REPO / "benchmarks" / "link_bench.py")]


def run_bench(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The bench to its end; ``.pid`` set on the result (its namespaces are named after it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(BENCH + list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def left_by(pid: int):
    """Namespaces still named after process ``pid`` (others' runs may be going on beside this test)."""
    return [ns for ns in netlink.namespaces() if ns.startswith(f"{netlink.PREFIX}-{pid}-")]


def test_shaped_link_carries_its_rate_in_both_directions():
    with netlink.EmulatedLink() as link:
        link.shape(rate_gbit=1)
        assert 0.8 < link.measure_gbit(1.0) < 1.05
        link.shape(rate_gbit=0.2)
        assert 0.15 < link.measure_gbit(1.0) < 0.21
    assert not set(link.names) & set(netlink.namespaces())


@pytest.mark.ci
def test_tiny_run_reports_every_engine_with_bytes_across_and_leaves_no_namespace(tmp_path):
    out = tmp_path / "rows.json"
    done = run_bench("--tiny", "--topologies", "2x1", "--rates", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    engines = set(r["engine"] for r in rows)
    assert engines == set(link_bench_engines("2x1"))
    by = {(r["rate_gbit"], r["engine"]): r for r in rows}
    for rate in (0.0, 1.0):
        assert by[rate, "ddp"]["vs_ddp"] == 1.0
        for e in engines:
            assert by[rate, e]["cross_mb"] > 0 and by[rate, e]["median_s"] > 0
            assert by[rate, e]["bound_s"] >= by[0.0, e]["median_s"]
    # what crosses is what each engine sends: int8 and fp16 cut DDP's bytes, FULL_SHARD adds a gather
    assert by[1.0, "ours+int8"]["cross_mb"] < 0.45 * by[1.0, "ours"]["cross_mb"]
    assert by[1.0, "ddp+fp16"]["cross_mb"] < 0.6 * by[1.0, "ddp"]["cross_mb"]
    assert by[1.0, "ours"]["cross_mb"] > 1.1 * by[1.0, "ours+noreshard"]["cross_mb"]
    assert left_by(done.pid) == []


def link_bench_engines(topology: str):
    import link_bench

    return link_bench.ENGINES[topology].split(",")


@pytest.mark.ci
def test_interrupted_run_leaves_no_namespace():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(BENCH + ["--tiny", "--topologies", "2x1", "--rates", "1", "--steps", "50"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(left_by(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # (the machines are starting their ranks)
        assert proc.poll() is None, "the bench ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert left_by(proc.pid) == []


def test_stale_namespaces_of_a_killed_run_are_removed_by_the_next(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # (a pid that no longer runs)
    stale = f"{netlink.PREFIX}-{dead.pid}-m0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netlink.remove_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert stale not in netlink.namespaces()


def test_refuses_with_what_to_do_without_root_or_tools(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netlink.LinkUnavailable, match="needs root"):
        netlink.EmulatedLink()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    with pytest.raises(netlink.LinkUnavailable, match="iproute2"):
        netlink.EmulatedLink()
