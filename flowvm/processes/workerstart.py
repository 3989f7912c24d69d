"""Why a pool's worker died before it ran anything: the error its start raised.

A worker of a process pool started with forkserver or spawn (the default pool's
methods) imports the main script again before it takes any work: the code of a
script outside ``if __name__ == '__main__':`` runs in every worker, and an error
there kills the worker with status 1, which the pool reports only as a
``BrokenProcessPool``.  ``start_failure(pool)`` tells that case apart (a dead
worker with exit status 1, not a signal) and gives the error with its traceback,
got by importing the main script once more the way a worker does, in a child
process of its own (bounded in time; its output is captured, never shown).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys

DIAGNOSE_TIMEOUT = 60.0  # seconds for importing the main script again to see its error

# Run with `python -c`: import the main script as a worker of a pool does (multiprocessing.spawn.prepare),
# under the name __mp_main__, with the parent's sys.path.
_IMPORT_AS_WORKER = r'''
import json, runpy, sys
how, what, path = json.loads(sys.argv[1])
sys.path[:] = path
if how == "name":
    runpy.run_module(what, run_name="__mp_main__", alter_sys=True)
else:
    runpy.run_path(what, run_name="__mp_main__")
'''


def main_module() -> tuple[str, str] | None:
    """How a spawn or forkserver worker imports the main module: ("name", module) or ("path", file); None
    when it does not import it (python -c, an interactive session, a notebook)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(sys, "frozen", False):
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" else ("name", name)
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None
    from multiprocessing import process

    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)
    return ("path", path) if os.path.exists(path) else None


def start_failure(executor) -> str | None:
    """The error a dead worker of this process pool died of while it started (the main script's import),
    with its traceback; None when no worker exited with status 1 or the main script imports cleanly."""
    if not isinstance(executor, cf.ProcessPoolExecutor):
        return None
    procs = getattr(executor, "_processes", None) or {}
    if not any(getattr(p, "exitcode", None) == 1 for p in list(procs.values())):
        return None
    main = main_module()
    if main is None:
        return None
    from multiprocessing import process

    how, what = main
    try:
        done = subprocess.run([sys.executable, "-c", _IMPORT_AS_WORKER, json.dumps([how, what, sys.path])],
                              capture_output=True, text=True, timeout=DIAGNOSE_TIMEOUT, stdin=subprocess.DEVNULL,
                              cwd=process.ORIGINAL_DIR or None)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0:
        return None
    lines = done.stderr.rstrip().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), 0)
    shown = [line for line in lines[start:] if 'File "<frozen runpy>"' not in line and 'File "<string>"' not in line]
    return "\n".join(shown[-60:])


def start_failure_text(where: str, failure: str, main: tuple[str, str] | None) -> str:
    """The message of a SpawnError for a worker that died while it started."""
    script = main[1] if main is not None else "the main script"
    return (f"a worker process of the {where} failed while starting, before it ran the fragment: a worker "
            f"imports the main script ({script}) again, and that raised:\n{failure}\n"
            "The code of the script outside `if __name__ == '__main__':` runs again in every worker: put the "
            "script's work (what runs programs, and anything that must run once) under that guard.")
