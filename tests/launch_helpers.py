"""Run real ``accelerate launch`` subprocesses (2 CPU processes) for the Accelerate-backend tests.

A launch costs ~10 s of CPU before the script's first line (the launcher and each rank import torch,
transformers and accelerate), so the accelerate-DDP reference runs of all the launch test files share one
launch: a file declares its reference with :func:`ddp_reference` (a module fixture giving the run's output
directory), and the first such fixture used in a session launches, once, the references of every collected
test that needs one (``tests/scripts/reference_runner.py`` runs the scripts one after the other).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"
REFERENCE_RUNNER = SCRIPTS / "reference_runner.py"
PLAIN_SCRIPT = SCRIPTS / "plain_accelerate_train.py"
CPU_FSDP_YAML = REPO / "accelerate_configs" / "cpu_2proc.yaml"
ACCELERATE = Path(sys.executable).parent / "accelerate"

# accelerate's own DDP on CPU: needs use_cpu in the yaml *and* ACCELERATE_USE_CPU in the environment
DDP_CONFIG: Dict[str, Any] = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
    "num_processes": 2, "machine_rank": 0, "mixed_precision": "no", "use_cpu": True,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_config(tmp: Path, name: str = "fsdp.yaml", mixed_precision: Optional[str] = None, **fsdp_overrides: Any) -> Path:
    """accelerate_configs/cpu_2proc.yaml with ``fsdp_config`` keys overridden, written to ``tmp/name``."""
    config = yaml.safe_load(CPU_FSDP_YAML.read_text())
    config["fsdp_config"].update(fsdp_overrides)
    if mixed_precision is not None:
        config["mixed_precision"] = mixed_precision
    path = tmp / name
    path.write_text(yaml.safe_dump(config))
    return path


def ddp_config(tmp: Path) -> Path:
    path = tmp / "ddp.yaml"
    path.write_text(yaml.safe_dump(DDP_CONFIG))
    return path


def launch(
    config: Path,
    script: Path,
    args: Sequence[str] = (),
    *,
    via_run: bool = False,
    env: Optional[Dict[str, str]] = None,
    ddp: bool = False,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file config [-m accel_flatshard.run] script args``; raises with the
    output when it fails (unless ``check=False``)."""
    cmd: List[str] = [str(ACCELERATE), "launch", "--config_file", str(config), "--main_process_port", str(_free_port())]
    if via_run:
        cmd += ["-m", "accel_flatshard.run"]
    elif ddp:
        cmd += [str(REFERENCE_RUNNER)]  # avoids a gloo teardown deadlock, see that file
    cmd += [str(script), *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FLATSHARD_", "ACCELERATE_", "FSDP_"))}
    full_env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    if ddp:
        full_env["ACCELERATE_USE_CPU"] = "true"
    full_env.update(env or {})
    proc = _run_or_dump_stacks(cmd, full_env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def _run_or_dump_stacks(cmd: List[str], env: Dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run``, except that on timeout the ranks (the launcher's leaf processes) first get SIGABRT:
    with ``PYTHONFAULTHANDLER`` each prints the Python stack of every thread to stderr, so the error shows
    where each rank hung, not only that the launch did not finish.  Then every process of the launch is killed."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(env, PYTHONFAULTHANDLER="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        family = psutil.Process(proc.pid).children(recursive=True)
        for child in family:
            if not child.children():
                _signal(child, signal.SIGABRT)
        psutil.wait_procs(family, timeout=5)
        for process in [*family, psutil.Process(proc.pid)]:
            _signal(process, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"launch timed out after {timeout:.0f} s: {' '.join(cmd)}\n--- stdout\n{stdout[-6000:]}"
                             f"\n--- stderr (ends with every rank's stacks at the timeout)\n{stderr[-16000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _signal(process: "psutil.Process", sig: int) -> None:
    try:
        process.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def read_json(path: Path) -> Dict[str, Any]:
    return json.loads(Path(path).read_text())


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- shared DDP reference launches
# name -> (script, its arguments given the run's output directory); filled by ddp_reference at import
REFERENCES: Dict[str, Tuple[Path, Callable[[Path], List[str]]]] = {}


def ddp_reference(name: str, script: Path, args: Callable[[Path], Sequence[str]] = lambda out: ()):
    """Declare the accelerate-DDP reference run ``script args(out)`` and return the module fixture ``name``,
    which gives ``out``, the run's output directory (made before the run).  Assign it to ``name`` in the
    test module.  The run happens in the session's one shared reference launch (``ddp_references``)."""
    if name in REFERENCES:
        raise ValueError(f"a DDP reference named {name!r} is declared twice")
    REFERENCES[name] = (Path(script), lambda out: [str(a) for a in args(out)])

    @pytest.fixture(scope="module", name=name)
    def reference_dir(ddp_references):
        return ddp_references(name)

    return reference_dir


class SharedReferences:
    """The session's DDP reference runs: launched together on first use, the ones ``needed`` by the
    collected tests (or just the one asked for if it is not among them)."""

    def __init__(self, work: Path, needed: Sequence[str]):
        self.work, self.needed = work, [n for n in REFERENCES if n in set(needed)]
        self.outcome: Dict[str, str] = {}
        self.output = ""

    def __call__(self, name: str) -> Path:
        if name not in self.outcome:
            self._launch([name] if name not in self.needed or self.outcome else self.needed)
        if self.outcome[name] != "ok":
            raise AssertionError(f"DDP reference {name!r} failed:\n{self.outcome[name][-8000:]}\n"
                                 f"--- launch output\n{self.output[-6000:]}")
        return self.work / name

    def _launch(self, names: List[str]) -> None:
        status = self.work / f"status_{len(self.outcome)}"
        status.mkdir()
        argv: List[str] = []
        for name in names:
            script, args = REFERENCES[name]
            out = self.work / name
            out.mkdir()
            argv += [":::"] * bool(argv) + [str(script), *args(out)]
        proc = launch(ddp_config(self.work), Path(argv[0]), argv[1:], ddp=True, timeout=240 * len(names),
                      env={"REFERENCE_STATUS_DIR": str(status)}, check=False)
        self.output += proc.stdout[-6000:] + proc.stderr[-8000:]
        for index, name in enumerate(names):
            ranks = [status / f"{index}.rank{r}" for r in range(DDP_CONFIG["num_processes"])]
            texts = [p.read_text() if p.exists() else f"no outcome from {p.name} (launch rc {proc.returncode})"
                     for p in ranks]
            self.outcome[name] = "ok" if all(t == "ok" for t in texts) else "\n".join(t for t in texts if t != "ok")
