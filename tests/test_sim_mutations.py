"""Breaks of the CUDA schedule that are not ordering calls, kept by hand next to the derived table.

tests/sim_table.py derives its rows from the code (every stream wait, event, record_stream, copy and
engine wait, removed or moved to the compute stream).  What it cannot derive is listed here: a swapped
divide factor, a loop bound, a stream's priority or role, a placement, a buffer reused, two calls in
swapped order, the stream a buffer is allocated on.  Each row is
(file, exact original text, replacement, the tests of ``tests_file`` (``-k``) that must fail); it is
applied to a copy of the package and run like a derived row (``sim_table.run_mutation``).  The original
text must be in today's source, so a refactor that moves or rewrites a line is reported here rather than
silently turning a row into a no-op.  All rows run with the derived table (``python tests/sim_table.py``).
"""
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent


class Mutation(NamedTuple):
    name: str
    file: str  # relative to accel_flatshard/
    original: str  # exact text, one line (two for a swap of order)
    replacement: str
    tests: tuple  # ``-k`` expressions of tests in ``tests_file`` expected to fail
    tests_file: str = "tests/test_streams.py"


MUTATIONS = [
    Mutation("pre- and post-divide swapped", "core/engine.py",
             "        self.predivide = float(gradient_predivide_factor(self.group.world_size))\n",
             "        self.predivide = self.group.world_size / float(gradient_predivide_factor(self.group.world_size))\n",
             ("fp16_gradients and 8",)),
    Mutation("fp16 pre-divide left out", "core/engine.py",
             "                full.div_(predivide)\n", "                pass\n", ("fp16_gradients",)),
    Mutation("pending-reduction bound lifted", "core/engine.py",
             "        while len(self._reduces) >= MAX_PENDING_REDUCTIONS:\n", "        while False:\n",
             ("at_most_n_full_gradients",)),
    Mutation("side streams without high priority", "core/device.py",
             "            self._side[role] = self.api.Stream(device=self.device, priority=HIGH_PRIORITY)\n",
             "            self._side[role] = self.api.Stream(device=self.device)\n", ("side_streams_have_high",)),
    Mutation("replica all-reduce on the reduce-scatter stream", "core/engine.py",
             '        self.replica_stream = streams.side_stream("replica_all_reduce") if self.can_defer_cross_machine else None\n',
             '        self.replica_stream = streams.side_stream("reduce_scatter") if self.can_defer_cross_machine else None\n',
             ("replica_all_reduce_runs",)),
    Mutation("streams of the current device, not the model's", "core/device.py",
             "        return self.api.current_stream(self.device)\n", "        return self.api.current_stream()\n",
             ("models_device_are_used",)),
    Mutation("inputs not moved to the model's device", "core/schedule.py",
             "        args, kwargs = self.engine.streams.move_inputs(args, kwargs)",
             "        pass", ("inputs_are_moved",)),
    Mutation("record_stream after the storage was resized to 0 (order swap)", "core/device.py",
             "        self.record_stream(flat.unsharded, compute)\n        self.release(flat)\n",
             "        self.release(flat)\n        self.record_stream(flat.unsharded, compute)\n",
             ("trains_exactly_like_the_plain_model",)),
    Mutation("gathered buffer allocated on the compute stream (allocation stream)", "core/engine.py",
             "            with s.on(self.all_gather_stream):\n                for flat in flats:\n",
             "            if True:\n                for flat in flats:\n",
             ("trains_exactly_like_the_plain_model",)),
    Mutation("clip coefficient copied to the host gradients without waiting (device -> host)", "core/grad_norm.py",
             "            coef_on[key] = clip_coef.to(device=g.device, dtype=g.dtype)\n",
             "            coef_on[key] = clip_coef.to(device=g.device, dtype=g.dtype, non_blocking=True)\n",
             ("clip_grad_norm and offload",), "tests/test_sim_paths.py"),
    Mutation("full state dict copied to the host without waiting (device -> host)", "core/model_state.py",
             '    return t.to("cpu", copy=True) if cpu_offload else t.clone()\n',
             '    return t.to("cpu", copy=True, non_blocking=True) if cpu_offload else t.clone()\n',
             ("save_pretrained and offload-get_state_dict",), "tests/test_sim_paths.py"),
    Mutation("sharded checkpoint chunk copied to the host without waiting (device -> host)", "state/dcp.py",
             "                tensor = planner.resolve_data(item).detach().cpu()\n",
             '                tensor = planner.resolve_data(item).detach().to("cpu", non_blocking=True)\n',
             ("checkpoint and plain-sharded",), "tests/test_sim_paths.py"),
    Mutation("events the host synchronises on spin (torch's default, not blocking)", "core/device.py",
             "        event = self.api.Event(blocking=True)\n", "        event = self.api.Event()\n",
             ("synchronises_only_on_blocking_events",)),
    Mutation("offload: shard left on the device", "core/offload.py",
             "        flat.local_shard = self._host_empty(flat.layout.shard_numel, flat.dtype).zero_()\n",
             "        pass\n", ("trains_exactly_like_the_plain_model_with_nothing",), "tests/test_offload_sim.py"),
    Mutation("offload: a new pinned gradient buffer every step", "core/offload.py",
             "        if flat.sharded_grad is None:\n", "        if True:\n", ("pinned_buffers_are_reused",),
             "tests/test_offload_sim.py"),
]


def apply(mutation: Mutation, source: str) -> str:
    """``source`` with the row applied; raises if the original text is not there exactly once."""
    if source.count(mutation.original) != 1:
        raise LookupError(f"mutation {mutation.name!r}: the original text is not (exactly once) in "
                          f"accel_flatshard/{mutation.file}; the code moved: update tests/test_sim_mutations.py\n"
                          f"{mutation.original}")
    return source.replace(mutation.original, mutation.replacement)


def test_every_row_applies_to_todays_source():
    for mutation in MUTATIONS:
        source = (REPO / "accel_flatshard" / mutation.file).read_text()
        compile(apply(mutation, source), mutation.file, "exec")
        assert (REPO / mutation.tests_file).exists()
