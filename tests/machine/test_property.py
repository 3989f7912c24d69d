"""Property tests: generated programs resume exactly after a stop at any step, however copied."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowvm
from flowvm.program.elements import ELEMENT_KINDS
from flowvm.program.paths import walk
from flowvm.testing import assert_same_run, diff, outcome

import progen
import toy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(progen.programs(depth=5), st.integers(0, 2**32 - 1))
def test_generated_programs_resume_exactly(program, seed):
    assert progen.nesting(program) >= 5
    assert_same_run(lambda: copy.deepcopy(program), seed=seed)


@settings(max_examples=60, deadline=None)
@given(progen.programs(depth=4), st.data())
def test_stepping_equals_running(program, data):
    """Stepping one at a time, or in chunks of any size, gives the same run as run()."""
    expected = copy.deepcopy(program).start()
    expected.run()
    drv = copy.deepcopy(program).start()
    while not drv.done:
        before = drv.steps
        chunk = data.draw(st.integers(1, 5))
        if chunk == 1:
            r = drv.step()
            assert (r is flowvm.INCOMPLETE) != drv.done
        else:
            drv.run(max_steps=chunk)
        assert drv.steps - before <= chunk
    assert not diff(outcome(expected), outcome(drv))


def test_generator_covers_every_element_kind():
    seen = set()
    for seed in range(200):
        seen |= {type(el) for _, el in walk(progen.random_program(seed))}
    assert seen == set(ELEMENT_KINDS)


def test_resume_in_fresh_subprocess(tmp_path, capsys):
    """save at a random step, load and finish in a new interpreter: same registers, result, steps."""
    import random

    rng = random.Random(1234)
    expected = {}
    for seed in range(40):
        program = progen.random_program(seed, depth=5)
        ref = copy.deepcopy(program).start()
        ref.run()
        expected[seed] = outcome(ref)
        drv = copy.deepcopy(program).start()
        drv.run(max_steps=rng.randint(0, ref.steps))
        flowvm.save(drv, tmp_path / f"{seed}.ckpt")
    script = textwrap.dedent("""
        import pickle, sys
        import flowvm
        from flowvm.testing import outcome
        out = {}
        for seed in range(40):
            d = flowvm.load(f"{sys.argv[1]}/{seed}.ckpt")
            d.run()
            out[seed] = outcome(d)
        with open(sys.argv[1] + "/out.pkl", "wb") as f:
            pickle.dump(out, f)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, str(toy.TESTS), ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, capture_output=True)
    got = pickle.loads((tmp_path / "out.pkl").read_bytes())
    for seed in range(40):
        assert not diff(expected[seed], got[seed]), (seed, diff(expected[seed], got[seed]))
