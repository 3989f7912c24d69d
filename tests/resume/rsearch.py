"""The resume search: generated programs (rgen.py) cut at random steps, copied by every copy path and finished
in fresh processes with random environments; the finished run must equal the uninterrupted one bit for bit,
or the copy must be refused with flowvm.CopyError where a forward CALL has run and its backward not yet.

Used by the short CI tests (test_resume_search.py) and the long run (scripts/resumetest.sh).  A failure is
shrunk (rgen.smaller) and printed as a reproduction: the spec, the program listing, the cut, the copy path
and the environment, and a command that checks it again:

    python tests/resume/rsearch.py --spec 'JSON' [--cut K] [--copy pickle] [--env torch-lazy]
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import rgen  # noqa: E402
import flowvm  # noqa: E402
from flowvm import testing as T  # noqa: E402

FILE_COPIERS = ("pickle", "cloudpickle", "checkpoint", "state")
ALL_PATHS = ("pickle", "cloudpickle", "deepcopy", "checkpoint", "state", "cli")
LIMIT = 5000  # steps: every generated program finishes far sooner


def copy_error():
    return getattr(flowvm, "CopyError", None) or type("NoCopyError", (Exception,), {})


@dataclass
class Failure:
    category: str          # 'differs', 'error', 'refused', 'imports-torch', 'never-finishes', 'subclass'
    spec: list
    cut: int | None = None
    path: str | None = None
    env: dict | None = None
    problems: list = field(default_factory=list)

    def same_kind(self, other: "Failure") -> bool:
        return (self.category, self.path, (self.env or {}).get("name")) == \
               (other.category, other.path, (other.env or {}).get("name"))

    def describe(self) -> str:
        try:
            listing = str(rgen.build(self.spec))
        except Exception as err:  # noqa: BLE001
            listing = f"<cannot build: {err}>"
        env = T.describe_environment(self.env) if self.env else "-"
        cmd = (f"python tests/resume/rsearch.py --spec '{json.dumps(self.spec)}'"
               + (f" --cut {self.cut}" if self.cut is not None else "")
               + (f" --copy {self.path}" if self.path else "")
               + (f" --env {self.env['name']}" if self.env else ""))
        where = (f"cut after {self.cut} steps, copy path {self.path}, resumed in {env}" if self.cut is not None
                 else "the uninterrupted run itself (no cut, no copy)")
        return (f"[{self.category}] {where}\n"
                f"  mutations: {rgen.mutations_of(self.spec)}, subclasses: {rgen.has_subclasses(self.spec)}\n"
                f"  problems:\n    " + "\n    ".join(p[:400] for p in self.problems[:8]) +
                f"\n  program:\n    " + listing.replace("\n", "\n    ") +
                f"\n  reproduce: {cmd}")


class Figures(Counter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key in ("programs", "cut_points", "resumes", "refusals", "failures"):
            self.setdefault(key, 0)

    def as_json(self) -> dict:
        return dict(sorted(self.items()))


@dataclass
class Options:
    cuts: int = 3
    paths: tuple = ALL_PATHS
    lazy_jobs: int = 2           # copies resumed where the program itself imports torch (a process each)
    cli: bool = True
    envs: tuple = ("torch-before", "torch-lazy", "threads", "same-process")
    only_cut: int | None = None  # reproductions: this cut only
    nproc: bool = False          # also a coordinated checkpoint of a 2-rank run (programs without torch objects)


def build_blob(spec) -> bytes:
    """build() for the fresh processes (state files need the program built again): rgen.build_json by reference."""
    import functools

    import cloudpickle

    return cloudpickle.dumps(functools.partial(rgen.build_json, json.dumps(spec)))


def _pending(driver) -> bool:
    return any(rgen.live_graph(v) for v in dict(driver.registers).values())


def reference(spec):
    with T._ProcessState():
        expected, pending = T.reference_run(lambda: rgen.build(spec), LIMIT, _pending)
        again, _ = T.reference_run(lambda: rgen.build(spec), LIMIT)
    return expected, pending, again


def check_program(spec, rng: random.Random, opts: Options, figures: Figures, workdir: str) -> list[Failure]:
    """Every check of one program; returns its failures (empty when it resumes exactly everywhere)."""
    figures["programs"] += 1
    failures: list[Failure] = []
    expected, pending, again = reference(spec)
    if not expected["done"]:
        return [Failure("never-finishes", spec, problems=[f"not finished after {LIMIT} steps"])]
    if T.fingerprint_diff(expected, again):
        raise AssertionError(f"generator bug: two runs of {json.dumps(spec)} differ: "
                             f"{T.fingerprint_diff(expected, again)}")
    if rgen.has_subclasses(spec):
        figures["subclass_programs"] += 1
        plain, _, _ = reference(rgen.plain_kinds(spec))
        problems = T.fingerprint_diff(plain, expected)
        if problems:
            failures.append(Failure("subclass", spec, problems=["with subclasses of the kinds, the run differs "
                                                                "from the same program with the kinds:"] + problems))
    total = expected["steps"]
    if opts.only_cut is not None:
        cuts = [min(opts.only_cut, total)]
    else:
        live = [k for k, p in enumerate(pending) if p]
        cuts = {rng.randint(0, total) for _ in range(opts.cuts)}
        if live:
            cuts.add(rng.choice(live))  # a cut between a forward CALL and its backward, when there is one
        cuts = sorted(cuts)
    figures["cut_points"] += len(cuts)
    profile = rgen.needs(spec)
    jobs, here = [], []
    limit = 2 * total + 100
    CopyError = copy_error()
    refused_for_good = rgen.copy_refused(spec)
    build = lambda: rgen.build(spec)  # noqa: E731
    with T._ProcessState():
        for k in cuts:
            original = build().start()
            original.run(max_steps=k)
            for how in [p for p in opts.paths if p in FILE_COPIERS or p == "deepcopy"]:
                try:
                    made = T.make_copy(original, how, os.path.join(workdir, f"copy-{k}-{how}"))
                except CopyError as err:
                    figures["refusals"] += 1
                    if refused_for_good:  # a generator in a register: refused, naming it (or, while a
                        # backward is due, for the autograd graph: the first of the two refusals a copy meets)
                        named = re.search(r"registers/gen\d+ holds a builtins.generator", str(err))
                        if not named and not (pending[k] and "autograd graph" in str(err)):
                            failures.append(Failure("refused", spec, k, how, None,
                                                    [f"a generator's copy refused without naming it: {err}"]))
                    elif not pending[k]:
                        failures.append(Failure("refused", spec, k, how, None,
                                                [f"refused where no backward is due: {err}"]))
                    continue
                except flowvm.CheckpointError as err:
                    if refused_for_good and re.search(r"registers/gen\d+ holds a generator", str(err)):
                        figures["refusals"] += 1  # a state file refuses it too, naming it
                    elif how == "state" and rgen.state_refused(spec):
                        figures["refusals_documented"] += 1  # a value docs/state.md says a state file cannot hold
                    else:
                        failures.append(Failure("error", spec, k, how, None, [f"copy raised CheckpointError: {err}"]))
                    continue
                except Exception as err:  # noqa: BLE001
                    failures.append(Failure("error", spec, k, how, None, [f"copy raised {type(err).__name__}: {err}"]))
                    continue
                if refused_for_good:
                    failures.append(Failure("error", spec, k, how, None, ["a run holding a generator was copied"]))
                    continue
                figures[f"copies_{how}"] += 1
                job = {"id": f"{k}/{how}", "how": how, "path": made, "cut": k, "limit": limit}
                (here if how == "deepcopy" else jobs).append(job)
    results = {}
    if here and "same-process" in opts.envs:
        with T._ProcessState():
            for job in here:
                results[job["id"]] = T._resume_here(job, job.pop("path"), {}) | {"env": {"name": "same-process",
                                                                                          "fresh": False}}
        figures["env_same-process"] += 1
    # fresh processes: every file copy where torch is imported before the load (with another thread count
    # when the program uses torch), and a few where only the program imports it (all of them for programs
    # without torch: then none may import it)
    if jobs:
        name = "threads" if profile != "plain" and "threads" in opts.envs and rng.random() < 0.5 else "torch-before"
        if name in opts.envs or opts.only_cut is not None:
            env = T._environment(name, rng)
            if name == "threads":
                env["threads"] = 2  # the program's build sets 1
            got = T.run_in_children(jobs, env, build_blob(spec), workdir)
            figures[f"env_{name}"] += got.pop("<processes>")
            for j in jobs:
                results[j["id"] + "@" + name] = got.get(j["id"], {"error": "never resumed"}) | {"env": env}
        if "torch-lazy" in opts.envs:
            lazy = jobs if profile in ("plain", "numpy") else rng.sample(jobs, min(opts.lazy_jobs, len(jobs)))
            if lazy:
                env = T._environment("torch-lazy", rng)
                got = T.run_in_children(lazy, env, build_blob(spec), workdir)
                figures["env_torch-lazy"] += got.pop("<processes>")
                for j in lazy:
                    r = got.get(j["id"], {"error": "never resumed"}) | {"env": env}
                    results[j["id"] + "@torch-lazy"] = r
                    if profile in ("plain", "numpy") and r.get("torch_imported"):
                        failures.append(Failure("imports-torch", spec, j["cut"], j["how"], env,
                                                ["a program without torch imported torch on resume"]))
    figures["resumes"] += len(results)
    for key, r in results.items():
        jid = key.split("@")[0]
        k, how = jid.split("/")
        if "error" in r:
            failures.append(Failure("error", spec, int(k), how, r.get("env"),
                                    [r["error"], *(r.get("traceback") or "").splitlines()[-6:]]))
            continue
        problems = T.fingerprint_diff(expected, r["fingerprint"])
        if problems:
            if pending[int(k)]:
                problems.insert(0, "(the cut is between a forward CALL and its backward: the copy should have "
                                   "been refused with CopyError, or resumed exactly)")
            failures.append(Failure("differs", spec, int(k), how, r.get("env"), problems))
    if refused_for_good:  # no copy to resume from (every one refused, above)
        return failures
    if "cli" in opts.paths and opts.cli:
        failures += check_cli(spec, expected, pending, rng, workdir, figures, opts)
    if opts.nproc and profile in ("plain", "numpy") and total > 1:
        failures += check_nproc(spec, total, rng, workdir, figures)
    return failures


def _flowvm(args, cwd, hashseed, timeout=300):
    os.makedirs(cwd, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "flowvm", *args, "--progress", "none"], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONHASHSEED=str(hashseed)))


def _coordinated_final(location):
    """The finished 2-rank run: rank 0's shared run the manifest names."""
    with open(os.path.join(location, "manifest.json")) as f:
        manifest = json.load(f)
    with T._ProcessState():
        return T.fingerprint(flowvm.load(os.path.join(location, manifest["folder"], "shared.ckpt"))), manifest


