"""The flowvm command, driven as a real subprocess: run, --set, resume, show, verify, list, progress output."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import re
import subprocess
import sys
import termios
import textwrap
import time

import pytest

import flowvm
from flowvm.base.errors import UsageError
from flowvm.command.targets import bundled_programs, parse_sets
from flowvm.command.runner import short_value, static_steps
from flowvm.programs import pca
from flowvm.testing import diff
from toy import COMMAND, ROOT, flowvm_cmd, saved

def kmeans_file() -> str:
    """The installed kmeans program's file: `flowvm run` takes a program by file name too."""
    from flowvm.programs import kmeans

    return kmeans.__file__


SMALL_PCA = ["--set", "batches=2", "--set", "samples=50", "--set", "dim=3", "--set", "components=2"]


# ------------------------------------------------------------------ run, --set, resume
def test_run_prints_the_report_and_set_overrides_builder_options():
    out = flowvm_cmd("run", "kmeans", "--set", "clusters=3", "--set", "samples=300", "--set", "restarts=2",
                     "--progress", "none")
    assert "k-means: 3 clusters of 300 points, best of 2 restarts" in out.stdout
    assert out.stdout.startswith("finished after ") and out.stderr == ""


def test_run_a_program_file_and_resume_it_from_another_directory(tmp_path):
    ckpt = tmp_path / "k.ckpt"
    out = flowvm_cmd("run", kmeans_file(), "--set", "samples=300", "--checkpoint", ckpt,
                     "--max-steps", 20, "--progress", "none")
    assert f"paused at step 20; continue with `flowvm resume {ckpt}`" in out.stdout
    assert flowvm.read_header(ckpt)["steps"] == 20
    flowvm_cmd("resume", ckpt, "--progress", "none", cwd=tmp_path)
    flowvm_cmd("run", "kmeans", "--set", "samples=300", "--checkpoint", tmp_path / "straight.ckpt",
               "--progress", "none")
    assert not diff(saved(tmp_path / "straight.ckpt"), saved(ckpt))


