"""The flowvm command with state checkpoints (a --checkpoint path ending in .safetensors): run, resume
(from the recorded target and options, or into another program, with new options), show, refusals."""

from __future__ import annotations

import json
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
