"""@flowvm.program, proven by search: random functions of the supported statements (tests/program/pyfuncs.py)
run as plain Python and as programs, and the programs cut at a random step, pickled and resumed, end with the
same value, the same mutations of their arguments and the same exception (type and arguments).  A few are
resumed in fresh processes that never ran the function (test_pyfunc_tensors.py: the same with tensors, the
programs optimized)."""

from __future__ import annotations

import importlib
import itertools
import pickle
import subprocess
import sys
import textwrap

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowvm

from pyfuncs import function

_COUNT = itertools.count()


def load(tmp_path, source: str):
    name = f"pyf_{next(_COUNT)}"
    (tmp_path / f"{name}.py").write_text(source)
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    return importlib.import_module(name)


def outcome(call):
    try:
        return ("value", call())
    except Exception as err:  # the same type and arguments either way
        return ("raised", type(err).__name__, err.args)


ARGS = [(1, 2, 3), (7, 0, 950), (40, 41, 2)]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(source=function(), which=st.sampled_from(ARGS), cut=st.floats(0, 1))
def test_a_random_function_runs_and_resumes_as_python_does(tmp_path_factory, source, which, cut):
    module = load(tmp_path_factory.mktemp("pyf"), source)
    plain_log: list = []
    want = outcome(lambda: module.f.function(*which, plain_log))
    log: list = []
    drv = module.f(*which, log).start()
    got = outcome(drv.run)
    assert got == want, source
    assert drv.registers["log"] == plain_log, source
    total = drv.steps
    k = int(cut * total)
    first = module.f(*which, []).start()
    done = outcome(lambda: first.run(max_steps=k))
    if done[0] == "raised":  # the cut came after the error
        assert done == want, source
        return
    copy = pickle.loads(pickle.dumps(first))
    assert outcome(copy.run) == want, f"cut at step {k} of {total}\n{source}"
    assert copy.registers["log"] == plain_log, source


RESUME = textwrap.dedent("""
    import pickle, sys
    sys.path.insert(0, sys.argv[1])
    drv = pickle.loads(open(sys.argv[2], "rb").read())
    try:
        print(repr(("value", drv.run())))
    except Exception as err:
        print(repr(("raised", type(err).__name__, err.args)))
    print(repr(drv.registers["log"]))
    import flowvm
    print(len(flowvm.fused_steps(drv.program)))
""")


def resume_elsewhere(folder, drv) -> list[str]:
    """The lines RESUME prints for drv, pickled into folder and resumed in a fresh process: its outcome, its
    log, its number of fused steps."""
    (folder / "half.pkl").write_bytes(pickle.dumps(drv))
    done = subprocess.run([sys.executable, "-c", RESUME, str(folder), str(folder / "half.pkl")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(source=function(), which=st.sampled_from(ARGS))
def test_a_half_run_resumes_in_a_process_that_never_ran_the_function(tmp_path_factory, source, which):
    folder = tmp_path_factory.mktemp("pyf")
    module = load(folder, source)
    plain_log: list = []
    want = outcome(lambda: module.f.function(*which, plain_log))
    drv = module.f(*which, []).start()
    drv.run(max_steps=3)
    value, log, _ = resume_elsewhere(folder, drv)
    assert value == repr(want) and log == repr(plain_log), source


def test_the_program_prints_the_functions_statements(tmp_path):
    module = load(tmp_path, textwrap.dedent("""
        import flowvm

        @flowvm.program
        def f(n):
            total = 0
            for i in range(n):
                if i % 2:
                    continue
                total += i
            return total
    """))
    text = str(module.f(5))
    for line in ("total = 0", "WHILE next(range(n)):", "i = next(...)", "SWITCH (i % 2):", "continue",
                 "total += i", "return total"):
        assert line in text, text
    assert module.f(5).run() == module.f.function(5) == 6
    assert isinstance(module.f(5), flowvm.SEQ)
