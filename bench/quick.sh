#!/usr/bin/env bash
# Every benchmark in its --quick mode with the project's venv (.venv, as scripts/test.sh leaves it, with the
# `bench` extra): CI's smoke run that the scripts still work.  Each writes bench/results/NAME.json.  The
# scripts run in two lanes at once, one after the other within a lane (quick figures are for the smoke run,
# not to be read): the compiling ones in one, those that start processes or listen on ports in the other.
# Each lane stops at its first failure; the run fails if either lane does, and prints both lanes' output.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

lane() {
    local name
    for name in "$@"; do
        echo "== bench/bench_$name.py --quick"
        "$python" "bench/bench_$name.py" --quick || { echo "== bench/bench_$name.py --quick FAILED"; return 1; }
    done
}

lane fuse fuse_runs fuse_cache core shapes edit pyfunc charlm >"$logs/compiling" 2>&1 &
compiling=$!
lane processes distributed watch programs data checkpoint state shipping >"$logs/processes" 2>&1 &
processes=$!
status=0
wait "$compiling" || status=1
wait "$processes" || status=1
cat "$logs/compiling" "$logs/processes"
exit $status
