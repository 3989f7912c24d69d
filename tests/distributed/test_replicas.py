"""The check that the ranks of a data-parallel run hold one model (flowvm.distributed.replicas): a model
trained on two ranks without DistributedDataParallel is refused in one line with status 2, naming its register
and DDP, and nothing is reported or written as if the run had succeeded; the same program wrapped in DDP, or
with the register declared per-rank (PER_RANK), runs to its end; the check at a coordinated checkpoint.  Each
run is the flowvm command in a new process, on two ranks of gloo on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(300)

PROG = Path(__file__).with_name("progs_replicas.py")
TIMEOUT = 120


def flowvm(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-P", "-m", "flowvm", *args, "--progress", "none"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def refusals(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if "the ranks train different models" in line]


@pytest.mark.parametrize("sync, step", [("20", 16), ("4", 4)], ids=["at-the-end", "after-the-first-update"])
def test_a_model_trained_without_ddp_on_two_ranks_is_refused(tmp_path, sync, step):
    # 16 steps, an update every second: agreements every 20 steps come only at the end (checked there, before
    # the report and --output); every 4, the first after the first update is at step 4
    out = tmp_path / "model.pt"
    done = flowvm("run", str(PROG), "--nproc", "2", "--output", str(out), "--sync-every", sync)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = refusals(done)
    assert len(lines) == 1, done.stderr[-3000:]  # said once, in one line
    assert lines[0].startswith("flowvm: the ranks train different models: registers/net holds a torch module "
                               f"(Sequential) whose copy on rank 1 differs from rank 0's at step {step} "
                               "(its parameters differ); "), lines[0]
    assert "torch.nn.parallel.DistributedDataParallel" in lines[0] and "PER_RANK = ('net',)" in lines[0]
    assert "Traceback" not in done.stderr and "rank 0 failed" not in done.stderr
    assert "weights" not in done.stdout and "finished" not in done.stdout  # no report of a finished run
    assert not out.exists()


def test_the_same_model_in_ddp_runs_to_its_end(tmp_path):
    out = tmp_path / "model.pt"
    done = flowvm("run", str(PROG), "--nproc", "2", "--set", "wrap=True", "--output", str(out), "--sync-every", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("weights ") == 1 and out.exists()


def test_registers_declared_per_rank_are_not_compared(tmp_path):
    own = tmp_path / "own.py"
    own.write_text(PROG.read_text() + "\n\nPER_RANK = ('net', 'opt')\n")
    done = flowvm("run", str(own), "--nproc", "2", "--set", "momentum=0.9")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("weights ") == 1


def test_the_replicas_are_compared_before_a_checkpoint_is_written(tmp_path):
    # no agreement before the end (--sync-every 50): the save at step 4 finds the optimizer's state differs too
    ckpt = tmp_path / "run"
    done = flowvm("run", str(PROG), "--nproc", "2", "--set", "momentum=0.9", "--checkpoint", str(ckpt),
                  "--every", "4", "--sync-every", "50")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = refusals(done)
    assert len(lines) == 1 and "rank 0's at step 4" in lines[0] and "(and registers/opt)" in lines[0], lines
    assert "PER_RANK = ('net', 'opt')" in lines[0]
    assert not (ckpt / "manifest.json").exists()  # no checkpoint of the two models


def test_per_rank_must_name_registers(tmp_path):
    own = tmp_path / "own.py"
    own.write_text(PROG.read_text() + "\n\nPER_RANK = 3\n")
    done = flowvm("run", str(own), "--nproc", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("PER_RANK in") == 1 and "must be register names" in done.stderr
    assert "Traceback" not in done.stderr


def test_what_is_compared_is_named_by_the_place_that_holds_it():
    # in one process: the walk and the digests alone (no group)
    import torch

    from flowvm import CALL, SEQ, Registers
    from flowvm.distributed import replicas

    class Trainer:
        def __init__(self):
            self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

        def step(self):
            return None

    trainer, own = Trainer(), torch.nn.Linear(2, 1)
    reg = Registers(net=torch.nn.Linear(2, 1), stats=own, w=torch.nn.Parameter(torch.ones(2)), loss=1.0)
    drv = SEQ([CALL(trainer.step), CALL(lambda m: None, own, store_to=reg("loss"))]).start()
    places = [(where, kind) for where, kind, _ in replicas.held(drv, frozenset({"stats"}))]
    assert places == [("registers/net", "module"), ("registers/w", "parameter"),
                      ("CALL at 0, function Trainer.step, self.model", "module"),
                      ("CALL at 0, function Trainer.step, self.optimizer", "optimizer")]  # stats's module: per-rank
    assert replicas.held(drv, frozenset({"*"})) == []

    def digest():
        return {where: d for where, _, d, _ in replicas.digests(drv)}

    before = digest()
    trainer.model[1].running_mean += 1  # a buffer: not compared (DDP broadcasts rank 0's at each forward)
    assert digest() == before
    with torch.no_grad():
        trainer.model[0].weight[0, 0] = torch.nextafter(trainer.model[0].weight[0, 0], torch.tensor(2.0))
    after = digest()  # one ulp of one weight
    assert after["CALL at 0, function Trainer.step, self.model"] != before["CALL at 0, function Trainer.step, self.model"]
    assert {k: v for k, v in after.items() if "self.model" not in k} == \
           {k: v for k, v in before.items() if "self.model" not in k}


def test_a_coordinated_checkpoint_lands_on_a_step_that_resumes_exactly(tmp_path):
    # 5 steps an update (batch, zero_grad, loss, backward, step): --max-steps 3 stops after the loss, before its
    # backward; the ranks step on together to step 4 and save there
    base = ["--nproc", "2", "--set", "wrap=True", "--set", "split=True", "--sync-every", "1"]
    straight = flowvm("run", str(PROG), *base)
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = tmp_path / "run"
    paused = flowvm("run", str(PROG), *base, "--checkpoint", str(ckpt), "--max-steps", "3")
    assert paused.returncode == 0, paused.stderr[-3000:]
    assert paused.stderr.count("flowvm: saving at step 4, not 3: a register held an autograd graph") == 1, \
        paused.stderr[-3000:]
    resumed = flowvm("resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    weights = [line for line in straight.stdout.splitlines() if line.startswith("weights ")]
    assert weights and weights == [line for line in resumed.stdout.splitlines() if line.startswith("weights ")]


def test_a_rank_dying_in_its_teardown_after_the_refusal_leaves_the_refusal_and_its_status(tmp_path):
    # every rank stops on the refusal (status 2) and says so; rank 1 then aborts at its exit, as a group's
    # thread can: the run's status and its one line stay the refusal's
    dying = tmp_path / "dying.py"
    dying.write_text(PROG.read_text() + "\n\nimport atexit, os\nif os.environ.get('RANK') == '1':\n"
                     "    atexit.register(os.abort)\n")
    ckpt = tmp_path / "run"
    done = flowvm("run", str(dying), "--nproc", "2", "--set", "momentum=0.9", "--checkpoint", str(ckpt),
                  "--every", "4", "--sync-every", "50")
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(refusals(done)) == 1 and "rank 1 failed" not in done.stderr, done.stderr[-3000:]
    assert not (ckpt / "manifest.json").exists()


def test_a_rank_dying_in_its_teardown_after_the_run_finished_leaves_the_finished_run(tmp_path):
    # every rank finishes the run and says so (rank 0 has written the output); rank 1 then aborts at its exit,
    # as a gloo thread can in the group's teardown: the run's status is 0, and the death is said in one line
    dying = tmp_path / "dying.py"
    dying.write_text(PROG.read_text() + "\n\nimport atexit, os\nif os.environ.get('RANK') == '1':\n"
                     "    atexit.register(os.abort)\n")
    out = tmp_path / "model.pt"
    done = flowvm("run", str(dying), "--nproc", "2", "--set", "wrap=True", "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("weights ") == 1 and out.exists()
    said = [line for line in done.stderr.splitlines() if "died in its teardown" in line]
    assert said == ["flowvm: rank 1 died in its teardown (exit code -6) after every rank had ended; "
                    "the run's status stands"], done.stderr[-3000:]
