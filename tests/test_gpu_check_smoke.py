"""benchmarks/gpu_check.sh, the one command a lent GPU runs, runs here on the CPU so it cannot rot between the
tasks that are lent a GPU: the script itself (parts, timeouts, budget, what comes back) and every part's code
path at tiny size (GPU_CHECK_DEVICE=cpu: gloo and torch's fake process group instead of NCCL).

What comes back from the device machine is at most 8 files of $OUT (16 MiB each) and the output's last 12,000
characters: gpu_check leaves exactly an archive of its logs and a self-contained summary there, and ends its
output with the summary.

The CPU smoke run (~2-4 min on a loaded machine: one process per part) is marked ``ci``: CI runs it, ``make
test`` does not; each part's code is the package's, which the default suite tests directly."""
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ONE_GPU_PARTS = ("nccl-1gpu", "w1", "compile", "overlap", "leak", "planner", "offload-w1", "fake-w8",
                 "offload-fake-w8", "muon")  # run order
PARITY_PARTS = ("nccl-1gpu", "w1", "compile", "offload-w1", "muon")  # each run as is and in slow-GPU mode


def _run_script(tmp_path, **env):
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), OMP_NUM_THREADS="1",
               **env)
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def _verdicts(tmp_path):
    """part -> its verdict line in summary.txt (``== NAME: VERDICT (...)``)."""
    text = (tmp_path / "out" / "summary.txt").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^== (\S+): (.*)$", text, re.M)}


def _part_section(summary: str, part: str) -> str:
    return summary.split(f"== {part}:", 1)[1].split("\n== ", 1)[0]


@pytest.mark.ci
def test_gpu_check_sh_cpu_smoke_passes_and_everything_comes_back(tmp_path):
    proc = _run_script(tmp_path, GPU_CHECK_DEVICE="cpu", PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    # what comes back: at most 8 files of at most 16 MiB; here exactly the archive and the summary
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check_logs.tar.gz", "summary.txt"]
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = set(tar.getnames())
        nccl_log = tar.extractfile("gpu_check/nccl-1gpu.log").read().decode()
    assert {f"gpu_check/{part}.log" for part in ONE_GPU_PARTS} <= names
    assert "gpu_check nccl-1gpu: PASS" in nccl_log
    # the summary is self-contained: every part's verdict and its figures; the output ends with it
    summary = (out / "summary.txt").read_text()
    verdicts = _verdicts(tmp_path)
    for part in ONE_GPU_PARTS:
        assert verdicts[part].startswith("PASS"), (part, verdicts)
    assert verdicts["nccl"].startswith("SKIP")
    assert "max|dloss|" in _part_section(summary, "w1") and "planner" in _part_section(summary, "planner")
    for part in PARITY_PARTS:
        assert "slow" in _part_section(summary, part).lower(), part
    # on CPU the NCCL stream check is reported as skipped, never as passed
    assert "stream check: SKIPPED" in _part_section(summary, "nccl-1gpu")
    assert proc.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1] + "\n" + proc.stdout.rstrip().splitlines()[-1])
    assert summary.strip() in proc.stdout[-12_000:]
    expected = int(re.search(r"expected wall time: at most (\d+) s on the GPU", summary).group(1))
    assert expected <= 9 * 60  # inside the device tool's 600 s command limit, with room for its start