def test_a_user_program_file_with_lambdas_runs_pauses_and_resumes(tmp_path, monkeypatch):
    (tmp_path / "helper_mod.py").write_text("def double(v):\n    return 2 * v\n")
    (tmp_path / "mytrain.py").write_text(textwrap.dedent('''\
        """A user's own program."""
        import random
        from flowvm import CALL, REPEAT, Registers
        from helper_mod import double

        SHOW = ["total"]

        def build(steps=40, scale=1.5):
            random.seed(1)
            reg = Registers(total=0.0)
            return REPEAT(steps, CALL(lambda t: double(t) % 97 + scale * random.random(), reg("total"),
                                      store_to=reg("total")))

        def report(registers):
            return f"total is {registers['total']!r}"
    '''))
    ckpt, straight = tmp_path / "u.ckpt", tmp_path / "s.ckpt"
    flowvm_cmd("run", tmp_path / "mytrain.py", "--set", "scale=2", "--checkpoint", ckpt, "--max-steps", 13,
               "--progress", "none", cwd=tmp_path)
    resumed = flowvm_cmd("resume", ckpt, "--progress", "none", cwd=ROOT)
    assert "total is " in resumed.stdout
    # the same run uninterrupted: random.random() went on from its saved state
    flowvm_cmd("run", "mytrain.py", "--set", "scale=2", "--checkpoint", straight, "--progress", "none",
               cwd=tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # to load the checkpoints here
    assert not diff(saved(straight), saved(ckpt))
    assert saved(ckpt)["steps"] == 40


@pytest.mark.parametrize("pair, words", [
    ("nosuch=1", "the program has no option 'nosuch'; options: samples, batches"),
    ("batches=two", "option 'batches' takes an int (default 5), got 'two'"),
    ("batches", "--set expects name=value"),
])
def test_bad_set_options_are_named(pair, words):
    out = flowvm_cmd("run", "pca", "--set", pair, check=False)
    assert out.returncode == 2 and words in out.stderr


def test_parse_sets_converts_to_the_default_type():
    def build(lr=0.1, name="x", n=3, flag=False, anything=None):
        pass

    assert parse_sets(["lr=1", "name=42", "n=7", "flag=True", "anything=[1, 2]"], build) == {
        "lr": 1.0, "name": "42", "n": 7, "flag": True, "anything": [1, 2]}
    with pytest.raises(UsageError, match="'flag' is True or False"):
        parse_sets(["flag=1"], build)
    with pytest.raises(UsageError, match="'lr' takes a number"):
        parse_sets(["lr=fast"], build)
    assert parse_sets(["name='adam'"], build) == parse_sets(["name=adam"], build) == {"name": "adam"}


def test_parse_sets_passes_any_option_to_a_build_taking_keyword_arguments():
    def build(n=3, **options):
        pass

    assert parse_sets(["n=5", "width=7", "mode=fast", "shape=(2, 3)"], build) == {
        "n": 5, "width": 7, "mode": "fast", "shape": (2, 3)}
    with pytest.raises(UsageError, match="'n' takes an int"):
        parse_sets(["n=x"], build)
    with pytest.raises(UsageError, match="a Python name"):
        parse_sets(["my-option=1"], build)

    def strict(n=3, *args):
        pass

    with pytest.raises(UsageError, match="no option 'args'; options: n"):
        parse_sets(["args=1"], strict)


def test_run_refuses_to_replace_a_file_that_is_no_checkpoint_unless_forced(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    out = flowvm_cmd("run", "pca", "--set", "batches=2", "--checkpoint", notes, check=False)
    assert out.returncode == 2 and f"{notes} exists and is not a flowvm checkpoint" in out.stderr
    assert notes.read_text() == "precious\n"
    flowvm_cmd("run", "pca", "--set", "batches=2", "--checkpoint", notes, "--force", "--progress", "none")
    assert flowvm.read_header(notes)["done"]


def test_unknown_targets_and_missing_files_are_named(tmp_path):
    out = flowvm_cmd("run", "no_such_program_anywhere", check=False)
    assert out.returncode == 2 and "no program 'no_such_program_anywhere'" in out.stderr
    (tmp_path / "needs.py").write_text("import not_a_real_module_xyz\n\ndef build():\n    pass\n")
    out = flowvm_cmd("run", tmp_path / "needs.py", check=False)
    assert out.returncode == 2 and "needs.py needs the module 'not_a_real_module_xyz', which is not installed" \
        in out.stderr and "Traceback" not in out.stderr
    out = flowvm_cmd("run", tmp_path / "missing.py", check=False)
    assert out.returncode == 2 and "no such program file" in out.stderr
    out = flowvm_cmd("run", "pca", "--every", 10, check=False)
    assert out.returncode == 2 and "--every and --every-seconds need --checkpoint PATH" in out.stderr
    out = flowvm_cmd("run", "pca", "--checkpoint", tmp_path / "nodir" / "x.ckpt", check=False)
    assert out.returncode == 2 and "no directory" in out.stderr
    out = flowvm_cmd("resume", tmp_path / "missing.ckpt", check=False)
    assert out.returncode == 2 and "missing.ckpt': no such file" in out.stderr


def test_a_failing_step_saves_the_run_and_resume_retries_it(tmp_path):
    (tmp_path / "flaky.py").write_text(textwrap.dedent('''\
        import os
        from flowvm import CALL, REPEAT, Registers

        def bump(n):
            if n == 5 and os.environ.get("FLAKY"):
                raise OSError("the disk is gone")
            return n + 1

        def build():
            reg = Registers(n=0)
            return REPEAT(9, CALL(bump, reg("n"), store_to=reg("n")))
    '''))
    ckpt = tmp_path / "f.ckpt"
    out = flowvm_cmd("run", tmp_path / "flaky.py", "--checkpoint", ckpt, "--progress", "none",
                     env=dict(os.environ, FLAKY="1"), check=False)
    assert out.returncode == 1 and "OSError: the disk is gone" in out.stderr
    assert f"the run is saved at step 5 in {ckpt}" in out.stderr
    out = flowvm_cmd("resume", ckpt, "--progress", "none")
    assert "finished after 9 steps" in out.stdout
    assert "  n                int        9" in out.stdout  # no report(): the registers summary


def test_signed_checkpoints_with_the_key_from_the_environment(tmp_path):
    ckpt = tmp_path / "signed.ckpt"
    env = dict(os.environ, FLOWVM_CHECKPOINT_KEY="s3cret")
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--max-steps", 10, "--progress", "none", env=env)
    assert flowvm.read_header(ckpt)["signed"]
    out = flowvm_cmd("resume", ckpt, "--key", "wrong", "--progress", "none", check=False)
    assert out.returncode == 2 and "signature does not match" in out.stderr
    flowvm_cmd("resume", ckpt, "--progress", "none", env=env)
    assert flowvm.load(ckpt, key="s3cret", restore_random=False).done


def test_a_signed_checkpoint_is_not_read_or_rewritten_without_its_key(tmp_path):
    ckpt = tmp_path / "signed.ckpt"
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--max-steps", 10, "--key", "s3cret",
               "--progress", "none")
    env = {k: v for k, v in os.environ.items() if k != "FLOWVM_CHECKPOINT_KEY"}
    before = ckpt.read_bytes()
    for command in (["resume", ckpt, "--progress", "none"], ["show", ckpt]):
        out = flowvm_cmd(*command, env=env, check=False)
        assert out.returncode != 0 and f"{ckpt} is signed: give its key with --key" in out.stderr, out.stderr
    assert ckpt.read_bytes() == before  # not rewritten unsigned
    flowvm_cmd("resume", ckpt, "--key", "s3cret", "--progress", "none", env=env)
    header = flowvm.read_header(ckpt)
    assert header["signed"] and header["done"]  # still signed after the resumed run saved it


def test_resume_keeps_saving_as_often_as_the_run_was_told(tmp_path, monkeypatch):
    from flowvm.command import cli, runs

    ckpt = tmp_path / "k.ckpt"
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--every", 7, "--max-steps", 10,
               "--progress", "none")
    assert flowvm.read_header(ckpt)["meta"]["every"] == 7
    seen = []
    real = runs.Runner

    def recording(drv, show, path, every, every_seconds, *rest):
        seen.append((every, every_seconds))
        return real(drv, show, path, every, every_seconds, *rest)

    monkeypatch.setattr(runs, "Runner", recording)
    assert cli.main(["resume", str(ckpt), "--max-steps", "3", "--progress", "none"]) == 0
    assert cli.main(["resume", str(ckpt), "--max-steps", "3", "--every-seconds", "5", "--progress", "none"]) == 0
    assert cli.main(["resume", str(ckpt), "--max-steps", "3", "--progress", "none"]) == 0
    assert seen == [(7, None), (None, 5.0), (None, 5.0)]  # a new choice given on resume is kept from then on


