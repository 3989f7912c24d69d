"""Crash safety of the flowvm command: SIGKILL at a random moment loses only the steps since the last save,
SIGINT and SIGTERM save and exit cleanly, and resuming gives the uninterrupted run's registers bit for bit."""

from __future__ import annotations

import importlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flowvm
from flowvm.testing import diff, outcome

from toy import COMMAND, ROOT, flowvm_cmd, saved

PROGRAMS = {
    # name: (build() options, --every)
    "rbm": ({"epochs": 6}, 100),
    "kmeans": ({"samples": 10000, "restarts": 2}, 10),
    "mlp": ({"epochs": 4}, 30),
}


def wait_for(path: Path, proc: subprocess.Popen, steps: int = 1, timeout: float = 90) -> None:
    """Wait until the run has saved a checkpoint of at least `steps` steps."""
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            try:
                if flowvm.read_header(path)["steps"] >= steps:
                    return
            except flowvm.CheckpointError:  # replaced while being read
                pass
        if proc.poll() is not None:
            raise AssertionError(f"flowvm exited {proc.returncode} before saving step {steps}:\n"
                                 f"{proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no checkpoint of {steps} steps after {timeout} s")
        time.sleep(0.002)


def start(name: str, ckpt: Path, *saving: str, options: dict | None = None) -> subprocess.Popen:
    default, every = PROGRAMS[name]
    options = default if options is None else options
    sets = [arg for k, v in options.items() for arg in ("--set", f"{k}={v}")]
    saving = saving or ("--every", str(every))
    return subprocess.Popen(COMMAND + ["run", name, *sets, "--checkpoint", str(ckpt), *saving,
                                       "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


_straight: dict = {}


def straight_run(name: str, options: dict | None = None) -> dict:
    """The uninterrupted run, here in the test process: the command must give the library's result."""
    options = PROGRAMS[name][0] if options is None else options
    key = (name, tuple(sorted(options.items())))
    if key not in _straight:
        module = importlib.import_module(f"flowvm.programs.{name}")
        threads = getattr(module, "THREADS", None)
        if threads is not None:  # as the command does
            torch = importlib.import_module("torch")
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            drv = module.build(**options).start()
            drv.run()
        finally:
            if threads is not None:
                torch.set_num_threads(before)
        _straight[key] = outcome(drv)
    return _straight[key]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sigkill_at_a_random_moment_then_resume_gives_the_uninterrupted_registers(name, tmp_path):
    expected = straight_run(name)
    every = PROGRAMS[name][1]
    seed = random.randrange(2 ** 32)
    rng = random.Random(seed)
    ckpt = tmp_path / "run.ckpt"
    for attempt in range(3):
        # a random moment: just after a random save point, with a little jitter
        target = rng.randrange(every, expected["steps"] - 4 * every, every)
        ckpt.unlink(missing_ok=True)
        proc = start(name, ckpt)
        wait_for(ckpt, proc, target)
        time.sleep(rng.uniform(0.0, 0.002))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        if proc.returncode == -signal.SIGKILL and not flowvm.read_header(ckpt)["done"]:
            break  # else the run got to its end before the kill landed: draw again
    else:
        pytest.fail(f"the run always finished before SIGKILL (seed {seed})")
    header = flowvm.read_header(ckpt)
    assert not header["done"] and header["steps"] % every == 0 and target <= header["steps"] < expected["steps"], \
        f"seed {seed}: {header}"
    out = flowvm_cmd("resume", ckpt, "--progress", "none")
    assert f"finished after {expected['steps']} steps" in out.stdout
    problems = diff(expected, saved(ckpt))
    assert not problems, f"killed at step {header['steps']} (seed {seed}): " + "; ".join(problems)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_save_and_exit_cleanly(sig, tmp_path):
    expected = straight_run("rbm")
    ckpt = tmp_path / "run.ckpt"
    proc = start("rbm", ckpt)
    wait_for(ckpt, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    header = flowvm.read_header(ckpt)
    name = signal.Signals(sig).name
    assert "paused at step" not in out  # the stop is said once, on stderr
    assert f"flowvm: stopped by {name} at step {header['steps']}; saved to {ckpt}, continue with " \
           f"`flowvm resume {ckpt}`" in err
    assert not header["done"] and 0 < header["steps"] < expected["steps"]
    assert not list(tmp_path.glob(".run.ckpt.*.tmp"))  # no half-written file left behind
    flowvm_cmd("resume", ckpt, "--progress", "none")
    assert not diff(expected, saved(ckpt))


def test_every_seconds_saves_while_the_run_goes_on(tmp_path):
    longer = {"epochs": 60}  # long enough (a few tenths of a second) for timed saves on a fast machine
    expected = straight_run("rbm", longer)
    ckpt = tmp_path / "timed.ckpt"
    proc = start("rbm", ckpt, "--every-seconds", "0.02", options=longer)
    wait_for(ckpt, proc)
    first = flowvm.read_header(ckpt)
    assert not first["done"] and 0 < first["steps"] < expected["steps"]  # saved by the clock, mid-run
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert not diff(expected, saved(ckpt))


def test_ctrl_c_while_spawned_trials_run_stops_the_whole_group_cleanly(tmp_path):
    """A terminal's Ctrl-C reaches every process of the group, the pool's workers too: the run must
    still save and exit 130, and the resumed run must finish (the trials run again)."""
    import os

    ckpt = tmp_path / "sweep.ckpt"
    proc = subprocess.Popen(COMMAND + ["run", "sweep", "--set", "trials=2", "--set", "epochs=3",
                                       "--set", "samples=2000", "--checkpoint", str(ckpt), "--every", "1",
                                       "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        wait_for(ckpt, proc, steps=2)  # both trials submitted
        time.sleep(1.0)  # and running in the workers
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    steps = flowvm.read_header(ckpt)["steps"]
    # nothing else: no worker's KeyboardInterrupt traceback, no crash message
    assert err.strip() == f"flowvm: stopped by SIGINT at step {steps}; saved to {ckpt}, continue with " \
                          f"`flowvm resume {ckpt}`", err
    assert not flowvm.read_header(ckpt)["done"]
    out = flowvm_cmd("resume", ckpt, "--progress", "none")
    assert "best: trial" in out.stdout and flowvm.read_header(ckpt)["done"]


def test_ctrl_c_during_the_last_step_lets_the_finished_run_report_success(tmp_path):
    marker = tmp_path / "last-step-started"
    (tmp_path / "slowlast.py").write_text(
        "import pathlib, time\n"
        "from flowvm import CALL, SEQ, Registers\n\n"
        "def last(path):\n"
        "    pathlib.Path(path).write_text('x')\n"
        "    time.sleep(1.5)\n"
        "    return 7\n\n"
        f"def build(marker={str(marker)!r}):\n"
        "    reg = Registers()\n"
        "    return SEQ([CALL(abs, -1, store_to=reg('a')), CALL(last, marker, store_to=reg('b'))])\n")
    ckpt = tmp_path / "s.ckpt"
    proc = subprocess.Popen(COMMAND + ["run", str(tmp_path / "slowlast.py"), "--checkpoint", str(ckpt),
                                       "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped" not in err, err
    assert flowvm.read_header(ckpt)["done"] and "finished after 2 steps" in out


# ------------------------------------------------------------------ start-up, and the program's own exits
SLOW_START = '''
import os
import time
from pathlib import Path

from flowvm import CALL, REPEAT, Registers

SHOW = ["x"]


def inc(x):
    return x + 1


def build(n=50, marker=""):
    if marker:
        Path(marker).write_text("building")
        time.sleep(float(os.environ.get("SLOW_START_SECONDS", "30")))
    reg = Registers(x=0)
    return REPEAT(n, CALL(inc, reg("x"), store_to=reg("x")))
'''


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_program_is_built_stops_the_command_at_once(tmp_path, sig):
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    marker, ckpt = tmp_path / "building", tmp_path / "run.ckpt"
    proc = subprocess.Popen(COMMAND + ["run", str(script), "--set", f"marker={marker}", "--checkpoint", str(ckpt),
                                       "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)  # not after the 30 s the build would take
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name} during start-up" in err and "Traceback" not in err
    assert not ckpt.exists()  # nothing ran: nothing to save


def test_a_signal_while_a_run_is_loaded_for_resuming_leaves_its_checkpoint_as_it_was(tmp_path):
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    ckpt = tmp_path / "run.ckpt"
    flowvm_cmd("run", script, "--checkpoint", ckpt, "--max-steps", "20", "--progress", "none", cwd=tmp_path)
    before = ckpt.read_bytes()
    launcher = SIGNAL_DURING_IMPORT.format(argv=["flowvm", "resume", str(ckpt), "--progress", "none"])
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM during start-up" in done.stderr
    assert ckpt.read_bytes() == before


# A signal landing during `import flowvm`, before the command's own handlers (made to happen there by an
# import hook): the entry point, flowvm_cli, takes it.
SIGNAL_DURING_IMPORT = (
    "import builtins, os, signal, sys\n"
    "import flowvm_cli\n"
    "real = builtins.__import__\n"
    "def hook(name, *args, **kwargs):\n"
    "    if name == 'flowvm.command.cli':\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return real(name, *args, **kwargs)\n"
    "builtins.__import__ = hook\n"
    "sys.argv = {argv!r}\n"
    "sys.exit(flowvm_cli.main())\n")


def test_a_signal_while_flowvm_is_imported_is_taken_by_the_entry_point(tmp_path):
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    ckpt = tmp_path / "run.ckpt"
    launcher = SIGNAL_DURING_IMPORT.format(argv=["flowvm", "run", str(script), "--checkpoint", str(ckpt),
                                                 "--progress", "none"])
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "stopped by SIGTERM during start-up" in done.stderr and "Traceback" not in done.stderr
    assert not ckpt.exists()


RAISING = '''
import os
import sys

from flowvm import CALL, REPEAT, Registers

SHOW = ["x"]


def inc(x):
    if x == 30 and not os.environ.get("NO_RAISE"):
        {raise_it}
    return x + 1


def build(n=50):
    reg = Registers(x=0)
    return REPEAT(n, CALL(inc, reg("x"), store_to=reg("x")))
'''


@pytest.mark.parametrize("raise_it, status, said", [
    ("raise KeyboardInterrupt", 130, "flowvm: interrupted (KeyboardInterrupt)"),
    ("sys.exit(3)", 3, "the run is saved at step 30"),
])
def test_keyboardinterrupt_or_systemexit_from_the_program_saves_before_the_command_exits(tmp_path, raise_it,
                                                                                         status, said, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # for saved(): the run's functions live in the script
    script = tmp_path / "raising.py"
    script.write_text(RAISING.replace("{raise_it}", raise_it))
    ckpt = tmp_path / "run.ckpt"
    done = flowvm_cmd("run", script, "--checkpoint", ckpt, "--progress", "none", cwd=tmp_path, check=False)
    assert done.returncode == status, done.stderr
    assert said in done.stderr and f"`flowvm resume {ckpt}` retries the failed step" in done.stderr
    assert "Traceback" not in done.stderr
    assert flowvm.read_header(ckpt)["steps"] == 30  # the step that raised is not counted: resuming retries it
    flowvm_cmd("resume", ckpt, "--progress", "none", cwd=tmp_path, env={**os.environ, "NO_RAISE": "1"})
    assert saved(ckpt)["registers"]["x"] == 50
