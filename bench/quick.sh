#!/usr/bin/env bash
# Every benchmark in its --quick mode, one after the other, with the project's venv (.venv, as scripts/test.sh
# leaves it): a smoke run that the scripts still work, whose figures mean little (CI runs it beside the
# serial tests, at the lowest CPU priority).  Each writes bench/results/NAME.json; the first that fails stops
# the run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
# (the ones with several processes first)
for name in distributed processes fuse_runs fuse_cache fuse checkpoint data shipping core shapes programs edit state; do
    echo "== bench/bench_$name.py --quick"
    "$python" "bench/bench_$name.py" --quick
done