# ------------------------------------------------------------------ show, verify, list
def test_show_prints_the_listing_with_the_position_steps_and_registers(tmp_path):
    ckpt = tmp_path / "s.ckpt"
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--max-steps", 77, "--progress", "none")
    out = flowvm_cmd("show", ckpt, "--trust").stdout.splitlines()  # (an unsigned pickle runs code: asked for)
    assert out[0].startswith(f"# {ckpt}: pca --set batches=2 --set samples=50 --set dim=3 --set components=2, "
                             "written by flowvm ")
    assert out[1:] == [
        "# flowvm driver: step 77, next: path '0.0.0.0'",
        "   SEQ:  # at child 0 of 3",
        "       REPEAT 2 (counter batch):  # 1 of 2 done",
        "           SEQ:  # at child 0 of 3",
        "               x = BUFFER 50:  # 25 of 50 done",
        ">>                 GaussianStream.next()",
        "               components = StreamingPCA.analyze(x)",
        "               explained = StreamingPCA.explained()",
        "       components = StreamingPCA.components()",
        "       model = StreamingPCA.model()",
        "registers:",
        "  batch            int        1",
        "  x                ndarray    shape (50, 3) float64",
        "  components       ndarray    shape (2, 3) float64",
        "  explained        list       2 items of float",
    ]


