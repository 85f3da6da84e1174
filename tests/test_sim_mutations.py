"""The simulated-CUDA tests keep their teeth: each single-line break of the CUDA schedule must fail them.

Every mutation is (file, exact original text, replacement).  It is applied to a *copy* of the package in
a temporary directory, and the tests that should catch it run there in a subprocess (``PYTHONPATH`` set to
the copy first); they must fail.  The original text must exist in today's source, so a refactor that
moves or rewrites a line is reported here rather than silently turning a mutation into a no-op.

One representative mutation runs by default; the whole table is ``slow``.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
STREAMS_TESTS = str(REPO / "tests" / "test_streams.py")


class Mutation(NamedTuple):
    name: str
    file: str  # relative to accel_flatshard/
    original: str  # exact text, one line (two for a swap of order)
    replacement: str
    tests: tuple  # test ids of tests/test_streams.py (``-k`` expressions) expected to fail


MUTATIONS = [
    # --- issue 17's five survivors
    Mutation("a: all-gather stream does not wait for the optimizer at step start", "engine.py",
             "        self.streams.wait_stream(self.all_gather_stream, self.streams.compute_stream())\n",
             "        pass\n", ("trains_exactly_like",)),
    Mutation("b: reduce-scatter stream does not wait for backward's gradient", "engine.py",
             "            s.wait_stream(self.reduce_scatter_stream, s.compute_stream())\n",
             "            pass\n", ("trains_exactly_like",)),
    Mutation("c: reduce-scatter output used on the compute stream without record_stream", "engine.py",
             "            self.streams.record_stream(r.shard_out, compute)\n",
             "            pass\n", ("trains_exactly_like",)),
    Mutation("d: pre- and post-divide swapped", "engine.py",
             "        self.predivide = float(gradient_predivide_factor(group.world_size))\n",
             "        self.predivide = group.world_size / float(gradient_predivide_factor(group.world_size))\n",
             ("fp16_gradients and 8",)),
    Mutation("e: collective's completion event recorded before the collective is issued", "streams.py",
             "            issue(False)\n            return _EventWait(self, self.record(stream))\n",
             "            done = self.record(stream)\n            issue(False)\n            return _EventWait(self, done)\n",
             ("trains_exactly_like",)),
    # --- the nine caught before the simulator tracked writes
    Mutation("record_stream of freed gathers", "engine.py",
             "        s.record_stream(flat.unsharded, compute)\n", "        pass\n", ("trains_exactly_like",)),
    Mutation("all-gather rate limit", "engine.py",
             "        self._wait_for_freed_buffers()\n", "        pass\n", ("limit_all_gathers_bounds",)),
    Mutation("fp16 pre-divide", "engine.py",
             "                full.div_(self.predivide)\n", "                pass\n", ("fp16_gradients",)),
    Mutation("pending-reduction bound", "engine.py",
             "        while len(self._reduces) >= self.max_pending_reductions:\n", "        while False:\n",
             ("at_most_n_full_gradients",)),
    Mutation("side-stream priority", "streams.py",
             "            self._side[role] = self.api.Stream(device=self.device, priority=HIGH_PRIORITY)\n",
             "            self._side[role] = self.api.Stream(device=self.device)\n", ("side_streams_have_high",)),
    Mutation("compute stream waits for the gather", "streams.py",
             "        self.streams.compute_stream().wait_event(self.event)\n", "        pass\n",
             ("trains_exactly_like",)),
    Mutation("replica all-reduce on its own stream", "engine.py",
             '        self.replica_stream = self.streams.side_stream("replica_all_reduce") if group.is_hybrid else None\n',
             '        self.replica_stream = self.streams.side_stream("reduce_scatter") if group.is_hybrid else None\n',
             ("replica_all_reduce_runs",)),
    Mutation("streams of the model's device", "streams.py",
             "        return self.api.current_stream(self.device)\n", "        return self.api.current_stream()\n",
             ("models_device_are_used",)),
    Mutation("inputs moved to the model's device", "fully_sharded.py",
             "        args, kwargs = self.engine.streams.move_inputs(args, kwargs)",
             "        pass", ("inputs_are_moved",)),
]

REPRESENTATIVE = "e: collective's completion event recorded before the collective is issued"


def _run_mutated(mutation: Mutation, tmp_path: Path, tests_file: str = STREAMS_TESTS) -> subprocess.CompletedProcess:
    package = tmp_path / "accel_flatshard"
    shutil.copytree(REPO / "accel_flatshard", package, ignore=shutil.ignore_patterns("__pycache__"))
    target = package / mutation.file
    source = target.read_text()
    assert source.count(mutation.original) == 1, (
        f"mutation {mutation.name!r}: the original text is not (exactly once) in accel_flatshard/{mutation.file}; "
        f"the code moved: update tests/test_sim_mutations.py\n{mutation.original}")
    target.write_text(source.replace(mutation.original, mutation.replacement))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "tests")]))
    # the copy is imported, not the checkout: run from the temporary directory
    check = ("import accel_flatshard, sys; from pathlib import Path; "
             f"sys.exit(0 if Path(accel_flatshard.__file__).parent == Path({str(package)!r}) else 3)")
    probe = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, timeout=300)
    assert probe.returncode == 0, "the mutated copy is not the package the subprocess imports"
    expression = " or ".join(f"({k})" for k in mutation.tests)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
         str(tests_file), "-k", expression],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _expect_caught(mutation: Mutation, tmp_path: Path, tests_file: str = STREAMS_TESTS) -> None:
    """``tests_file``: the test module whose ``mutation.tests`` must fail (other modules reuse this runner)."""
    result = _run_mutated(mutation, tmp_path, tests_file)
    tail = (result.stdout + result.stderr)[-3000:]
    assert result.returncode == 1 and " failed" in tail, (
        f"mutation {mutation.name!r} survived the simulated-CUDA tests (-k {mutation.tests}):\n{tail}")


def test_the_representative_mutation_is_caught(tmp_path):
    (mutation,) = [m for m in MUTATIONS if m.name == REPRESENTATIVE]
    _expect_caught(mutation, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.name != REPRESENTATIVE], ids=lambda m: m.name.split(":")[0])
def test_every_mutation_is_caught(mutation, tmp_path):
    _expect_caught(mutation, tmp_path)
