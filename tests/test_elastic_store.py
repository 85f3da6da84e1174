"""Process groups of a torchelastic restart get a key space of their own (elastic.scoping_store_per_attempt).

torchelastic's agent keeps one TCPStore for the whole job (static rendezvous, c10d's shared store), and torch's
env:// store has no per-attempt prefix: without the patch, a restarted rank can read its dead peer's gloo address
(tests/test_resume.py launches the real thing; here a TCPStore of the test process plays the agent's, so the
order of the ranks can be forced).
"""
from __future__ import annotations

import datetime
import os
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

from accel_flatshard.core import elastic
from accel_flatshard.integrations import patches
from dist_helpers import _context

TIMEOUT = datetime.timedelta(seconds=20)


def _agent_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def _agree_in_threads(port: int, ranks, world_size: int, names: dict, timeout=TIMEOUT) -> list:
    def run(rank):
        try:
            names[rank] = elastic.agree_on_attempt(_client(port), rank, world_size, timeout)
        except RuntimeError as e:
            names[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    return threads


def test_each_attempt_gets_a_name_all_its_ranks_agree_on_whatever_the_earlier_attempts_left():
    agent = _agent_store()
    first: dict = {}
    for t in _agree_in_threads(agent.port, range(3), 3, first):
        t.join(30)
    assert len(set(first.values())) == 1 and isinstance(first[0], str), first
    # the next attempt: ranks 1 and 2 come first and find the first attempt's keys; they wait for rank 0
    second: dict = {}
    early = _agree_in_threads(agent.port, [1, 2], 3, second)
    time.sleep(0.5)
    assert second == {}, second  # nobody took the earlier attempt's name
    for t in [*early, *_agree_in_threads(agent.port, [0], 3, second)]:
        t.join(30)
    assert len(set(second.values())) == 1 and second[0] != first[0], (first, second)


def test_a_rank_that_never_comes_is_an_error_naming_it_after_the_timeout():
    agent = _agent_store()
    short = datetime.timedelta(seconds=0.5)
    alone: dict = {}
    for t in _agree_in_threads(agent.port, [0], 3, alone, short):
        t.join(30)
    assert "rank(s) [1, 2] of this torchelastic attempt did not reach init_process_group" in str(alone[0])
    for t in _agree_in_threads(agent.port, [2], 3, alone, short):
        t.join(30)
    assert "rank 0 of this torchelastic attempt did not reach init_process_group" in str(alone[2])


def _attempt_rank(rank: int, port: int, restart_count: int, delay_s: float, result_dir: str) -> None:
    """One worker of an attempt, set up as torchelastic's agent sets up its workers (env:// on the agent's store)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(restart_count))
    patches.install("process_group")
    time.sleep(delay_s)
    try:
        dist.init_process_group("gloo", timeout=TIMEOUT)
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        result = total.item()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = repr(e)
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))


def _attempt(port: int, restart_counts, delays) -> list:
    with tempfile.TemporaryDirectory() as result_dir:
        procs = [_context().Process(target=_attempt_rank, args=(r, port, restart_counts[r], delays[r], result_dir))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt")) if os.path.exists(
            os.path.join(result_dir, f"rank{r}.pt")) else "no result" for r in range(2)]


def test_a_restarted_attempt_never_connects_to_the_address_its_dead_peer_left_in_the_agents_store():
    agent = _agent_store()
    assert _attempt(agent.port, (0, 0), (0, 0)) == [3.0, 3.0]
    # one rank comes late: the other finds only the earlier attempt's keys of it (without the patch, one such
    # restart in three failed here: "Gloo connectFullMesh failed ... timed out connecting", the late rank hung).
    # The restart counts differ, as on an agent restarted for another node's failure (they name nothing here)
    for late in (0, 1, 0):
        assert _attempt(agent.port, (1, 0), (1.0 * (late == 0), 1.0 * (late == 1))) == [3.0, 3.0], late


@pytest.mark.parametrize("use_agent_store", ["False", None])
def test_other_launches_get_torchs_store_unchanged(monkeypatch, use_agent_store):
    seen = []

    def env_handler(url, **kwargs):
        seen.append((url, kwargs))
        yield "torch's store", 0, 1

    if use_agent_store is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", use_agent_store)
    handler = elastic.scoping_store_per_attempt(env_handler)
    assert next(handler("env://", timeout=TIMEOUT)) == ("torch's store", 0, 1)
    assert seen == [("env://", {"timeout": TIMEOUT})]