def test_show_summarizes_tensors_and_containers(tmp_path):
    from flowvm.programs import mlp

    ckpt = tmp_path / "m.ckpt"
    drv = mlp.build(epochs=1).start()
    drv.run(max_steps=9)
    flowvm.save(drv, ckpt)  # a checkpoint written by the library, shown by the command
    out = flowvm_cmd("show", ckpt, "--trust").stdout
    assert "  x_test           Tensor     shape (1000, 2) float32" in out
    assert "  batch            tuple      2 items of Tensor" in out
    assert "  loss             float      " in out
    assert "  history          list       0 items" in out
    assert ">>" in out and "step 9" in out


def test_the_registers_summary_gives_scalars_their_value_and_survives_odd_values():
    import numpy as np
    import torch

    from flowvm.command.values import registers_summary

    text = registers_summary({"loss": torch.tensor(0.25), "acc": np.float64(0.5), "cls": np.ndarray,
                              "x": np.zeros((2, 3), dtype=np.float32)})
    assert "  loss             Tensor     0.25 float32" in text and "  acc              float64    0.5 float64" in text
    assert "  cls              type       <class 'numpy.ndarray'>" in text
    assert "  x                ndarray    shape (2, 3) float32" in text
    text = registers_summary({"one": [1.5], "two": (1, 2)})
    assert "  one              list       1 item of float" in text and "  two              tuple      2 items" in text


def test_verify_prints_the_program_and_its_step_count():
    out = flowvm_cmd("verify", "pca", "--set", "batches=2").stdout
    assert out.splitlines()[-1] == "# pca: verified; it takes 2006 steps"  # 2 x (1000 samples + 2) + 2
    assert str(pca.build(batches=2)) in out
    out = flowvm_cmd("verify", "kmeans").stdout
    assert out.splitlines()[-1] == "# kmeans: verified"


def test_list_names_every_bundled_program_with_its_first_doc_line():
    out = flowvm_cmd("list", "--options").stdout.splitlines()
    names = [line.split()[0] for line in out if not line.startswith(" ")]
    assert {"pca", "kmeans", "mlp", "rbm", "lbfgs"} <= set(names)
    k = names.index("pca")
    pca_lines = [line for line in out if line.startswith("pca ")]
    assert pca_lines[0].split(None, 1)[1] == "Principal component analysis over a stream of samples."
    options = out[out.index(pca_lines[0]) + 1]
    assert options.startswith(" ") and options.strip() == \
        "options: samples=1000 batches=5 dim=13 components=3 seed=123 data=None drop=None"
    assert k == sorted(names).index("pca")
    assert [n for n, _, _ in bundled_programs()] == names


def test_static_steps_counts_only_fixed_shapes():
    assert static_steps(pca.build(batches=3, samples=10)) == 3 * (10 + 2) + 2
    from flowvm.programs import kmeans

    assert static_steps(kmeans.build()) is None  # a WHILE


def test_short_value_formats_numbers_compactly():
    import numpy as np

    assert short_value(0.123456789) == "0.12346"
    assert short_value(np.float64(2.5e-7)) == "2.5e-07"
    assert short_value(np.zeros((2, 3))) == "<array float64 2x3>"
    assert short_value(7) == "7"


