"""Property tests over generated programs: random edits, and hot patches on half-run drivers."""

from __future__ import annotations

import copy
import pickle

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import flowvm
from flowvm import BUFFER, CALL, LOOP, REPEAT, SEQ, SWITCH, WEAVE, WHILE, EditError
from flowvm.program.paths import format_path, get, walk
from flowvm.testing import COPIERS, diff, outcome

import progen
import toy

LIMIT = 20_000  # steps: an edit may leave a WEAVE with only LOOPs to wait for
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ the oracle
def construct(el, kids):
    """el rebuilt over kids with the element constructors (not with_children)."""
    if isinstance(el, SEQ):
        return SEQ(kids)
    if isinstance(el, REPEAT):
        return REPEAT(el.n, kids[0], counter=el.counter)
    if isinstance(el, BUFFER):
        return BUFFER(el.n, kids[0], store_to=el.store_to)
    if isinstance(el, LOOP):
        return LOOP(kids[0])
    if isinstance(el, WHILE):
        return WHILE(kids[0], kids[1])
    if isinstance(el, SWITCH):
        head = 1 if isinstance(el.selector, CALL) else 0
        cases = dict(zip(el.cases, kids[head:head + len(el.cases)]))
        return SWITCH(kids[0] if head else el.selector, cases, kids[-1] if el.default is not None else None)
    if isinstance(el, WEAVE):
        return WEAVE(el.n_required, kids, el.weights)
    return el


def direct(el, path, target, make):
    """The program with make(parent, index, child) applied to the child at target (path of the parent)."""
    kids = list(el.children)
    if path == target[:-1]:
        return make(el, target[-1], kids)
    if target[: len(path) + 1][:-1] == path and len(target) > len(path):
        i = target[len(path)]
        kids[i] = direct(kids[i], path + (i,), target, make)
        return construct(el, kids)
    return el


def is_role(program, path):
    if not path:
        return False
    parent = get(program, path[:-1])
    return (isinstance(parent, WHILE) and path[-1] == 0) or (
        isinstance(parent, SWITCH) and isinstance(parent.selector, CALL) and path[-1] == 0)


def oracle(program, path, op, items):
    """The expected program after op at path, built directly; None when the edit must be refused."""
    if op == "replace":
        if is_role(program, path) and not isinstance(items[0], CALL):
            return None
        if not path:
            return items[0]
        return direct(program, (), path, lambda p, i, kids: construct(p, kids[:i] + [items[0]] + kids[i + 1:]))
    if op == "remove":
        if not path or is_role(program, path):
            return None
        parent = get(program, path[:-1])
        if isinstance(parent, WEAVE):
            if parent.n_required > len(parent.elements) - 1:
                return None
            weights = None if parent.weights is None else parent.weights[:path[-1]] + parent.weights[path[-1] + 1:]
            return direct(program, (), path, lambda p, i, kids: WEAVE(p.n_required, kids[:i] + kids[i + 1:], weights))
        if isinstance(parent, SEQ):
            return direct(program, (), path, lambda p, i, kids: SEQ(kids[:i] + kids[i + 1:]))
        return direct(program, (), path, lambda p, i, kids: construct(p, kids[:i] + [SEQ([])] + kids[i + 1:]))
    after = op == "after"
    if is_role(program, path):
        return None
    if path and isinstance(get(program, path[:-1]), SEQ):
        def make(p, i, kids):
            j = i + 1 if after else i
            return SEQ(kids[:j] + list(items) + kids[j:])
        return direct(program, (), path, make)
    wrap = lambda old: SEQ([old, *items] if after else [*items, old])  # noqa: E731
    if not path:
        return wrap(program)
    return direct(program, (), path, lambda p, i, kids: construct(p, kids[:i] + [wrap(kids[i])] + kids[i + 1:]))


def run_limited(program):
    """(driver, error) after at most LIMIT steps; an edit may make a SWITCH meet a value it has no case for."""
    drv = copy.deepcopy(program).start()
    try:
        drv.run(max_steps=LIMIT)
    except Exception as err:
        return drv, f"{type(err).__name__}: {err}"
    return drv, None


def verify_message(program):
    try:
        flowvm.verify(program)
    except flowvm.VerifyError as err:
        return str(err)
    return None


