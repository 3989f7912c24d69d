#!/usr/bin/env python
"""What watching costs a run: the bundled mlp run by the command's Runner unwatched, with ``--watch`` and
nobody on the page, and with a page open (a client asking for the state twice a second, as the page does).

Run from the repository root (needs the ``watch`` extra, aiohttp)::

    python bench/bench_watch.py            # 1000 epochs a run, 5 rounds (about a minute)
    python bench/bench_watch.py --quick    # CI smoke test

Each round runs the three forms in turn, each a fresh program from the same seed, the whole run timed;
reported: medians and each form's ratio to unwatched.  Figures are reported, never asserted; JSON goes to
bench/results/watch.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowvm  # noqa: E402,F401
from flowvm.command.runner import Runner  # noqa: E402
from flowvm.command.watch import Watch  # noqa: E402
from flowvm.programs import mlp  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "watch.json"


def one(epochs: int, form: str) -> float:
    drv = mlp.build(epochs=epochs, samples=600, hidden=16).start()
    watch = None if form == "unwatched" else Watch("127.0.0.1", 0)
    stop = threading.Event()
    if watch is not None:
        watch.thread.start()
        watch.ready.wait(30)
    if form == "page open":
        def poll():
            while not stop.is_set():
                with urllib.request.urlopen(f"http://127.0.0.1:{watch.port}/api/state?page=bench", timeout=30) as r:
                    r.read()
                stop.wait(0.5)
        threading.Thread(target=poll, daemon=True).start()
        time.sleep(0.6)  # the page has asked: the run publishes snapshots from its first chunk
    runner = Runner(drv, [], progress="none", meta={"target": "mlp"}, watch=watch)
    t0 = time.perf_counter()
    runner.run()
    took = time.perf_counter() - t0
    stop.set()
    assert drv.done
    return took


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    epochs = 30 if args.quick else 1000
    rounds = args.rounds or (2 if args.quick else 5)
    forms = ("unwatched", "nobody on the page", "page open")
    one(2, "unwatched")  # warm-up
    times: dict[str, list[float]] = {f: [] for f in forms}
    for _ in range(rounds):
        for form in forms:
            times[form].append(one(epochs, form))
    med = {f: statistics.median(v) for f, v in times.items()}
    print(f"mlp, {epochs} epochs a run, {rounds} rounds, medians")
    print(f"{'form':20s} {'seconds':>8s} {'x unwatched':>12s}")
    for f in forms:
        print(f"{f:20s} {med[f]:8.3f} {med[f] / med['unwatched']:12.3f}")
    result = {"benchmark": "watch", "quick": args.quick, "epochs": epochs, "rounds": rounds,
              "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                              "date": datetime.datetime.now().isoformat(timespec="seconds")},
              "seconds": times, "median_seconds": med, "ratio": {f: med[f] / med["unwatched"] for f in forms}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
