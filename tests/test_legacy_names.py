"""flowvm 0.1's and 0.2's module paths keep working for one release, each with a DeprecationWarning that
names the new path (flowvm/legacy.py, docs/api.md)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import flowvm
from flowvm.legacy import MOVED

# old module, a name it had, the path the warning names
OLD = [
    ("flowvm.fused.internals", "aoti_library", "flowvm.fused.torch_internals.aoti_library"),
    ("flowvm.machine.history", "attach", "flowvm.machine.metrics.attach"),
    ("flowvm.machine.compile", "leaf_function", "flowvm.machine.leafcode.leaf_function"),
    ("flowvm.machine.running", "__name__", None),
    ("flowvm.program.element", "Leaf", "flowvm.Leaf"),
    ("flowvm.distributed.checkpoints", "read_manifest", "flowvm.distributed.coordinated.read_manifest"),
    ("flowvm.distributed.launching", "RankError", "flowvm.distributed.agent.RankError"),
    ("flowvm.analysis", "all_registers", "flowvm.program.analysis.all_registers"),
    ("flowvm.checkpoint", "read_header", "flowvm.read_header"),
    ("flowvm.checkpoint", "save", "flowvm.save"),
    ("flowvm.cli", "main", "flowvm.command.cli.main"),
    ("flowvm.cli", "parse_sets", "flowvm.command.targets.parse_sets"),
    ("flowvm.compile", "leaf_function", "flowvm.machine.leafcode.leaf_function"),
    ("flowvm.data", "Batches", "flowvm.Batches"),
    ("flowvm.depends", "Depends", "flowvm.Depends"),
    ("flowvm.dot", "to_dot", "flowvm.to_dot"),
    ("flowvm.driver", "Driver", "flowvm.Driver"),
    ("flowvm.driver", "INCOMPLETE", "flowvm.INCOMPLETE"),
    ("flowvm.edit", "ANY", "flowvm.ANY"),
    ("flowvm.elements", "CALL", "flowvm.CALL"),
    ("flowvm.environment", "capture_random", "flowvm.base.environment.capture_random"),
    ("flowvm.errors", "CheckpointError", "flowvm.CheckpointError"),
    ("flowvm.errors", "SpawnTimeout", "flowvm.SpawnTimeout"),
    ("flowvm.executors", "register_executor", "flowvm.register_executor"),
    ("flowvm.hotpatch", "__name__", None),
    ("flowvm.idle", "__name__", None),
    ("flowvm.namespaces", "isolate", "flowvm.isolate"),
    ("flowvm.passes.fused_runtime", "__name__", None),
    ("flowvm.paths", "format_path", "flowvm.program.paths.format_path"),
    ("flowvm.printer", "listing", "flowvm.program.printer.listing"),
    ("flowvm.registers", "Registers", "flowvm.Registers"),
    ("flowvm.runner", "__name__", None),
    ("flowvm.source", "to_source", "flowvm.to_source"),
    ("flowvm.verify", "verify", "flowvm.verify"),
    ("flowvm.fastpaths", "__name__", None),
    ("flowvm.fileformat", "MAGIC", "flowvm.persist.fileformat.MAGIC"),
    ("flowvm.frames", "child_index", "flowvm.machine.frames.child_index"),
    ("flowvm.job", "__name__", None),
    ("flowvm.match", "ANY", "flowvm.ANY"),
    ("flowvm.pickler", "Pickler", "flowvm.persist.pickler.Pickler"),
    ("flowvm.remote", "__name__", None),
    ("flowvm.running", "__name__", None),
    ("flowvm.sentinels", "PENDING", "flowvm.PENDING"),
    ("flowvm.storage", "__name__", None),
    ("flowvm.version", "__version__", None),
]


@pytest.fixture
def fresh():
    """The old modules as if never imported (each test imports them anew), and flowvm's attributes kept."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name in MOVED}
    attributes = dict(vars(flowvm))
    yield
    for name in [n for n in sys.modules if n in MOVED]:
        del sys.modules[name]
    sys.modules.update(saved)
    for name in [n for n in vars(flowvm) if n not in attributes]:
        delattr(flowvm, name)


