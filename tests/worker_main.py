"""Run a test worker script as ``__main__``, then leave without the interpreter's C++ teardown.

    python tests/worker_main.py SCRIPT [ARGS...]

``tests/launch.py``'s ``run_script`` starts every worker this way (under torchrun or alone).
When a worker's code returns, it has written its results and destroyed its process groups.
About one launch in forty still died after that, in the interpreter's teardown: "terminate
called without an active exception", a gloo thread still joinable when C++ statics are
destroyed (the class of pytorch/pytorch#190489). It was seen in the DeepSpeed worker and in the
core codecs worker. So a worker that returns (or exits with 0) runs the atexit handlers (the
adapters wait for pending saves there), flushes, and leaves with ``os._exit(0)``. An exception
or a non-zero exit status fails the launch exactly as before. The exit runs what the
interpreter runs, in its order: thread shutdown (where pending saves commit), then atexit.

The script's folder comes first on ``sys.path``, as when it is run directly, and the
repository root after it, so that every worker imports the shared helpers as ``tests.*``
(``tests.checks``: the check recorder and the full-state compare).
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # as when the script is run directly
    if REPO not in sys.path:
        sys.path.insert(1, REPO)  # the shared helpers: tests.checks, tests.hostile_pickle, ...
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    threading._shutdown()  # type: ignore[attr-defined] # as the interpreter does first: pending saves commit
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
