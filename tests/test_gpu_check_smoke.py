"""benchmarks/gpu_check.sh, the one command a lent GPU runs, runs here on the CPU so it cannot rot between the
tasks that are lent a GPU: the script itself (parts, timeouts, budget, summary) and every part's code path at
tiny size (GPU_CHECK_DEVICE=cpu: gloo and torch's fake process group instead of NCCL).

The CPU smoke run (~80 s: one process per part) is marked ``ci``: CI runs it, ``make test`` does not; each
part's code is the package's, which the default suite tests directly."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ONE_GPU_PARTS = ("nccl-1gpu", "w1", "compile", "leak", "planner", "offload-w1", "fake-w8", "offload-fake-w8")  # run order


def _run_script(tmp_path, **env):
    env = dict(os.environ, OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def _summary(tmp_path):
    return {line.split()[0]: line.split(None, 1)[1] for line in (tmp_path / "out" / "summary.txt").read_text().splitlines()}


@pytest.mark.ci
def test_gpu_check_sh_cpu_smoke_passes(tmp_path):
    proc = _run_script(tmp_path, GPU_CHECK_DEVICE="cpu", PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = _summary(tmp_path)
    for part in ONE_GPU_PARTS:
        assert summary[part].startswith("PASS"), (part, summary)
    assert "gpu_check nccl-1gpu: PASS" in proc.stdout and "gpu_check.sh: PASS" in proc.stdout


def test_gpu_check_sh_guards_each_part(tmp_path):
    """A failing part and a hanging one (killed at what is left of the budget) do not hide the others'
    verdicts; parts beyond the budget are reported as skipped; the script fails."""
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
    summary = _summary(tmp_path)
    assert proc.returncode == 1
    assert summary["nccl-1gpu"].startswith("FAIL (exit 1)")
    assert summary["w1"].startswith("FAIL (timeout after")
    assert all(summary[p].startswith("SKIP (budget spent)") for p in ONE_GPU_PARTS[2:]), summary
    assert "gpu_check.sh: FAIL" in proc.stdout
