"""Hot patches: edits on half-run drivers change them in place and keep the run exact."""

import pytest

import flowvm
from flowvm import BUFFER, CALL, INCOMPLETE, Element, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, EditError, Registers
from flowvm.testing import COPIERS, diff, outcome

import toy
from toy import Countdown


def step_fn(w, x):
    return (w * 31 + x) % 1_000_003


def data_fn(i):
    return (i * 7 + 3) % 101


def hook(log, tag, value):
    log.append((tag, value))


def training(reg, epochs=3, batches=5):
    return SEQ([
        CALL(toy.const, 1, store_to=reg("w")),
        REPEAT(epochs, SEQ([
            REPEAT(batches, SEQ([
                CALL(data_fn, reg("i"), store_to=reg("x")),
                CALL(step_fn, reg("w"), reg("x"), store_to=reg("w")),
                CALL(toy.inc, reg("i"), store_to=reg("i")),
            ]), counter=reg("batch")),
            CALL(toy.add, reg("w"), reg("epoch_sum"), store_to=reg("epoch_sum")),
        ]), counter=reg("epoch")),
        CALL(toy.add, reg("w"), 0),
    ])


def fresh():
    reg = Registers(i=0, epoch_sum=0, log=[])
    return training(reg), reg


def unpatched():
    prog, reg = fresh()
    drv = prog.start()
    drv.run()
    return drv


def data_registers(drv):
    return {k: v for k, v in drv.registers.items() if k != "log"}


@pytest.mark.parametrize("k", range(0, 50, 3))
def test_a_hook_added_at_any_step_sees_every_later_update_and_changes_nothing_else(k):
    ref = unpatched()
    prog, reg = fresh()
    drv = prog.start()
    drv.run(max_steps=k)
    same_driver = drv.find(step_fn).insert_after(CALL(hook, reg("log"), "w", reg("w")))
    assert same_driver is drv and "hook" in str(drv)
    drv.run()
    assert data_registers(drv) == data_registers(ref) and drv.result == ref.result
    # the driver sits just before the next element it runs: a hook inserted right after an update
    # that has just run runs next; every later update is followed by the hook
    ws, w, i = [], 1, 0
    for _ in range(15):
        w = step_fn(w, data_fn(i))
        i += 1
        ws.append(w)
    update_steps = [3 + 16 * e + 3 * b for e in range(3) for b in range(5)]  # step numbers of step_fn
    done_updates = sum(1 for s in update_steps if s < k)
    assert [v for _, v in reg["log"]] == ws[done_updates:]
    assert drv.steps == ref.steps + len(reg["log"])


def test_hot_patch_a_run_loaded_from_a_checkpoint(tmp_path):
    ref = unpatched()
    prog, reg = fresh()
    drv = prog.start()
    drv.run(max_steps=20)
    flowvm.save(drv, tmp_path / "run.ckpt")
    loaded = flowvm.load(tmp_path / "run.ckpt")
    r = loaded.registers  # a loaded driver has its own register file: build hooks on it
    loaded.find(CALL(toy.add, r("w"), r("epoch_sum"))).insert_before(CALL(hook, r("log"), "epoch", r("epoch")))
    loaded.run()
    assert data_registers(loaded) == data_registers(ref)
    assert r["log"] == [("epoch", 1), ("epoch", 2)]
    with pytest.raises(EditError, match="another register file"):
        loaded.find(toy.inc).insert_after(CALL(hook, reg("log"), "x", 1))


def test_replacing_or_removing_a_running_element_is_refused_naming_it():
    prog, reg = fresh()
    drv = prog.start()
    drv.run(max_steps=5)  # inside the second batch: its SEQ has run data_fn
    before = str(drv)
    with pytest.raises(EditError, match=r"cannot replace REPEAT 3 \(counter epoch\) at path '1': it is running"):
        drv.find(REPEAT(3, SEQ([REPEAT(5, SEQ([CALL(data_fn), CALL(step_fn), CALL(toy.inc)])),
                                 CALL(toy.add)]))).replace_with(PRINT("x"))
    with pytest.raises(EditError, match="cannot remove SEQ at path '1.0.0.0'") as info:
        drv.at("1.0.0.0").remove()
    assert info.value.path == "1.0.0.0"
    with pytest.raises(EditError, match="root"):
        drv.at("").replace_with(PRINT("x"))
    assert str(drv) == before  # refused edits change nothing


