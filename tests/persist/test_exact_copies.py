"""Copies that used to resume silently other: a copy resumed where torch is imported only by the program, after
the load (its torch states and settings are set when torch arrives), and a copy taken between a forward pass and
its backward (refused by hand, waited past by the command's saves)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import flowvm
from flowvm.testing import digest
import toy

LAZY = textwrap.dedent('''
    from flowvm import CALL, REPEAT, SEQ, Registers

    def draw(total):
        import torch  # only the program imports torch
        return total + int(torch.randint(0, 1000, (1,)))

    def noop(n):
        return n + 1

    def dtype_of(seen):
        import torch
        return seen + [str(torch.ones(2).dtype)]

    def build():
        import torch
        torch.manual_seed(3)
        torch.set_default_dtype(torch.float64)
        reg = Registers(total=0, n=0, seen=[])
        return REPEAT(10, SEQ([CALL(noop, reg('n'), store_to=reg('n')), CALL(noop, reg('n'), store_to=reg('n')),
                               CALL(draw, reg('total'), store_to=reg('total')),
                               CALL(dtype_of, reg('seen'), store_to=reg('seen'))]))
''')

TRAIN = textwrap.dedent('''
    import torch
    from flowvm import CALL, REPEAT, SEQ, Registers

    def loss_of(net, x, y):
        return torch.nn.functional.mse_loss(net(x), y)

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        reg = Registers(net=net, x=torch.randn(32, 4), y=torch.randn(32, 1), loss=None)
        return REPEAT(6, SEQ([CALL(opt.zero_grad), CALL(loss_of, reg('net'), reg('x'), reg('y'), store_to=reg('loss')),
                              CALL(torch.Tensor.backward, reg('loss')), CALL(opt.step)]))
''')


@pytest.fixture(autouse=True)
def _default_dtype():
    """LAZY's build() sets torch's default dtype in this process too: put it back."""
    import torch

    before = torch.get_default_dtype()
    yield
    torch.set_default_dtype(before)


def _write(tmp_path, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


def _fresh(tmp_path, code, *args) -> str:
    """Run code in a fresh interpreter (torch not imported unless the code does) and return its last line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(toy.TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-P", "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


RESUME = ("import sys, warnings, flowvm\n"
          "from flowvm.testing import digest\n"
          "warnings.simplefilter('ignore')\n"
          "d = flowvm.load(sys.argv[1]) if sys.argv[1].endswith('.ckpt') else __import__('pickle').loads("
          "open(sys.argv[1], 'rb').read())\n"
          "d.run(max_steps=int(sys.argv[2])) if len(sys.argv) > 2 else d.run()\n"
          "if len(sys.argv) > 3: flowvm.save(d, sys.argv[3]); print('torch' in sys.modules)\n"
          "else: print(digest(dict(d.registers)))\n")


@pytest.mark.parametrize("how", ["checkpoint", "pickle"])
@pytest.mark.parametrize("cut", [2, 9])  # before the first draw; after it
def test_a_copy_resumed_where_only_the_program_imports_torch_is_exact(tmp_path, how, cut):
    lazy = _write(tmp_path, f"lazy_{how}_{cut}", LAZY)
    reference = lazy.build().start()
    reference.run()
    drv = lazy.build().start()
    drv.run(max_steps=cut)
    path = tmp_path / ("half.ckpt" if how == "checkpoint" else "half.pkl")
    flowvm.save(drv, path) if how == "checkpoint" else path.write_bytes(pickle.dumps(drv))
    assert _fresh(tmp_path, RESUME, path) == digest(dict(reference.registers))
    assert reference.registers["seen"][-1] == "torch.float64"


def test_a_copy_of_a_copy_that_has_not_met_torch_yet_carries_its_torch_states_on(tmp_path):
    lazy = _write(tmp_path, "lazy_twice", LAZY)
    reference = lazy.build().start()
    reference.run()
    drv = lazy.build().start()
    drv.run(max_steps=4)  # the next draw is at step 7
    flowvm.save(drv, tmp_path / "a.ckpt")
    assert _fresh(tmp_path, RESUME, tmp_path / "a.ckpt", 1, tmp_path / "b.ckpt") == "False"  # no torch yet
    assert _fresh(tmp_path, RESUME, tmp_path / "b.ckpt") == digest(dict(reference.registers))


def test_a_finished_copy_leaves_a_later_import_of_torch_alone(tmp_path):
    lazy = _write(tmp_path, "lazy_done", LAZY)
    drv = lazy.build().start()
    drv.run(max_steps=1)
    flowvm.save(drv, tmp_path / "a.ckpt")
    code = ("import sys, warnings, flowvm\nwarnings.simplefilter('ignore')\n"
            "d = flowvm.load(sys.argv[1]); d.run(max_steps=1)\n"
            "mine = 'torch' not in sys.modules\n"
            "d.run(max_steps=60)\n"  # imports torch: the run's states and settings are set
            "import torch\nprint(mine, torch.get_default_dtype())\n")
    assert _fresh(tmp_path, code, tmp_path / "a.ckpt") == "True torch.float64"
    code = ("import sys, warnings, flowvm\nwarnings.simplefilter('ignore')\n"
            "d = flowvm.load(sys.argv[1]); d.run(max_steps=1)\n"
            "del d\n"  # the run is gone: torch imported later keeps its own defaults
            "import gc; gc.collect()\nimport torch\nprint(torch.get_default_dtype())\n")
    assert _fresh(tmp_path, code, tmp_path / "a.ckpt") == "torch.float32"


def test_a_copy_between_forward_and_backward_is_refused_naming_the_register(tmp_path):
    train = _write(tmp_path, "train_refused", TRAIN)
    drv = train.build().start()
    drv.run(max_steps=2)
    with pytest.raises(flowvm.CopyError) as refused:
        flowvm.save(drv, tmp_path / "c.ckpt")
    assert refused.value.where == "registers/loss" and "backward" in str(refused.value)
    assert not (tmp_path / "c.ckpt").exists()
    with pytest.raises(pickle.PicklingError, match="registers/loss"):
        pickle.dumps(drv)


def test_the_commands_saves_wait_for_a_step_the_run_resumes_from_exactly(tmp_path):
    _write(tmp_path, "train_cli", TRAIN)
    train = __import__("train_cli")
    reference = train.build().start()
    reference.run()
    prog, ckpt = tmp_path / "train_cli.py", tmp_path / "c.ckpt"
    paused = toy.flowvm_cmd("run", prog, "--max-steps", "2", "--checkpoint", ckpt, "--every", "4", cwd=tmp_path)
    assert "saving at step 3, not 2: at step 2 registers/loss held an autograd graph" in paused.stderr
    assert flowvm.load(ckpt).steps == 3
    # periodic saves every 4 steps: 4k + 2 is always just after the forward pass, so each waits a step
    toy.flowvm_cmd("resume", ckpt, "--every", "3", cwd=tmp_path)
    assert digest(dict(flowvm.load(ckpt).registers)) == digest(dict(reference.registers))


def test_a_cancelled_arun_stops_on_a_step_the_run_resumes_from_exactly(tmp_path):
    import asyncio

    train = _write(tmp_path, "train_async", TRAIN)
    reference = train.build().start()
    reference.run()
    drv = train.build().start()

    async def cancel_after_the_forward_pass():
        task = asyncio.create_task(drv.arun(steps_per_yield=2))  # zero_grad, the loss: then it yields
        await asyncio.sleep(0)
        assert drv.steps == 2 and drv.copyable() is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError), pytest.warns(flowvm.CopyWarning) as said:
            await task
        assert len(said) == 1 and str(said[0].message).startswith(
            "arun() cancelled at step 2 stopped at step 3: a register held an autograd graph a backward() still "
            "needed, and a copy resumes exactly only without one (waited 1 step, "), str(said[0].message)

    asyncio.run(cancel_after_the_forward_pass())
    assert drv.steps == 3 and drv.copyable() is None  # the backward ran before the task ended
    copy = pickle.loads(pickle.dumps(drv))
    copy.run()
    assert digest(dict(copy.registers)) == digest(dict(reference.registers))


