"""flowvm's own exceptions travel between processes: pickled, they come back with type, message and attributes."""

import copy
import pickle

from flowvm.base.errors import CopyError, UsageError
from flowvm.base.interrupts import Interrupted
from flowvm.persist.refusals import LiveGraph
from flowvm.distributed.replicas import ReplicaError
from flowvm.distributed.group import AllRanksError, SaveFailed

import cloudpickle
import pytest

from flowvm.editing.edit import EditError
from flowvm.base.errors import CheckpointError, FlowError, RegisterError, SwitchError, VerifyError
from flowvm.base.errors import SpawnError, SpawnTimeout, WorkerError
from flowvm.distributed import RankError
from flowvm.passes import PassError, UnknownPassError
from flowvm.processes.leaves import CommandError
from flowvm.views.source import SourceError

SAMPLES = [
    RegisterError("CALL argument: register 'x' holds no value", "x", "0.1"),
    SwitchError("SWITCH selector value 'c' has no case", "c", "2"),
    CheckpointError("/tmp/run.ckpt", "truncated: only 3 bytes"),
    VerifyError("register 'w' is read before it is written", "1.0", "w"),
    EditError("no element matches CALL(abs)", "0.2"),
    PassError("flatten produced a program that does not verify", "flatten", "3", "y"),
    SourceError("a lock has no source form", "1"),
    CommandError(2, ["make", "all"], "out", "missing target"),
    SpawnError("the worker process running the fragment died"),
    SpawnTimeout("the fragment ran longer than the timeout of 1 s"),
    FlowError("plain"),
    UnknownPassError("no optimizer pass named 'nope'; known passes: flatten", "nope"),
    WorkerError("Batches: worker 1 (pid 123) failed on sample 7: ValueError"),
    RankError(1, 1, "ValueError: boom", "Traceback (most recent call last): ..."),
    CopyError("<copy>", "holds a tensor whose autograd graph a later backward() may still run through",
              "registers/loss"),
    UsageError("option 'lr' takes a finite number, got '1e999'"),
    Interrupted("Batches: stopped by SIGTERM: worker 0 (pid 7, stopped) made nothing for 3 s", 15),
    LiveGraph(7),  # (the pickler's signal, carrying the tensor it met)
    ReplicaError("the ranks train different models: registers/net holds a torch module", "registers/net", (1,), 4),
    AllRanksError("the ranks' programs take different numbers of steps (55 to 64)"),
    SaveFailed("/runs/a", "rank 1 could not save its part (No space left on device); the previous checkpoint is kept"),
]

COPIERS = {
    "pickle": lambda e: pickle.loads(pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)),
    "pickle-0": lambda e: pickle.loads(pickle.dumps(e, protocol=0)),
    "cloudpickle": lambda e: cloudpickle.loads(cloudpickle.dumps(e)),
    "deepcopy": copy.deepcopy,
}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@pytest.mark.parametrize("copier", sorted(COPIERS))
@pytest.mark.parametrize("err", SAMPLES, ids=lambda e: type(e).__name__)
def test_an_error_survives_copying_with_type_message_and_attributes(err, copier):
    err = copy.copy(err)  # a note of its own: the samples are shared between tests
    err.add_note("flowvm: while running CALL abs(x) at path '0.1' (step 3)")
    err.child_traceback = "Traceback (most recent call last): ..."
    again = COPIERS[copier](err)
    assert type(again) is type(err)
    assert str(again) == str(err) and again.args == err.args
    assert vars(again) == vars(err)
    assert again.__notes__ == err.__notes__ and again.child_traceback == err.child_traceback


def test_the_named_attributes_come_back():
    reg, sw, ck, pe = (pickle.loads(pickle.dumps(e)) for e in SAMPLES[:3] + [SAMPLES[5]])
    assert (reg.register, reg.path, str(reg)) == ("x", "0.1", "CALL argument: register 'x' holds no value")
    assert isinstance(reg, KeyError) and isinstance(sw, LookupError)
    assert (sw.value, sw.path) == ("c", "2")
    assert (ck.path, ck.reason) == ("/tmp/run.ckpt", "truncated: only 3 bytes")
    assert str(ck) == "checkpoint '/tmp/run.ckpt': truncated: only 3 bytes"  # not formatted twice
    assert (pe.pass_name, pe.path, pe.register) == ("flatten", "3", "y")
    cmd = pickle.loads(pickle.dumps(SAMPLES[7]))
    assert (cmd.returncode, cmd.cmd, cmd.stderr) == (2, ["make", "all"], "missing target")
    assert "missing target" in str(cmd)


def test_a_value_that_is_not_a_string_keeps_its_type():
    sel = (1, 2.5)
    err = pickle.loads(pickle.dumps(SwitchError("no case for (1, 2.5)", sel)))
    assert err.value == sel and type(err.value) is tuple and err.path == ""


def test_every_flowvm_exception_class_is_covered():
    classes = {c for c in _subclasses(FlowError) if c.__module__.startswith("flowvm.")} | {FlowError}
    missing = sorted(c.__qualname__ for c in classes - {type(e) for e in SAMPLES})
    assert not missing, f"add a sample of {missing} to SAMPLES"
