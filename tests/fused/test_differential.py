"""Differential testing of fuse-torch: generated programs (tests/fused/diffprogs.py) run interpreted and
optimized with their compile forced early, while the values a compiled step could have read that are not
its inputs (a list or dict among a call's constants, a global, a closure cell, an attribute of a bound
method's object, the default dtype, grad mode, deterministic algorithms, matmul precision) change between
iterations, the same in both runs.  The optimized run must record what the interpreted run records each
iteration: dtypes, shapes and gradient flags exactly, values bit for bit while no compiled code ran and to
float rounding once some did; a step that never ran compiled says why (``runtime().refused`` or its
header).

Other mutations meet what no guard of a trace sees (diffprogs.py): input registers made overlapping views of
one tensor, forward hooks added and removed, an assertion turning false, an error after in-place writes and
draws, extreme values (signed zeros, infinities, casts out of int8's range).  A program that raises must raise
the same error type at the same iteration, leaving the same registers and generator.

The CI runs a short, derandomized version: 20 programs on the thread, 2 through the child process (2-3
minutes here with inductor's cache cold, 20-40 s warm plus the children's compiles).  The long run is
``bash scripts/difftest.sh [EXAMPLES]`` (FLOWVM_DIFF_EXAMPLES examples on the thread, a tenth of them
through the child process, random seeds); it ends with a JSON line of figures: programs run, mutations
made, compiled calls (``runtime().hits``), steps left eager with a reason, and programs with differences.
FLOWVM_DIFF_TEMPLATES=global,cell narrows the programs to those templates (names in diffprogs.TEMPLATES).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings

import diffprogs as D
from flowvm.passes.fuse_torch import FUSED, fuse_torch
from flowvm.program.paths import walk

LONG = int(os.environ.get("FLOWVM_DIFF_EXAMPLES", "0"))
ONLY = tuple(t for t in os.environ.get("FLOWVM_DIFF_TEMPLATES", "").split(",") if t)  # e.g. "global,cell"
THREAD_EXAMPLES = LONG or 20
PROCESS_EXAMPLES = max(LONG // 10, 1)  # and, in the CI, the explicit example below
COMMON = dict(deadline=None, derandomize=not LONG,
              suppress_health_check=list(HealthCheck))

ON_THE_THREAD = dict(form="compiled", compile_after=0, payback=0, background=False, compile_in="thread")
IN_A_CHILD = dict(form="compiled", compile_after=0, payback=0, background=True, compile_in="process")
CHILD_WAIT = 240.0  # seconds a child's compile may take (cold: 20-30 s here)

FIGURES = {"programs": 0, "mutations": 0, "compiled_calls": 0, "fused_steps": 0, "eager_with_reason": 0,
           "programs_with_differences": 0, "seconds": 0.0}


@pytest.fixture(scope="module", autouse=True)
def figures():
    start = time.perf_counter()
    yield FIGURES
    FIGURES["seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps({"differential": FIGURES})
    print("\n" + line)
    if os.environ.get("FLOWVM_DIFF_REPORT"):
        with open(os.environ["FLOWVM_DIFF_REPORT"], "a") as f:
            f.write(line + "\n")


def fused_runtimes(program) -> list:
    return [el.runtime() for _, el in walk(program) if isinstance(el, FUSED)]


def compare(spec: D.Spec, options: dict, waits=None) -> None:
    """Run spec interpreted and optimized with options (waits(runtimes) -> the clock's ``before`` hook of
    the optimized run); fail on any difference, or on a step that never ran compiled and does not say why."""
    expected = D.run(D.build(spec))
    built = D.build(spec)
    fast = fuse_torch(built.program, **options)
    runtimes = fused_runtimes(fast)
    assert runtimes, f"{spec}: nothing fused"
    if waits is not None:
        built.clock.before = waits(runtimes)
    got = D.run(built, fast)
    hits = sum(rt.hits for rt in runtimes)
    FIGURES["programs"] += 1
    FIGURES["mutations"] += built.clock.made
    FIGURES["compiled_calls"] += hits
    FIGURES["fused_steps"] += len(runtimes)
    found = D.differences(expected, got, exact=hits == 0)
    unexplained = []
    for rt in runtimes:
        if rt.hits == 0:
            reason = rt.refused or ("eager" in rt.el.header_text() and rt.el.header_text())
            if reason:
                FIGURES["eager_with_reason"] += 1
            else:
                unexplained.append(rt.el.header_text())
    if found:
        FIGURES["programs_with_differences"] += 1
    states = [(rt.state, rt.hits, rt.refused) for rt in runtimes]
    assert not found, f"{spec}: the optimized run differs ({states}):\n  " + "\n  ".join(found[:6])
    assert not unexplained, f"{spec}: a step never ran compiled and does not say why: {unexplained}"


@settings(max_examples=THREAD_EXAMPLES, **COMMON)
@given(D.specs(templates=ONLY or tuple(D.TEMPLATES), together=None))
def test_the_optimized_program_computes_what_the_interpreted_one_does_whatever_changes_between_steps(spec):
    """Compiled on the program's thread, the first execution waiting for the compile."""
    compare(spec, ON_THE_THREAD)


