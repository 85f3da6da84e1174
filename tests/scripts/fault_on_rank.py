"""Run ``examples/resume_on_fault.py`` (or the script ``FAULT_SCRIPT`` names) with a fault injected on its first attempt: rank ``FAULT_RANK`` (default 1)
SIGKILLs itself at ``FAULT`` = ``<point>:<n>`` (tests/test_resume.py):

* ``mid_step:<n>``: in the n-th optimizer step, after its backward (torch's optimizer step pre-hook);
* ``during_write:<n>``: in the background writer of the n-th asynchronous save, after its first part is written;
* ``after_commit:<n>``: once the n-th save's commit marker exists.

Later attempts (``TORCHELASTIC_RESTART_COUNT`` > 0) run the example unchanged.
"""
import os
import runpy
import signal
import sys
import time

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "resume_on_fault.py")


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, n: int) -> None:
    import accelerate  # noqa: F401 - first, as the example imports it (accel_flatshard registers on its import)

    from accel_flatshard.checkpoint import commit
    from accel_flatshard.integrations import fsdp_utils_shim

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
            if counts["saves"] == n:
                first, *rest = parts
                parts = [first, ("the fault", lambda writer: die())] + rest
            return start_save(directory, parts, group, ready, commit_marker, background)

        commit.start_save = start_then_die
    elif point == "after_commit":
        save_state = fsdp_utils_shim.save_state

        def save_then_die(*args, **kwargs):
            location = save_state(*args, **kwargs)
            counts["saves"] += 1
            if counts["saves"] == n:
                while not os.path.exists(os.path.join(location, commit.COMPLETE_FILE)):
                    time.sleep(0.01)
                die()
            return location

        fsdp_utils_shim.save_state = save_then_die
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
