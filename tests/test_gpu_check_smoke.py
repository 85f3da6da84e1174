"""benchmarks/gpu_check.py, the one-command GPU check, runs its CPU smoke mode here so it cannot rot
between the tasks that are lent a GPU: the same code paths (W=1 parity over the engine settings, the
emulated W=8 memory bounds on torch's fake process group) at tiny size on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("part", ["w1", "fake-w8"])
def test_gpu_check_cpu_smoke_passes(part, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--part", part, "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"gpu_check {part}: PASS" in proc.stdout