def wait_for_compiles(runtimes):
    """The clock's hook: at iteration 1, wait until each step's child compile delivered a package or was
    refused; at iteration 2, until a compile the refusal left to the thread (started at iteration 1) is done."""
    def before(i):
        deadline = time.time() + CHILD_WAIT
        if i == 1:
            while any(rt._direct is None and rt.refused is None for rt in runtimes) and time.time() < deadline:
                time.sleep(0.05)
        elif i == 2:
            while any(getattr(rt, "_job_running", False) for rt in runtimes) and time.time() < deadline:
                time.sleep(0.05)
    return before


CHILD_TEMPLATES = tuple(t for t in ("roll", "roll_kw", "ones", "cumsum", "matmul", "global", "dict", "hook", "int8",
                                    "mul0") if not ONLY or t in ONLY) or ONLY


def audited(test):
    """Unless FLOWVM_DIFF_TEMPLATES narrows the templates: first, a list constant and the default dtype
    changed under one step compiled in a child process."""
    spec = D.Spec(("roll", "ones"), 5, ((2, "list", 3), (3, "dtype", torch.float64)), together=True)
    return test if ONLY else example(spec)(test)


@settings(max_examples=PROCESS_EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate], **COMMON)
@given(D.specs(templates=CHILD_TEMPLATES, iterations=(4, 6), first_mutation=2, together=True))
@audited
def test_a_step_compiled_in_a_child_process_computes_what_the_interpreted_one_does(spec):
    """Compiled in a child process (AOTInductor), in the background; the program waits for it once, so
    that the mutations come after the package arrived.  No shrinking: each example costs a child's compile."""
    compare(spec, IN_A_CHILD, waits=wait_for_compiles)


# One program per class a guarded trace used to miss (compiled on the thread): each must run as interpreted.
UNSEEN = [
    D.Spec(("alias", "roll"), 5, ((2, "alias", "overlap"), (3, "list", 3)), together=True),  # overlapping inputs
    D.Spec(("bn_hook",), 5, ((2, "hook", "on"), (4, "hook", "off"))),  # a hook on a training step (writes, draws)
    D.Spec(("assert_fn",), 4, ((2, "nan", True),)),  # an assertion in a function of the program's
    D.Spec(("raise",), 4, ((2, "index", D.SIZE + 5),)),  # an error after a draw and an in-place write
    D.Spec(("clamp", "int8"), 3, ((1, "extreme", True),)),  # signed zeros, infinities, int8 casts
    D.Spec(("mul0",), 3, ((1, "extreme", True),)),  # infinities times an int zero
]


@pytest.mark.parametrize("spec", UNSEEN, ids=str)
def test_what_no_guard_of_the_trace_sees_runs_as_interpreted(spec):
    compare(spec, ON_THE_THREAD)


def test_what_the_childs_compile_folds_runs_as_interpreted():
    """AOTInductor folds ``x * 0`` to zeros where the thread's compile keeps it (an infinity times 0 is NaN)."""
    compare(D.Spec(("mul0",), 5, ((2, "extreme", True),)), IN_A_CHILD, waits=wait_for_compiles)
