import os
import sys

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
