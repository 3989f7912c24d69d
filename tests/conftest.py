import os
import sys
from pathlib import Path

# The persistent cache of compiled packages (flowvm/fused/cache.py) is off for the tests, and for the programs
# they start, unless a test gives its own directory: a package cached by one test must not change what
# another sees, nor a run of the suite what the next one sees.
os.environ["FLOWVM_CACHE_DIR"] = "off"

# The tests import their helper modules (toy, progen, ...) from this folder; flowvm itself is the
# installed package, never the source tree: scripts/test.sh runs `python -P -m pytest`, so the checkout's
# flowvm/ folder is not on the path.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# Tests that must have the machine to themselves: the fused tests (a compile child runs at the lowest CPU
# priority, and a test waits for it), and the distributed ones (several ranks, their time-outs, fixed test
# hosts).  scripts/test.sh runs the other tests on several workers (pytest-xdist), then these alone, one at
# a time: `-m "not serial" -n 2`, then `-m serial`.
SERIAL_FOLDERS = ("fused", "distributed")


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: run alone, not beside other tests (tests/fused, tests/distributed)")
    config.addinivalue_line("markers", "heavy: a test of half a minute or more of child compiles, run once per CI "
                                       "(on the pinned torch: scripts/test_torch.sh leaves it out)")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        parts = item.path.parts[len(Path(HERE).parts):] if Path(HERE) in item.path.parents else ()
        if parts and parts[0] in SERIAL_FOLDERS:
            item.add_marker(pytest.mark.serial)
