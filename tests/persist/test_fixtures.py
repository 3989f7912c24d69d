"""Checkpoints written by every flowvm release that changed the format (tests/fixtures/, made by
make_fixtures.py) load and finish bit for bit, and name flowvm objects only by stable public names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flowvm
from flowvm.pickled import LEGACY_NAMES, STABLE_MODULES
from flowvm.testing import digest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
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
    assert states == mine - {"sweep"}, "run tests/fixtures/make_fixtures.py"
    assert all((FIXTURES / file).is_file() for file in ALL)


@pytest.mark.parametrize("file", sorted(STATES))
def test_a_state_fixture_loads_into_its_program_built_again_and_finishes_bit_for_bit(file, one_thread):
    import importlib

    info = STATES[file]
    module = importlib.import_module(f"flowvm.programs.{info['program']}")
    drv = flowvm.load_state(FIXTURES / file, module.build(**info["options"]))
    assert drv.steps == info["saved_at_step"]
    drv.run()
    assert digest(dict(drv.registers)) == info["registers"], f"{file} finished differently"
    assert drv.steps == info["steps"]


@pytest.mark.parametrize("file", sorted(DIGESTS))
def test_a_fixture_loads_and_finishes_bit_for_bit(file, one_thread):
    info = DIGESTS[file]
    header = flowvm.read_header(FIXTURES / file)
    assert header["flowvm"] == info["flowvm"] and header["steps"] == info["saved_at_step"]
    drv = flowvm.load(FIXTURES / file)
    drv.run()
    assert digest(dict(drv.registers)) == info["registers"], f"{file} finished differently"
    if info["program"] != "sweep":  # a SPAWN's polls depend on timing
        assert drv.steps == info["steps"]


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
