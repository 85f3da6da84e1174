"""``make docs-figures`` (issue 47): makes docs/figures/step_timeline.png, plan.png and bench.png again from real
runs on this machine, and docs/figures/figures.json: for each figure the commands that made it and the git commit
(``git rev-parse --short HEAD``, "+dirty" when the tree had changes) it was made at.

* step_timeline.png: a small Llama (from its config) trained 6 steps at W=2 under ``accelerate launch`` with
  accelerate_configs/cpu_2proc.yaml and ``FLATSHARD_PROFILE``; of the profiled steps, the one whose slowest rank
  was fastest, drawn by tools/step_timeline.py;
* plan.png: ``accel-flatshard plan --plot`` on the README's model (``make example``'s GPT-2 config, batch 8 x 128,
  cpu_2proc.yaml) with ``--measured``: the same step under ``accelerate launch`` measured on each rank by torch's
  MemTracker (tests/scripts/plan_measure.py ``--curve``);
* bench.png: benchmarks/bench_plot.py over benchmarks/bench.py ``--json``: by default bench.py run here at its small
  rows with few steps (:data:`BENCH_ARGS`, named in the figure's title), or ``--bench-json FILE`` (a full ``make
  bench``'s output, e.g. ``bench.py --json FILE``) read as it is.

    .venv/bin/python tools/docs_figures.py [--only timeline,plan,bench] [--bench-json FILE] [--out docs/figures]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
YAML = "accelerate_configs/cpu_2proc.yaml"
TIMELINE_ARGS = ["--layers", "4", "--hidden", "256", "--vocab", "4096", "--batch", "4", "--seq", "128",
                 "--steps", "6"]  # (profiled: steps 2 to 6, the first a warm-up; FLATSHARD_PROFILE_EVERY=6)
BENCH_ARGS = ["--rows", "llama-5M,llama-40M", "--engines", "ddp,fsdp1,fsdp2,nocomm", "--ours", "ours",
              "--compile-rows", "", "--muon-rows", "", "--steps", "4", "--warmup", "1"]
TARGET_BYTES = 150_000  # the target size of one PNG


def _run(cmd: List[str], log: List[str], env: Optional[Dict[str, str]] = None, tmp: str = "") -> None:
    """Run ``cmd`` in the repository (its output to this one's), recording it in ``log`` (the temporary directory
    written as $TMP)."""
    shown = " ".join(shlex.quote(os.path.relpath(c, REPO) if c.startswith(str(BIN)) else c) for c in cmd)
    extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    line = ((extra + " ") if extra else "") + shown
    log.append(line.replace(tmp, "$TMP") if tmp else line)
    print(f"[docs-figures] {log[-1]}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, **(env or {})})


def _rel(path: Path) -> str:
    return os.path.relpath(path, REPO)


def timeline(out: Path, tmp: str) -> List[str]:
    log: List[str] = []
    traces = os.path.join(tmp, "traces")
    run_json = os.path.join(tmp, "timeline_run.json")
    _run([str(BIN / "accelerate"), "launch", "--config_file", YAML, "tools/step_timeline.py", "--train",
          *TIMELINE_ARGS, "--run-json", run_json], log,
         env={"FLATSHARD_PROFILE": traces, "FLATSHARD_PROFILE_EVERY": "6"}, tmp=tmp)
    with open(run_json) as f:
        r = json.load(f)
    title = (f"accel_flatshard step timeline: Llama {r['layers']} layers x {r['hidden']} hidden "
             f"({r['params'] / 1e6:.1f} M parameters), W={r['world_size']}, batch {r['batch']} x {r['seq']} tokens "
             f"per rank\nCPU, gloo (streams: the async work handles); torch.profiler (FLATSHARD_PROFILE): {{step}} "
             f"of 5 profiled, the least disturbed (load average {os.getloadavg()[0]:.1f} after the run); each rank "
             "from its step start")
    _run([sys.executable, "tools/step_timeline.py", "--trace-dir", traces, "--out", _rel(out / "step_timeline.png"),
          "--title", title], log, tmp=tmp)
    return log


def plan(out: Path, tmp: str) -> List[str]:
    log: List[str] = []
    model = os.path.join(tmp, "model")
    _run([sys.executable, "-c", "import sys; sys.path.insert(0, 'examples'); import train_causal_lm; "
          f"train_causal_lm.build_model('gpt2-tiny', 257, 128).config.save_pretrained({model!r})"], log, tmp=tmp)
    measured = os.path.join(tmp, "measured.json")
    _run([str(BIN / "accelerate"), "launch", "--config_file", YAML, "tests/scripts/plan_measure.py", "--model", model,
          "--out", measured, "--curve"], log, tmp=tmp)
    _run([str(BIN / "accel-flatshard"), "plan", "--model", model, "--config_file", YAML, "--batch_size", "8",
          "--seq_len", "128", "--device", "cpu", "--plot", _rel(out / "plan.png"), "--measured", measured], log,
         tmp=tmp)
    return log


def bench(out: Path, tmp: str, bench_json: Optional[str]) -> List[str]:
    log: List[str] = []
    title = None
    if bench_json is None:
        bench_json = os.path.join(tmp, "bench.json")
        load = os.getloadavg()[0]
        _run([sys.executable, "benchmarks/bench.py", *BENCH_ARGS, "--json", bench_json], log, tmp=tmp)
        title = ("make bench's engines at its small rows, few steps (bench.py " + " ".join(
            shlex.quote(a) for a in BENCH_ARGS) + f"), W=2 CPU gloo, batch 2 x 128 per rank; a shared "
            f"{os.cpu_count()}-core host, load average {load:.1f} at the start")
    _run([sys.executable, "benchmarks/bench_plot.py", bench_json, _rel(out / "bench.png")] +
         (["--title", title] if title else []), log, tmp=tmp)
    return log


def _commit(out: Path) -> str:
    """HEAD, "+dirty" if a tracked file other than the figures themselves has changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{_rel(out)}"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="timeline,plan,bench", help="comma list of timeline, plan, bench")
    p.add_argument("--bench-json", default=None, help="draw bench.png from this bench.py --json output (no run)")
    p.add_argument("--out", default="docs/figures")
    args = p.parse_args(argv)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    commit = _commit(out)
    record_path = out / "figures.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    makers = {"timeline": ("step_timeline.png", lambda tmp: timeline(out, tmp)),
              "plan": ("plan.png", lambda tmp: plan(out, tmp)),
              "bench": ("bench.png", lambda tmp: bench(out, tmp, args.bench_json))}
    for name in [n for n in args.only.split(",") if n]:
        png, make = makers[name]
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"docs_figures_{name}_") as tmp:
            commands = make(tmp)
        size = (out / png).stat().st_size
        record[png] = {"commands": commands, "commit": commit, "made": datetime.datetime.now(
            datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "seconds": round(time.monotonic() - start),
            "bytes": size}
        print(f"[docs-figures] {png}: {size:,} bytes in {record[png]['seconds']} s"
              + (f" (over the {TARGET_BYTES:,}-byte target)" if size > TARGET_BYTES else ""), flush=True)
        record_path.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")  # (after each figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