def check_nproc(spec, total, rng, workdir, figures) -> list[Failure]:
    """A coordinated checkpoint at the same world size: `flowvm run prog.py --nproc 2` straight, and cut with
    --max-steps k then `flowvm resume` in another directory; rank 0's finished runs must be the same."""
    base = tempfile.mkdtemp(prefix="nproc-", dir=workdir)
    prog = os.path.join(base, "resume_prog.py")
    with open(prog, "w") as f:
        f.write(rgen.program_file(spec))
    k = rng.randint(1, total - 1)
    env = {"name": "nproc2", "torch": "cli", "hashseed": rng.randint(1, 2**31), "fresh": True}
    steps = [("straight", ["run", prog, "--nproc", "2", "--checkpoint", os.path.join(base, "a")], "c0"),
             ("cut", ["run", prog, "--nproc", "2", "--max-steps", str(k), "--checkpoint", os.path.join(base, "b")], "c1"),
             ("resume", ["resume", os.path.join(base, "b")], "c2")]
    for i, (what, args, cwd) in enumerate(steps):
        done = _flowvm(args, os.path.join(base, cwd), env["hashseed"] + i)
        figures["env_nproc2"] += 1
        if done.returncode != 0:
            return [Failure("error", spec, k, "nproc2", env, [f"`flowvm {' '.join(args)}` exited {done.returncode}",
                                                               *done.stderr.strip().splitlines()[-6:]])]
    want, _ = _coordinated_final(os.path.join(base, "a"))
    got, manifest = _coordinated_final(os.path.join(base, "b"))
    figures["copies_nproc2"] += 1
    figures["resumes"] += 1
    problems = T.fingerprint_diff(want, got)
    if problems or not manifest["done"]:
        return [Failure("differs", spec, k, "nproc2", env, problems or ["the resumed run did not finish"])]
    return []


