"""The checkpoint commit protocol: crash-consistent checkpoint directories, and the asynchronous save (host
snapshot, background writer).

docs/architecture-details.md section 7 tells both stories: :func:`mark_pending` writes :data:`PENDING_FILE`
first, :func:`commit_when_written` the commit marker :data:`COMPLETE_FILE` last, once every rank's files are written
(then prunes: :func:`prune_checkpoints`, never the newest complete one).  A directory with neither marker (plain
accelerate, older accel_flatshard) is judged by its files; an empty one is incomplete.  While :func:`snapshots` is
open with ``background``, the parts of a save are copied to host memory (:func:`defer_sharded`,
:func:`defer_write`) and written by :func:`start_save`'s background writer.  The callers
(``integrations/state_io.py``: ``save_state``, the four FSDP functions; ``integrations/trainer_trl_peft.py``: the
Trainer's checkpoints) say only what a save holds.
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..core import comm
from ..core.device import HostAdapter
from .atomic import remove_dir, write_json_atomic
from .dcp import Entry, FlatRange
from ..core.state_errors import CheckpointError


logger = logging.getLogger(__name__)

COMPLETE_FILE = "flatshard_complete.json"  # the commit marker, written last
PENDING_FILE = "flatshard_pending.json"  # the parts a save will write, written first
_NUMBERED = re.compile(r"[^.\d]*?(\d+)")  # checkpoint_12 (accelerate), checkpoint-12 (Trainer), step_12, 12


# ---------------------------------------------------------------------- is a directory complete?
def missing_parts(directory: str) -> Optional[List[str]]:
    """None when ``directory`` is a complete checkpoint, else what is missing (see the module docstring)."""
    marker = os.path.join(directory, COMPLETE_FILE)
    manifest = marker if os.path.isfile(marker) else os.path.join(directory, PENDING_FILE)
    if not os.path.isfile(manifest):
        return None if os.listdir(directory) else ["everything (the directory is empty)"]
    try:
        with open(manifest) as f:
            parts = json.load(f)["parts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"a readable {os.path.basename(manifest)} ({type(exc).__name__}: {exc})"]
    # a sharded (DCP) part "name/" is present once renamed in with its flatshard.json
    missing = [p for p in parts
               if not os.path.isfile(os.path.join(directory, p + ("flatshard.json" if p.endswith("/") else "")))]
    if not os.path.isfile(marker):
        missing.append(f"{COMPLETE_FILE} (the commit marker: the save did not finish)")
    return missing or None


def check_complete(directory: str) -> None:
    """Raise :class:`CheckpointError` naming what is missing when ``directory`` is not a complete checkpoint."""
    missing = missing_parts(directory) if os.path.isdir(directory) else None
    if missing:
        parent = os.path.dirname(os.path.abspath(directory))
        raise CheckpointError(
            f"{directory} is an incomplete checkpoint (its save was interrupted); missing: {', '.join(missing)}. "
            f"Load the previous one: accel_flatshard.state.newest_complete_checkpoint({parent!r}) finds it")


def _numbered_dirs(root: str, prefix: str) -> List[str]:
    """The numbered folders of ``root`` whose names start with ``prefix``, oldest (lowest number) first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if name.startswith(prefix)
             and (m := _NUMBERED.fullmatch(name)) and os.path.isdir(os.path.join(root, name))]
    return [path for _, path in sorted(found)]


def newest_complete_checkpoint(root: str, prefix: str = "") -> Optional[str]:
    """The complete checkpoint folder of ``root`` with the highest number (``checkpoint_<n>``,
    ``checkpoint-<n>``, ...; names starting with ``prefix``), skipping incomplete ones (logged); None when there
    is none."""
    for path in reversed(_numbered_dirs(root, prefix)):
        missing = missing_parts(path)
        if missing is None:
            return path
        logger.warning(f"skipping incomplete checkpoint {path} (missing: {', '.join(missing)})")
    return None


