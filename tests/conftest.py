import os
import sys

# The tests import their helper modules (toy, progen, ...) from this folder; flowvm itself is the
# installed package, never the source tree (the repository keeps it under src/).
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
