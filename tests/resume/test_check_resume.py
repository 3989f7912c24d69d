"""flowvm.testing.check_resume: the resume search on a user's own builder, in fresh processes."""

from __future__ import annotations

import pytest

import flowvm
from flowvm.testing import check_resume

import rbuilders

pytestmark = pytest.mark.timeout(300)


def test_a_resumable_builder_passes_every_copy_path_and_environment():
    report = check_resume(rbuilders.good, cuts=3, seed=1)
    assert report["checked"] == len(report["cuts"]) * 5 and report["refusals"] == []
    assert report["outcome"]["steps"] == 24 and report["processes"] >= 3
    # numpy only: where torch is not imported before the load, nothing imports it
    lazy = check_resume(rbuilders.good, cuts=[7], copiers=["pickle", "checkpoint", "state"],
                        environments=["torch-lazy"])
    assert lazy["imported_torch"] == [] and lazy["processes"] == 1  # one process resumed all three


def test_a_generator_no_copy_carries_is_caught_with_where_and_what():
    with pytest.raises(AssertionError) as caught:
        check_resume(rbuilders.leaky, cuts=[3], copiers=["pickle"], environments=["torch-lazy"])
    message = str(caught.value)
    assert "the copy after 3 of 6 steps via pickle, resumed in torch imported only by the program" in message
    assert "differs from the uninterrupted run" in message and "register 'total'" in message


def test_a_builder_whose_straight_runs_differ_is_named():
    with pytest.raises(AssertionError, match="two uninterrupted runs of build"):
        check_resume(rbuilders.private_draw_unseeded, cuts=1)


def test_a_copy_between_forward_and_backward_is_a_refusal_reported():
    if not hasattr(flowvm, "CopyError"):
        pytest.skip("this flowvm has no CopyError")
    report = check_resume(rbuilders.train, cuts=[2, 4], copiers=["pickle", "checkpoint", "deepcopy"],
                          environments=["torch-before"])
    assert sorted({(k, how) for k, how, _ in report["refusals"]}) == [(2, "checkpoint"), (2, "deepcopy"),
                                                                        (2, "pickle")]
    assert "registers/loss" in report["refusals"][0][2]
    assert report["checked"] == 3  # the cut after the backward: copied and resumed exactly


def test_unknown_copiers_and_environments_are_named():
    with pytest.raises(ValueError, match="unknown copier 'json'"):
        check_resume(rbuilders.good, copiers=["json"])
    with pytest.raises(ValueError, match="unknown environment 'gpu'"):
        check_resume(rbuilders.good, environments=["gpu"])