def prune_checkpoints(root: str, total_limit: Optional[int], reserve: int = 0, prefix: str = "",
                      protect: Sequence[Optional[str]] = ()) -> List[str]:
    """Delete the oldest numbered folders of ``root`` (names starting with ``prefix``; incomplete ones first)
    until at most ``total_limit - reserve`` remain (``reserve``: folders about to be created), never the newest
    complete one nor those in ``protect`` (the best one): with ``total_limit=1`` the previous checkpoint stays until
    the next one committed.  Returns the deleted paths."""
    if not total_limit or total_limit <= 0:
        return []
    folders = _numbered_dirs(root, prefix)
    keep = {newest_complete_checkpoint(root, prefix)} | {os.path.normpath(p) for p in protect if p}
    # incomplete ones first; the stable sort keeps each kind oldest first
    doomed = [p for p in sorted(folders, key=lambda p: missing_parts(p) is None) if p not in keep]
    deleted = doomed[:max(len(folders) - max(total_limit - reserve, 0), 0)]
    for path in deleted:
        remove_dir(path)
    if deleted:
        logger.warning(f"total_limit {total_limit}: deleted {deleted}")
    return deleted


# ---------------------------------------------------------------------- one save: pending, then committed
# ``acc`` below: the Accelerator (``is_main_process``, ``num_processes``, ``wait_for_everyone()``)
def fresh_numbered_dir(acc: Any, root: str, total_limit: Optional[int], iteration: int) -> str:
    """``root/checkpoint_<iteration>`` made ready for a save (accelerate's ``automatic_checkpoint_naming``): older
    ones pruned to leave room for it (never the newest complete one), an interrupted save's leftovers removed;
    a complete one there raises."""
    if acc.is_main_process:
        prune_checkpoints(root, total_limit, reserve=1)
    output_dir = os.path.join(root, f"checkpoint_{iteration}")
    acc.wait_for_everyone()  # no rank looks while rank 0 still deletes (a half-deleted folder reads complete)
    if os.path.exists(output_dir) and missing_parts(output_dir) is None:
        raise ValueError(
            f"Checkpoint directory {output_dir} ({iteration}) already exists. Please manually override "
            "`self.save_iteration` with what iteration to start with.")
    acc.wait_for_everyone()
    if acc.is_main_process and os.path.exists(output_dir):  # an interrupted save's leftovers
        remove_dir(output_dir)
    return output_dir


def mark_pending(acc: Any, output_dir: str, parts: List[str], step: int) -> Dict[str, Any]:
    """Rank 0 marks ``output_dir`` incomplete (the pending manifest of ``parts``, returned) until
    :func:`commit_when_written` commits it."""
    manifest = {"parts": parts, "step": step, "world_size": acc.num_processes}
    if acc.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        if os.path.exists(os.path.join(output_dir, COMPLETE_FILE)):
            os.remove(os.path.join(output_dir, COMPLETE_FILE))
        write_json_atomic(os.path.join(output_dir, PENDING_FILE), manifest)
    acc.wait_for_everyone()
    return manifest


def commit_when_written(acc: Any, output_dir: str, manifest: Dict[str, Any],
                        writes: Optional[List[Tuple[str, Callable]]], readies: List[Callable[[], None]],
                        prune: Callable[[], Any], shard_size: int) -> None:
    """Rank 0 writes the commit marker (the save's last file, then ``prune()``) once every rank's files are
    written: here, or (``writes`` not None: the parts :func:`snapshots` collected) after the background writer ran
    ``writes`` on a writer group over every rank (``shard_size``: the model's)."""
    def commit_marker() -> None:
        write_json_atomic(os.path.join(output_dir, COMPLETE_FILE), manifest)
        os.remove(os.path.join(output_dir, PENDING_FILE))
        prune()

    if writes is not None:
        writer = writer_group(dist.group.WORLD if acc.num_processes > 1 else None, shard_size)
        start_save(output_dir, writes, writer, lambda: [ready() for ready in readies], commit_marker, True)
        return
    acc.wait_for_everyone()  # every rank's files are written
    if acc.is_main_process:
        commit_marker()
    acc.wait_for_everyone()  # a load (or a copy) right after must see every rank's files and the marker


# (writes, readies) while an asynchronous save runs in this thread (:func:`snapshots`): a context variable, so a
# save running in another thread (another Accelerator) never sees it
SNAPSHOTS: contextvars.ContextVar[Optional[Tuple[List[Tuple[str, Callable]], List[Callable[[], None]]]]] = \
    contextvars.ContextVar("accel_flatshard_snapshots", default=None)


