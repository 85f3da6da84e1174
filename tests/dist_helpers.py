"""Spawn N gloo ranks running one function; collect rank results.  Keeps multi-process tests short.

The ranks are forked from one multiprocessing *forkserver* per test session, which has imported torch,
transformers (the two model families of tests/models.py) and accelerate once (``_PRELOAD``): a rank starts
in well under a second instead of paying ~6 s of CPU for those imports.  Each ``spawn`` still gets brand-new
processes, and accel_flatshard itself is imported fresh in each (its import-time work, e.g. the patch table,
and its lazy imports happen per rank as in a plain process).  The environment is the caller's at the time of
``spawn``: it is sent along, not inherited from the server."""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import tempfile
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver (a name that fails to import is skipped by multiprocessing).
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.llama.modeling_llama", "accelerate", "torch.distributed.checkpoint"]
_CONTEXT = None


def _context():
    """The forkserver context, its preload list set before the server first starts."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
        atexit.register(_stop_forkserver)
    return _CONTEXT


def _stop_forkserver() -> None:
    """Stop and reap the server at exit (multiprocessing leaves it to exit on its own), so that it and the ranks
    it forked count in the session's child CPU time (``/usr/bin/time``, ``os.times``)."""
    from multiprocessing import forkserver

    try:
        forkserver._forkserver._stop()  # private, but the one way to wait for the server
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result_dir: str, timeout_s: float,
            environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world_size: int, fn: Callable, *args: Any, timeout_s: float = 120.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled).  A failure on any rank raises with that
    rank's traceback.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        port = _free_port()
        ctx = _context()
        environ = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, result_dir, timeout_s, environ))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + 60)
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors, by_rank = [], [], {}
        for r in range(world_size):
            path = os.path.join(result_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result")
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results.append(payload["result"])
                by_rank[r] = payload["result"]
            else:
                errors.append(f"rank {r}:\n{payload['error']}")
        if errors:
            failure = RuntimeError("distributed test failed\n" + "\n".join(errors))
            failure.results = by_rank  # what the surviving ranks returned
            raise failure
        return results


def trainer_run_and_resume(make_trainer: Callable[[str], Any], root: str) -> tuple:
    """In a rank: ``make_trainer(output_dir)`` (a ``transformers.Trainer`` that checkpoints at step 4) trained to its
    end, then a fresh one resumed from that checkpoint.  Returns (losses by step, the resumed run's losses by step,
    whether the Trainer's model was accel_flatshard's wrapper)."""
    def run(out: str, resume: Any = None) -> tuple:
        trainer = make_trainer(out)
        trainer.train(resume_from_checkpoint=resume)
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        sharded = type(trainer.model).__name__ == "FullyShardedDataParallel"
        trainer.accelerator.wait_for_everyone()
        return losses, sharded

    losses, sharded = run(os.path.join(root, "run"))
    resumed, _ = run(os.path.join(root, "resumed"), os.path.join(root, "run", "checkpoint-4"))
    return losses, resumed, sharded


def trainer_args(out: str, world: int, **overrides: Any) -> Any:
    """The tests' ``TrainingArguments``: 6 steps of a global batch of 8 on CPU, a checkpoint at step 4, a loss logged
    every step, no reporting, seeded."""
    import transformers

    kwargs = dict(output_dir=out, max_steps=6, per_device_train_batch_size=8 // world, lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="steps", save_steps=4, report_to=[], seed=0, data_seed=0,
                  disable_tqdm=True, use_cpu=True, dataloader_drop_last=True)
    return transformers.TrainingArguments(**{**kwargs, **overrides})