def check_cli(spec, expected, pending, rng, workdir, figures, opts) -> list[Failure]:
    """`flowvm run prog.py --max-steps k --checkpoint c` in one directory, `flowvm resume c` in another (another
    PYTHONHASHSEED), then the finished run loaded here."""
    total = expected["steps"]
    live = [k for k, p in enumerate(pending) if p and k > 0]
    if opts.only_cut is not None:
        k = min(opts.only_cut, total)
    else:
        k = rng.choice(live) if live and rng.random() < 0.5 else rng.randint(1, max(total, 1))
    kind = rng.choice([".ckpt", ".ckpt", ".safetensors"]) if not rgen.state_refused(spec) else ".ckpt"
    base = tempfile.mkdtemp(prefix="cli-", dir=workdir)
    prog = os.path.join(base, "resume_prog.py")
    with open(prog, "w") as f:
        f.write(rgen.program_file(spec))
    ckpt = os.path.join(base, "run" + kind)
    env = {"name": f"cli{kind}", "torch": "cli", "hashseed": rng.randint(1, 2**31), "fresh": True}
    runs = []
    for i, argv in enumerate(([prog, "--max-steps", str(k), "--checkpoint", ckpt, "--progress", "none"],
                              ["resume", ckpt, "--progress", "none"])):
        cwd = os.path.join(base, f"cwd{i}")
        os.mkdir(cwd)
        cmd = [sys.executable, "-m", "flowvm", *(["run"] if i == 0 else []), *argv]
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONHASHSEED=str(env["hashseed"] + i)))
        runs.append(done)
        figures["env_cli"] += 1
        if done.returncode != 0:
            return [Failure("error", spec, k, "cli", env, [f"`flowvm {' '.join(cmd[3:])}` exited {done.returncode}",
                                                          *done.stderr.strip().splitlines()[-6:]])]
    figures["copies_cli"] += 1
    said = runs[0].stderr
    if "saving at step" in said:
        figures["cli_stepped_on"] += 1
    with T._ProcessState():
        drv = (flowvm.load(ckpt) if kind == ".ckpt" else flowvm.load_state(ckpt, rgen.build(spec)))
        got = T.fingerprint(drv)
    figures["resumes"] += 1
    problems = T.fingerprint_diff(expected, got)
    if problems:
        if pending[k]:
            problems.insert(0, "(--max-steps fell between a forward CALL and its backward: the save should "
                               "have stepped on)")
        return [Failure("differs", spec, k, "cli", env, problems + ["run's stderr: " + said.strip()[-300:]])]
    return []