def test_seq_position_follows_its_running_child():
    reg = Registers(log=[])
    a = CALL(hook, reg("log"), "a", 0)
    drv = SEQ([a, REPEAT(3, CALL(hook, reg("log"), "r", 1)), CALL(hook, reg("log"), "z", 2)]).start()
    drv.run(max_steps=2)  # a, then the REPEAT's first iteration: the REPEAT is running
    drv.find(a).insert_after(CALL(hook, reg("log"), "inserted", 9))  # before the running REPEAT: not run now
    drv.find(a).remove()
    assert str(drv).splitlines()[1:4] == ["   SEQ:  # at child 1 of 3", "       hook(log, 'inserted', 9)",
                                          "       REPEAT 3:  # 1 of 3 done"]
    drv.run()
    assert [t for t, _ in reg["log"]] == ["a", "r", "r", "r", "z"]


def test_the_next_element_has_not_started_it_can_be_replaced_removed_or_preceded():
    reg = Registers(log=[])
    mk = lambda tag: CALL(hook, reg("log"), tag, 0)  # noqa: E731
    drv = SEQ([mk("a"), mk("b"), mk("c"), mk("d")]).start()
    drv.run(max_steps=1)
    assert drv.position == "1"
    drv.find(CALL(hook, reg("log"), "b")).insert_before(mk("before-b"))
    assert drv.position == "1"
    drv.find(CALL(hook, reg("log"), "b")).replace_with(mk("B"))
    drv.step()
    drv.step()
    assert drv.position == "3"
    drv.find(CALL(hook, reg("log"), "c")).remove()
    with pytest.raises(EditError, match="last element of its SEQ"):
        drv.find(CALL(hook, reg("log"), "d")).remove()
    drv.run()
    assert [t for t, _ in reg["log"]] == ["a", "before-b", "B", "d"]


def test_wrapping_a_running_element_adds_a_frame_around_it():
    reg = Registers(x=0, log=[])
    body = CALL(toy.inc, reg("x"), store_to=reg("x"))
    loop = REPEAT(4, body)
    drv = BUFFER(2, loop, store_to=reg("b")).start()
    drv.run(max_steps=2)
    drv.find(where=lambda el: el is loop).insert_after(CALL(hook, reg("log"), "loop done", reg("x")))
    drv.find(where=lambda el: el is loop).insert_before(CALL(hook, reg("log"), "loop start", reg("x")))
    assert drv.position == "0.1.0"
    result = drv.run()
    assert reg["log"] == [("loop done", 4), ("loop start", 4), ("loop done", 8)]
    assert result == [None, None] and reg["x"] == 8 and drv.steps == 8 + 3


def test_fast_repeat_cache_is_dropped_so_the_next_step_runs_the_new_leaf():
    reg = Registers(x=0)
    drv = REPEAT(10, CALL(toy.inc, reg("x"), store_to=reg("x"))).start()
    drv.run(max_steps=3)
    assert drv.fast_path == "repeat-leaf"
    drv.find(toy.inc).replace_with(CALL(toy.mix, reg("x"), 0, k=2, store_to=reg("x")))
    assert drv.step() is INCOMPLETE and reg["x"] == 3 * 2 + 1
    drv.run()
    expected = 3
    for _ in range(7):
        expected = toy.mix(expected, 0, k=2)
    assert reg["x"] == expected and drv.steps == 10


