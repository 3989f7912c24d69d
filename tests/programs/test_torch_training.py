"""A torch training loop (nn.Module, optimizer, dropout, global torch RNG) stopped anywhere resumes bit for bit."""

import pickle
import subprocess
import sys

import pytest
import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.testing import assert_same_run, diff, outcome, same
import os
import toy


def make_data(n=64):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).squeeze(1)
    return x, y


def pick_batch(x, y, size=8):
    idx = torch.randint(0, len(x), (size,))  # the global torch generator
    return x[idx], y[idx]


def loss_of(model, batch):
    xb, yb = batch
    return torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def build(optimizer="adam", steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
    opt = (torch.optim.Adam(model.parameters(), lr=0.01) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x, y = make_data()
    reg = Registers(x=x, y=y)
    return SEQ([
        REPEAT(steps, SEQ([
            CALL(pick_batch, reg("x"), reg("y"), store_to=reg("batch")),
            CALL(opt.zero_grad),
            CALL(loss_of, model, reg("batch"), store_to=reg("loss")),
            CALL(torch.Tensor.backward, reg("loss")),
            CALL(opt.step),
        ]), counter=reg("step")),
        CALL(weights, model, store_to=reg("weights")),
    ])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_training_loop_resumes_exactly_after_any_copy(optimizer):
    # every cut except the one between the loss CALL and backward() (k % 5 == 3): see the next test
    expected = assert_same_run(lambda: build(optimizer), cuts=[0, 1, 7, 12, 24, 30, 31])
    assert expected["steps"] == 31
    assert expected["registers"]["step"] == 6


@pytest.mark.parametrize("copier", ["pickle", "cloudpickle", "deepcopy", "checkpoint"])
def test_a_copy_between_the_forward_pass_and_its_backward_is_refused(copier):
    """An autograd graph cannot be copied (torch pickles a tensor with a grad_fn as a leaf, whose backward()
    gives the parameters no gradient): a copy that would need one is refused, naming the register; one step
    later, after the backward, the copy is taken and resumes exactly."""
    from flowvm.testing import COPIERS

    expected = outcome(_finished(build().start()))
    drv = build().start()
    drv.run(max_steps=3)  # the loss is computed, backward() not yet run
    assert drv.registers["loss"].grad_fn is not None
    assert drv.copyable().where == "registers/loss"
    with pytest.raises(flowvm.CopyError, match="registers/loss .*autograd graph") as refused:
        COPIERS[copier](drv)
    assert refused.value.where == "registers/loss"
    drv.run(max_steps=1)  # backward()
    assert drv.copyable() is None
    copy = COPIERS[copier](drv)
    copy.run()
    assert not diff(expected, outcome(copy))


def _finished(drv):
    drv.run()
    return drv


def test_standard_pickle_of_a_half_run_training_loop_resumes_in_a_fresh_process(tmp_path):
    reference = build().start()
    reference.run()
    drv = build().start()
    drv.run(max_steps=12)
    path = tmp_path / "half.ckpt"
    flowvm.save(drv, path)
    blob = tmp_path / "half.pkl"
    blob.write_bytes(pickle.dumps(drv))  # standard pickle: everything here is importable
    script = (
        "import pickle, sys, torch, flowvm\n"
        "from flowvm.testing import outcome\n"
        "d = flowvm.load(sys.argv[1]); d.run()\n"
        "pickle.dump(outcome(d), open(sys.argv[2], 'wb'))\n"
    )
    out = tmp_path / "out.pkl"
    subprocess.run([sys.executable, "-c", script, str(path), str(out)], check=True, timeout=120,
                   cwd=str(tmp_path), env={"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), str(toy.TESTS)]),
                                           "PATH": "/usr/bin:/bin"})
    got = pickle.loads(out.read_bytes())
    exp = outcome(reference)
    assert got["steps"] == exp["steps"]
    assert all(same(a, b) for a, b in zip(got["registers"]["weights"], exp["registers"]["weights"]))
    assert same(got["registers"]["loss"], exp["registers"]["loss"])
    # the standard-pickle copy, finished here after restoring the random state at step 12, agrees too
    assert pickle.loads(blob.read_bytes()).steps == 12


def test_torch_default_generator_passed_explicitly_stays_the_global_one():
    def build():
        torch.manual_seed(0)
        reg = Registers()
        return REPEAT(4, SEQ([CALL(torch.rand, 2, generator=torch.default_generator, store_to=reg("a")),
                              CALL(torch.rand, 2, store_to=reg("b"))]))

    straight = build().start()
    straight.run()
    for cut in range(1, 8):
        drv = build().start()
        drv.run(max_steps=cut)
        copy_ = pickle.loads(pickle.dumps(drv))
        torch.manual_seed(1234)  # as in another process: the copy sets the generator it was copied with
        copy_.run()
        assert torch.equal(copy_.registers["a"], straight.registers["a"]), cut
        assert torch.equal(copy_.registers["b"], straight.registers["b"]), cut


def test_a_run_with_an_lr_scheduler_saves_and_resumes_and_dropped_hooks_are_warned_about(tmp_path):
    import warnings

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # wraps opt.step before the CALL takes it
        reg = Registers(x=torch.ones(4, 3))

        def loss(x):
            out = model(x).pow(2).mean()
            out.backward()
            return out.detach()

        return REPEAT(3, SEQ([CALL(opt.zero_grad), CALL(loss, reg("x"), store_to=reg("loss")), CALL(opt.step),
                              CALL(sched.step)])), model

    prog, model = build()
    prog.run()
    expected = model.weight.detach().clone()
    prog, _ = build()
    drv = prog.start()
    drv.run(max_steps=5)
    flowvm.save(drv, tmp_path / "sched.ckpt")
    loaded = flowvm.load(tmp_path / "sched.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes that the copy's optimizer.step is not wrapped any more
        loaded.run()
    weight = loaded.program.body.elements[2].fn.__self__.param_groups[0]["params"][0]
    assert torch.equal(weight.detach(), expected)

    hooked = torch.nn.Linear(2, 1)
    hooked.weight.register_hook(lambda g: g * 0)
    with pytest.warns(flowvm.persist.checkpoint.CopyWarning, match="gradient hooks registered on a tensor"):
        pickle.dumps(CALL(hooked).start())
