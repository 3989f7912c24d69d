"""POPEN: OS commands as leaves that never block a step; no process outlives its driver."""

import gc
import os
import pickle
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import flowvm
from flowvm import CALL, INCOMPLETE, LOOP, POPEN, REPEAT, SEQ, WEAVE, CommandError, Registers, VerifyError

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


def py(code):
    return [PY, "-c", textwrap.dedent(code)]


def gone(pid, within=5.0):
    """True once pid has exited, checked until within seconds passed.

    A zombie child of this process counts as left behind (nobody reaped it); a
    dead grandchild reparented to init is gone, whenever init reaps it.
    """
    end = time.monotonic() + within
    while True:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() != os.getpid():
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def live_process(drv):
    (proc,) = drv.live.values()
    return proc.popen


def read_pids(path, n, within=10.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        if os.path.exists(path):
            pids = open(path).read().split()
            if len(pids) >= n:
                return [int(p) for p in pids]
        time.sleep(0.02)
    raise AssertionError(f"{path} never held {n} pids")


# ----------------------------------------------------------------- values
def test_the_value_is_the_exit_code_and_the_first_step_only_launches():
    reg = Registers()
    drv = POPEN(py("import sys; sys.exit(3)"), store_to=reg("rc")).start()
    assert drv.step() is INCOMPLETE and drv.steps == 1 and drv.position == ""
    assert "rc" not in reg
    assert drv.run() == 3 and reg["rc"] == 3 and drv.done


def test_capture_gives_a_completed_process_with_text_or_bytes():
    reg = Registers()
    out = POPEN(py("import sys; print('out'); print('err', file=sys.stderr)"), capture=True,
                store_to=reg("p")).run()
    assert isinstance(out, subprocess.CompletedProcess) and reg["p"] is out
    assert (out.returncode, out.stdout, out.stderr) == (0, "out\n", "err\n")
    raw = POPEN(py("print('x')"), capture=True, text=False).run()
    assert raw.stdout == b"x\n"


def test_registers_in_args_cwd_and_env_are_read_at_launch(tmp_path):
    reg = Registers(n=6, where=str(tmp_path), env={"FLOWVM_X": "seven", "PATH": os.environ["PATH"]})
    code = "import os, sys; print(int(sys.argv[1]) * 7, os.getcwd(), os.environ['FLOWVM_X'])"
    prog = SEQ([CALL(lambda n: n, reg("n"), store_to=reg("m")),
                POPEN([PY, "-c", code, reg("m")], cwd=reg("where"), env=reg("env"), capture=True)])
    words = prog.run().stdout.split()
    assert words == ["42", str(tmp_path), "seven"]


def test_a_command_string_is_split_like_a_shell_would():
    el = POPEN(f"{PY} -c 'print(1 + 1)'", capture=True)
    assert el.args == (PY, "-c", "print(1 + 1)")
    assert el.run().stdout == "2\n"


def test_a_woven_call_keeps_stepping_while_the_command_runs():
    reg = Registers(ticks=0)
    prog = WEAVE(1, [POPEN(py("import time; time.sleep(0.4)")),
                     LOOP(CALL(lambda t: t + 1, reg("ticks"), store_to=reg("ticks")))])
    drv = prog.start()
    t0 = time.monotonic()
    while drv.step() is INCOMPLETE:
        time.sleep(0.001)
    assert time.monotonic() - t0 >= 0.35
    assert reg["ticks"] > 10 and drv.result == [0, None]


# ----------------------------------------------------------------- errors
def test_check_raises_with_the_tail_of_stderr_and_the_next_step_launches_again(tmp_path):
    log = tmp_path / "runs"
    code = f"""
        import sys
        open({str(log)!r}, "a").write("run\\n")
        print("line one", file=sys.stderr)
        print("the real reason", file=sys.stderr)
        sys.exit(2)
    """
    drv = SEQ([POPEN(py(code), check=True)]).start()
    with pytest.raises(CommandError) as info:
        drv.run()
    err = info.value
    assert err.returncode == 2 and isinstance(err, subprocess.CalledProcessError)
    assert "exited with code 2" in str(err) and str(err).rstrip().endswith("the real reason")
    assert any("POPEN" in note and "'0'" in note for note in err.__notes__)
    assert not drv.done and drv.position == "0"
    with pytest.raises(CommandError):
        drv.run()
    assert log.read_text() == "run\nrun\n"


def test_check_without_capture_still_shows_stderr(capfd):
    POPEN(py("import sys; print('warning here', file=sys.stderr)"), check=True).run()
    assert "warning here" in capfd.readouterr().err


def test_check_without_capture_puts_the_stderr_tail_in_stderr_only():
    with pytest.raises(CommandError) as info:
        POPEN(py("import sys; print('out'); print('ERR', file=sys.stderr); sys.exit(3)"), check=True).run()
    assert info.value.returncode == 3 and info.value.stdout is None and "ERR" in info.value.stderr


def test_a_command_killed_by_a_signal_is_reported_as_such():
    with pytest.raises(CommandError, match="died of signal SIGKILL"):
        POPEN(py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), check=True).run()


