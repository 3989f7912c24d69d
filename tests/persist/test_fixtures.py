"""Checkpoints written by every flowvm release that changed the format (tests/fixtures/, made by
make_fixtures.py) load and finish bit for bit, and name flowvm objects only by stable public names."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import flowvm
from flowvm.pickled import LEGACY_NAMES, STABLE_MODULES
from flowvm.testing import diff, digest, outcome

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
_spec = importlib.util.spec_from_file_location("fixture_summaries", FIXTURES / "summaries.py")
summaries = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summaries)
HERE = summaries.fingerprint(summaries.machine())  # this machine, as digests.json names machines
ALL = json.loads((FIXTURES / "digests.json").read_text())
DIGESTS = {file: info for file, info in ALL.items() if info.get("kind", "pickle") == "pickle"}
STATES = {file: info for file, info in ALL.items() if info.get("kind") == "state"}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the fixtures were made
    yield
    torch.set_num_threads(before)


def test_every_bundled_program_has_a_fixture_of_this_release():
    from flowvm.command.targets import bundled_programs

    mine = {info["program"] for file, info in DIGESTS.items() if info["flowvm"] == flowvm.__version__}
    assert mine == {name for name, _, _ in bundled_programs()}, "run tests/fixtures/make_fixtures.py"
    states = {info["program"] for file, info in STATES.items() if info["flowvm"] == flowvm.__version__}
    assert states == mine - {"sweep", "charlm"}, "run tests/fixtures/make_fixtures.py"  # (their NO_STATE)
    assert all((FIXTURES / file).is_file() for file in ALL)


def _start(file: str, info: dict, path=None):
    """The fixture (or a copy of it saved at path) loaded, into its program built again for a state file."""
    import importlib

    if info.get("kind") == "state":
        module = importlib.import_module(f"flowvm.programs.{info['program']}")
        if path is None:
            return flowvm.load_state(FIXTURES / file, module.build(**info["options"]))
        # saved later in the run, the state may hold the results the program makes (a fitted model)
        made = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]
        return flowvm.load_state(path, module.build(**info["options"]), classes=made)
    return flowvm.load(FIXTURES / file if path is None else path)


def _save(drv, info: dict, path) -> None:
    (flowvm.save_state if info.get("kind") == "state" else flowvm.save)(drv, path)


def check_finishes(file: str, info: dict, tmp_path) -> dict:
    """What a fixture proves here.  Its digest, bit for bit, on a machine that digests.json lists for it (one
    that reproduced it: same CPU kernels, Python, torch and numpy); on any other machine a torch run may end
    with other last digits (MKL picks its sgemm kernel by the CPU), and then: it loads at its recorded step
    and ends at its recorded step count, finishing it straight and finishing it saved and loaded again part
    way give the same registers bit for bit, and these agree with the recorded summaries to float tolerance."""
    timed = info["program"] == "sweep"  # a SPAWN's polls depend on timing
    drv = _start(file, info)
    assert drv.steps == info["saved_at_step"]
    drv.run()
    straight = outcome(drv)
    if not timed:
        assert drv.steps == info["steps"]
    same_digest = digest(dict(drv.registers)) == info["registers"]
    if HERE in info.get("machines", []):
        assert same_digest, f"{file} finished differently on a machine that reproduced it"
    half = _start(file, info)
    half.run(max_steps=(info["saved_at_step"] + info["steps"]) // 2)
    _save(half, info, tmp_path / f"half-{file}")
    again = _start(file, info, tmp_path / f"half-{file}")
    again.run()
    assert diff(straight, outcome(again), steps=not timed) == [], f"{file}: saving part way changed the run"
    assert same_digest or "summaries" in info, \
        f"{file} finished with other digits and digests.json has no summaries: run make_fixtures.py --summarize"
    if "summaries" in info:
        problems = summaries.mismatches(info["summaries"], summaries.summarize(drv.registers))
        assert not problems, f"{file} finished beyond float tolerance of the recorded run: {problems}"
    return straight


@pytest.mark.parametrize("file", sorted(STATES))
def test_a_state_fixture_loads_into_its_program_built_again_and_finishes_bit_for_bit(file, one_thread, tmp_path):
    check_finishes(file, STATES[file], tmp_path)


@pytest.mark.parametrize("file", sorted(DIGESTS))
def test_a_fixture_loads_and_finishes_bit_for_bit(file, one_thread, tmp_path):
    info = DIGESTS[file]
    header = flowvm.read_header(FIXTURES / file)
    assert header["flowvm"] == info["flowvm"] and header["steps"] == info["saved_at_step"]
    check_finishes(file, info, tmp_path)


@pytest.mark.parametrize("file", sorted(f for f, i in DIGESTS.items()
                                        if i["flowvm"] == flowvm.__version__ and i["program"] in ("mlp", "lbfgs")))
def test_a_fixture_saved_part_way_finishes_bit_for_bit_in_a_fresh_process(file, one_thread, tmp_path):
    import pickle
    import subprocess
    import sys

    info = DIGESTS[file]
    straight = check_finishes(file, info, tmp_path)
    half = flowvm.load(FIXTURES / file)
    half.run(max_steps=(info["saved_at_step"] + info["steps"]) // 2)
    flowvm.save(half, tmp_path / "half.ckpt")
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(tests / "resume_child.py"), "checkpoint", str(tmp_path / "half.ckpt"),
                    str(tmp_path / "out.pkl")], check=True, timeout=120, env=env, cwd=str(tmp_path))
    got = pickle.loads((tmp_path / "out.pkl").read_bytes())
    assert "error" not in got, got.get("error")
    assert diff(straight, got["outcome"]) == []


def test_the_summaries_tell_apart_values_beyond_the_tolerance(one_thread):
    file = max(f for f, i in DIGESTS.items() if i["program"] == "mlp")
    drv = flowvm.load(FIXTURES / file)
    drv.run()
    registers = dict(drv.registers)
    assert summaries.mismatches(DIGESTS[file]["summaries"], summaries.summarize(registers)) == []
    for scale, moved in ((1 + summaries.RTOL / 20, False), (1 + summaries.RTOL * 20, True)):
        changed = dict(registers, weights=[w * scale for w in registers["weights"]])
        problems = summaries.mismatches(DIGESTS[file]["summaries"], summaries.summarize(changed))
        assert bool(problems) == moved and all("'weights'" in p for p in problems), (scale, problems)
    one_more = dict(registers, epoch=registers["epoch"] + 1)  # a count is compared exactly
    assert summaries.mismatches(DIGESTS[file]["summaries"], summaries.summarize(one_more)) == [
        "register 'epoch': its non-float content or its number of floats differs"]


def _private(module: str, name: str) -> bool:
    if module.startswith("flowvm.programs."):
        return any(part.startswith("_") for part in (module + "." + name).split("."))
    return module not in STABLE_MODULES or name.startswith("_")


@pytest.mark.parametrize("file", sorted(f for f, i in DIGESTS.items() if i["flowvm"] == flowvm.__version__))
def test_a_fixture_of_this_release_names_only_stable_public_names(file):
    named = [r for r in flowvm.persist.checkpoint.references(FIXTURES / file) if r[0].split(".")[0] == "flowvm"]
    assert named, "the reference scan found nothing"
    private = [f"{m}.{n}" for m, n in named if _private(m, n)]
    assert not private, f"{file} names flowvm objects by module paths that may move: {private}"


@pytest.mark.parametrize("file", sorted(f for f, i in DIGESTS.items() if i["flowvm"] != flowvm.__version__))
def test_an_older_fixture_names_only_what_the_legacy_table_maps(file):
    named = [r for r in flowvm.persist.checkpoint.references(FIXTURES / file) if r[0].split(".")[0] == "flowvm"]
    unmapped = [f"{m}.{n}" for m, n in named
                if _private(m, n) and (m, n.partition(".")[0]) not in LEGACY_NAMES]
    assert not unmapped, f"{file} names {unmapped}, which flowvm.pickled.LEGACY_NAMES does not map"


def test_the_reference_scan_sees_a_private_name(tmp_path):
    from flowvm import CALL, Registers
    from flowvm.persist.checkpoint import references

    reg = Registers(x=1)
    drv = CALL(flowvm.testing._feed, None, reg("x")).start()
    flowvm.save(drv, tmp_path / "p.ckpt")
    assert ("flowvm.testing", "_feed") in references(tmp_path / "p.ckpt")
    assert _private("flowvm.testing", "_feed") and not _private("flowvm", "CALL")


def test_every_object_a_saved_run_may_name_is_marked_with_its_stable_name():
    from flowvm import pickled

    pickled.check()
    assert flowvm.CALL.__module__ == "flowvm" and flowvm.pickled.rebuild_driver.__module__ == "flowvm.pickled"
