"""What CI runs besides the suite (.ci/run, bench/quick.sh) stays in step with the checkout."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_benchmark_has_its_quick_run_in_bench_quick_sh_once():
    lanes = re.findall(r"^lane (.*) >", (REPO / "bench" / "quick.sh").read_text(), re.M)
    listed = [name for lane in lanes for name in lane.split()]
    scripts = sorted(p.stem.removeprefix("bench_") for p in (REPO / "bench").glob("bench_*.py"))
    assert len(lanes) == 2 and sorted(listed) == scripts


def test_ci_runs_them_with_the_bench_extra_installed():
    ci = (REPO / ".ci" / "run").read_text()
    assert '"$(ls dist/*.whl)[bench]"' in ci
    assert ci.rstrip().endswith("bash bench/quick.sh")