# ------------------------------------------------------------------ progress
def test_plain_progress_lines_when_not_a_terminal():
    out = flowvm_cmd("run", "rbm", "--set", "epochs=3", "--progress-every", "0.01")
    lines = out.stderr.splitlines()
    assert lines[0] == "flowvm: running from step 0"
    progress = [line for line in lines[1:] if line.startswith("step ")]
    assert progress and progress[-1].startswith("step 610/610 (")  # 2 + 3 x (100 x 2 + 2) + 2
    assert "epoch=3" in progress[-1] and "error=" in progress[-1]
    assert "\r" not in out.stderr


def test_a_progress_bar_on_a_terminal():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(COMMAND + ["run", "pca", "--set", "batches=3"], stdout=subprocess.PIPE,
                            stderr=follower, cwd=ROOT)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.1)
        if ready:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the terminal closed
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    stdout = proc.communicate(timeout=30)[0].decode()
    seen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0
    assert "\r" in seen and "step/s" in seen and "3008/3008" in seen and "100%" in seen
    assert "batch=3" in seen  # the registers the program shows
    assert "finished after 3008 steps" in stdout


def test_saving_after_every_step_for_thousands_of_steps(tmp_path):
    from flowvm import CALL, REPEAT
    from flowvm.command.runner import Runner

    drv = REPEAT(1100, CALL(abs, -1)).start()
    assert Runner(drv, [], tmp_path / "r.ckpt", every=1, progress="none").run() == 0
    assert drv.done and flowvm.read_header(tmp_path / "r.ckpt")["steps"] == 1100


def test_a_module_in_the_current_directory_and_a_build_that_returns_no_program(tmp_path):
    (tmp_path / "mytrain.py").write_text(textwrap.dedent("""
        from flowvm import CALL, Registers
        def build(n: int = 3):
            reg = Registers()
            return CALL(sum, list(range(n)), store_to=reg("total"))
    """))
    (tmp_path / "broken.py").write_text("def build():\n    return [1, 2]\n")
    out = flowvm_cmd("run", "mytrain", "--set", "n=5", "--progress", "none", cwd=tmp_path)
    assert "total" in out.stdout and "10" in out.stdout
    assert "verified" in flowvm_cmd("verify", "mytrain", cwd=tmp_path).stdout
    out = flowvm_cmd("run", "broken.py", "--progress", "none", cwd=tmp_path, check=False)
    assert out.returncode != 0 and f"build() in {tmp_path / 'broken.py'} returned list [1, 2], not a flowvm " \
                                   "program" in out.stderr, out.stderr


def test_a_tampered_signed_checkpoint_runs_no_code_before_its_signature_is_checked(tmp_path):
    import hashlib
    import json
    import struct

    from flowvm.persist.checkpoint import MAGIC

    ckpt, forged, marker = tmp_path / "signed.ckpt", tmp_path / "forged.ckpt", tmp_path / "EVIL"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef build():\n    pass\n")
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--max-steps", 10, "--key", "k1",
               "--progress", "none")
    data = ckpt.read_bytes()
    (hlen,) = struct.unpack(">I", data[8:12])
    header = json.loads(data[12:12 + hlen])
    payload = data[12 + hlen + 32: 12 + hlen + 32 + header["payload_bytes"]]
    header["meta"]["target"] = str(tmp_path / "evil.py")  # name a program of the attacker's
    h = json.dumps(header).encode()
    head = MAGIC + struct.pack(">I", len(h)) + h
    body = head + hashlib.sha256(head).digest() + payload
    forged.write_bytes(body + hashlib.sha256(body).digest() + b"\0" * 32)  # checksums fine, no valid HMAC
    for command in (["resume", forged, "--key", "k1", "--progress", "none"], ["show", forged, "--key", "k1"]):
        out = flowvm_cmd(*command, check=False)
        assert out.returncode == 2 and "signature does not match" in out.stderr, out.stderr
        assert not marker.exists(), f"flowvm {command[0]} imported the module a tampered header names"


