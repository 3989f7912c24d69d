#!/usr/bin/env bash
# Every benchmark in its --quick mode, one after the other, with the project's venv (.venv, as scripts/test.sh
# leaves it, with the `bench` extra): CI's smoke run that the scripts still work.  Each writes
# bench/results/NAME.json; the first that fails stops the run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
for name in core shapes programs edit processes fuse fuse_runs fuse_cache data checkpoint state shipping distributed pyfunc charlm watch; do
    echo "== bench/bench_$name.py --quick"
    "$python" "bench/bench_$name.py" --quick
done
