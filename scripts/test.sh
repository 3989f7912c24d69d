#!/usr/bin/env bash
# Set up and pass the tests with flowvm as users get it: build the sdist and, from it, the wheel; install
# the wheel (not editable) with the test extras into .venv; run the suite against that installed package.
# Arguments go to pytest (scripts/test.sh -x -k checkpoint), in one run.  Without arguments the suite runs in
# two parts: the tests that can share the machine on $FLOWVM_TEST_WORKERS workers (default 2, pytest-xdist),
# then those marked serial (tests/fused, tests/distributed: see tests/conftest.py) one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q build uv
rm -rf dist
.venv/bin/python -m build
wheel=$(ls dist/*.whl)
# torch is pinned so that pip takes the local CPU build on this project's machines; uv then installs the test
# requirements next to it (fetching them in parallel: pip takes minutes for them), or pip where uv cannot.
.venv/bin/pip install torch==2.13.0
.venv/bin/uv pip install -q --python .venv/bin/python torch==2.13.0 "$wheel[test]" ||
    .venv/bin/pip install torch==2.13.0 "$wheel[test]"  # torch==2.13.0: never replaced by a requirement's
.venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')"  # still pinned
.venv/bin/pip install --force-reinstall --no-deps "$wheel"  # the wheel just built, even at an unchanged version
# -P: the checkout (the current directory) is not put on sys.path, so `import flowvm` is the installed wheel,
# not the flowvm/ folder beside this script.
if [ $# -gt 0 ]; then
    exec .venv/bin/python -P -m pytest "$@"
fi
.venv/bin/python -P -m pytest -m "not serial" -n "${FLOWVM_TEST_WORKERS:-2}" --dist loadfile
.venv/bin/python -P -m pytest -m serial
