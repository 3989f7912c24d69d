"""The resume search's targets: programs of the shapes outside probes found resuming differently (issue 35),
each checked through every copy path at the cuts that matter; the generated search (test_resume_search.py)
finds them too, these keep them found whatever the random draws.

- a copy between a training step's forward CALL and its backward: refused (CopyError), or, for the
  command's saves, taken at the next step from which the resume is exact;
- a copy resumed where only the program imports torch, after the load: torch's generator state and its
  settings (the default dtype) as the copy had them;
- a subclass of an element kind is that kind everywhere (a WEAVE subclass abandoning its LOOP).
"""

from __future__ import annotations

import random
import tempfile

import pytest

import rgen
import rsearch

pytestmark = pytest.mark.timeout(300)

ALL = rsearch.ALL_PATHS


def failures_of(spec, cut, paths=ALL, envs=("torch-before", "torch-lazy", "same-process"), seed=0):
    opts = rsearch.Options(paths=paths, cli="cli" in paths, envs=envs, only_cut=cut, lazy_jobs=5)
    return rsearch.check_program(spec, random.Random(seed), opts, rsearch.Figures(), tempfile.mkdtemp())


def assert_none(found):
    assert not found, "\n\n".join(f.describe() for f in found)


TRAIN = ["seq", False, [["leaf", False, "train-step", {"seed": 3, "opt": "sgd"}],
                        ["leaf", False, "train-step", {"seed": 3, "opt": "sgd"}]]]


@pytest.mark.parametrize("cut", [2, 3])
def test_a_copy_between_forward_and_backward_is_refused_never_different(cut):
    """After zero_grad and the forward CALL (cut 2) the loss holds a live graph: every copy path refuses,
    the command steps on; after the backward (cut 3) everything copies and resumes exactly."""
    found = failures_of(TRAIN, cut, paths=("pickle", "cloudpickle", "deepcopy", "checkpoint", "state"))
    assert_none(found)


def test_the_command_saving_between_forward_and_backward_steps_on():
    assert_none(failures_of(TRAIN, 2, paths=("cli",)))


LAZY_DRAW = ["seq", False, [["leaf", False, "torch-draw", 0], ["leaf", False, "torch-draw", 0]]]
LAZY_DTYPE = ["seq", False, [["leaf", False, "torch-setting", ["dtype", "float64"]],
                             ["leaf", False, "torch-compute", 0]]]


@pytest.mark.parametrize("spec", [LAZY_DRAW, LAZY_DTYPE], ids=["torch-draw", "default-dtype"])
def test_where_only_the_program_imports_torch_the_copy_still_sets_its_state(spec):
    assert_none(failures_of(spec, 1, paths=("pickle", "checkpoint", "state"), envs=("torch-lazy",)))


SUB_WEAVE = ["weave", True, 1, [["loop", False, ["leaf", False, "int", [0, 0, 0]]],
                                ["repeat", False, 5, ["leaf", False, "int", [0, 1, 1]], False]], None]


def subclassed(kind_spec):
    """Every node of a spec made its kind's subclass."""
    node = list(kind_spec)
    node[1] = True
    for i, part in enumerate(node):
        if isinstance(part, list) and part and isinstance(part[0], str):
            node[i] = subclassed(part)
        elif isinstance(part, list) and part and isinstance(part[0], list):
            node[i] = [subclassed(c) for c in part]
    return node


EVERY_KIND = subclassed(["seq", False, [
    ["leaf", False, "print", 0],
    ["weave", False, 1, [["loop", False, ["leaf", False, "int", [0, 0, 0]]],
                         ["repeat", False, 2, ["leaf", False, "record", 1], True]], [2, 1]],
    ["while", False, 2, ["switch", False, ["leaf", False, "int", [1, 2, 1]], ["leaf", False, "py-random", 0]]],
    ["buffer", False, 2, ["leaf", False, "np-random", 0]]]])


@pytest.mark.parametrize("spec", [SUB_WEAVE, EVERY_KIND], ids=["weave-subclass", "every-kind-subclassed"])
def test_a_subclass_of_every_kind_is_that_kind(spec):
    assert_none(failures_of(spec, 3, paths=("pickle", "checkpoint", "state", "deepcopy")))


GENERATOR = ["repeat", False, 3, ["seq", False, [["leaf", False, "generator", 2], ["leaf", False, "int", [0, 1, 2]]]], False]


@pytest.mark.parametrize("cut", [0, 3])
def test_a_run_holding_a_generator_is_refused_by_every_copy_naming_the_register(cut):
    opts = rsearch.Options(paths=ALL, cli=True, envs=("same-process",), only_cut=cut, lazy_jobs=5)
    figures = rsearch.Figures()
    assert_none(rsearch.check_program(GENERATOR, random.Random(0), opts, figures, tempfile.mkdtemp()))
    assert figures["refusals"] >= 4  # pickle, cloudpickle, deepcopy, checkpoint, state: each refused
