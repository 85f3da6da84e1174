"""The one completion handle: what a collective, a copy or work that must follow another returns.

A :class:`Handle` is the completion of some work, whatever ran it (gloo's work handles, CUDA events, a host step);
``wait()`` makes what follows safe to read its results.  Its data, each part optional, in the order ``wait()`` uses
them:

* ``issue``: work not issued yet (host work that needs another's result): a function that issues it and returns
  its completion (anything with ``wait()``, or None: done when it returns); :meth:`Handle.start` calls it once
  (``wait()`` too) and its result joins ``works``;
* ``works``: completions to wait for, in order (torch's work handles, other handles); dropped once waited for;
* ``then``: a host step run once, after ``works`` (copying a packed gather out, summing received chunks, a
  dequantization, the second exchange of a two-level reduction);
* ``event`` and ``adapter``: stream-ordered completion (CUDA): ``wait()`` makes the adapter's compute stream wait
  for the event (``to_host``: the host synchronises on it instead, for copies it reads); kept, so every ``wait()``
  orders the compute stream again;
* ``keep``: tensors kept alive until the first ``wait()`` (a collective's input, on the host).

Contract: ``wait()`` returns True, never issues or runs anything twice, and may be called again (a no-op but for the
event); :func:`wait_for` is the engine's wait, naming what failed.  This module imports nothing.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

__all__ = ["DONE", "Handle", "bounded", "followed_by", "issued", "start", "wait_for", "waited"]


class Handle:
    """One completion (see the module docstring for its parts and contract)."""

    __slots__ = ("works", "then", "issue", "event", "adapter", "to_host", "keep")

    def __init__(self, works: Iterable[Any] = (), then: Optional[Callable[[], Any]] = None,
                 issue: Optional[Callable[[], Any]] = None, event: Any = None, adapter: Any = None,
                 to_host: bool = False, keep: Any = None) -> None:
        self.works, self.then, self.issue = [w for w in works if w is not None], then, issue
        self.event, self.adapter, self.to_host, self.keep = event, adapter, to_host, keep

    @property
    def issued(self) -> bool:
        """Whether its work was issued (work that waits for another's is issued by :meth:`start`)."""
        return self.issue is None

    def start(self) -> None:
        """Issue the work now if it waited for another's; work issued already is left alone."""
        if self.issue is not None:
            # (the closure is dropped once run: it may hold the pending reduction that holds this handle, a cycle
            # that would keep the reduced shard alive until the garbage collector ran)
            issue, self.issue = self.issue, None
            work = issue()
            if work is not None:
                self.works.append(work)

    def wait(self) -> bool:
        self.start()
        for work in self.works:
            work.wait()
        self.works, self.keep = [], None
        if self.then is not None:
            step, self.then = self.then, None
            step()
        if self.event is not None:
            if self.to_host:
                self.adapter.synchronize(self.event)
            else:
                self.adapter.compute_stream().wait_event(self.event)
        return True


DONE = Handle()  # work that already finished: a synchronous call, a group of one


def start(handle: Any) -> None:
    """:meth:`Handle.start` of ``handle`` (None, or any other completion: issued already)."""
    if isinstance(handle, Handle):
        handle.start()


def issued(handle: Any) -> bool:
    """Whether ``handle`` stands for work that was issued (None: no work)."""
    return handle is not None and (not isinstance(handle, Handle) or handle.issued)


def followed_by(work: Any, step: Callable[[], Any], async_op: bool) -> Handle:
    """``work`` followed by the host step ``step``: at once after a synchronous call (on the collective's stream),
    else when the handle is waited for."""
    if not async_op:
        work.wait()
        step()
        return DONE
    return Handle([work], then=step)


def waited(handle: Handle, async_op: bool) -> Handle:
    """``handle``, waited for already when the call is synchronous."""
    if not async_op:
        handle.wait()
    return handle


class bounded:
    """``work`` (a torch work handle) whose ``wait()`` raises once ``timeout`` (a ``timedelta``) has passed."""

    __slots__ = ("work", "timeout")

    def __init__(self, work: Any, timeout: Any) -> None:
        self.work, self.timeout = work, timeout

    def wait(self) -> bool:
        return self.work.wait(self.timeout)


def wait_for(handle: Any, what: str, group: Any) -> None:
    """Wait for ``handle``; if its collective fails (a peer died, the timeout expired) say which one it was (``what``,
    on ``group``: its ``world_rank``, ``world_size``, ``shard_size`` and ``peers``, the ranks it waits for by
    machine)."""
    try:
        handle.wait()
    except ValueError:  # (the data, not the collective: a non-finite weight under quantized_all_gather)
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(
            f"accel_flatshard: {what} failed on rank {group.world_rank} of {group.world_size} "
            f"(shard group size {group.shard_size}; {getattr(group, 'peers', 'peers unknown')}). A peer rank "
            f"probably died or stopped participating, its machine went off the network, or the process-group "
            f"timeout (FLATSHARD_TIMEOUT_S) expired. Original error: {exc}"
        ) from exc
