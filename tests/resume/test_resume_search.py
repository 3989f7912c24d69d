"""The resume search (rsearch.py): generated programs over every element kind and its subclass, with leaves
that draw from random, numpy and torch, change torch's settings, import torch lazily, split a training step
into forward, backward and optimizer CALLs, hold iterators and Batches; cut at random steps, copied through
pickle, cloudpickle, deepcopy, flowvm.save, state files and the command, resumed in fresh processes with
random environments.  Each must finish as the uninterrupted run did, bit for bit, or be refused with
CopyError between a forward CALL and its backward.

The CI runs a short, derandomized search; ``bash scripts/resumetest.sh [N]`` runs N random programs
(FLOWVM_RESUME_EXAMPLES) and ends with a JSON line of figures.  A failure prints a shrunk reproduction.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import rgen
import rsearch

LONG = int(os.environ.get("FLOWVM_RESUME_EXAMPLES", "0"))
EXAMPLES = LONG or 4
COMMON = dict(deadline=None, derandomize=not LONG, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])  # no hypothesis shrinking: rsearch.shrink does it

FIGURES = rsearch.Figures()


@pytest.fixture(scope="module", autouse=True)
def figures():
    start = time.perf_counter()
    yield FIGURES
    FIGURES["seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps({"resume": FIGURES.as_json()})
    print("\n" + line)
    if os.environ.get("FLOWVM_RESUME_REPORT"):
        with open(os.environ["FLOWVM_RESUME_REPORT"], "a") as f:
            f.write(line + "\n")


def check(spec, seed, opts):
    found = rsearch.search([spec], random.Random(seed), opts, FIGURES, shrink_budget=25 if LONG else 10,
                           shrink_seconds=180 if LONG else 45)
    if found:
        pytest.fail("a resumed copy is not the uninterrupted run; each way it differs, shrunk:\n\n"
                    + "\n\n".join(f.describe() for f in found[0]), pytrace=False)


@pytest.mark.timeout(0 if LONG else 400)
@settings(max_examples=EXAMPLES, **COMMON)
@given(rgen.spec_strategy("torch", depth=3, long=bool(LONG)), st.integers(0, 2**31), st.integers(0, 2))
def test_generated_programs_resume_exactly_or_refuse(spec, seed, cli):
    """Programs that may use everything, torch models included; the command on a third of them."""
    check(spec, seed, rsearch.Options(cuts=3 if LONG else 2, lazy_jobs=2 if LONG else 1, cli=LONG or cli == 0))


@pytest.mark.timeout(0 if LONG else 300)
@settings(max_examples=EXAMPLES, **COMMON)
@given(st.sampled_from(["plain", "numpy", "lazy-torch"]).flatmap(
    lambda p: rgen.spec_strategy(p, depth=3, long=bool(LONG))), st.integers(0, 2**31))
def test_programs_without_torch_objects_resume_where_only_the_program_imports_torch(spec, seed):
    """No torch object in any register: the copy loads without torch (and a program without torch never
    imports it on resume); the leaves that use torch import it themselves, after the load.  In the long run,
    a third of the programs without torch also run on 2 ranks, cut and resumed from a coordinated checkpoint."""
    check(spec, seed, rsearch.Options(cuts=3, lazy_jobs=3 if LONG else 2, cli=bool(LONG),
                                      nproc=bool(LONG) and seed % 3 == 0))
