"""One key space per torchelastic attempt: the process groups of a restarted attempt never read the keys (a dead
peer's gloo address) of the attempt before.  :func:`scoping_store_per_attempt` wraps torch's ``env://`` rendezvous
handler (the patch table's ``elastic_attempt_store``); :func:`agree_on_attempt`
is the store protocol that names an attempt.
"""
from __future__ import annotations

import datetime
import functools
import time
import uuid
from typing import Any, Callable, Iterator, Tuple

import torch.distributed as dist

from .options import env_flag


# torchelastic's agent keeps one TCPStore for the whole job (the static rendezvous, accelerate's yaml default, and
# the c10d one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and since torch 2.5 the workers' env:// store has no
# per-attempt prefix (torch/distributed/rendezvous.py, _create_c10d_store).  The process groups of a restarted
# attempt then find the keys of the attempt before: a rank that reads its dead peer's gloo address fails
# ("connectFullMesh ... Connection refused") or waits for a connection that never comes (30 min by default).
_ATTEMPT_KEYS = "accel_flatshard/attempt/"
_WELCOME_POLL_S = (0.01, 0.5)  # first and longest pause of a rank waiting for rank 0's answer


def scoping_store_per_attempt(env_handler: Callable[..., Iterator[Tuple[Any, int, int]]]) -> Callable:
    """torch's ``env://`` rendezvous handler (``init_process_group``'s default), made to give each attempt of a
    torchelastic job a store prefix of its own when the workers share the agent's store (the patch table's
    ``elastic_attempt_store``); any other launch gets torch's store unchanged."""

    @functools.wraps(env_handler)
    def handler(url: str, **kwargs: Any) -> Iterator[Tuple[Any, int, int]]:
        for store, rank, world_size in env_handler(url, **kwargs):
            if env_flag("TORCHELASTIC_USE_AGENT_STORE"):
                timeout = kwargs.get("timeout") or datetime.timedelta(minutes=30)
                store = dist.PrefixStore(f"/worker/attempt_{agree_on_attempt(store, rank, world_size, timeout)}",
                                         store)
            yield store, rank, world_size

    return handler


def agree_on_attempt(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A name for this attempt that all its ``world_size`` ranks agree on, through ``store``, which keeps the keys
    of earlier attempts.  Rank 0 names it; each other rank learns it by a token of its own, so a key left by an
    earlier attempt is never taken for this one's (torchelastic's restart count could serve as the name only on
    one node: an agent restarted for another node's failure keeps its count).  Raises after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    arrived = [f"{_ATTEMPT_KEYS}arrived/{r}" for r in range(1, world_size)]
    welcome = [f"{_ATTEMPT_KEYS}welcome/{r}" for r in range(1, world_size)]
    if rank == 0:
        name = uuid.uuid4().hex
        for key in arrived:  # an earlier attempt's: whatever is there after this was written by this attempt
            store.delete_key(key)
        if arrived:
            try:
                store.wait(arrived, timeout)
            except RuntimeError as e:  # (torch's DistStoreError)
                missing = [r for r, key in enumerate(arrived, 1) if not store.check([key])]
                raise RuntimeError(f"accel_flatshard: rank(s) {missing} of this torchelastic attempt did not reach "
                                   f"init_process_group within {timeout} ({e})") from e
            tokens = store.multi_get(arrived)
            store.multi_set(welcome, [token + b" " + name.encode() for token in tokens])
        return name
    token, pause = uuid.uuid4().hex, _WELCOME_POLL_S[0]
    while True:
        # written again each time round: rank 0 deletes what it finds before it starts waiting
        store.set(arrived[rank - 1], token)
        if store.check([welcome[rank - 1]]):
            theirs, _, name = store.get(welcome[rank - 1]).decode().partition(" ")
            if theirs == token:
                return name
        if time.monotonic() > deadline:
            raise RuntimeError(f"accel_flatshard: rank 0 of this torchelastic attempt did not reach "
                               f"init_process_group within {timeout} (rank {rank} waited for it)")
        time.sleep(pause)
        pause = min(pause * 1.5, _WELCOME_POLL_S[1])