def test_patches_inside_paused_weave_children_keep_turns_exact():
    def build(with_hook):
        reg = Registers(a=0, b=0, log=[])
        a = REPEAT(4, CALL(toy.inc, reg("a"), store_to=reg("a")))
        b = REPEAT(3, SEQ([CALL(toy.mix, reg("b"), 1, store_to=reg("b")), PRINT("b")]))
        return WEAVE(-1, [a, b], [2, 1]), reg

    ref = build(False)[0].start()
    ref.run()
    prog, reg = build(True)
    drv = prog.start()
    drv.run(max_steps=3)  # a a b: child 1 is paused inside its SEQ
    assert "..  " in str(drv)
    drv.find(PRINT("b")).replace_with(PRINT("B"))  # a paused, not yet started leaf
    drv.find(CALL(toy.mix)).insert_before(SEQ([]))  # zero-step edit inside the paused segment
    with pytest.raises(EditError, match="it is running \\(a child of a running WEAVE"):
        drv.find(where=lambda el: el.kind == "REPEAT" and el.n == 3).remove()
    drv.run()
    assert reg["a"] == ref.registers["a"] and reg["b"] == ref.registers["b"] and drv.steps == ref.steps


def test_a_weave_added_to_a_program_without_one_takes_turns():
    reg = Registers(log=[])
    drv = REPEAT(2, CALL(hook, reg("log"), "x", 0)).start()
    drv.run(max_steps=1)
    drv.find(hook).replace_with(WEAVE(-1, [REPEAT(2, CALL(hook, reg("log"), "p", 0)),
                                            REPEAT(2, CALL(hook, reg("log"), "q", 0))]))
    drv.run()
    assert [t for t, _ in reg["log"]] == ["x", "p", "q", "p", "q"]


def test_patched_drivers_copy_and_resume_exactly():
    def patched(k):
        prog, reg = fresh()
        drv = prog.start()
        drv.run(max_steps=k)
        drv.find(step_fn).insert_after(CALL(hook, reg("log"), "w", reg("w")))
        return drv

    for k in (0, 7, 30):
        ref = patched(k)
        ref.run()
        for cut in (0, 5, 17):
            for name, copier in COPIERS.items():
                drv = patched(k)
                drv.run(max_steps=cut)
                clone = copier(drv)
                clone.run()
                assert not diff(outcome(ref), outcome(clone)), (k, cut, name)


def test_a_patch_that_fails_verification_leaves_the_driver_unchanged():
    prog, reg = fresh()
    drv = prog.start()
    drv.run(max_steps=5)
    before = (str(drv), repr(drv.frame_paths()))
    with pytest.raises(flowvm.VerifyError, match="'never_written'"):
        drv.find(step_fn).insert_before(CALL(toy.inc, reg("never_written")))
    assert (str(drv), repr(drv.frame_paths())) == before
    drv.run()
    assert data_registers(drv) == data_registers(unpatched())


def test_a_polling_leaf_is_running_and_a_finished_driver_only_changes_its_program():
    log = []
    cd = Countdown(3, log)
    drv = SEQ([cd, PRINT("after")]).start()
    drv.run(max_steps=2)
    with pytest.raises(EditError, match="COUNTDOWN at path '0': it is running"):
        drv.find(where=lambda el: el is cd).replace_with(PRINT("x"))
    drv.find(where=lambda el: el is cd).insert_after(PRINT("hooked"))
    drv.run()
    assert drv.result is None and drv.steps == 4 + 2
    drv.find(PRINT("after")).remove()
    assert drv.done and "after" not in str(drv.program)


def test_while_and_switch_frames_are_remapped():
    reg = Registers(w=0, s=1, log=[])
    body = CALL(hook, reg("log"), "body", reg("w"))
    prog = SEQ([
        WHILE(CALL(toy.below, reg("w"), 3, store_to=reg("w")), body),
        SWITCH(reg("s"), {1: SEQ([PRINT("one"), CALL(hook, reg("log"), "case", 1)])}),
        PRINT("end"),
    ])
    drv = prog.start()
    drv.run(max_steps=2)  # condition, body
    drv.find(where=lambda el: el is body).insert_before(CALL(hook, reg("log"), "pre", reg("w")))
    drv.find(PRINT("one")).insert_after(CALL(hook, reg("log"), "after one", 0))
    drv.run()
    assert reg["log"] == [("body", 1), ("pre", 2), ("body", 2), ("pre", 3), ("body", 3), ("after one", 0),
                          ("case", 1)]


