"""benchmarks/gpu_check.py, the one-command GPU check, runs its CPU smoke mode here so it cannot rot
between the tasks that are lent a GPU: the same code paths (W=1 parity over the engine settings, the
emulated W=8 memory bounds on torch's fake process group) at tiny size on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script, part", [("gpu_check.py", "w1"), ("gpu_check.py", "fake-w8"),
                                          ("gpu_check_offload.py", "w1"), ("gpu_check_offload.py", "fake-w8")])
def test_gpu_check_cpu_smoke_passes(script, part, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--device", "cpu",
                           "--part", part, "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    label = "gpu_check offload" if script == "gpu_check_offload.py" else "gpu_check"
    assert f"{label} {part}: PASS" in proc.stdout