def test_gpu_check_sh_guards_each_part(tmp_path):
    """A failing part and a hanging one (killed at what is left of the budget) do not hide the others'
    verdicts; parts beyond the budget are reported as skipped; the script fails; the archive and summary
    still come back."""
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\n"
                    'case "$*" in\n'
                    '  -c*) echo 1 ;;\n'  # the version line and the GPU count
                    '  *"--part nccl-1gpu"*) echo "gpu_check nccl-1gpu: FAIL"; exit 1 ;;\n'
                    '  *"--part w1"*) exec sleep 60 ;;\n'
                    '  *) echo ok ;;\n'
                    "esac\n")
    stub.chmod(0o755)
    proc = _run_script(tmp_path, PYTHON=str(stub), GPU_CHECK_BUDGET_S="6", GPU_CHECK_MIN_PART_S="2")
    verdicts = _verdicts(tmp_path)
    assert proc.returncode == 1
    assert verdicts["nccl-1gpu"].startswith("FAIL (exit 1)")
    assert verdicts["w1"].startswith("FAIL (timeout after")
    assert all(verdicts[p].startswith("SKIP (budget spent)") for p in ONE_GPU_PARTS[2:]), verdicts
    assert "gpu_check.sh: FAIL" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check_logs.tar.gz", "summary.txt"]
    assert "gpu_check nccl-1gpu: FAIL" in _part_section((tmp_path / "out" / "summary.txt").read_text(), "nccl-1gpu")


def _report():
    spec = importlib.util.spec_from_file_location("gpu_check_report", REPO / "benchmarks" / "gpu_check_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_archive_over_the_limit_leaves_traces_out_and_says_so(tmp_path):
    """A Chrome trace larger than what may come back is left out of the archive (largest first); the logs stay,
    and the summary and LEFT_OUT.txt name what was dropped."""
    report = _report()
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "w1.log").write_text("  parity as is gpt2 max|dloss|=0.00e+00 PASS\ngpu_check w1: PASS\n")
    (work / "overlap_trace.json").write_bytes(os.urandom(3 * 2**20))  # incompressible: 3 MiB in the archive
    (work / "verdicts.tsv").write_text("w1\tPASS\t3\t50\n")
    archive = report.build_archive(work, out / report.ARCHIVE, max_bytes=2**20)
    size, names, left_out = archive
    assert size <= 2**20 and "w1.log" in names and "overlap_trace.json" not in names
    assert "overlap_trace.json" in left_out[0]
    with tarfile.open(out / report.ARCHIVE) as tar:
        assert "overlap_trace.json" in tar.extractfile("gpu_check/LEFT_OUT.txt").read().decode()
    summary = report.summary_text(work, report.read_verdicts(work), "at most 475 s", archive)
    assert "left out: overlap_trace.json" in summary and "== w1: PASS (3 s of a 50 s timeout)" in summary
    assert "max|dloss|=0.00e+00" in summary


# ---------------------------------------------------------------------- the GPU-only analyses, on made-up traces
def _bench(name):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _launch(events, tid, ts, correlation, stream, cat="kernel", name="k"):
    """A host runtime call at ``ts`` and the device work it launched on ``stream``."""
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": ts, "dur": 1,
                   "args": {"correlation": correlation}})
    events.append({"ph": "X", "cat": cat, "name": name, "tid": 99, "ts": ts + 100, "dur": 5,
                   "args": {"correlation": correlation, "stream": stream}})


