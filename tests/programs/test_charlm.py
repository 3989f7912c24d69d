"""The bundled character model (flowvm/programs/charlm.py): its training loop is plain Python under
@flowvm.program, so the program must compute what the function run as Python computes, bit for bit, and resume
exactly at any statement (mid-iteration, mid-evaluation), in this process and in a fresh one; a resume whose
corpus differs is refused naming both digests; its schedule is torch's own warm-up and cosine decay."""

from __future__ import annotations

import math
import pickle
import random
import re

import pytest
import torch

import flowvm
from flowvm.programs import charlm
from flowvm.testing import diff, outcome, same

from toy import flowvm_cmd

SMALL = dict(iters=4, batch_size=4, block=16, n_layer=2, n_head=2, n_embd=16, eval_every=2, eval_iters=2, warmup=1)
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(100))


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _arguments(prog) -> tuple:
    reg = prog.start().registers
    return tuple(reg[name] for name in ("corpus", "iters", "batch_size", "block", "n_layer", "n_head", "n_embd",
                                        "lr", "min_lr", "warmup", "weight_decay", "clip", "eval_every",
                                        "eval_iters", "seed"))


def test_the_program_computes_what_the_function_run_as_python_computes():
    prog = charlm.build(text=TEXT, **SMALL)
    want = charlm.train.function(*_arguments(charlm.build(text=TEXT, **SMALL)))
    got = prog.run()
    assert got["losses"] == want["losses"] and got["evals"] == want["evals"]
    assert same(got["model"].state_dict(), want["model"].state_dict())
    assert len(got["losses"]) == 4 and [it for it, _ in got["evals"]] == [2, 4]
    assert got["losses"][-1] < got["losses"][0]


def test_the_optimizer_fuses_its_forward_pass_and_loss_and_the_eager_form_changes_nothing():
    prog = flowvm.optimize(charlm.build(text=TEXT, **SMALL), options={"fuse-torch": {"form": "eager"}})
    steps = flowvm.fused_steps(prog)
    assert [[c.fn.text for c in step.calls] for _, step in steps] == [
        ["logits = model(x)", "loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))"]]
    want = charlm.build(text=TEXT, **SMALL).run()
    drv = prog.start()
    drv.run(max_steps=40)
    assert drv.run_to_copyable() is None
    got = pickle.loads(pickle.dumps(drv)).run()
    assert got["losses"] == want["losses"] and got["evals"] == want["evals"]
    assert same(got["model"].state_dict(), want["model"].state_dict())


def test_a_run_cut_at_every_statement_resumes_bit_for_bit():
    straight = charlm.build(text=TEXT, **SMALL).start()
    straight.run()
    want = outcome(straight)
    evaluating = refused = 0
    for cut in range(1, want["steps"], 3):
        drv = charlm.build(text=TEXT, **SMALL).start()
        drv.run(max_steps=cut)
        if drv.copyable() is not None:  # between a forward pass and its backward: refused, so step on
            assert "autograd graph" in str(drv.copyable())
            refused += 1
            while drv.copyable() is not None:
                drv.step()
        evaluating += any(s in _next_statement(drv) for s in ("corpus.batch('val'", "logits_v = ", "total += "))
        copy = pickle.loads(pickle.dumps(drv))
        torch.manual_seed(99)  # whatever the global generator does meanwhile
        copy.run()
        assert not diff(want, outcome(copy)), f"cut at step {cut}"
    assert want["steps"] > 100 and evaluating >= 3  # cuts inside the evaluations' loops among them
    assert 0 < refused < want["steps"] // 6  # the few statements from logits = model(x) to loss.backward()


def test_the_command_resumes_it_in_a_fresh_process_in_the_middle_of_an_evaluation(tmp_path):
    sets = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    straight = tmp_path / "straight.ckpt"
    flowvm_cmd("run", "charlm", *sets, "--checkpoint", straight, "--progress", "none")
    done = flowvm.load(straight)
    probe = charlm.build(**SMALL).start()
    while "logits_v = model(xv)" not in _next_statement(probe):  # inside the first evaluation's loop
        probe.step()
    cut = probe.steps
    ckpt = tmp_path / "cut.ckpt"
    flowvm_cmd("run", "charlm", *sets, "--checkpoint", ckpt, "--max-steps", cut, "--progress", "none")
    assert flowvm.read_header(ckpt)["steps"] == cut
    flowvm_cmd("resume", ckpt, "--progress", "none")
    resumed = flowvm.load(ckpt)
    assert resumed.done and not diff(outcome(done), outcome(resumed))


def _next_statement(drv) -> str:
    lines = [line for line in str(drv).splitlines() if ">>" in line]
    return lines[-1] if lines else ""


def test_a_resume_whose_corpus_changed_is_refused_naming_both_digests(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 40)
    ckpt = tmp_path / "lm.ckpt"
    sets = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    flowvm_cmd("run", "charlm", *sets, "--set", f"corpus={src}", "--checkpoint", ckpt, "--max-steps", 30,
               "--progress", "none", cwd=tmp_path)
    saved = flowvm.load(ckpt).registers["corpus"].digest  # the same files: loads
    (src / "m1.py").write_text("# edited\n" + (src / "m1.py").read_text())
    out = flowvm_cmd("resume", ckpt, "--progress", "none", check=False)
    assert out.returncode == 2
    assert "charlm: the corpus differs from the one the run trained on" in out.stderr
    assert saved[:16] in out.stderr and "a resume needs the same text" in out.stderr
    with pytest.raises(flowvm.CheckpointError, match="the corpus differs"):
        flowvm.load(ckpt)


def test_the_standard_library_corpus_travels_as_its_digest_not_its_text():
    corpus = charlm.Corpus(max_bytes=50_000)
    data = pickle.dumps(corpus)
    assert len(data) < 1000 and corpus.digest.encode() in data
    again = pickle.loads(data)
    assert again.digest == corpus.digest and torch.equal(again.train, corpus.train)
    assert len(corpus.train) + len(corpus.val) == 50_000 and len(corpus.val) == 5_000
    assert corpus.decode([corpus.vocab.index(ord("d"))]) == "d"


def test_the_schedule_is_torchs_linear_warm_up_then_cosine_decay():
    # torch's schedulers, nobody's code here: LinearLR for the warm-up, then CosineAnnealingLR to min_lr
    lr, min_lr, warmup, iters = 3e-3, 3e-4, 10, 60
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters - warmup, eta_min=min_lr)],
        milestones=[warmup])
    theirs = []
    for _ in range(iters):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    mine = [charlm.lr_at(it, lr, min_lr, warmup, iters) for it in range(iters)]
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(mine, theirs)), (mine, theirs)


@pytest.mark.parametrize("options, message", [
    (dict(n_embd=30, n_head=4), "n_embd (30) must be a multiple of n_head (4)"),
    (dict(iters=0), "iters must be >= 1"),
    (dict(corpus="/no/such/folder"), "is no file or folder"),
    (dict(text="too short"), "at least 1000"),
])
def test_bad_options_are_refused_naming_them(options, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        charlm.build(**options)


def test_a_random_cut_of_the_default_shape_resumes_exactly():
    options = dict(SMALL, n_layer=4, n_head=4, n_embd=32, block=32)
    straight = charlm.build(text=TEXT, **options).start()
    straight.run()
    cut = random.Random(5).randint(1, straight.steps - 1)
    drv = charlm.build(text=TEXT, **options).start()
    drv.run(max_steps=cut)
    while drv.copyable() is not None:
        drv.step()
    copy = pickle.loads(pickle.dumps(drv))
    copy.run()
    assert not diff(outcome(straight), outcome(copy))