# ------------------------------------------------------------- program edits
@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_random_edits_give_the_program_built_directly(data):
    gen = progen.ProgramGenerator(progen.DrawChooser(data.draw))
    program = expected = gen.program(depth=4)
    for _ in range(data.draw(st.integers(1, 4))):
        paths = [p for p, _ in walk(program)]
        path = data.draw(st.sampled_from(paths))
        op = data.draw(st.sampled_from(["replace", "remove", "before", "after"]))
        items = [gen.leaf() for _ in range(data.draw(st.integers(1, 2)))]
        if op == "replace" and data.draw(st.booleans()):
            items = [gen.finite(2)]
        want = oracle(program, path, op, items)
        target = copy.copy(program).at(path)  # edits change the program in place
        try:
            if op == "replace":
                got = target.replace_with(items[0])
            elif op == "remove":
                got = target.remove()
            else:
                got = getattr(target, f"insert_{op}")(*items)
        except EditError as err:
            assert want is None, f"refused {op} at {format_path(path)!r}: {err}"
            assert err.path == format_path(path)
            continue
        assert want is not None, f"{op} at {format_path(path)!r} should have been refused"
        assert str(got) == str(want)
        program, expected = got, want
    # verifies, prints, pickles, rebuilds from source and runs as the program built directly
    assert verify_message(program) == verify_message(expected)
    assert str(pickle.loads(pickle.dumps(program))) == str(expected)
    assert str(flowvm.from_source(flowvm.to_source(program))) == str(expected)
    if verify_message(program) is None:
        (a, err_a), (b, err_b) = run_limited(program), run_limited(expected)
        assert err_a == err_b and a.done == b.done and not diff(outcome(a), outcome(b))


@settings(max_examples=100, **SETTINGS)
@given(progen.programs(depth=4), st.data())
def test_find_matches_exactly_the_equal_elements_and_edits_them_all(program, data):
    elements = [el for _, el in walk(program)]
    pattern = data.draw(st.sampled_from(elements))
    found = program.find(pattern)
    assert [m.path for m in found] == [p for p, el in walk(program) if el.kind == pattern.kind
                                       and str(el) == str(pattern)]
    assert all(get(program, m.path) is m.element for m in found)
    marker = CALL(toy.const, "marker")
    if all(not is_role(program, m.path) for m in found):
        edited = found.insert_before(marker)
        assert len(edited.find(marker)) == len(found)
        assert str(edited).count("const('marker')") == len(found)


# --------------------------------------------------------------- hot patches
def zero_effect_edit(data, program, path):
    """An edit that changes no step and no value: the patched run must equal the unpatched one."""
    choices = ["copy"] if is_role(program, path) else ["copy", "wrap", "empty-before"]
    kind = data.draw(st.sampled_from(choices))
    if kind == "copy":
        return "replace", lambda old: copy.copy(old)
    if kind == "wrap":
        return "replace", lambda old: SEQ([old])
    return "before", SEQ([])


@settings(max_examples=150, **SETTINGS)
@given(progen.programs(depth=4), st.data())
def test_zero_effect_hot_patches_keep_the_run_exact(program, data):
    ref = copy.deepcopy(program).start()
    ref.run()
    drv = copy.deepcopy(program).start()
    drv.run(max_steps=data.draw(st.integers(0, ref.steps)))
    for _ in range(data.draw(st.integers(1, 4))):
        paths = [p for p, _ in walk(drv.program)]
        path = data.draw(st.sampled_from(paths))
        op, new = zero_effect_edit(data, drv.program, path)
        before = str(drv)
        try:
            if op == "replace":
                drv.at(path).replace_with(new)
            else:
                drv.at(path).insert_before(new)
        except EditError as err:
            assert "running" in str(err) and str(drv) == before
        if data.draw(st.booleans()):
            drv.run(max_steps=data.draw(st.integers(0, 3)))
    drv.run()
    assert not diff(outcome(ref), outcome(drv))


def under_weave(program, path):
    return any(isinstance(get(program, path[:k]), WEAVE) for k in range(len(path)))


