"""@flowvm.program: what cannot run resumably is refused when the function is decorated, naming the line; an
iterator that cannot be saved is refused when the loop starts; a run resumed where the function's source
changed is refused unless asked to go on (and then only with the same shape); the program's tools (the
command line's run, checkpoints and resume, the step-wise driver and arun) take it as any program."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import pickle
import subprocess
import sys
import textwrap

import pytest

import flowvm
from flowvm.program.pyfunc import ACCEPT_ENV, SourceChanged
from flowvm.program.pylower import ProgramSyntaxError

_COUNT = itertools.count()


def load(folder, source: str, name: str | None = None):
    name = name or f"pyf_refused_{next(_COUNT)}"
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    return importlib.import_module(name)


REFUSED = {
    "try around a loop": ("try:\n        for i in range(n):\n            x = i\n    except ValueError:\n        pass",
                          "try around statements that loop or jump", 5),
    "yield": ("x = yield n", "yield cannot run as a resumable program", 5),
    "global": ("global G\n    G = n", "global cannot run", 5),
    "nonlocal": ("def g():\n        nonlocal n\n        n = 1\n    g()", "nonlocal cannot run", 6),
    "for else": ("for i in range(n):\n        pass\n    else:\n        x = 1", "for ... else is not supported", 5),
    "while else": ("while n:\n        n -= 1\n    else:\n        x = 1", "while ... else is not supported", 5),
    "a lambda over a changing local": ("x = 1\n    x = 2\n    g = lambda: x", "a lambda reads the local x, assigned "
                                                                          "more than once", 7),
    "with open around a loop": ("with open('f') as fh:\n        for line in fh:\n            pass",
                                "with around statements that loop or jump: only", 5),
    "a flowvm name": ("__jump = 1", "the name __jump is flowvm's own", 5),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_run_resumably_is_refused_at_decoration_naming_the_line(tmp_path, case):
    body, words, line = REFUSED[case]
    source = f"import flowvm\n\n\n@flowvm.program\ndef f(n):\n    {body}\n    return n\n"
    with pytest.raises(ProgramSyntaxError) as err:
        load(tmp_path, source)
    assert str(err.value).startswith(words) and str(err.value).endswith(f".py, line {line + 1})"), str(err.value)


def test_an_async_function_and_star_args_are_refused(tmp_path):
    with pytest.raises(ProgramSyntaxError, match="an async function cannot run as a resumable program"):
        load(tmp_path, "import flowvm\n\n@flowvm.program\nasync def f(n):\n    return n\n")
    with pytest.raises(ProgramSyntaxError, match=r"\*args and \*\*kwargs are not supported"):
        load(tmp_path, "import flowvm\n\n@flowvm.program\ndef f(*n):\n    return n\n")


def test_a_loop_over_an_iterator_that_cannot_be_saved_is_refused_when_it_starts(tmp_path):
    module = load(tmp_path, """
        import flowvm

        @flowvm.program
        def f(n):
            total = 0
            for x in (i * i for i in range(n)):
                total += x
            return total
    """)
    with pytest.raises(TypeError, match="for over generator: its iterator .generator. cannot be saved"):
        module.f(3).run()


def test_an_error_points_at_the_users_line(tmp_path):
    module = load(tmp_path, """
        import flowvm

        @flowvm.program
        def f(n):
            total = 0
            for i in range(n):
                total += 10 // (2 - i)
            return total
    """)
    with pytest.raises(ZeroDivisionError) as err:
        module.f(4).run()
    frames = [(f.filename, f.lineno) for f in __import__("traceback").extract_tb(err.value.__traceback__)]
    assert (module.__file__, 8) in frames, frames


def test_a_read_of_an_unbound_local_raises_as_python_does(tmp_path):
    module = load(tmp_path, """
        import flowvm

        @flowvm.program
        def f(n):
            if n:
                y = 1
            return y
    """)
    with pytest.raises(UnboundLocalError) as plain:
        module.f.function(0)
    with pytest.raises(UnboundLocalError) as got:
        module.f(0).run()
    assert str(got.value) == str(plain.value)
    assert module.f(1).run() == 1


SOURCE = """
    import flowvm

    @flowvm.program
    def f(n):
        total = 0
        for i in range(n):
            total += i * {k}
        return total
"""

RESUME = textwrap.dedent("""
    import pickle, sys
    sys.path.insert(0, sys.argv[1])
    print(pickle.loads(open(sys.argv[2], "rb").read()).run())
