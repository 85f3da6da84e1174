"""The public paths on the simulated CUDA schedule at W=2: real gloo collectives issued the CUDA way.

Two gloo ranks run the scenarios of tests/test_sim_paths.py (generation in each mode, summons, the TRL
seam, state dicts, FULL and SHARDED checkpoints, clipping, ``no_sync``, activation checkpointing, a read
from outside a unit, a frozen reference kept gathered, the issue-22 cases), sharded over both ranks or
hybrid (two replicas of one-rank shard groups), with and without offload.  Every rank runs each scenario
unsimulated and simulated: the results must be equal and the simulated schedule free of violations.
Training is also compared with one process (every rank feeds the same batch, so the W=2 average is the
single-process step).  One launch for all of it; ``slow`` (CI runs it with the mutation table, .ci/run).
"""
import functools

import pytest
import torch

import test_sim_paths as paths
from dist_helpers import spawn

pytestmark = pytest.mark.slow

SCENARIOS = [  # (name, scenario, variants, model keyword arguments)
    ("train", paths.train, ["plain", "hybrid", "offload", "hybrid-offload"], {}),
    ("generate full", functools.partial(paths.generate_after_step, mode="full"), ["plain", "offload"], {}),
    ("generate budget-partial", functools.partial(paths.generate_after_step, mode="budget-partial"), ["plain"],
     {"make": lambda: paths.llama(n_layer=3)}),
    ("generate per_unit", functools.partial(paths.generate_after_step, mode="per_unit"), ["hybrid"], {}),
    ("TRL seam full", functools.partial(paths.trl_seam, mode="full"), ["plain"], {"make": lambda: paths.llama(n_layer=3)}),
    ("TRL seam per_unit", functools.partial(paths.trl_seam, mode="per_unit"), ["offload"],
     {"make": lambda: paths.llama(n_layer=3)}),
    ("summon writeback", functools.partial(paths.summon, how="writeback"), ["plain", "offload"], {}),
    ("summon no-writeback", functools.partial(paths.summon, how="no-writeback"), ["hybrid"], {}),
    ("summon bf16-inside", functools.partial(paths.summon, how="bf16-inside"), ["plain"], {}),
    ("state dicts", paths.state_dicts, ["plain", "offload"], {}),
    ("checkpoint full", functools.partial(paths.checkpoint, kind="full"), ["plain", "hybrid"], {}),
    ("checkpoint sharded", functools.partial(paths.checkpoint, kind="sharded"), ["plain", "offload"], {}),
    ("clip_grad_norm_", paths.clip, ["plain", "hybrid"], {}),
    ("no_sync", paths.no_sync, ["hybrid", "offload"], {}),
    ("activation checkpointing", functools.partial(paths.activation_checkpointing, how="non-reentrant"),
     ["plain", "hybrid-offload"], {}),
    ("activation checkpointing whole-stack", functools.partial(paths.activation_checkpointing, how="whole-stack"),
     ["hybrid"], {}),
    ("forward skipping a unit", functools.partial(paths.skipped_unit, then="load_state_dict"), ["plain"],
     paths.SKIPPABLE_MODEL),
    ("outside read", functools.partial(paths.outside_read, nograd_between=True), ["plain", "hybrid"],
     paths.OUTSIDE_READ_MODEL),
    ("write between forward and backward", functools.partial(paths.write_between_forward_and_backward,
                                                             write="load_full_state_dict"), ["plain", "offload"], {}),
    ("host write after an eval forward", functools.partial(paths.host_write_after_forward, before="eval-forward",
                                                           then="load_state_dict"), ["offload"], {}),
    ("backward that raised", paths.raised_backward, ["plain", "hybrid"], {"make": lambda: paths.llama(n_layer=3)}),
    ("outside read, root kept", functools.partial(paths.outside_read, nograd_between=True, keep_root=True),
     ["offload"], paths.OUTSIDE_READ_MODEL),
]


def _worker(rank, world_size, tmp):
    torch.set_num_threads(1)
    assert paths.wrap("hybrid").shard_group.is_hybrid and not paths.wrap("plain").shard_group.is_hybrid
    results = []
    for name, scenario, variants, kwargs in SCENARIOS:
        for variant in variants:
            got, expected, violations = paths.run_both(variant, scenario, f"{tmp}/{name}-{variant}", **kwargs)
            try:
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
                mismatch = None
            except AssertionError as e:
                mismatch = str(e)[:400]
            results.append((name, variant, violations[:4], mismatch, got if name == "train" else None))
    for variant in ("plain", "offload"):
        got, expected, violations = paths.run_frozen_reference(variant)
        mismatch = None if all(torch.equal(a, b) for a, b in zip(got, expected)) else "frozen reference differs"
        results.append(("frozen reference kept gathered", variant, violations[:4], mismatch, None))
    return results


def test_every_public_path_at_w2_matches_the_unsimulated_run_and_one_process(tmp_path):
    single = _single_process_training()
    failures = []
    for rank, results in enumerate(spawn(2, _worker, str(tmp_path), timeout_s=900)):
        assert len(results) == sum(len(variants) for _, _, variants, _ in SCENARIOS) + 2
        for name, variant, violations, mismatch, losses in results:
            if violations:
                failures.append(f"rank {rank} {name} [{variant}]: {violations}")
            if mismatch:
                failures.append(f"rank {rank} {name} [{variant}] differs from the unsimulated run: {mismatch}")
            if losses is not None and not torch.allclose(torch.stack(losses), torch.stack(single), atol=1e-5):
                failures.append(f"rank {rank} {name} [{variant}]: {losses} vs one process {single}")
    assert not failures, "\n".join(failures)


def _single_process_training():
    """:func:`test_sim_paths.train` on the plain model in this process (every rank feeds the same batches)."""
    model = paths.llama(n_layer=2)
    return paths.train(model, None)
