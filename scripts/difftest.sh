#!/usr/bin/env bash
# The long differential test of fuse-torch (tests/fused/test_differential.py): bash scripts/difftest.sh [EXAMPLES]
# runs EXAMPLES generated programs (default 500) compiled on the thread and a tenth as many through the child
# process, with random seeds, and ends with a JSON line of figures.  Against the source: PYTHON=<a venv with `pip install -e .`>.
set -uo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
FLOWVM_DIFF_EXAMPLES="${1:-500}" FLOWVM_DIFF_REPORT="$report" "${PYTHON:-.venv/bin/python}" -P -m pytest -q \
    -p no:logging -o timeout=0 tests/fused/test_differential.py
status=$?
cat "$report"
exit $status