def test_every_old_module_is_tested():
    assert {old for old, _, _ in OLD} == set(MOVED)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_importing_an_old_module_works_and_warns_naming_the_new_one(fresh, old):
    with pytest.warns(DeprecationWarning, match=rf"the module {old} is deprecated .*: use {MOVED[old][0]}$"):
        module = importlib.import_module(old)
    assert module is sys.modules[old]


@pytest.mark.parametrize("old, name, new", [row for row in OLD if row[2]], ids=lambda v: v or "")
def test_a_name_from_an_old_module_works_and_warns_naming_its_new_path(fresh, old, name, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} is deprecated .*: use {new}$") as record:
        value = getattr(module, name)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller's line
    where, _, attribute = new.rpartition(".")
    assert value is getattr(importlib.import_module(where), attribute)


def test_from_import_and_import_statements_of_0_1(fresh):
    with pytest.warns(DeprecationWarning) as record:
        from flowvm.checkpoint import read_header
        import flowvm.checkpoint
        header = flowvm.checkpoint.read_header
    assert read_header is header is flowvm.read_header
    messages = [str(w.message) for w in record]
    assert messages[0].startswith("the module flowvm.checkpoint is deprecated")
    assert all("use flowvm.read_header" in m for m in messages[1:]) and len(messages) == 3
    assert {w.filename for w in record} == {__file__}


def test_an_old_module_named_like_a_function_leaves_the_function(fresh):
    with pytest.warns(DeprecationWarning):
        import flowvm.verify
        from flowvm.verify import verify
    assert verify is flowvm.verify and callable(flowvm.verify) and not isinstance(flowvm.verify, type(sys))


def test_old_modules_are_attributes_of_the_package_too(fresh):
    with pytest.warns(DeprecationWarning) as record:
        writes = flowvm.analysis.writes
    assert writes is importlib.import_module("flowvm.program.analysis").writes
    assert [str(w.message).rpartition(": use ")[2] for w in record] == ["flowvm.program.analysis",
                                                                     "flowvm.program.analysis.writes"]
    assert {w.filename for w in record} == {__file__}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        flowvm.nothing


def test_the_names_of_0_1_processes_module_work_and_warn():
    with pytest.warns(DeprecationWarning, match=r"^flowvm.processes.SpawnTimeout is deprecated .*: use "
                                                r"flowvm.SpawnTimeout$") as record:
        from flowvm.processes import SpawnTimeout
    assert {w.filename for w in record} == {__file__}
    assert SpawnTimeout is flowvm.SpawnTimeout
    with pytest.warns(DeprecationWarning, match="use flowvm.processes.executors.default_executor"):
        from flowvm.processes import default_executor  # noqa: F401
    with pytest.raises(ImportError):
        from flowvm.processes import nothing_of_the_kind  # noqa: F401


def test_a_name_flowvm_no_longer_has_is_an_import_error(fresh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ImportError, match="capture_rng"):
            from flowvm.checkpoint import capture_rng  # noqa: F401


def test_a_script_of_0_1_runs_and_is_warned_in_a_fresh_process():
    script = ("from flowvm.elements import CALL, SEQ\nfrom flowvm.registers import Registers\n"
              "from flowvm.checkpoint import read_header\nimport flowvm.checkpoint\n"
              "reg = Registers(x=1)\nprint(SEQ([CALL(lambda v: v + 1, reg('x'))]).run())\n")
    out = subprocess.run([sys.executable, "-P", "-W", "default::DeprecationWarning", "-c", script],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
    assert "flowvm.elements.CALL is deprecated and goes away in the next release: use flowvm.CALL" in out.stderr
    assert "the module flowvm.checkpoint is deprecated" in out.stderr
