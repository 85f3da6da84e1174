"""Run accelerate DDP reference scripts unmodified, then leave without interpreter teardown.

torch 2.13's gloo process group can deadlock when a DDP ``Reducer`` is garbage-collected at interpreter
exit: the group's destructor joins its worker thread, which waits for the GIL held by the exiting main
thread (seen in CI as one rank of a finished DDP reference run that never exits, py-spy:
``~Reducer -> ~ProcessGroupGloo -> thread::join``).  The tests compare against those runs, so the launch
helper starts them through this file: the script runs as ``__main__`` exactly as ``python script.py``
would, and once it has returned (its files written and closed) the process exits with ``os._exit``.

Several scripts, separated by ``:::`` (``reference_runner.py a.py ARGS ::: b.py ARGS``), run one after the
other in the same launch: the DDP references of the launch tests share one launch, so its imports are paid
once (launch_helpers.ddp_reference).  Between two scripts each starts as it would in a launch of its own:
the environment and ``sys.argv`` are restored and accelerate's ``AcceleratorState`` / ``GradientState``
are cleared; the gloo process group (accelerate's ``PartialState``) is kept for all of them, so a script's
``end_training()`` does not destroy it.  A script that fails does not stop the next ones; each one's
outcome (``ok`` or its traceback) goes to ``$REFERENCE_STATUS_DIR/<index>.rank<RANK>``, and the exit
code is non-zero if any failed.
"""
import gc
import os
import runpy
import sys
import traceback

SEPARATOR = ":::"


def _run(argv):
    """Run one script as ``__main__``; its exit code and, on failure, the traceback."""
    sys.argv = list(argv)
    script_dir = os.path.dirname(os.path.abspath(argv[0]))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, "" if code == 0 else f"SystemExit({exc.code!r})"
    except BaseException:  # noqa: BLE001 - reported, then a non-zero exit like an uncaught exception
        text = traceback.format_exc()
        sys.stderr.write(text)
        return 1, text
    return 0, ""


def _fresh_accelerate_state():
    """What a new launch would have: no AcceleratorState/GradientState; the process group stays."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _keep_process_group():
    """``end_training()`` destroys the default process group; the next script still needs it."""
    from accelerate.state import PartialState

    destroy = PartialState.destroy_process_group

    def destroy_unless_default(self, group=None):
        if group is not None:
            destroy(self, group)

    PartialState.destroy_process_group = destroy_unless_default


def main() -> None:
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == SEPARATOR:
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    status_dir = os.environ.get("REFERENCE_STATUS_DIR")
    if len(runs) > 1:
        _keep_process_group()
    environ = dict(os.environ)
    worst = 0
    for index, argv in enumerate(runs):
        if index:
            os.environ.clear()
            os.environ.update(environ)
            _fresh_accelerate_state()
            gc.collect()
        code, error = _run(argv)
        worst = worst or code
        if status_dir:
            with open(os.path.join(status_dir, f"{index}.rank{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(error or "ok")
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(worst)


if __name__ == "__main__":
    main()