@contextlib.contextmanager
def snapshots(background: bool) -> Iterator[Tuple[Optional[List[Tuple[str, Callable]]], List[Callable[[], None]]]]:
    """``(writes, readies)``: while open and ``background``, the parts of a save are copied to host memory and the
    writer of each goes to ``writes`` (the wait for its copies to ``readies``) instead of writing
    (:func:`defer_sharded`, :func:`defer_write`); ``writes`` is None when not ``background``."""
    writes, readies = ([], []) if background else (None, [])
    token = SNAPSHOTS.set((writes, readies) if background else None)
    try:
        yield writes, readies
    finally:
        SNAPSHOTS.reset(token)


def saving_in_background() -> bool:
    """Whether the parts of a save go to the background writer now (:func:`snapshots`)."""
    return SNAPSHOTS.get() is not None


def defer_write(path: str, write: Callable[[Any], Any]) -> None:
    """Background save: ``write(writer group)`` writes the part at ``path`` (its state is a host copy already)."""
    SNAPSHOTS.get()[0].append((path, write))


def defer_sharded(path: str, live: Dict[str, Entry], adapter: Optional[HostAdapter],
                  write: Callable[[Any, Dict[str, Entry]], Any]) -> None:
    """Background save: ``live`` (this rank's entries of a sharded part) copied to host memory as it is now (on the
    streams of ``adapter``, :func:`snapshot_entries`), ``write(writer group, snapshot)`` writes it later."""
    snapshot, ready = snapshot_entries(live, adapter)
    SNAPSHOTS.get()[1].append(ready)
    logger.info(f"async save: {snapshot_bytes(snapshot) / 2**20:.1f} MiB host snapshot for {path}")
    defer_write(path, lambda writer: write(writer, snapshot))


# ---------------------------------------------------------------------- host snapshot
def snapshot_entries(entries: Dict[str, Entry], adapter: Optional[HostAdapter] = None
                     ) -> Tuple[Dict[str, Entry], Callable[[], None]]:
    """Host copies of ``entries`` as they are now; the returned ``ready()`` blocks until the copies are done
    (immediately without streams).  Later changes to the originals never reach the copies.  ``adapter``: the model's
    device adapter (``FullyShardedDataParallel.schedule.adapter``; None or a host one: plain clones).  With streams
    the copies run on its ``checkpoint`` side stream into pinned buffers: the side stream waits for the compute
    stream, and the compute stream then waits for the copies."""
    out: Dict[str, Entry] = {}
    streams = adapter if adapter is not None and adapter.stream_ordered else None
    if streams is not None:
        side, compute = streams.side_stream("checkpoint"), streams.compute_stream()
        streams.wait_stream(side, compute)  # the copies see every update queued so far
    for key, entry in entries.items():
        tensor = (entry.local if isinstance(entry, FlatRange) else entry).detach()
        if streams is not None:
            host = streams.host_empty(tensor.numel(), tensor.dtype).view(tensor.shape)  # pinned
            with streams.on(side):
                streams.to_host(tensor, host)
            streams.record_stream(tensor, side)
        else:
            host = tensor.clone()
        out[key] = FlatRange(host, entry.start, entry.shape) if isinstance(entry, FlatRange) else host
    event = None
    if streams is not None:
        event = streams.record(side)
        streams.wait_event(compute, event)  # later in-place updates run after the copies

    def ready() -> None:
        if event is not None:
            streams.synchronize(event)

    return out, ready


def snapshot_bytes(entries: Dict[str, Entry]) -> int:
    """Host bytes a snapshot of ``entries`` holds."""
    return sum((e.local if isinstance(e, FlatRange) else e).nbytes for e in entries.values())


# ---------------------------------------------------------------------- the background writer
@dataclass(frozen=True)
class WriterGroup:
    """What ``save_entries`` reads of a group (the attributes it reads of a :class:`ShardGroup`
    too): the writer's own gloo group over every rank, this rank in it, its size, and the model's shard size."""

    world_group: Any
    world_rank: int
    world_size: int
    shard_size: int


# One writer gloo group per world process group, made on first use.  Process-wide on purpose: every model and
# Accelerator of the process shares the world group, and a gloo group costs a rendezvous to make.
_WRITER_GROUPS: Dict[Any, Any] = {}


