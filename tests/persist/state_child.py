"""Run in a fresh interpreter by test_state.py: build programs again from code, load state files into them,
finish them, and write what they produced.

    python state_child.py SPEC.json OUT.pickle

SPEC: {"jobs": [{"file": ..., "build": "module:function", "options": {...}, "control": bool}], "warm": job or null,
"audit": bool}.  With "audit", after the warm-up job (which does the first imports), an audit hook records
what loading each file does that it must never do: unpickle (pickle.find_class), import a module not yet
imported, compile or exec code, start a process, load a library (a "control" job unpickles and imports
something after loading, to show that the hook sees it).
"""

import importlib
import os
import pickle
import sys
import traceback

WATCHED = ("pickle.find_class", "import", "exec", "compile", "os.system", "subprocess.Popen", "os.exec",
           "os.posix_spawn", "os.spawn", "os.fork", "ctypes.dlopen", "builtins.input", "open")


def build(job):
    module, _, name = job["build"].partition(":")
    return getattr(importlib.import_module(module), name)(**job.get("options", {}))


def run(job, events):
    import flowvm
    from flowvm.testing import outcome

    program = build(job)  # the program is the user's code: built before the audit window opens
    try:
        events.clear()
        events.append(None)  # recording
        try:
            module = importlib.import_module(job["build"].partition(":")[0])
            classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
            drv = flowvm.load_state(job["file"], program, classes=classes)  # as the command does
            if job.get("control"):  # what the hook sees when something is unpickled and imported
                pickle.loads(pickle.dumps(__import__("collections").OrderedDict()))
                importlib.import_module("tabnanny")  # not imported before: its code runs (exec)
        finally:
            events.remove(None)
        seen = list(events)
        drv.run()
        return {"outcome": outcome(drv), "loaded_events": seen}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(),
                "loaded_events": [e for e in events if e is not None]}


def main(argv):
    import json

    spec_path, out = argv
    with open(spec_path) as f:
        spec = json.load(f)
    events: list = []
    if spec.get("warm"):
        run(spec["warm"], events)
    if spec.get("audit"):
        def hook(event, args):
            if None in events and (event in WATCHED or event.startswith("os.exec")):
                if event == "open" and args and isinstance(args[0], str) and not args[0].endswith(".py"):
                    return  # reading the state file itself
                if event == "import" and args and args[0] in sys.modules:
                    return  # an import statement of a module already imported (no code runs)
                events.append((event, repr(args)[:200]))
        sys.addaudithook(hook)
    results = [run(job, events) for job in spec["jobs"]]
    from state_programs import Pickler

    with open(out, "wb") as f:
        Pickler(f).dump(results)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # state_programs, progen, toy
    main(sys.argv[1:])
