"""Run ``examples/resume_on_fault.py`` (or the script ``FAULT_SCRIPT`` names) with a fault injected on its first attempt: rank ``FAULT_RANK`` (default 1)
SIGKILLs itself at ``FAULT`` = ``<point>:<n>`` (tests/test_resume.py):

* ``mid_step:<n>``: in the n-th optimizer step, after its backward (torch's optimizer step pre-hook);
* ``during_write:<n>``: in the background writer of the n-th asynchronous save, after its first part is written;
* ``after_commit:<n>``: once the n-th asynchronous save's commit marker exists (a thread watches for it).

Later attempts (``TORCHELASTIC_RESTART_COUNT`` > 0) run the example unchanged, and every process leaves the way
the example does (the abort at interpreter exit that about one launch in thirty saw before is comm's pause at exit,
tests/test_exit.py).
"""
import os
import runpy
import signal
import sys
import threading
import time

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "resume_on_fault.py")


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def die_once_exists(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.005)
    die()


def install(point: str, n: int) -> None:
    import accelerate  # noqa: F401 - first, as the example imports it (accel_flatshard registers on its import)

    from accel_flatshard.state import commit

    counts = {"steps": 0, "saves": 0}
    if point == "mid_step":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def pre_step(optimizer, args, kwargs):
            counts["steps"] += 1
            if counts["steps"] == n:
                die()

        register_optimizer_step_pre_hook(pre_step)
    elif point == "during_write":
        start_save = commit.start_save

        def start_then_die(directory, parts, group, ready, commit_marker, background):
            counts["saves"] += 1
            print(f"save {counts['saves']} writes in the background: {[what for what, _ in parts]}", flush=True)
            if counts["saves"] == n:
                first, *rest = parts
                parts = [first, ("the fault", lambda writer: die())] + rest
            return start_save(directory, parts, group, ready, commit_marker, background)

        commit.start_save = start_then_die
    elif point == "after_commit":  # (asynchronous saves: a watcher thread sees rank 0's marker appear)
        start_save = commit.start_save

        def start_then_watch(directory, parts, group, ready, commit_marker, background):
            counts["saves"] += 1
            if counts["saves"] == n:
                threading.Thread(target=die_once_exists, args=(os.path.join(directory, commit.COMPLETE_FILE),),
                                 daemon=True).start()
            return start_save(directory, parts, group, ready, commit_marker, background)

        commit.start_save = start_then_watch
    else:
        raise ValueError(f"FAULT={point}:{n}: unknown point")


if __name__ == "__main__":
    fault = os.environ.get("FAULT")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if fault and first_attempt and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1"):
        point, n = fault.split(":")
        install(point, int(n))
    script = os.environ.get("FAULT_SCRIPT", EXAMPLE)
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")
