"""Bad input gets an error that names the culprit; a dead rank makes the others fail, not hang."""
import os
import signal
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import gpt2, llama
from toy import Block, Toy


def _expect(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors_worker(rank, world_size):
    errors = {}
    errors["fsdp_group_size"] = _expect(lambda: FullyShardedDataParallel(Toy(), fsdp_group_size=3))
    errors["no_block"] = _expect(lambda: transformer_auto_wrap_policy(gpt2(), ["LlamaDecoderLayer"]))
    wrapped = FullyShardedDataParallel(Toy(), auto_wrap_policy=transformer_auto_wrap_policy([Block]))
    errors["ours_twice"] = _expect(lambda: FullyShardedDataParallel(wrapped.module))
    errors["ddp"] = _expect(lambda: FullyShardedDataParallel(DDP(nn.Linear(2, 2))))
    mixed = Toy()
    mixed.head.to(torch.float64)
    errors["devices_dtypes_ok"] = _expect(lambda: FullyShardedDataParallel(mixed))  # dtypes: separate flats
    int_param = Toy()
    int_param.register_parameter("steps", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    errors["int_param"] = _expect(lambda: FullyShardedDataParallel(int_param))
    # a parameter changed behind the engine's back is detected at the next forward
    wrapped.module.head.weight.data = torch.zeros(12)
    errors["changed"] = _expect(lambda: wrapped(torch.ones(2, 12)))
    return errors


def test_bad_input_errors_name_the_culprit():
    errors = spawn(2, _errors_worker)[0]
    assert "fsdp_group_size=3" in errors["fsdp_group_size"] and "divide the world size 2" in errors["fsdp_group_size"]
    assert "LlamaDecoderLayer" in errors["no_block"] and "GPT2Block" in errors["no_block"]
    assert "already wrapped by accel_flatshard" in errors["ours_twice"]
    assert "DistributedDataParallel" in errors["ddp"]
    assert errors["devices_dtypes_ok"] == "no error"
    assert "steps" in errors["int_param"] and "int64" in errors["int_param"]
    assert "head.weight" in errors["changed"] and "behind accel_flatshard's back" in errors["changed"]


def _second_step_after_rank_1(rank, world_size, leave):
    """One step on both ranks, then rank 1 ``leave()``s and rank 0 steps again: (its error, seconds it waited)."""
    model = llama()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    x = torch.randint(0, 100, (2, 8))
    wrapped(x, labels=x).loss.backward()
    if rank == 1:
        leave()
    start = time.monotonic()
    try:
        wrapped(x, labels=x).loss.backward()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


def _dies_mid_step(rank, world_size):
    return _second_step_after_rank_1(rank, world_size, _killed)


def test_a_rank_killed_mid_step_makes_the_survivor_fail_fast_with_context():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(2, _dies_mid_step, timeout_s=20)
    elapsed = time.monotonic() - start
    report = str(info.value)
    # rank 1 has no result (killed); rank 0 returned the error it saw instead of hanging
    assert "rank 1: exited with code -9" in report
    message, waited = info.value.results[0]
    assert "accel_flatshard:" in message and "of unit" in message and "peer rank probably died" in message, message
    assert waited < 20 and elapsed < 60, f"survivor waited {waited:.0f}s, test took {elapsed:.0f}s"


def _silent_exit():
    # rank 1 stays alive, connections open, but sends nothing: what a rank behind a dead link looks like
    time.sleep(12)
    os._exit(0)  # (gone without a word: no teardown collective)


def _stops_answering_mid_step(rank, world_size):
    return _second_step_after_rank_1(rank, world_size, _silent_exit)


@pytest.mark.ci
def test_a_rank_that_stops_answering_fails_its_peer_within_flatshard_timeout_s_naming_its_machine(monkeypatch):
    # gloo's point-to-point waits ignore the group's timeout: the engine bounds them by FLATSHARD_TIMEOUT_S, which
    # also bounds the world group the collectives run on here (the launcher's timeout: 60 s in spawn)
    monkeypatch.setenv("FLATSHARD_TIMEOUT_S", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per machine
    with pytest.raises(RuntimeError) as info:
        spawn(2, _stops_answering_mid_step, timeout_s=60)
    message, waited = info.value.results[0]
    assert "this rank is on machine 0; its peers: machine 1: rank 1)" in message, message
    assert 2.5 < waited < 8, f"waited {waited:.1f} s with FLATSHARD_TIMEOUT_S=3"


def _step_during_backward_worker(rank, world_size):
    wrapped = FullyShardedDataParallel(Toy(), auto_wrap_policy=transformer_auto_wrap_policy([Block]))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.ones(2, 12)
    errors = {}
    # 1. a step from inside backward (e.g. an optimizer-in-backward hook)
    out = wrapped(x)
    hook = out.register_hook(lambda g: opt.step())
    errors["inside"] = _expect(out.backward)
    hook.remove()
    # 2. a backward that raised part-way; stepping on its partial gradients is refused
    errors["after_abort_step"] = _expect(opt.step)
    # 3. the next step starts clean and trains normally
    loss = wrapped(x)
    loss.backward()
    opt.step()
    grads_ok = all(p.grad is not None for p in wrapped.parameters())
    return errors, grads_ok


def test_optimizer_step_with_gradients_of_an_unfinished_backward_is_refused():
    errors, grads_ok = spawn(2, _step_during_backward_worker)[0]
    assert "while a backward of an accel_flatshard model is still running" in errors["inside"]
    assert "backward that did not complete" in errors["after_abort_step"]
    assert grads_ok


def test_illegal_unit_transitions_raise_naming_the_unit_the_states_and_the_hook(world_of_one):
    """Each hook checks its unit's state (unit.py): a reshard while the unit's all-gather is in flight, a wait for
    a gather never issued, a backward inside summon_full_params (the parameters are full tensors there)."""
    from accel_flatshard.core.unit import UnitStateError

    wrapped = FullyShardedDataParallel(Toy(), auto_wrap_policy=transformer_auto_wrap_policy([Block]))
    block = wrapped.units[1]
    block.unshard()
    with pytest.raises(UnitStateError, match=rf"unit {block.name}: reshard in state IDLE/GATHERING: its "
                                             "all-gather is in flight"):
        block.reshard()
    block.release()  # the legal way: wait, then free
    with pytest.raises(UnitStateError, match=rf"unit {block.name}: wait_unshard in state IDLE/SHARDED: "
                                             "no all-gather was issued"):
        block.wait_unshard()
    loss = wrapped(torch.ones(2, 12))
    with wrapped.summon_full_params():
        with pytest.raises(UnitStateError, match=r"unit <root>: pre_backward in state SUMMONED/\w+: "
                                                 r"expected AWAIT_BACKWARD or BACKWARD_DONE or IDLE"):
            loss.backward()
    with pytest.warns(UserWarning, match="previous backward did not complete"):
        loss = wrapped(torch.ones(2, 12))  # the model still trains
    loss.backward()
    assert all(p.grad is not None for p in wrapped.parameters())