def test_a_missing_program_raises_at_its_step_naming_the_element():
    drv = SEQ([CALL(int), POPEN(["flowvm-no-such-program-xyz"])]).start()
    with pytest.raises(FileNotFoundError) as info:
        drv.run()
    assert any("POPEN" in n and "'1'" in n for n in info.value.__notes__)
    assert drv.live == {}


def test_timeout_kills_the_command():
    drv = POPEN(py("import time; time.sleep(30)"), timeout=0.3).start()
    drv.step()
    pid = live_process(drv).pid
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        drv.run()
    assert time.monotonic() - t0 < 5
    assert gone(pid)


@pytest.mark.parametrize("args, error", [
    (42, TypeError), ([], ValueError), ([PY, object()], TypeError), (Registers()("x"), TypeError),
    (["echo", True], TypeError), ('echo "unterminated', ValueError),
])
def test_bad_arguments_are_rejected_when_built(args, error):
    with pytest.raises(error, match="POPEN"):
        POPEN(args)


@pytest.mark.parametrize("value, where, message", [
    (None, "args", r"argument 2 \(register 'v'\) is NoneType None"),
    (["a", "b"], "args", r"argument 2 \(register 'v'\) is list"),
    (True, "args", r"argument 2 \(register 'v'\) is bool"),
    (3, "cwd", r"cwd \(register 'v'\) is int 3; it must be a path"),
    (["A=1"], "env", r"env \(register 'v'\) is list .*must be a dict"),
    ({"A": None}, "env", r"env\['A'\] \(register 'v'\) is NoneType"),
])
def test_register_values_that_cannot_be_command_items_are_clear_errors_at_launch(value, where, message):
    reg = Registers(v=value)
    args = [PY, "-c", reg("v")] if where == "args" else [PY, "-c", "pass"]
    el = POPEN(args, **({where: reg("v")} if where != "args" else {}))
    drv = el.start()
    with pytest.raises(TypeError, match=message):
        drv.step()
    reg["v"] = {"args": "pass", "cwd": ".", "env": {"A": "1"}}[where]
    assert drv.run(timeout=30) == 0  # the failed step left the driver ready to launch again


def test_bad_options_are_rejected_when_built():
    with pytest.raises(ValueError, match="timeout"):
        POPEN(["true"], timeout=0)
    with pytest.raises(TypeError, match="check"):
        POPEN(["true"], check="yes")
    with pytest.raises(TypeError, match="env"):
        POPEN(["true"], env=["A=1"])


def test_verify_sees_the_registers_a_command_reads_and_writes():
    reg = Registers()
    with pytest.raises(VerifyError) as info:
        POPEN(["echo", reg("missing")]).start()
    assert info.value.register == "missing"
    SEQ([POPEN(["true"], store_to=reg("rc")), CALL(abs, reg("rc"))]).start()  # rc is written first


def test_listing():
    reg = Registers()
    el = POPEN(["train", "--lr", reg("lr")], store_to=reg("rc"), check=True, timeout=60)
    assert str(el) == "rc = POPEN ['train', '--lr', lr] (check, timeout 60s)"


