"""flowvm.testing: the resume check users run on their own programs."""

import random

import pytest

import flowvm
from flowvm import CALL, REPEAT, Registers


def test_assert_same_run_passes_a_seeded_build_and_says_when_build_is_not_deterministic():
    def seeded():
        random.seed(3)
        reg = Registers()
        return REPEAT(5, CALL(random.random, store_to=reg("r")))

    expected = flowvm.testing.assert_same_run(seeded)
    assert expected["steps"] == 5

    def unseeded():
        reg = Registers()
        return REPEAT(3, CALL(random.random, store_to=reg("r")))

    with pytest.raises(AssertionError, match="seed the global random generators inside build"):
        flowvm.testing.assert_same_run(unseeded)


SHARED: list = []  # state outside the registers: a copied run cannot carry it


def _append_and_count():
    SHARED.append(1)
    return len(SHARED)


def test_assert_same_run_catches_state_a_copy_does_not_carry():
    def build():
        SHARED.clear()
        reg = Registers()
        return REPEAT(3, CALL(_append_and_count, store_to=reg("n")))

    with pytest.raises(AssertionError, match="resumed after .* steps via pickle differs from an uninterrupted run"):
        flowvm.testing.assert_same_run(build, copiers=["pickle"])