def writer_group(world: Optional[dist.ProcessGroup], shard_size: int) -> Optional[WriterGroup]:
    """A group for ``save_entries`` whose collectives run on a gloo group of their own over the ranks of
    ``world`` (made on first use: collective, on the main thread), so a background writer never interleaves
    with the training's collectives.  None: one process."""
    if world is None:
        return None
    if world not in _WRITER_GROUPS:
        _WRITER_GROUPS.clear()  # a group of an earlier, destroyed process group is dead
        _WRITER_GROUPS[world] = comm.new_gloo_group(world)
    pg = _WRITER_GROUPS[world]
    return WriterGroup(pg, dist.get_rank(pg), dist.get_world_size(pg), shard_size)


@dataclass
class _Save:
    """One save's writer: its thread (None: it ran on the caller's) and its failure (a message, or None)."""

    thread: Optional[threading.Thread] = None
    error: Optional[str] = None


@dataclass
class _Saves:
    """The background save not yet joined (benchmarks poll ``in_flight``).  Process-wide on purpose: a save of any
    model or Accelerator waits for the one before it (one writer at a time on the disk and the writer group), and
    the exit handler joins whichever is in flight."""

    in_flight: Optional[_Save] = None
    exit_handler: bool = False  # registered by the first background save: importing changes nothing


SAVES = _Saves()


def start_save(directory: str, parts: Sequence[Tuple[str, Callable[[Any], None]]], group: Any,
               ready: Callable[[], None], commit_marker: Callable[[], None], background: bool) -> None:
    """Run every ``write(group)`` of ``parts`` ((what, write) pairs; ``group`` from :func:`writer_group`), then
    gather every rank's outcome over ``group``; when all succeeded, rank 0 calls ``commit_marker()``.
    ``background``: on a thread (the caller returns at once), else here.  Waits for the previous save first."""
    wait_for_saves()
    save = _Save()
    world, rank = (None, 0) if group is None else (group.world_group, group.world_rank)

    def job() -> None:
        status = None
        try:
            if background:
                _lower_priority()
            ready()
            for what, write in parts:
                status = what
                write(group)
            status = None
        except BaseException as exc:  # noqa: BLE001 - reported on every rank, raised by wait_for_saves
            status = f"rank {rank} writing {status}: {type(exc).__name__}: {exc}"
        try:
            failed = [s for _, s in comm.agree_on_failure(world, status)]
        except Exception as exc:  # noqa: BLE001 - a rank died mid-save: its files are not vouched for
            failed = [status or f"rank {rank} gathering every rank's outcome (a rank died?): {type(exc).__name__}: "
                                f"{exc}"]
        if not failed and rank == 0:
            try:
                commit_marker()
            except Exception as exc:  # noqa: BLE001
                failed = [f"rank 0 committing {os.path.join(directory, COMPLETE_FILE)}: {type(exc).__name__}: {exc}"]
        if failed:
            save.error = (f"saving {directory} failed, the checkpoint is incomplete (no {COMPLETE_FILE}): "
                          + "; ".join(failed))

    if background:
        if not SAVES.exit_handler:
            atexit.register(_wait_at_exit)
            SAVES.exit_handler = True
        save.thread = threading.Thread(target=job, name=f"accel_flatshard save {directory}", daemon=True)
        SAVES.in_flight = save
        save.thread.start()
    else:
        job()
        if save.error is not None:
            raise CheckpointError(save.error)


# The background writer's nice value.  When the CPUs are busy it yields them to training: its work (copying,
# checksumming, system calls) then fills the time the training threads leave idle instead of slowing the step it
# overlaps.  10, not 19: a thread that holds the GIL when the scheduler passes it over makes the training thread
# wait for it, and a write that falls far behind delays the next save_state.  Measured: docs/checkpoints.md.
WRITER_NICE = 10


def _lower_priority() -> None:
    """Give the calling (writer) thread :data:`WRITER_NICE`; Linux only, where a thread id names one thread (on
    other systems ``setpriority`` would take it for a process id)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # e.g. a sandbox that forbids it: the save goes on at normal priority
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), WRITER_NICE))


def wait_for_saves() -> None:
    """Wait for the save in flight (if any); raise its failure (every rank raises: outcomes were gathered)."""
    save, SAVES.in_flight = SAVES.in_flight, None
    if save is None or save.thread is None:
        return
    save.thread.join()
    if save.error is not None:
        raise CheckpointError(save.error)


def _wait_at_exit() -> None:
    try:
        wait_for_saves()
    except CheckpointError as exc:  # nobody is left to raise it to: say it loudly
        logger.error(str(exc))
        print(f"accel_flatshard: {exc}", flush=True)