""")


def _resume(folder, env=None):
    import os

    return subprocess.run([sys.executable, "-c", RESUME, str(folder), str(folder / "half.pkl")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **(env or {})))


def test_a_run_resumed_where_the_function_changed_is_refused_unless_asked(tmp_path):
    name = f"pyf_changed_{next(_COUNT)}"
    module = load(tmp_path, SOURCE.format(k=1), name)
    drv = module.f(10).start()
    drv.run(max_steps=8)
    (tmp_path / "half.pkl").write_bytes(pickle.dumps(drv))
    assert _resume(tmp_path).stdout.strip() == "45"  # unchanged: resumes
    load(tmp_path, SOURCE.format(k=2), name)  # the file edited: i * 2
    refused = _resume(tmp_path)
    assert refused.returncode != 0 and "SourceChanged" in refused.stderr, refused.stderr
    assert "the run was saved with another version of f" in refused.stderr and ACCEPT_ENV in refused.stderr
    went_on = _resume(tmp_path, {ACCEPT_ENV: "1"})  # with the new code from where it was
    assert went_on.returncode == 0, went_on.stderr
    assert int(went_on.stdout) > 45
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SOURCE.format(k=1)).replace(
        "        total += i * 1\n", "        total += i\n        total -= 0\n"))
    reshaped = _resume(tmp_path, {ACCEPT_ENV: "1"})
    assert reshaped.returncode != 0 and "changed shape since the run was saved" in reshaped.stderr, reshaped.stderr


def test_the_step_wise_driver_and_arun_run_it(tmp_path):
    module = load(tmp_path, SOURCE.format(k=3))
    drv = module.f(6).start()
    while drv.step() is flowvm.INCOMPLETE:
        pass
    assert drv.result == module.f.function(6) == 45
    assert asyncio.run(module.f(6).start().arun(steps_per_yield=1)) == 45


def test_the_command_runs_checkpoints_and_resumes_it_exactly(tmp_path):
    (tmp_path / "prog.py").write_text(textwrap.dedent("""
        import flowvm

        @flowvm.program
        def walk(n, seed):
            x = seed
            seen = []
            for i in range(n):
                x = (x * 1103515245 + 12345) % 2147483648
                if x % 7 == 0:
                    continue
                seen.append(x % 100)
            print("walked", sum(seen), len(seen))
            return sum(seen)

        def build(n: int = 200, seed: int = 1):
            return walk(n, seed)
    """))
    cmd = [sys.executable, "-m", "flowvm", "run", str(tmp_path / "prog.py"), "--progress", "none"]
    straight = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    ckpt = tmp_path / "c.ckpt"
    paused = subprocess.run(cmd + ["--checkpoint", str(ckpt), "--max-steps", "333"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert paused.returncode == 0 and "walked" not in paused.stdout, paused.stderr
    resumed = subprocess.run([sys.executable, "-m", "flowvm", "resume", str(ckpt), "--progress", "none"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    line = [ln for ln in straight.stdout.splitlines() if ln.startswith("walked")]
    assert line and line == [ln for ln in resumed.stdout.splitlines() if ln.startswith("walked")]


def test_to_source_writes_the_call_back_and_from_source_rebuilds_it(tmp_path):
    from flowvm.base.errors import SourceError
    from flowvm.views.source import from_source

    module = load(tmp_path, SOURCE.format(k=2))
    text = flowvm.to_source(module.f(7))
    assert f"from {module.__name__} import f" in text and "program = f(n=7)" in text, text
    assert from_source(text).run() == module.f.function(7) == 42
    with pytest.raises(SourceError, match="the call of f takes n, which source cannot write"):
        flowvm.to_source(module.f([1, 2]))


BATCHES = """
    import numpy as np
    import flowvm

    @flowvm.program
    def total(batches, epochs):
        sums = []
        for epoch in range(epochs):
            for batch in batches:
                sums.append(float(batch.sum()))
        return sums

    def data():
        return np.arange(200, dtype=np.float64).reshape(100, 2)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_for_over_batches_with_workers_resumes_mid_epoch_as_with_none(tmp_path, workers):
    module = load(tmp_path, BATCHES)

    def build(w):
        return module.total(flowvm.Batches(module.data(), batch_size=7, seed=3, workers=w), 2)

    want = module.total.function(flowvm.Batches(module.data(), batch_size=7, seed=3), 2)
    assert build(workers).run() == want and len(want) == 2 * 15
    drv = build(workers).start()
    drv.run(max_steps=40)  # inside the first epoch
    copy = pickle.loads(pickle.dumps(drv))
    assert copy.run() == want


def test_the_optimizer_fuses_its_tensor_statements_and_says_why_not_the_others(tmp_path):
    pytest.importorskip("torch")
    module = load(tmp_path, """
        import torch
        import flowvm

        @flowvm.program
        def f(n):
            x = torch.ones(3)
            log = []
            for i in range(n):
                y = torch.relu(x - i)
                x = x + y
                log.append(float(x.sum()))
            return x, log
    """)
    import torch

    fast = flowvm.optimize(module.f(4), options={"fuse-torch": {"form": "eager"}})
    [(_, step)] = flowvm.fused_steps(fast)
    assert [c.fn.text for c in step.calls] == ["y = torch.relu(x - i)", "x = x + y"]
    got, want = fast.run(), module.f.function(4)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    why = flowvm.explain_fusion(module.f(4))
    assert "y = torch.relu(x - i): fused: calls" in why and "x = x + y: fused: calls" in why, why
    assert "log.append(float(x.sum())): not a tensor statement: it calls log.append: append is a method of " \
           "builtin values" in why, why
    assert "x = torch.ones(3): a tensor statement with none beside it" in why, why


def test_the_listing_puts_the_cursor_on_the_next_statement(tmp_path):
    module = load(tmp_path, SOURCE.format(k=3))
    drv = module.f(6).start()
    drv.run(max_steps=5)
    marked = [line for line in str(drv).splitlines() if line.startswith(">>")]
    assert len(marked) == 1
    texts = [p.text for p in drv.program.elements[0].fn.source.plan.pieces.values()]
    assert any(t in marked[0] for t in texts), marked


def test_an_optimized_program_is_written_statement_by_statement_and_read_back(tmp_path):
    pytest.importorskip("torch")
    module = load(tmp_path, """
        import torch
        import flowvm

        @flowvm.program
        def f(n):
            x = torch.ones(3)
            for i in range(n):
                y = torch.relu(x - i)
                x = x * 0.5 + y
            return x
    """)
    import torch

    fast = flowvm.optimize(module.f(4), options={"fuse-torch": {"form": "eager"}})
    text = flowvm.to_source(fast)
    assert "fused_step(" in text and "statement(f, '_stmt_" in text and "'x': unbound()" in text, text
    back = flowvm.from_source(text)
    assert str(back) == str(fast)
    assert torch.equal(back.run(), module.f.function(4))
    with pytest.raises(LookupError, match="'_stmt_99' is no statement of"):
        flowvm.pickled.statement(module.f, "_stmt_99")