def test_run_refuses_to_replace_an_unfinished_run_and_build_errors_name_the_options(tmp_path):
    ckpt = tmp_path / "r.ckpt"
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--max-steps", 5, "--progress", "none")
    before = ckpt.read_bytes()
    out = flowvm_cmd("run", "kmeans", "--checkpoint", ckpt, "--progress", "none", check=False)
    assert out.returncode != 0 and f"{ckpt} holds an unfinished run (pca, step 5); continue it with " \
                                   f"`flowvm resume {ckpt}`, or pass --force" in out.stderr, out.stderr
    assert ckpt.read_bytes() == before
    flowvm_cmd("run", "kmeans", "--set", "samples=300", "--checkpoint", ckpt, "--force", "--progress", "none")
    assert flowvm.read_header(ckpt)["done"]
    flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", ckpt, "--progress", "none")  # a finished run is replaced
    out = flowvm_cmd("run", "rbm", "--set", "epochs=-1", check=False)
    assert out.returncode != 0 and "rejected --set epochs=-1: ValueError: rbm: epochs must be >= 1, got -1" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_signed_pause_says_the_key_is_needed_and_a_moved_program_is_reported(tmp_path):
    out = flowvm_cmd("run", "pca", *SMALL_PCA, "--checkpoint", tmp_path / "s.ckpt", "--max-steps", 5, "--key", "k",
                     "--progress", "none")
    assert "(signed: give the key with --key or $FLOWVM_CHECKPOINT_KEY)" in out.stdout
    program = tmp_path / "prog.py"
    program.write_text("from flowvm import CALL, REPEAT, Registers\n"
                       "def build():\n    reg = Registers(n=0)\n"
                       "    return REPEAT(50, CALL(abs, reg('n'), store_to=reg('n')))\n"
                       "def report(registers):\n    return 'the report'\n")
    ckpt = tmp_path / "p.ckpt"
    flowvm_cmd("run", program, "--checkpoint", ckpt, "--max-steps", 5, "--progress", "none")
    program.rename(tmp_path / "moved.py")
    out = flowvm_cmd("resume", ckpt, "--progress", "none")
    assert "flowvm: warning: cannot load the run's program (no such program file" in out.stderr
    assert "finished after 50 steps" in out.stdout and "the report" not in out.stdout


def test_version_and_the_help_of_targets_and_options():
    assert flowvm_cmd("--version").stdout.strip() == f"flowvm {flowvm.__version__}"
    for command in ("run", "verify", "sweep"):
        text = " ".join(flowvm_cmd(command, "--help").stdout.split())
        assert "a .py file" in text and "NAME=VALUE with VALUE a Python literal" in text \
            or command == "sweep" and "VALUE a Python literal" in text, text
    assert "a bundled program's name (flowvm list), a module name (mypkg.train) or a .py file" in \
        " ".join(flowvm_cmd("verify", "--help").stdout.split())
    assert "--key KEY the key of a signed checkpoint" in " ".join(flowvm_cmd("show", "--help").stdout.split())


