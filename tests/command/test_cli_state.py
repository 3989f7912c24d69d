"""The flowvm command with state checkpoints (a --checkpoint path ending in .safetensors): run, resume
(from the recorded target and options, or into another program, with new options), show, refusals."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import flowvm
from flowvm.programs import pca
from flowvm.testing import diff, outcome
from toy import flowvm_cmd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "persist"))  # state_programs

PCA = {"batches": 3, "samples": 40, "dim": 4, "components": 2}
SETS = [a for k, v in PCA.items() for a in ("--set", f"{k}={v}")]


def finished(path, build, module=pca):
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    drv = flowvm.load_state(path, build(), classes=classes)  # results the run made (as flowvm resume does)
    assert drv.done
    return outcome(drv)


def test_run_pause_show_resume_bit_for_bit(tmp_path):
    ckpt = tmp_path / "run.safetensors"
    out = flowvm_cmd("run", "pca", *SETS, "--checkpoint", ckpt, "--every", 25, "--max-steps", 60,
                     "--progress", "none")
    assert f"paused at step 60; continue with `flowvm resume {ckpt}`" in out.stdout
    head = flowvm.persist.state.read_state_header(ckpt)
    assert head["steps"] == 60 and head["meta"]["target"] == "pca" and head["meta"]["sets"] == [s for s in SETS if s != "--set"]
    shown = flowvm_cmd("show", ckpt).stdout
    assert f"# {ckpt}: pca --set batches=3" in shown and "state checkpoint written by flowvm" in shown
    assert "# flowvm driver: step 60, next: path '0.0.0.0'" in shown and ">>" in shown and "x = BUFFER 40:" in shown
    assert "registers:" in shown and "batch" in shown
    refused = flowvm_cmd("run", "pca", "--checkpoint", ckpt, check=False)
    assert refused.returncode != 0 and "holds an unfinished run (pca, step 60)" in refused.stderr
    flowvm_cmd("resume", ckpt, "--progress", "none", cwd=tmp_path)
    straight = pca.build(**PCA).start()
    straight.run()
    from state_programs import comparable

    assert not diff(comparable(outcome(straight)), comparable(finished(ckpt, lambda: pca.build(**PCA))))


def test_resume_with_a_new_setting_and_into_another_program(tmp_path):
    (tmp_path / "walk.py").write_text(textwrap.dedent('''\
        """A user's program: a constant step added n times."""
        from flowvm import CALL, REPEAT, Registers

        def add(total, step):
            return total + step

        def build(n: int = 10, step: float = 1.0):
            reg = Registers(total=0.0)
            return REPEAT(n, CALL(add, reg("total"), step, store_to=reg("total")))
    '''))
    ckpt = tmp_path / "walk.safetensors"
    flowvm_cmd("run", tmp_path / "walk.py", "--checkpoint", ckpt, "--max-steps", 4, "--progress", "none")
    flowvm_cmd("resume", ckpt, "--set", "step=3.0", "--max-steps", 2, "--progress", "none")
    head = flowvm.persist.state.read_state_header(ckpt)
    assert head["steps"] == 6 and head["meta"]["sets"] == ["step=3.0"]
    out = flowvm_cmd("resume", ckpt, "--program", tmp_path / "walk.py", "--set", "step=0.5", "--progress", "none")
    assert "finished after 10 steps" in out.stdout
    assert "total            float      12" in out.stdout  # 4 * 1.0 + 2 * 3.0 + 4 * 0.5
    wrong = flowvm_cmd("resume", ckpt, "--program", "pca", check=False)
    assert wrong.returncode == 2 and "differs from the saved run's at path '<root>'" in wrong.stderr


def test_show_and_resume_into_your_own_program_import_nothing_the_file_names(tmp_path):
    marker = tmp_path / "imported"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\ndef build():\n    raise SystemExit('ran')\n")
    ckpt = tmp_path / "run.safetensors"
    flowvm_cmd("run", "pca", *SETS, "--checkpoint", ckpt, "--max-steps", 30, "--progress", "none")
    from state_programs import rewrite

    def edit(meta):
        head = json.loads(meta["flowvm.header"])
        head["meta"] = {"target": str(evil), "module": "evil", "sets": []}
        meta["flowvm.header"] = json.dumps(head)

    crafted = rewrite(ckpt, tmp_path / "crafted.safetensors", edit)
    shown = flowvm_cmd("show", crafted).stdout
    assert f"{evil}," in shown and "step 30" in shown
    flowvm_cmd("resume", crafted, "--program", "pca", *SETS, "--progress", "none")
    assert not marker.exists()


def test_refusals_before_anything_runs(tmp_path):
    (tmp_path / "lam.py").write_text(textwrap.dedent('''\
        from flowvm import CALL, REPEAT, Registers

        def build():
            reg = Registers(f=lambda x: x, n=0)
            return REPEAT(5, CALL(abs, reg("n"), store_to=reg("n")))
    '''))
    out = flowvm_cmd("run", tmp_path / "lam.py", "--checkpoint", tmp_path / "l.safetensors", check=False)
    assert out.returncode == 2 and "registers/f holds a function" in out.stderr and "finished" not in out.stdout
    from safetensors.numpy import save_file
    import numpy as np

    save_file({"w": np.zeros(2)}, str(tmp_path / "model.safetensors"))
    out = flowvm_cmd("run", "pca", "--checkpoint", tmp_path / "model.safetensors", check=False)
    assert out.returncode != 0 and "exists and is not a flowvm state checkpoint" in out.stderr


def test_signed_state_checkpoints(tmp_path):
    ckpt = tmp_path / "signed.safetensors"
    flowvm_cmd("run", "pca", *SETS, "--checkpoint", ckpt, "--max-steps", 30, "--key", "k1", "--progress", "none")
    assert flowvm.persist.state.read_state_header(ckpt, key="k1")["signed"]
    out = flowvm_cmd("show", ckpt, check=False)
    assert out.returncode != 0 and "is signed: give its key" in out.stderr
    out = flowvm_cmd("resume", ckpt, "--key", "wrong", check=False)
    assert out.returncode == 2 and "signature does not match" in out.stderr
    flowvm_cmd("resume", ckpt, "--key", "k1", "--progress", "none")
    assert flowvm.persist.state.read_state_header(ckpt, key="k1")["done"]


# ------------------------------------------------------------------ files from anyone
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bounded


def test_show_of_an_unsigned_pickle_imports_and_unpickles_nothing(tmp_path):
    import crafted

    trap = tmp_path / "trap.py"
    marker = tmp_path / "ran"
    trap.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef build():\n    pass\n")
    ckpt = crafted.saved_checkpoint(tmp_path / "run.ckpt", meta={"target": str(trap), "sets": []})
    out = flowvm_cmd("show", ckpt)
    assert not marker.exists(), "show imported the module the file names"
    assert "registers: not shown" in out.stdout and "--trust" in out.stdout
    assert "loading it imports and calls: " in out.stdout and "crafted.Walker" in out.stdout
    flowvm_cmd("show", ckpt, "--trust", check=False)  # asked for: the module the file names is imported
    assert marker.exists()


def test_show_prints_a_files_control_characters_escaped(tmp_path):
    import crafted

    good = crafted.saved_state(tmp_path / "good.safetensors")

    def names(registers):
        registers[0][0] = "\x1b]0;owned\x07\x1b[2J"

    def listing(program):
        program["listing"][0][2] = "REPEAT \x1b[31mred\u202e"

    bad = crafted.edit_state(good, tmp_path / "a.safetensors", "registers", names)
    bad = crafted.edit_state(bad, tmp_path / "b.safetensors", "program", listing)
    out = flowvm_cmd("show", bad).stdout
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b]0;owned\\x07\\x1b[2J" in out and "REPEAT \\x1b[31mred\\u202e" in out


def test_a_malformed_header_is_one_line_and_exit_2(tmp_path):
    import crafted

    ckpt = crafted.saved_checkpoint(tmp_path / "run.ckpt")
    ckpt.write_bytes(crafted.reheader(ckpt.read_bytes(), lambda h: dict(h, meta=[1])))
    for command in (("show", ckpt), ("plot", ckpt), ("resume", ckpt, "--progress", "none")):
        out = flowvm_cmd(*command, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "the header's field 'meta' must be an object" in out.stderr


def _full_disk(limit):
    import resource
    import signal

    def start():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return start


import pytest  # noqa: E402


@pytest.mark.parametrize("name", ["run.ckpt", "run.safetensors"])
def test_a_full_disk_is_one_line_exit_2_and_keeps_the_previous_checkpoint(tmp_path, name):
    import subprocess

    from toy import COMMAND

    ckpt = tmp_path / name
    flowvm_cmd("run", "pca", *SETS, "--checkpoint", ckpt, "--max-steps", 10, "--progress", "none")
    before = ckpt.read_bytes()
    out = subprocess.run(COMMAND + ["resume", str(ckpt), "--every", "5", "--progress", "none"],
                         capture_output=True, text=True, preexec_fn=_full_disk(len(before) // 2), timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot save: " in lines[0] and "File too large" in lines[0], out.stderr
    assert "keeps the run as saved at step 10" in lines[0]
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary, no lock left


def test_a_second_run_on_a_checkpoint_in_use_is_refused_naming_the_first(tmp_path, capsys):
    import os

    from flowvm.command import cli
    from flowvm.persist.lock import holding

    ckpt = tmp_path / "run.safetensors"
    with holding(ckpt):  # the first run (another process holds the lock the same way)
        status = cli.main(["run", "pca", *SETS, "--checkpoint", str(ckpt), "--progress", "none"])
    assert status == 2
    assert f"in use: process {os.getpid()} on " in capsys.readouterr().err
    assert not ckpt.exists()
    assert cli.main(["run", "pca", *SETS, "--checkpoint", str(ckpt), "--progress", "none"]) == 0


def test_data_is_recorded_as_a_value_and_the_resumed_run_reads_it(tmp_path):
    import numpy as np
    from safetensors import safe_open

    data = tmp_path / "it's my data.npy"  # a quote and a space: a path, never parsed as a literal
    np.save(data, np.random.default_rng(0).normal(size=(80, 6)))
    ckpt = tmp_path / "run.safetensors"
    flowvm_cmd("run", "pca", "--data", data, "--set", "components=2", "--checkpoint", ckpt, "--max-steps", "3",
               "--progress", "none", cwd=tmp_path)
    with safe_open(str(ckpt), framework="np") as f:
        meta = json.loads(f.metadata()["flowvm.header"])["meta"]
    assert meta["data"] == str(data.resolve()) and meta["sets"] == ["components=2"]
    shown = flowvm_cmd("show", ckpt, cwd=tmp_path).stdout
    assert f" pca --data {data.resolve()} --set components=2," in shown.splitlines()[0]
    flowvm_cmd("resume", ckpt, "--max-steps", "2", "--progress", "none", cwd=tmp_path)
    with safe_open(str(ckpt), framework="np") as f:
        again = json.loads(f.metadata()["flowvm.header"])
    assert again["meta"]["data"] == str(data.resolve()) and again["meta"]["sets"] == ["components=2"]
    assert again["steps"] == 5
    flowvm_cmd("resume", ckpt, "--output", tmp_path / "pca.npz", "--progress", "none", cwd=tmp_path)
    straight = pca.build(data=str(data), components=2).start()
    straight.run()
    assert np.allclose(np.load(tmp_path / "pca.npz")["components_"], pca.model(straight.registers).components_)


def test_a_file_recording_data_among_its_sets_resumes(tmp_path):
    import numpy as np

    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(1).normal(size=(40, 4)))
    ckpt = tmp_path / "old.safetensors"
    flowvm_cmd("run", "pca", "--set", f"data={str(data)!r}", "--checkpoint", ckpt, "--max-steps", "2",
               "--progress", "none", cwd=tmp_path)  # as flowvm 0.3 recorded --data
    done = flowvm_cmd("resume", ckpt, "--progress", "none", cwd=tmp_path)
    assert done.returncode == 0
    from flowvm.persist.state import read_state_header

    assert read_state_header(ckpt)["meta"]["sets"] == [f"data={str(data)!r}"]
