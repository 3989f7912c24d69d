#!/usr/bin/env bash
# The long resume search (tests/resume/test_resume_search.py): bash scripts/resumetest.sh [EXAMPLES] checks
# EXAMPLES generated programs of each family (default 100; random seeds; the command and the lazily-imported
# torch environment on every program, the leaves that start worker processes included), shrinking any failure
# to a reproduction, and ends with a JSON line of figures: programs, cut points, resumes, copies per path,
# processes per environment, refusals, failures, seconds.
# Against the source: PYTHON=<a venv with `pip install -e .`>, or PYTHONPATH=<checkout> with this venv.
set -uo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
FLOWVM_RESUME_EXAMPLES="${1:-100}" FLOWVM_RESUME_REPORT="$report" "${PYTHON:-.venv/bin/python}" -P -m pytest -q \
    -p no:logging -o timeout=0 tests/resume/test_resume_search.py
status=$?
# the figures of both tests, summed
"${PYTHON:-.venv/bin/python}" -P -c '
import json, sys
total = {}
for line in open(sys.argv[1]):
    for k, v in json.loads(line)["resume"].items():
        total[k] = round(total.get(k, 0) + v, 1)
print(json.dumps({"resume": dict(sorted(total.items()))}))' "$report"
exit $status