def test_a_move_that_failed_can_be_fixed_by_replacing_the_element_it_entered():
    reg = Registers(x=0)
    drv = SEQ([CALL(toy.const, "three", store_to=reg("n")),
               REPEAT(reg("n"), CALL(toy.inc, reg("x"), store_to=reg("x")))]).start()
    with pytest.raises(TypeError, match="count register 'n' holds str"):
        drv.run()
    assert drv.steps == 1
    with pytest.raises(TypeError, match="holds str"):  # retried, and raised again
        drv.step()
    drv.at("1").replace_with(REPEAT(3, CALL(toy.inc, reg("x"), store_to=reg("x"))))
    assert drv.position == "1.0"
    assert drv.run() == 3 and drv.steps == 4


def test_matches_of_a_driver_are_used_once():
    reg = Registers(log=[])
    drv = REPEAT(3, CALL(hook, reg("log"), "x", 0)).start()
    found = drv.find(hook)
    found.insert_before(PRINT("before"))
    with pytest.raises(EditError, match="program has changed since these matches"):
        found.insert_after(PRINT("after"))
    drv.find(hook).insert_after(PRINT("after"))
    assert [el.kind for el in drv.program.body.elements] == ["PRINT", "CALL", "PRINT"]


class Remote(Element):
    """A leaf with a child, like SPAWN: polls twice, then runs its fragment in place."""

    kind = "REMOTE"
    is_leaf = True

    def __init__(self, body):
        self._init(body=body)

    @property
    def children(self):
        return (self.body,)

    def with_children(self, children):
        return Remote(children[0])

    def bind(self, drv, frame):
        def leaf():
            polls = drv.live.setdefault(id(frame), [2])
            if polls[0]:
                polls[0] -= 1
                return flowvm.machine.driver.PENDING
            del drv.live[id(frame)]
            return self.body.run()
        return leaf


def test_edits_inside_a_polling_leaf_are_refused_and_allowed_before_it_starts():
    reg = Registers(x=0)
    remote = Remote(CALL(toy.inc, reg("x"), store_to=reg("x")))
    drv = SEQ([PRINT("a"), remote]).start()
    drv.run(max_steps=1)
    drv.find(toy.inc).replace_with(CALL(toy.const, 10, store_to=reg("x")))  # not started yet: fine
    drv.step()  # polls: now it is running
    with pytest.raises(EditError, match="cannot edit inside REMOTE at path '1': it is running"):
        drv.find(toy.const).replace_with(CALL(toy.const, 20, store_to=reg("x")))
    drv.run()
    assert reg["x"] == 10 and drv.steps == 4


def test_a_weave_child_waiting_for_its_first_turn_can_be_removed():
    def build(n_children):
        reg = Registers(log=[])
        kids = [REPEAT(2, CALL(hook, reg("log"), name, 0)) for name in "abc"[:n_children]]
        return WEAVE(-1, kids), reg

    ref = build(2)[0].start()
    ref.run()
    prog, reg = build(3)
    drv = prog.start()
    drv.run(max_steps=1)  # a; b has the turn; c waits for its first
    drv.find(CALL(hook, reg("log"), "c")).replace_with(PRINT("unused"))  # not started: fine
    drv.at("2").remove()
    assert len(drv.program.elements) == 2
    assert drv.run() == [None, None] and [t for t, _ in reg["log"]] == [t for t, _ in ref.registers["log"]]
    prog, reg = build(3)
    drv = prog.start()
    drv.run(max_steps=4)  # a b c a: a finished its two steps at the next turn; c is paused
    with pytest.raises(EditError, match="cannot remove REPEAT 2 at path '2': it is running"):
        drv.at("2").remove()
    drv.run(max_steps=1)  # b finishes
    with pytest.raises(EditError, match="it has finished and its value is part of"):
        drv.at("1").remove()