def shrink(failure: Failure, opts: Options, budget: int, workdir: str, deadline: float | None = None) -> Failure:
    """A smaller spec failing the same way (same category, copy path, environment), greedily: at most budget
    candidates, and none started after deadline (a time.monotonic() value)."""
    narrowed = Options(cuts=3, paths=(failure.path,) if failure.path else (), lazy_jobs=3,
                       cli=failure.path == "cli", nproc=failure.path == "nproc2",
                       envs=(failure.env["name"],) if failure.env and failure.env.get("name") in T.ENVIRONMENTS
                       else opts.envs)
    best, tries = failure, 0
    improved = True
    while improved and tries < budget:
        improved = False
        for cand in sorted(rgen.smaller(best.spec), key=rgen.size):
            if tries >= budget or (deadline is not None and time.monotonic() > deadline):
                return best
            tries += 1
            try:
                found = check_program(cand, random.Random(tries), narrowed, Figures(), workdir)
            except Exception:  # noqa: BLE001 - a candidate that breaks otherwise is no reproduction
                continue
            same = [f for f in found if f.same_kind(failure)]
            if same:
                best, improved = same[0], True
                break
    return best


def distinct(failures: list[Failure], most: int = 3) -> list[Failure]:
    """The first failure of each kind (category, copy path, environment), at most `most` of them."""
    kinds: dict = {}
    for f in failures:
        kinds.setdefault((f.category, f.path, (f.env or {}).get("name")), f)
    return list(kinds.values())[:most]


def search(specs, rng: random.Random, opts: Options, figures: Figures, shrink_budget=20, stop_after=None,
           shrink_seconds: float = 120.0) -> list[list[Failure]]:
    """Check each spec; returns, for each program that fails, its distinct failures, shrunk."""
    found = []
    workdir = tempfile.mkdtemp(prefix="resume-search-")
    try:
        for spec in specs:
            failures = check_program(spec, rng, opts, figures, workdir)
            if failures:
                figures["failures"] += 1
                kinds = distinct(failures)
                for f in kinds:
                    figures[f"failures_{f.category}"] += 1
                deadline = time.monotonic() + shrink_seconds
                found.append([shrink(f, opts, shrink_budget, workdir, deadline) if shrink_budget else f
                              for f in kinds])
                if stop_after and len(found) >= stop_after:
                    break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return found


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", help="a spec (JSON) to check, as a failure prints it")
    ap.add_argument("--seeds", type=int, default=0, help="check this many random programs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cut", type=int)
    ap.add_argument("--copy", choices=ALL_PATHS)
    ap.add_argument("--env", choices=T.ENVIRONMENTS)
    ap.add_argument("--profile", default="torch", choices=tuple(rgen.PROFILES))
    a = ap.parse_args(argv)
    opts = Options(only_cut=a.cut)
    if a.copy:
        opts.paths = (a.copy,)
        opts.cli = a.copy == "cli"
    if a.env:
        opts.envs = (a.env,)
    figures = Figures()
    rng = random.Random(a.seed)
    specs = [json.loads(a.spec)] if a.spec else [rgen.random_spec(a.seed + i, a.profile, long=True)
                                                 for i in range(a.seeds)]
    found = search(specs, rng, opts, figures, shrink_budget=0 if a.spec else 20)
    for program in found:
        for f in program:
            print(f.describe(), "\n")
    print(json.dumps({"resume": figures.as_json()}))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
