"""A SPAWN fragment raising KeyboardInterrupt or SystemExit in its worker: a SpawnError here, never a Ctrl-C or an
exit of this process, with the driver consistent and the step retried."""

from __future__ import annotations

import pickle
import sys

import pytest

from flowvm import CALL, SPAWN, Registers, SpawnError


def stop_in_worker(kind, tries):
    if tries < 1:
        raise KeyboardInterrupt if kind == "kbd" else SystemExit(3)
    return "done"


def bump(tries):
    return tries + 1


@pytest.mark.parametrize("kind, named", [("kbd", "KeyboardInterrupt"), ("exit", "SystemExit")])
def test_a_fragments_keyboardinterrupt_or_systemexit_is_a_spawn_error_here(kind, named):
    reg = Registers(kind=kind, tries=0)
    drv = SPAWN(CALL(stop_in_worker, reg("kind"), reg("tries"), store_to=reg("out"))).start()
    with pytest.raises(SpawnError, match=f"raised {named}") as info:
        drv.run()
    assert "its traceback there" in "\n".join(info.value.__notes__)
    steps = drv.steps
    copy = pickle.loads(pickle.dumps(drv))  # consistent: it copies, and the step is retried
    for d in (drv, copy):
        d.registers["tries"] = 1
        assert d.run() == "done" and d.registers["out"] == "done" and d.steps > steps
    assert sys.exc_info() == (None, None, None)