def test_add_a_hook_to_a_training_run_loaded_from_a_checkpoint_and_resume_it(tmp_path):
    """The issue's scenario on the bundled RBM: CD-1 updates at step N, a hook added after a restart."""
    from flowvm.programs import rbm
    from flowvm.testing import same

    def build():
        return rbm.build(samples=200, side=4, hidden=6, epochs=3, batch_size=20)

    ref = build().start()
    ref.run()
    drv = build().start()
    drv.run(max_steps=25)
    flowvm.save(drv, tmp_path / "rbm.ckpt")
    loaded = flowvm.load(tmp_path / "rbm.ckpt")
    reg = loaded.registers
    seen = []
    cd1 = loaded.find(where=lambda el: getattr(el, "fn", None) is not None and el.fn.__name__ == "cd1")
    assert cd1.paths == ["2.0.0.0.1"]
    cd1.insert_after(CALL(seen.append, reg("batch_error")))
    loaded.run()
    assert same(loaded.registers["parameters"], ref.registers["parameters"])
    assert loaded.registers["errors"] == ref.registers["errors"]
    # steps: 2 first, then per epoch 10 batches of (next_batch, cd1) and 2 more; cd1 runs at these steps
    cd1_steps = [2 + 22 * e + 2 * b + 2 for e in range(3) for b in range(10)]
    assert len(seen) == sum(1 for s in cd1_steps if s >= 25) and seen[-1] == ref.registers["batch_error"]
    assert loaded.steps == ref.steps + len(seen)


def _log(t, x):
    return t + (x,)


def _mark(reg, tag):
    return CALL(_log, reg("t"), tag, store_to=reg("t"))


@pytest.mark.parametrize("via", ["step", "run"])
def test_a_container_the_run_has_only_entered_is_not_started(via):
    """After a leaf the driver enters the containers on its way to the next leaf; none of their steps has
    run, so they can be replaced or removed, and an element inserted before them (or after the element
    that just finished) runs first."""
    def advance(drv, n):
        for _ in range(n):
            drv.step() if via == "step" else drv.run(max_steps=1)

    cases = [
        (lambda reg: SEQ([_mark(reg, "x"), REPEAT(3, _mark(reg, "y"))]), 1,
         lambda drv: drv.at("0").insert_after(_mark(drv.registers, "W")), ("x", "W", "y", "y", "y")),
        (lambda reg: SEQ([_mark(reg, "x"), SEQ([_mark(reg, "y"), _mark(reg, "z")])]), 1,
         lambda drv: drv.at("1").insert_before(_mark(drv.registers, "W")), ("x", "W", "y", "z")),
        (lambda reg: SEQ([_mark(reg, "x"), REPEAT(3, _mark(reg, "y"))]), 1,
         lambda drv: drv.at("1").replace_with(_mark(drv.registers, "R")), ("x", "R")),
        (lambda reg: SEQ([_mark(reg, "x"), REPEAT(3, _mark(reg, "y")), _mark(reg, "z")]), 1,
         lambda drv: drv.at("1").remove(), ("x", "z")),
        (lambda reg: REPEAT(3, SEQ([_mark(reg, "a"), _mark(reg, "b")])), 2,  # the body begins again
         lambda drv: drv.at("0").insert_before(_mark(drv.registers, "W")), ("a", "b", "W", "a", "b", "W", "a", "b")),
    ]
    for build, k, patch, expected in cases:
        reg = Registers(t=())
        drv = build(reg).start()
        advance(drv, k)
        patch(drv)
        drv.run()
        assert reg["t"] == expected, (expected, reg["t"])
    reg = Registers(t=())
    drv = SEQ([_mark(reg, "x"), REPEAT(3, _mark(reg, "y"))]).start()
    advance(drv, 2)  # the REPEAT has run an iteration: it is running
    with pytest.raises(EditError, match="it is running"):
        drv.at("1").replace_with(_mark(drv.registers, "R"))


def test_a_patch_of_a_driver_that_has_not_stepped_reads_no_register():
    reg = Registers(t=(), n=1)
    drv = SEQ([REPEAT(reg("n"), _mark(reg, "a")), _mark(reg, "z")]).start()
    assert drv.run(max_steps=0) is INCOMPLETE and drv.position is None  # entered nothing, read nothing
    drv.at("1").insert_after(_mark(drv.registers, "W"))
    reg["n"] = 3  # read by the first step, as without the patch
    drv.run()
    assert reg["t"] == ("a", "a", "a", "z", "W")