def test_bad_data_is_flowvms_own_error_one_line_and_status_2_naming_the_program_not_its_path(tmp_path):
    (tmp_path / "points.csv").write_text("a,b\n1,2\n3,x\n")
    out = flowvm_cmd("run", "kmeans", "--data", tmp_path / "points.csv", check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"flowvm: kmeans: {tmp_path / 'points.csv'}: line 3, column 2 ('b') holds 'x', " \
                                 "not a number"
    out = flowvm_cmd("run", "kmeans", "--set", "clusters=0", check=False)
    assert out.returncode != 0 and out.stderr.startswith("flowvm: kmeans: build() rejected --set clusters=0")
    assert "site-packages" not in out.stderr and "kmeans.py" not in out.stderr


def test_show_of_a_state_file_of_a_torch_run_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    ckpt = tmp_path / "run.safetensors"
    flowvm_cmd("run", "mlp", "--set", "epochs=1", "--set", "samples=300", "--checkpoint", ckpt, "--max-steps", "30",
               "--progress", "none")
    code = ("import sys\nfrom flowvm.command.cli import main\nstatus = main(['show', sys.argv[1]])\n"
            "print('torch imported:', 'torch' in sys.modules, status, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "torch imported: False 0", done.stderr
    assert "30" in done.stdout


@pytest.mark.parametrize("args, words", [
    (["run", ".."], "no program '..'"),
    (["run", ""], "no program ''"),
    (["run", "pca", "--every", "0"], "--every must be >= 1"),
    (["run", "pca", "--checkpoint", "c.ckpt", "--every-seconds", "inf"],
     "--every-seconds must be a finite number of seconds > 0, got inf"),
    (["run", "pca", "--checkpoint", "c.ckpt", "--every-seconds", "nan"],
     "--every-seconds must be a finite number of seconds > 0, got nan"),
    (["run", "mlp", "--set", "lr=1e999"], "option 'lr' takes a finite number, got '1e999'"),
    (["run", "mlp", "--set", "lr=nan"], "mlp: build() rejected --set lr=nan"),
    (["run", "mlp", "--set", "hidden=4000000"], "mlp: build() with --set hidden=4000000 needs more memory than"),
    (["run", "rbm", "--set", "side=100000"], "rbm: build() with --set side=100000 needs more memory than"),
    (["run", "mlp", "--set", "workers=100000"], "workers=100000 is more than this machine can run usefully"),
])
def test_every_bad_input_is_one_line_and_status_2(args, words):
    out = flowvm_cmd(*args, check=False)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("flowvm: "), out.stderr


def test_an_output_the_program_cannot_give_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "nomodel.py").write_text(textwrap.dedent('''\
        from flowvm import CALL, REPEAT, Registers

        def touch(path):
            open(path, "w").close()

        def build(path=""):
            return REPEAT(3, CALL(touch, path))
    '''))
    marker = tmp_path / "stepped"
    out = flowvm_cmd("run", tmp_path / "nomodel.py", "--set", f"path={str(marker)!r}", "--output",
                     tmp_path / "m.npz", check=False)
    assert out.returncode == 2 and "--output" in out.stderr and "gives no model" in out.stderr
    assert not marker.exists()


@pytest.mark.parametrize("where, words", [("missing/m.npz", "its folder {tmp}/missing does not exist"),
                                          ("a.npz", "a folder, not a file")])
def test_an_output_that_cannot_be_written_is_refused_before_the_first_step(tmp_path, where, words):
    (tmp_path / "a.npz").mkdir()
    start = time.monotonic()
    out = flowvm_cmd("run", "pca", "--output", tmp_path / where, check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0] == f"flowvm: --output {tmp_path / where}: {words.format(tmp=tmp_path)}", out.stderr
    assert time.monotonic() - start < 60  # refused at once: pca's full run is not waited for
    assert "finished" not in out.stdout


def test_a_programs_error_shows_its_own_frames_and_where_it_happened(tmp_path):
    (tmp_path / "boom.py").write_text(textwrap.dedent('''\
        from flowvm import CALL, REPEAT, SEQ, Registers

        def inner(x):
            return 1 / x

        def step(x):
            return inner(x - 3)

        def bump(x):
            return x + 1

        def build():
            reg = Registers(x=0)
            return REPEAT(5, SEQ([CALL(step, reg('x')), CALL(bump, reg('x'), store_to=reg('x'))]))
    '''))
    out = flowvm_cmd("run", tmp_path / "boom.py", "--checkpoint", tmp_path / "b.ckpt", "--progress", "none",
                     check=False)
    assert out.returncode == 1
    err = out.stderr
    assert err.startswith("Traceback (most recent call last):\n") and "ZeroDivisionError: division by zero" in err
    assert 'boom.py", line 7, in step' in err and 'boom.py", line 4, in inner' in err
    assert "flowvm/" not in err.replace("flowvm: ", "") and "<flowvm" not in err, err  # none of the machine's frames
    assert "flowvm: while running CALL step(x) at path '0.0' (step 7)" in err
    assert "the run is saved at step 6" in err


def test_a_resume_says_nothing_of_the_commands_own_thread_count_and_other_settings_in_one_line(tmp_path):
    ckpt = tmp_path / "m.ckpt"
    flowvm_cmd("run", "mlp", "--set", "epochs=1", "--checkpoint", ckpt, "--max-steps", "5", "--progress", "lines")
    out = flowvm_cmd("resume", ckpt, "--max-steps", "5", "--progress", "lines")
    assert "Warning" not in out.stderr and "warning" not in out.stderr, out.stderr  # THREADS=1, set by the command
    lines = out.stderr.splitlines()
    assert lines[0] == "flowvm: running from step 5, saving to " + str(ckpt)
    assert "(0 steps/s)" not in out.stderr
    script = ("import sys, torch, flowvm\nfrom flowvm import CALL, REPEAT, Registers\n"
              "torch.set_num_threads(1)\nreg = Registers(n=0)\n"
              "d = REPEAT(4, CALL(torch.get_num_threads, store_to=reg('n'))).start(); d.run(max_steps=1)\n"
              "flowvm.save(d, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "py.ckpt")], check=True, timeout=120)
    out = flowvm_cmd("resume", tmp_path / "py.ckpt", "--progress", "none")
    warned = [line for line in out.stderr.splitlines() if "torch.threads=1" in line]
    assert len(warned) == 1 and re.fullmatch(r"flowvm: warning: resuming with the settings the run was saved with: "
                                             r"torch.threads=1 \(this process had \d+\)\. --keep-settings keeps this "
                                             r"process's own\.", warned[0]), out.stderr
    assert "n                int        1" in out.stdout
    assert "SettingsWarning" not in out.stderr and "warnings.warn" not in out.stderr


def test_a_missing_tensorboard_is_said_before_the_run_starts(tmp_path):
    script = ("import sys\nsys.modules['tensorboard'] = None\nsys.modules['torch.utils.tensorboard'] = None\n"
              "from flowvm.command.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", script, "run", "pca", "--set", "batches=2", "--tensorboard",
                          str(tmp_path / "tb"), "--progress", "lines"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--tensorboard needs the tensorboard package" in out.stderr, out.stderr
    assert "running from step" not in out.stderr


def test_a_model_that_cannot_be_written_is_one_line_after_a_finished_saved_run(tmp_path):
    (tmp_path / "dictmodel.py").write_text(textwrap.dedent('''\
        from flowvm import CALL, REPEAT, Registers

        def build():
            return REPEAT(3, CALL(abs, -1, store_to=Registers(n=0)("n")))

        def model(registers):
            return {"weights": object()}
    '''))
    ckpt = tmp_path / "d.ckpt"
    out = flowvm_cmd("run", tmp_path / "dictmodel.py", "--checkpoint", ckpt, "--output", tmp_path / "m.npz",
                     "--progress", "none", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--output" in out.stderr and "model(registers) gave a dict, which cannot be written" in out.stderr
    assert flowvm.read_header(ckpt)["done"]


def test_a_progress_line_gives_a_slow_speed_in_significant_digits():
    from flowvm.command.runner import rate_text

    assert rate_text(1, 2.5) == "0.4 steps/s"  # one slow step is not "0 steps/s"
    assert rate_text(3, 2.0) == "1.5 steps/s" and rate_text(1234, 2.0) == "617 steps/s"
    assert rate_text(5, 0.0).endswith(" steps/s")
