"""Helpers for testing flowvm programs: run them several ways and compare.

``assert_same_run(build)`` is the differential test every program should pass:
the registers, result and step count are the same whether the program runs
straight through or is stopped at step k, copied (pickle, cloudpickle,
deepcopy or a checkpoint) and resumed.
"""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any, Callable, Iterable

import cloudpickle

from .persist.checkpoint import dumps as checkpoint_dumps
from .persist.checkpoint import loads as checkpoint_loads
from .machine.driver import Driver
from .program.elements import Element
from .base.environment import apply_random, capture_random

COPIERS: dict[str, Callable[[Driver], Driver]] = {
    "pickle": lambda d: pickle.loads(pickle.dumps(d)),
    "cloudpickle": lambda d: pickle.loads(cloudpickle.dumps(d)),
    "deepcopy": copy.deepcopy,
    "checkpoint": lambda d: checkpoint_loads(checkpoint_dumps(d)),
}


def same(a: Any, b: Any) -> bool:
    """Exact equality that also understands numpy arrays and torch tensors (bit for bit, NaNs equal), and
    plain objects without an ``__eq__`` of their own (by their attributes)."""
    array = _same_arrays(a, b)
    if array is not None:
        return array
    if isinstance(a, (list, tuple, dict)):
        return _same_items(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if type(a) is type(b) and type(a).__eq__ is object.__eq__:
        return a is b or _same_object(a, b)
    return type(a) is type(b) and a == b


def _same_object(a: Any, b: Any) -> bool:
    """same(a, b) for two objects of one class without an ``__eq__`` of its own: a module or an optimizer by
    its state, a plain object by its attributes, a loop's iterator by what is left of it, a value that says
    how it is rebuilt by that; else by identity."""
    if callable(getattr(a, "state_dict", None)):
        return same(a.state_dict(), b.state_dict())
    if _plain_object(a):
        return same(vars(a), vars(b))
    state = iterator_state(a)
    if state is not None:
        return same(state, iterator_state(b))
    if "__reduce__" in vars(type(a)):
        return same(a.__reduce__()[1:], b.__reduce__()[1:])
    return False


def iterator_state(value: Any) -> tuple | None:
    """A built-in iterator (a list's, a range's, ...) as plain data: what is left of the sequence it runs over
    (from its pickle reduction: an exhausted one and one at the end of its list are the same); None for
    anything else."""
    kind = type(value)
    if kind.__module__ != "builtins" or not kind.__name__.endswith("iterator"):
        return None
    reduced = value.__reduce__()
    if len(reduced) < 2 or not isinstance(reduced[1], tuple) or len(reduced[1]) != 1:
        return (kind.__name__, reduced[1:])
    seq, pos = reduced[1][0], reduced[2] if len(reduced) > 2 else 0
    if isinstance(seq, range):  # what is left of it, however the range was written
        rest = seq[pos:]
        return ("range", len(rest), rest.start if rest else None, rest.step)
    try:
        return (kind.__name__, list(seq[pos:]))  # what is left: an exhausted iterator reduces to an empty list
    except TypeError:
        return (kind.__name__, reduced[1:])


def _same_items(a: list | tuple | dict, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _plain_object(a: Any) -> bool:
    """An object without an ``__eq__`` of its own, compared by its attributes."""
    return type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__") and not isinstance(a, type) \
        and not callable(a)


def _same_arrays(a: Any, b: Any) -> bool | None:
    """same(a, b) when a is a tensor or a numpy array or scalar; None for anything else."""
    import sys

    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if torch.equal(a, b):
            return True
        return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else False
    if np is not None and isinstance(a, (np.ndarray, np.generic)):
        return (isinstance(b, (np.ndarray, np.generic)) and np.shape(a) == np.shape(b)
                and np.asarray(a).dtype == np.asarray(b).dtype
                and np.array_equal(a, b, equal_nan=np.asarray(a).dtype.kind in "fc"))
    return None


def outcome(driver: Driver) -> dict:
    """What a finished run produced: result, step count and a copy of the registers."""
    return {"result": driver.result, "steps": driver.steps, "registers": dict(driver.registers)}


def diff(expected: dict, got: dict, steps: bool = True) -> list[str]:
    """What differs between two outcomes (empty when they are the same); steps=False ignores step counts."""
    problems = []
    if not same(expected["result"], got["result"]):
        problems.append(f"result {got['result']!r:.80} != {expected['result']!r:.80}")
    if steps and expected["steps"] != got["steps"]:
        problems.append(f"steps {got['steps']} != {expected['steps']}")
    er, gr = expected["registers"], got["registers"]
    for name in sorted(set(er) | set(gr)):
        if name not in gr or name not in er or not same(er[name], gr[name]):
            problems.append(f"register {name!r}: {gr.get(name, '<missing>')!r:.80} != {er.get(name, '<missing>')!r:.80}")
    return problems


def assert_same_run(build: Callable[[], Element], cuts: Iterable[int] | None = None,
                    copiers: Iterable[str] = tuple(COPIERS), seed: int = 0, steps: bool | None = None) -> dict:
    """Check that stopping at step k, copying and resuming changes nothing.

    ``build`` returns a fresh program (with fresh registers and seeded random
    generators) each time it is called.  The copy goes on after the global generators were moved
    elsewhere, as in a fresh process: it must set the states it was copied with itself.  The original
    goes on from the states it reached at step k.  ``cuts`` defaults to a few step counts
    spread over the run.  Step counts are compared too, unless ``steps=False``
    or (by default) the program holds leaves that poll work running elsewhere
    (POPEN, SPAWN), whose step counts depend on timing.  Returns the
    uninterrupted outcome.
    """
    program = build()
    if steps is None:
        from .program.paths import walk

        steps = not any(el.polls for _, el in walk(program))
    reference = program.start()
    reference.run()
    expected = outcome(reference)
    again = build().start()
    again.run()
    problems = diff(expected, outcome(again), steps)
    if problems:
        raise AssertionError("two uninterrupted runs of build() differ, so resumed runs cannot be compared: "
                             "seed the global random generators inside build() (random.seed, "
                             "numpy.random.seed, torch.manual_seed) and keep its CALLs deterministic:\n  "
                             + "\n  ".join(problems))
    total = expected["steps"]
    if cuts is None:
        rng = random.Random(seed)
        cuts = sorted({0, total, *(rng.randint(0, total) for _ in range(3))})
    for k in cuts:
        for name in copiers:
            original = build().start()
            original.run(max_steps=k)
            at_k = capture_random()
            clone = COPIERS[name](original)
            for who, drv in (("copy", clone), ("original", original)):
                if who == "copy":
                    _scramble_random()  # as in another process: the copy sets its own states
                else:
                    apply_random(at_k)
                drv.run()
                problems = diff(expected, outcome(drv), steps)
                if problems:
                    raise AssertionError(f"the {who} resumed after {k} steps via {name} differs from an "
                                         f"uninterrupted run:\n  " + "\n  ".join(problems))
    return expected


def _scramble_random() -> None:
    """Move every global generator to a state unrelated to the run's."""
    import sys

    random.seed(0x5EED)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(0x5EED)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0x5EED)


def digest(value: Any) -> str:
    """A SHA-256 of value's exact contents: equal digests mean equal values bit for bit (floats by their
    bits, arrays and tensors by dtype, shape and bytes), whatever process or machine computed them.
    Takes None, bools, numbers, strings, bytes, numpy arrays and scalars, torch tensors, lists, tuples
    and dicts of these (a Registers file too), and objects (by class name) through their ``state_dict()``
    or, lacking one, their attributes (a fitted model)."""
    import hashlib

    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    import struct

    if value is None or isinstance(value, (bool, int, str)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, float):
        h.update(b"float:" + struct.pack(">d", value))
    elif isinstance(value, (bytes, bytearray)):
        h.update(f"bytes:{len(value)}:".encode() + bytes(value))
    elif not _feed_array(h, value):
        _feed_container(h, value)


def _feed_array(h, value: Any) -> bool:
    """Feed a tensor or a numpy array or scalar; False for anything else."""
    import sys

    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode() + raw.numpy().tobytes())
    elif np is not None and isinstance(value, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(value)
        if a.dtype.hasobject:
            h.update(f"objects:{a.shape}:".encode())
            for item in a.ravel():
                _feed(h, item)
        else:
            h.update(f"array:{a.dtype.str}:{a.shape}:".encode() + a.tobytes())
    else:
        return False
    return True


def _feed_container(h, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}:{len(value)}[".encode())
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(value, dict):
        h.update(f"dict:{len(value)}{{".encode())
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b"}")
    elif iterator_state(value) is not None:
        h.update(f"iterator:{type(value).__name__}:".encode())
        _feed(h, iterator_state(value))
    elif "__reduce__" in vars(type(value)) and not isinstance(value, type):  # a value that says how it is rebuilt
        h.update(f"reduced:{type(value).__qualname__}:".encode())
        _feed(h, value.__reduce__()[1:])
    elif callable(getattr(value, "state_dict", None)):
        h.update(f"object:{type(value).__qualname__}:state_dict".encode())
        _feed(h, value.state_dict())
    elif hasattr(value, "__dict__") and not callable(value) and not isinstance(value, type):
        h.update(f"object:{type(value).__qualname__}:".encode())
        _feed(h, vars(value))
    else:
        raise TypeError(f"digest: cannot digest a {type(value).__name__}; give it numbers, strings, arrays, "
                        "tensors, lists, tuples and dicts of these, or objects with state_dict() or plain "
                        "attributes of these")


# ------------------------------------------------------------------ resume in fresh processes
# check_resume(build): the differential test of resume across processes.  A copy of the run cut at step k
# is made in this process (pickle, cloudpickle, flowvm.save, a state file, deepcopy) and finished in a
# FRESH interpreter whose environment differs from this one (torch imported before the load or only by the
# program itself, another torch thread count, another working directory and PYTHONHASHSEED); the finished
# run's registers, result and step count are compared with the uninterrupted run's through digest().

#: the copy paths check_resume knows: each writes the cut driver to a file (or, for deepcopy, keeps it here)
RESUME_COPIERS = ("pickle", "cloudpickle", "checkpoint", "state", "deepcopy")
#: the environments check_resume knows (see ``_environment``)
ENVIRONMENTS = ("torch-before", "torch-lazy", "threads", "same-process")


def _copy_error() -> type:
    from .base import errors

    return getattr(errors, "CopyError", type("NoCopyError", (Exception,), {}))


def value_digest(value: Any) -> str:
    """digest(value), or for a value digest() does not take, a SHA-256 of its pickle (a list iterator, an
    object without plain attributes), or its type's name as the last resort."""
    import hashlib

    try:
        return digest(value)
    except Exception:  # noqa: BLE001 - anything digest() refuses
        pass
    try:
        return "pickle:" + hashlib.sha256(pickle.dumps(value)).hexdigest()
    except Exception:  # noqa: BLE001
        return f"type:{type(value).__module__}.{type(value).__qualname__}"


def fingerprint(driver: Driver) -> dict:
    """A finished (or stopped) run as plain data: step count, whether done, digests of the result and of
    every register, and a short text of each for messages.  Comparable across processes."""
    regs = dict(driver.registers)
    return {"steps": driver.steps, "done": driver.done, "result": value_digest(driver.result),
            "registers": {k: value_digest(v) for k, v in regs.items()},
            "shown": {k: _short(v) for k, v in regs.items()} | {"<result>": _short(driver.result)}}


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= 100 else text[:97] + "..."


def fingerprint_diff(expected: dict, got: dict, steps: bool = True) -> list[str]:
    """What differs between two fingerprints (empty when the runs are the same bit for bit)."""
    problems = []
    if not got.get("done", True):
        problems.append(f"not finished after {got['steps']} steps (the uninterrupted run took {expected['steps']})")
    if steps and expected["steps"] != got["steps"]:
        problems.append(f"steps {got['steps']} != {expected['steps']}")
    if expected["result"] != got["result"]:
        problems.append(f"result {got['shown'].get('<result>')} != {expected['shown'].get('<result>')}")
    er, gr = expected["registers"], got["registers"]
    for name in sorted(set(er) | set(gr)):
        if er.get(name) != gr.get(name):
            problems.append(f"register {name!r}: {got['shown'].get(name, '<missing>')} != "
                            f"{expected['shown'].get(name, '<missing>')}")
    return problems


class _ProcessState:
    """The global generators and torch's result-changing settings of this process, put back on exit: a
    check runs programs that change them."""

    def __enter__(self):
        import sys

        self.random = _capture_all_random()
        torch = sys.modules.get("torch")
        self.torch = None if torch is None else _torch_settings(torch)
        return self

    def __exit__(self, *exc):
        import sys

        _set_all_random(self.random)
        torch = sys.modules.get("torch")
        if torch is not None:
            _set_torch_settings(torch, self.torch or _DEFAULT_TORCH)
        return False


_DEFAULT_TORCH = {"dtype": "float32", "deterministic": False, "precision": "highest", "threads": None}


def _torch_settings(torch) -> dict:
    return {"dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "precision": torch.get_float32_matmul_precision(), "threads": torch.get_num_threads()}


def _set_torch_settings(torch, s: dict) -> None:
    torch.set_default_dtype(getattr(torch, s["dtype"]))
    torch.use_deterministic_algorithms(s["deterministic"])
    torch.set_float32_matmul_precision(s["precision"])
    if s["threads"]:
        torch.set_num_threads(s["threads"])


def _capture_all_random() -> dict:
    import sys

    state = {"random": random.getstate()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if "torch" in sys.modules:
        state["torch"] = sys.modules["torch"].get_rng_state()
    return state


def _set_all_random(state: dict) -> None:
    import sys

    random.setstate(state["random"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "torch" in state and "torch" in sys.modules:
        sys.modules["torch"].set_rng_state(state["torch"])


def _environment(name: str, rng: random.Random) -> dict:
    """An environment to resume in, as plain data: where torch is imported ('before' the load, or 'lazy':
    only by the program itself, or by the load when the copy holds tensors), torch's thread count set
    before the load (threads), PYTHONHASHSEED, and whether it is this process ('same-process': generators
    scrambled and torch's settings changed before the copy goes on)."""
    env = {"name": name, "torch": "before", "threads": None, "hashseed": rng.randint(1, 2**31),
           "fresh": name != "same-process"}
    if name == "torch-lazy":
        env["torch"] = "lazy"
    elif name == "threads":
        env["threads"] = rng.choice([1, 2, 3])
    elif name != "torch-before" and name != "same-process":
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(ENVIRONMENTS)}")
    return env


def describe_environment(env: dict) -> str:
    if not env.get("fresh", True):
        return "this process (generators scrambled, torch settings changed)"
    if env.get("torch") == "cli":
        return (f"the flowvm command ({env['name']}: run with --max-steps, then resume in another working "
                f"directory), PYTHONHASHSEED={env['hashseed']}")
    parts = [f"torch imported {'before the load' if env['torch'] == 'before' else 'only by the program (lazily)'}"]
    if env.get("threads"):
        parts.append(f"torch threads {env['threads']} before the load")
    parts.append(f"PYTHONHASHSEED={env['hashseed']}")
    parts.append("a fresh working directory")
    return ", ".join(parts)


def make_copy(driver: Driver, how: str, path: str) -> Any:
    """Copy driver by one of RESUME_COPIERS: writes path (or returns the deep copy); raises what the copy
    raises (CopyError where the run cannot be copied exactly)."""
    if how == "pickle":
        data = pickle.dumps(driver)
    elif how == "cloudpickle":
        data = cloudpickle.dumps(driver)
    elif how == "checkpoint":
        from .persist.checkpoint import save

        save(driver, path)
        return path
    elif how == "state":
        from .persist.state import save_state

        save_state(driver, path)
        return path
    elif how == "deepcopy":
        return copy.deepcopy(driver)
    else:
        raise ValueError(f"unknown copier {how!r}; known: {', '.join(RESUME_COPIERS)}")
    with open(path, "wb") as f:
        f.write(data)
    return path


def resume_copy(job: dict, build: Callable[[], Element] | None) -> Driver:
    """Load the copy a job names (how, path) and run it to its end (at most job['limit'] steps)."""
    how, path = job["how"], job["path"]
    if how in ("pickle", "cloudpickle"):
        with open(path, "rb") as f:
            drv = pickle.load(f)
    elif how == "checkpoint":
        from .persist.checkpoint import load

        drv = load(path)
    elif how == "state":
        from .persist.state import load_state

        drv = load_state(path, build())
    else:
        raise ValueError(f"cannot resume a {how!r} copy from a file")
    drv.run(max_steps=job.get("limit"))
    return drv


def _child_main() -> None:
    """The fresh interpreter's side: ``python -c 'from flowvm.testing import _child_main; _child_main()' JOBS OUT``.
    Sets the environment, resumes each job's copy, writes a list of results to OUT after each job.  In the
    lazy environment it stops after the job that imported torch (the next job needs a process of its own)."""
    import sys
    import traceback
    import warnings

    jobs_path, out_path = sys.argv[1:3]
    with open(jobs_path, "rb") as f:
        plan = pickle.load(f)
    env = plan["env"]
    sys.path[:0] = [p for p in plan["path"] if p not in sys.path]
    if env["torch"] == "before":
        import torch

        if env.get("threads"):
            torch.set_num_threads(env["threads"])
        torch.manual_seed(0x5EED)
    _scramble_random()
    build = None
    results = []
    for job in plan["jobs"]:
        lazy_before = "torch" not in sys.modules
        result = {"id": job["id"]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if job["how"] == "state" and build is None:
                    build = pickle.loads(plan["build"])
                drv = resume_copy(job, build)
                result["fingerprint"] = fingerprint(drv)
            except BaseException as err:  # noqa: BLE001 - reported to the parent
                result["error"] = f"{type(err).__name__}: {err}"
                result["traceback"] = traceback.format_exc()[-3000:]
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught][:5]
        result["torch_imported"] = "torch" in sys.modules
        results.append(result)
        with open(out_path, "wb") as f:
            pickle.dump(results, f)
        if env["torch"] == "lazy" and lazy_before and "torch" in sys.modules:
            break  # torch is imported now: the next job needs a process where it is not
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


CHILD_CODE = "from flowvm.testing import _child_main; _child_main()"


def run_in_children(jobs: list[dict], env: dict, build_blob: bytes | None, workdir: str,
                    timeout: float = 300.0, extra_path: Iterable[str] = ()) -> dict:
    """Resume jobs in fresh interpreters with env: as many jobs per process as the environment allows (in
    the lazy one, a process ends once torch is imported).  Returns {job id: result}; a process that died
    gives its remaining jobs an 'error'.  Also counts the processes started (results['<processes>'])."""
    import os
    import subprocess
    import sys
    import tempfile

    path = [os.path.abspath(p) if p else os.getcwd() for p in [*extra_path, *sys.path]]
    results: dict = {"<processes>": 0}
    left = list(jobs)
    while left:
        cwd = tempfile.mkdtemp(prefix="resume-cwd-", dir=workdir)
        plan_path = os.path.join(workdir, f"plan-{len(results)}.pkl")
        out_path = os.path.join(workdir, f"out-{len(results)}.pkl")
        with open(plan_path, "wb") as f:
            pickle.dump({"env": env, "jobs": left, "path": path, "build": build_blob}, f)
        child_env = dict(os.environ, PYTHONHASHSEED=str(env["hashseed"]))
        results["<processes>"] += 1
        try:
            done = subprocess.run([sys.executable, "-c", CHILD_CODE, plan_path, out_path], cwd=cwd, env=child_env,
                                  capture_output=True, text=True, timeout=timeout)
            tail = (done.stderr or "")[-2000:]
        except subprocess.TimeoutExpired:
            tail = f"the process did not finish within {timeout} s"
        got = []
        if os.path.exists(out_path):
            with open(out_path, "rb") as f:
                got = pickle.load(f)
        for r in got:
            results[r["id"]] = r
        if not got:  # it died before finishing one: the first job is at fault
            results[left[0]["id"]] = {"id": left[0]["id"], "error": f"the resuming process failed: {tail}"}
            got = [left[0]]
        left = left[len(got):]
    return results


def _resume_here(job: dict, clone: Driver, env: dict) -> dict:
    """Finish a deep copy in this process after moving every generator and torch setting elsewhere."""
    import sys

    _scramble_random()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(torch.float64 if torch.get_default_dtype() == torch.float32 else torch.float32)
        torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the copy says it sets its settings again: it should
            clone.run(max_steps=job.get("limit"))
        return {"id": job["id"], "fingerprint": fingerprint(clone), "torch_imported": "torch" in sys.modules}
    except Exception as err:  # noqa: BLE001
        return {"id": job["id"], "error": f"{type(err).__name__}: {err}"}


def reference_run(build: Callable[[], Element], limit: int, probe: Callable[[Driver], Any] | None = None):
    """The uninterrupted run's fingerprint (run step by step when probe is given: probe(driver) after each
    step, the labels returned as a list indexed by step count)."""
    drv = build().start()
    labels = []
    if probe is None:
        drv.run(max_steps=limit)
    else:
        labels.append(probe(drv))
        while not drv.done and drv.steps < limit:
            drv.step()
            labels.append(probe(drv))
    return fingerprint(drv), labels


def check_resume(build: Callable[[], Element], cuts: int | Iterable[int] = 5,
                 copiers: Iterable[str] = ("pickle", "cloudpickle", "checkpoint", "state", "deepcopy"),
                 environments: Iterable[str] = ("torch-before", "torch-lazy", "threads"), seed: int = 0,
                 steps: bool | None = None, timeout: float = 300.0, max_steps: int = 1_000_000,
                 refusable: Callable[[int, BaseException], bool] | None = None,
                 workdir: str | None = None) -> dict:
    """Check that a run cut at random steps, copied and resumed in a fresh process equals the uninterrupted run.

    ``build`` returns a fresh program each call (seeding the generators it draws from); the fresh processes
    need it for state files: a module-level function of an importable module (found by its module name and
    this process's sys.path) or anything cloudpickle takes.  ``cuts``: how many random step counts to cut
    at (drawn with seed, 0 and the last step among the candidates), or the step counts themselves.  Every
    cut is copied by every copier (see RESUME_COPIERS; 'deepcopy' resumes in this process after the
    generators and torch's settings moved), and each file copy is resumed in one of ``environments`` (see
    ENVIRONMENTS), in turn.  A copy refused with ``flowvm.CopyError`` (a live autograd graph at that cut) is
    an allowed outcome, listed in the return value; ``refusable(cut, error)`` narrows where.

    Raises AssertionError describing the first difference: the cut, the copy path, the environment and what
    differs.  Returns {'outcome': the uninterrupted run's fingerprint, 'checked': the copies resumed,
    'refusals': [(cut, copier, reason)], 'processes': the fresh interpreters started, 'cuts': the step
    counts cut at, 'imported_torch': the ids ('cut/copier') of the fresh resumes that imported torch}.
    """
    import os
    import shutil
    import tempfile

    copiers, environments = tuple(copiers), tuple(environments)
    for name in copiers:
        if name not in RESUME_COPIERS:
            raise ValueError(f"unknown copier {name!r}; known: {', '.join(RESUME_COPIERS)}")
    rng = random.Random(seed)
    envs = [_environment(name, rng) for name in environments]
    CopyError = _copy_error()
    with _ProcessState():
        expected, _ = reference_run(build, max_steps)
        if not expected["done"]:
            raise AssertionError(f"build()'s run did not finish within {max_steps} steps")
        again, _ = reference_run(build, max_steps)
        if fingerprint_diff(expected, again):
            raise AssertionError("two uninterrupted runs of build() differ, so resumed runs cannot be compared: "
                                 "seed the global random generators inside build() and keep its CALLs "
                                 "deterministic:\n  " + "\n  ".join(fingerprint_diff(expected, again)))
    if steps is None:
        from .program.paths import walk

        steps = not any(el.polls for _, el in walk(build()))
    total = expected["steps"]
    if isinstance(cuts, int):
        candidates = sorted({0, total, *(rng.randint(0, total) for _ in range(max(cuts, 0)))})
        cuts = sorted(rng.sample(candidates, min(cuts, len(candidates))))
    cuts = list(cuts)
    limit = 2 * total + 100
    tmp = workdir or tempfile.mkdtemp(prefix="check-resume-")
    try:
        build_blob = cloudpickle.dumps(build)
        jobs, refusals, here = [], [], []
        with _ProcessState():
            for k in cuts:
                original = build().start()
                original.run(max_steps=k)
                for how in copiers:
                    jid = f"{k}/{how}"
                    try:
                        made = make_copy(original, how, os.path.join(tmp, f"copy-{k}-{how}"))
                    except CopyError as err:
                        if refusable is not None and not refusable(k, err):
                            raise AssertionError(f"the copy after {k} steps via {how} was refused where it "
                                                 f"should not be: {err}") from err
                        refusals.append((k, how, str(err)))
                        continue
                    job = {"id": jid, "how": how, "path": made, "cut": k, "limit": limit}
                    (here if how == "deepcopy" else jobs).append(job)
        found: dict = {}
        with _ProcessState():
            for job in here:
                found[job["id"]] = _resume_here(job, job.pop("path"), {})
        processes = 0
        by_env: dict[int, list] = {}
        for i, job in enumerate(jobs):
            by_env.setdefault(i % max(len(envs), 1), []).append(job)
        for e, share in by_env.items():
            got = run_in_children(share, envs[e], build_blob, tmp, timeout)
            processes += got.pop("<processes>")
            for job in share:
                got[job["id"]]["env"] = envs[e]
            found.update(got)
        for job in here:
            found[job["id"]]["env"] = {"name": "same-process", "fresh": False}
        for job in sorted(here + jobs, key=lambda j: (j["cut"], j["how"])):
            r = found.get(job["id"], {"error": "never resumed"})
            where = (f"the copy after {job['cut']} of {total} steps via {job['how']}, resumed in "
                     f"{describe_environment(r['env'])}")
            if "error" in r:
                raise AssertionError(f"{where}, raised {r['error']}\n{r.get('traceback', '')}")
            problems = fingerprint_diff(expected, r["fingerprint"], steps)
            if problems:
                raise AssertionError(f"{where}, differs from the uninterrupted run:\n  " + "\n  ".join(problems))
        imported = sorted(j["id"] for j in jobs if found[j["id"]].get("torch_imported"))
        return {"outcome": expected, "checked": len(jobs) + len(here), "refusals": refusals,
                "processes": processes, "cuts": cuts, "imported_torch": imported}
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
