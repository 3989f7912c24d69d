"""What CI runs besides the suite (.ci/run, bench/quick.sh) stays in step with the checkout."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_benchmark_has_its_quick_run_in_bench_quick_sh():
    listed = re.search(r"^for name in (.*); do$", (REPO / "bench" / "quick.sh").read_text(), re.M).group(1).split()
    scripts = sorted(p.stem.removeprefix("bench_") for p in (REPO / "bench").glob("bench_*.py"))
    assert sorted(listed) == scripts


def test_ci_installs_the_bench_extra_as_pyproject_declares_it():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    ci = (REPO / ".ci" / "run").read_text()
    beside = next(line for line in ci.splitlines() if line.startswith("beside="))
    assert all(f'"{requirement}"' in beside for requirement in extra), (beside, extra)
    assert 'FLOWVM_TEST_BESIDE=$beside bash scripts/test.sh' in ci