# ----------------------------------------------------------------- no leftovers
def test_a_woven_command_that_is_abandoned_is_killed_with_its_whole_group(tmp_path):
    pids = tmp_path / "pids"
    script = f"sleep 30 & echo $! >> {pids}; echo $$ >> {pids}; wait"
    prog = WEAVE(1, [POPEN(["sh", "-c", script]), REPEAT(50, CALL(time.sleep, 0.01))])
    drv = prog.start()
    drv.step()
    shell, grandchild = read_pids(pids, 2)[::-1]
    assert psutil.pid_exists(grandchild)
    assert drv.run() == [None, None]
    assert drv.live == {}
    assert gone(shell) and gone(grandchild)


def test_a_dropped_driver_kills_and_reaps_its_command():
    drv = POPEN(py("import time; time.sleep(30)")).start()
    drv.run(max_steps=2)
    pid = live_process(drv).pid
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    del drv
    gc.collect()
    assert gone(pid, within=0)  # killed and reaped by then: no zombie left
    assert not any(c.pid == pid for c in psutil.Process().children(recursive=True))


def test_interpreter_exit_kills_running_commands(tmp_path):
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from flowvm import POPEN, WEAVE
        drv = WEAVE(-1, [POPEN(["sh", "-c", "sleep 60 & echo $! >> {pids}; echo $$ >> {pids}; wait"]),
                         POPEN(["sleep", "60"])]).start()
        drv.run(max_steps=4)
        print(*(h.popen.pid for h in drv.live.values()))
    """)
    done = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    direct = [int(p) for p in done.stdout.split()]
    assert len(direct) == 2
    for pid in direct + read_pids(pids, 2):
        assert gone(pid), f"process {pid} outlived the interpreter"


# ----------------------------------------------------------------- copies
def test_a_copy_made_while_the_command_runs_launches_it_again(tmp_path):
    log = tmp_path / "runs"
    reg = Registers()
    code = f"import time; open({str(log)!r}, 'a').write('run\\n'); time.sleep(0.3)"
    prog = SEQ([POPEN(py(code), store_to=reg("rc")), CALL(lambda rc: rc + 100, reg("rc"), store_to=reg("after"))])
    drv = prog.start()
    drv.run(max_steps=2)
    assert drv.live  # in flight
    for copy in (pickle.loads(pickle.dumps(drv)), flowvm.persist.checkpoint.loads(flowvm.persist.checkpoint.dumps(drv))):
        assert copy.live == {}
        assert copy.run() == 100 and copy.registers["after"] == 100
    assert drv.run() == 100
    assert log.read_text().count("run") == 3


def test_a_copy_made_after_the_command_finished_does_not_launch_it_again(tmp_path):
    log = tmp_path / "runs"
    reg = Registers()
    prog = SEQ([POPEN(py(f"open({str(log)!r}, 'a').write('run\\n')"), store_to=reg("rc")),
                CALL(lambda rc: rc, reg("rc"))])
    drv = prog.start()
    drv.step()
    while drv.position == "0":
        time.sleep(0.01)
        drv.step()
    copy = pickle.loads(pickle.dumps(drv))
    assert copy.run() == 0 and drv.run() == 0
    assert log.read_text() == "run\n"


def test_check_without_capture_passes_stderr_through_while_the_command_runs(capfd):
    code = """
        import sys, time
        print("early line", file=sys.stderr, flush=True)
        time.sleep(0.5)
        print("late line", file=sys.stderr)
        sys.exit(1)
    """
    drv = POPEN(py(code), check=True).start()
    end = time.monotonic() + 10
    seen = ""
    while "early line" not in seen:
        assert time.monotonic() < end, "stderr was held back"
        drv.step()
        time.sleep(0.02)
        seen += capfd.readouterr().err
    assert not drv.done and drv.live  # still running when its first line arrived
    with pytest.raises(CommandError) as info:
        drv.run()
    assert str(info.value).endswith("early line\nlate line")