FOREVER = textwrap.dedent('''
    import time
    import torch
    from flowvm import CALL, REPEAT, Registers

    w = torch.ones(2, requires_grad=True)

    def keep(n):  # a graph with no saved tensor: a backward could always run through it
        time.sleep(0.01)
        return (w * 2).sum() + n

    def build():
        return REPEAT(100000, CALL(keep, 1.0, store_to=Registers(loss=None)('loss')))
''')


def test_a_save_that_never_reaches_an_exact_step_is_skipped_or_refused_in_one_line(tmp_path):
    (tmp_path / "forever.py").write_text(FOREVER)
    ckpt = tmp_path / "f.ckpt"
    done = toy.flowvm_cmd("run", tmp_path / "forever.py", "--max-steps", "5", "--checkpoint", ckpt, "--every", "2",
                          "--progress", "none", cwd=tmp_path, check=False,
                          env=dict(os.environ, FLOWVM_SAVE_WAIT="0.3"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("flowvm: checkpoint skipped at step ")  # the periodic save at step 2
    assert "registers/loss still holds an autograd graph" in lines[-1]
    assert lines[-1].endswith("no checkpoint of this run was written") and "Traceback" not in done.stderr
    assert not ckpt.exists()


class _Logger:
    def __init__(self, path):
        self.file = open(path, "w")
        self.lines = 0


def _log(logger, value):
    logger.lines += 1
    return value


def test_a_value_that_does_not_pickle_is_named_with_its_type(tmp_path):
    reg = flowvm.Registers(log=_Logger(tmp_path / "log.txt"))
    drv = flowvm.REPEAT(5, flowvm.CALL(_log, reg("log"), 1)).start()
    drv.run(max_steps=2)
    with pytest.raises(flowvm.CopyError, match=r"registers/log\.file holds a _io\.TextIOWrapper") as refused:
        pickle.dumps(drv)
    assert refused.value.where == "registers/log.file"
    with pytest.raises(flowvm.CopyError, match="cannot save the run to .*registers/log.file holds a _io.TextIO"):
        flowvm.save(drv, tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()
    def _plus_one(x, guard=__import__("threading").Lock()):  # a local function: pickled by value, with its lock
        return x + 1

    reg = flowvm.Registers(x=0)
    drv = flowvm.REPEAT(5, flowvm.CALL(_plus_one, reg("x"), store_to=reg("x"))).start()
    drv.run(max_steps=2)
    with pytest.raises(flowvm.CopyError, match=r"CALL at 0, function .*_plus_one, default argument 1 holds a "
                                               r"_thread\.lock"):
        pickle.dumps(drv)
