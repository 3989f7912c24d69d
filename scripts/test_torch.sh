#!/usr/bin/env bash
# Pass the torch-dependent core of the suite (core, persist and fused tests) with flowvm's wheel (dist/, built
# by scripts/test.sh) against one torch release: `scripts/test_torch.sh newest` (the newest torch pip
# installs here), `scripts/test_torch.sh oldest` (the floor of the `torch` extra in pyproject.toml) or a
# version.  The venv is kept under $FLOWVM_CI_CACHE (default ~/.cache/flowvm-ci), one per torch version, so
# later runs only reinstall the wheel.  Arguments after the version go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:?usage: scripts/test_torch.sh newest|oldest|VERSION [pytest arguments]}
shift
cache=${FLOWVM_CI_CACHE:-$HOME/.cache/flowvm-ci}
case "$which" in
    newest)
        report=$(mktemp)
        python3 -m pip install -q --dry-run --no-deps --ignore-installed --report "$report" torch
        version=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['install'][0]['metadata']['version'])" "$report")
        rm -f "$report" ;;
    oldest)
        version=$(python3 -c "
import re, tomllib
extra = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['torch']
print(re.search(r'torch>=([0-9.]+)', ' '.join(extra)).group(1))") ;;
    *) version=$which ;;
esac
wheel=$(ls dist/flowvm-*.whl)
venv="$cache/torch-$version"
echo "== torch $version ($which): $venv"
if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    # torch releases before 2.3 were built against numpy 1.x
    numpy=$(python3 -c "print('numpy<2' if tuple(map(int, '$version'.split('.')[:2])) < (2, 3) else 'numpy')")
    "$venv/bin/pip" install -q "torch==$version" "$numpy" "$wheel[test]"
fi
"$venv/bin/pip" install -q "$wheel[test]"  # a test requirement added since the venv was made
"$venv/bin/pip" install -q --force-reinstall --no-deps "$wheel"  # the wheel just built
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
# test_cross_python.py resumes runs under other Python versions, not other torches: the main suite runs it.
# FLOWVM_TORCH_TESTS: the test files (default: those of the core, persist and fused folders that use torch; a
# file that never names torch runs the same under any torch, and the main suite runs it).
tests=${FLOWVM_TORCH_TESTS:-$(grep -l torch tests/test_package.py tests/base/test_*.py tests/program/test_*.py \
    tests/machine/test_*.py tests/persist/test_*.py tests/fused/test_*.py | tr '\n' ' ')}
# The tests that can share the machine on two workers, then the serial ones (tests/conftest.py) alone, but
# for the heavy ones (half a minute or more of child compiles each): the pinned torch runs those
# (scripts/test.sh), and FLOWVM_TORCH_HEAVY=1 runs them here too.
run() {
    # shellcheck disable=SC2086
    timeout 1200 "$venv/bin/python" -P -m pytest -q -rs $tests --ignore=tests/persist/test_cross_python.py "$@" ||
        [ $? -eq 5 ]  # 5: arguments that leave one part with no test
}
run -m "not serial" -n "${FLOWVM_TEST_WORKERS:-2}" --dist loadfile "$@"
if [ "${FLOWVM_TORCH_HEAVY:-0}" = 1 ]; then
    run -m serial "$@"
else
    run -m "serial and not heavy" "$@"
fi