@settings(max_examples=150, **SETTINGS)
@given(progen.programs(depth=4), st.data())
def test_hooks_patched_into_half_run_drivers(program, data):
    """Registers, result and later hook calls are exactly those of the runs without and with the hooks."""
    ref = copy.deepcopy(program).start()
    ref.run()
    candidates = [p for p, _ in walk(program) if not under_weave(program, p) and not is_role(program, p)]
    chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
    # last in walk order first, so that each edit leaves the paths of the others in place
    edits = [(p, data.draw(st.sampled_from(["before", "after"]))) for p in sorted(chosen, reverse=True)]
    k = data.draw(st.integers(0, ref.steps))

    def hooked(prog, regs):
        regs["hooks"] = []
        for n, (path, op) in enumerate(edits):
            hook = CALL(toy.record, regs("hooks"), [n, regs(progen.DATA[n % 4])])
            target = prog.at(path)
            prog = target.insert_before(hook) if op == "before" else target.insert_after(hook)
        return prog

    # the program with the hooks from the start
    scratch_prog = copy.deepcopy(program)
    scratch = hooked(scratch_prog, progen_registers(scratch_prog))
    scratch_drv = scratch.start()
    scratch_drv.run()
    # the same hooks patched in after k steps (edits on the same paths, applied to the driver)
    drv = copy.deepcopy(program).start()
    drv.run(max_steps=k)
    drv.registers["hooks"] = []
    for n, (path, op) in enumerate(edits):
        hook = CALL(toy.record, drv.registers("hooks"), [n, drv.registers(progen.DATA[n % 4])])
        target = drv.at(path)
        if op == "before":
            target.insert_before(hook)
        else:
            target.insert_after(hook)
    if data.draw(st.booleans()):  # and copied on the way
        drv.run(max_steps=data.draw(st.integers(0, 5)))
        drv = COPIERS[data.draw(st.sampled_from(sorted(COPIERS)))](drv)
    drv.run()
    got = drv.registers.pop("hooks")
    full = scratch_drv.registers["hooks"]
    assert got == full[len(full) - len(got):], (got, full)
    assert drv.steps == ref.steps + len(got)
    want, have = outcome(ref), {**outcome(drv), "steps": ref.steps}
    if any(op == "after" for _, op in edits):
        # a hook after the last element of a SEQ gives the SEQ its value: only values (BUFFER
        # registers b*, the result) may differ; hooks inserted before an element change no value
        for o in (want, have):
            o["result"] = None
            o["registers"] = {k: v for k, v in o["registers"].items() if not k.startswith("b")}
    assert not diff(want, have)


def progen_registers(program):
    from flowvm.program.verify import program_registers

    return program_registers(program)


@settings(max_examples=200, **SETTINGS)
@given(st.data())
def test_any_edit_ahead_of_the_run_gives_the_run_of_the_edited_program(data):
    """Edits of top-level children the run has not reached: the patched run is the edited program's run."""
    gen = progen.ProgramGenerator(progen.DrawChooser(data.draw))
    program = gen.program(depth=4)  # SEQ([leaf, finite, finite]) on gen.reg
    ref = copy.deepcopy(program).start()
    ref.run()
    k = data.draw(st.integers(0, ref.steps))
    probe = copy.deepcopy(program).start()  # where the run stands after k steps
    probe.run(max_steps=k)
    if probe.done:
        return
    frames = probe.frame_paths()
    running = frames[1][0][0] if len(frames) > 1 else -1  # the top-level SEQ's position
    ahead = [p for p, _ in walk(program) if p and p[0] > running]
    if not ahead:
        return
    path = data.draw(st.sampled_from(ahead))
    op = data.draw(st.sampled_from(["replace", "remove", "before", "after"]))
    items = [gen.finite(2)] if op == "replace" else [gen.leaf() for _ in range(data.draw(st.integers(1, 2)))]

    def edit(target):
        m = target.at(path)
        if op == "replace":
            return m.replace_with(items[0])
        if op == "remove":
            return m.remove()
        return getattr(m, f"insert_{op}")(*items)

    try:
        edited = edit(copy.copy(program))  # edits change the program in place
    except EditError:
        return  # refused on the program too (a condition, a WEAVE's required child): tested above
    if verify_message(edited) is not None:
        return
    scratch, err = run_limited(edited)  # on a copy of the register file
    drv = program.start()  # on gen.reg itself, which the new elements are bound to
    drv.run(max_steps=k)
    edit(drv)
    try:
        drv.run(max_steps=LIMIT - drv.steps)
        err_patched = None
    except Exception as e:  # the same error as the edited program's run, at the same step
        err_patched = f"{type(e).__name__}: {e}"
    event(f"checked {op}")
    assert err_patched == err and drv.done == scratch.done
    assert not diff(outcome(scratch), outcome(drv))
