"""Run an accelerate DDP reference script unmodified, then leave without interpreter teardown.

torch 2.13's gloo process group can deadlock when a DDP ``Reducer`` is garbage-collected at interpreter
exit: the group's destructor joins its worker thread, which waits for the GIL held by the exiting main
thread (seen in CI as one rank of a finished DDP reference run that never exits, py-spy:
``~Reducer -> ~ProcessGroupGloo -> thread::join``).  The tests compare against those runs, so the launch
helper starts them through this file: the script runs as ``__main__`` exactly as ``python script.py``
would, and once it has returned (its files written and closed) the process exits with ``os._exit``.
"""
import os
import runpy
import sys
import traceback


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported, then a non-zero exit like an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