def _collective_trace(tmp_path, gather_stream, reduce_stream):
    """A matmul on stream 7 (the compute stream), an all-gather and a reduce-scatter on the given streams, each
    launched inside its ``gpu_check::`` range; an unrelated copy outside any range on stream 99."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 10},
              {"ph": "X", "cat": "user_annotation", "name": "gpu_check::all_gather", "tid": 1, "ts": 20, "dur": 10},
              {"ph": "X", "cat": "user_annotation", "name": "gpu_check::reduce_scatter", "tid": 2, "ts": 40, "dur": 10}]
    _launch(events, 1, 2, 1, 7)
    _launch(events, 1, 22, 2, gather_stream, name="ncclDevKernel_AllGather")
    _launch(events, 2, 42, 3, reduce_stream, cat="gpu_memcpy", name="Memcpy DtoD")
    _launch(events, 1, 60, 4, 99, cat="gpu_memcpy")
    path = tmp_path / "trace.json"
    path.write_text(__import__("json").dumps({"traceEvents": events}))
    return str(path)


def test_nccl_stream_check_reads_the_streams_from_the_profiler(tmp_path):
    nccl = _bench("gpu_check_nccl")
    trace = _collective_trace(tmp_path, gather_stream=13, reduce_stream=14)
    assert nccl.observed_streams(trace) == ({"all_gather": {13}, "reduce_scatter": {14}}, 7)
    good, text = nccl.stream_check(trace, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0})
    assert good is True and "compute 7" in text


def test_nccl_stream_check_fails_a_collective_on_the_compute_stream(tmp_path):
    nccl = _bench("gpu_check_nccl")
    trace = _collective_trace(tmp_path, gather_stream=13, reduce_stream=7)
    good, text = nccl.stream_check(trace, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0})
    assert good is False and "ON THE COMPUTE STREAM: ['reduce_scatter']" in text


def test_nccl_stream_check_is_skipped_without_a_trace_never_passed():
    good, text = _bench("gpu_check_nccl").stream_check(None, {"all_gather": 1, "reduce_scatter": 1})
    assert good is None and "SKIPPED" in text


def test_overlap_ceiling_leaves_out_the_first_two_gathers_and_the_last_two_reductions():
    overlap = _bench("gpu_check_overlap")
    step = [("gather", 10), ("gather", 20), ("gather", 30), ("reduce", 30), ("reduce", 20), ("reduce", 10)]
    assert overlap.ceiling([step, step]) == 1 - (10 + 20 + 20 + 10) / 120


def test_overlap_is_measured_against_the_stream_with_the_most_kernel_time(tmp_path):
    """The emulated collectives are device copies and may keep their stream busier than the compute stream."""
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 50, "dur": 200, "args": {"stream": 13}}]
    path = tmp_path / "trace.json"
    path.write_text(__import__("json").dumps({"traceEvents": events}))
    frac, comm_us, busy = _bench("gpu_check_overlap")._trace_overlap(str(path))
    assert frac == 50 / 200 and comm_us == 200 and busy == {7: 100, 13: 200}


def test_nccl_stream_check_falls_back_to_the_nccl_kernels_names(tmp_path):
    """Where the profiler links no launch of a kind to its range (a driver call it does not record), the NCCL
    kernels named after the kind still show their stream."""
    nccl = _bench("gpu_check_nccl")
    trace = _collective_trace(tmp_path, gather_stream=13, reduce_stream=14)
    data = __import__("json").loads(Path(trace).read_text())
    for e in data["traceEvents"]:
        if e.get("cat") == "cuda_runtime" and e["args"]["correlation"] == 2:
            e["args"]["correlation"] = 1002  # the all-gather's launch is not linked to its kernel
    Path(trace).write_text(__import__("json").dumps(data))
    assert nccl.observed_streams(trace) == ({"all_gather": {13}, "reduce_scatter": {14}}, 7)


def test_a_summary_too_long_for_the_output_tail_folds_the_parity_rows_there(tmp_path, capsys, monkeypatch):
    """summary.txt keeps every row; the printed summary (the output's last 12,000 characters come back) folds the
    passing parts' parity rows into a count and keeps their other figures and every failure's detail."""
    report = _report()
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    rows = "".join(f"  parity as is llama setting{i:03d} max|dloss|=0.0e+00 max|dparam|=0.0e+00 {'x' * 250} PASS\n"
                   for i in range(50))
    (work / "w1.log").write_text(rows + "gpu_check w1: PASS\n")
    (work / "fake-w8.log").write_text("  ours : peak 9000 MiB <= bound 9500 MiB: PASS; 800 ms/step\nboom\n")
    (work / "verdicts.tsv").write_text("w1\tPASS\t3\t45\nfake-w8\tFAIL (exit 1)\t9\t55\n")
    monkeypatch.setattr(sys, "argv", ["gpu_check_report.py", "--work", str(work), "--out", str(out),
                                      "--expected", "at most 475 s"])
    assert report.main() == 0
    printed = capsys.readouterr().out
    whole = (out / "summary.txt").read_text()
    assert whole.count("max|dloss|") == 50 and len(whole) > 12_000 and len(printed) <= 12_000
    assert "50 parity rows PASS" in printed and "shortened to fit" in printed
    assert "peak 9000 MiB <= bound 9500 MiB" in printed and "| boom" in printed
