"""The torch programs (MLP, L-BFGS): results, exact resume, listings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowvm import WEAVE
from flowvm.program.paths import walk
from flowvm.programs import lbfgs, mlp
from flowvm.testing import assert_same_run

from test_programs import resume_from_file


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster than two on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ MLP
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_mlp_reaches_the_stated_accuracy_on_its_default_data(optimizer):
    drv = mlp.build(optimizer=optimizer).start()
    drv.run()
    regs = drv.registers
    assert regs["accuracy"] >= mlp.TARGET_ACCURACY
    # the accuracy is measured on held-out points, never trained on
    x, y = mlp.spirals()
    held_out = len(x) // 3
    assert torch.equal(regs["x_test"], x[:held_out]) and torch.equal(regs["y_test"], y[:held_out])
    model = [el for _, el in walk(drv.program) if getattr(el, "fn", None) is mlp.weights][0].args[0]
    with torch.no_grad():
        assert (model(x[:held_out]).argmax(1) == y[:held_out]).float().mean().item() == regs["accuracy"]
    assert regs["epoch"] == 20


def test_mlp_optimizers_are_the_ones_asked_for():
    def optimizer_of(program):
        call = [el for _, el in walk(program) if getattr(el, "fn", None).__class__.__name__ == "method"
                and el.fn.__name__ == "train_step"][0]
        return call.fn.__self__.optimizer

    assert isinstance(optimizer_of(mlp.build()), torch.optim.Adam)
    sgd = optimizer_of(mlp.build(optimizer="sgd", lr=0.05))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.05
    with pytest.raises(ValueError, match="optimizer must be 'adam' or 'sgd', got 'rmsprop'"):
        mlp.build(optimizer="rmsprop")


def test_mlp_evaluation_and_logging_are_woven_into_training():
    drv = mlp.build(samples=600, epochs=4, batch_size=50, eval_every=10, log_every=4).start()
    assert any(isinstance(el, WEAVE) for _, el in walk(drv.program))
    accuracies = []
    while not drv.done:
        drv.step()
        acc = drv.registers["accuracy"]
        if acc is not None and (not accuracies or accuracies[-1][1] != acc):
            accuracies.append((drv.program.elements[0].elements[0].body.body.children[1].fn.__self__.updates, acc))
    history = drv.registers["history"]
    updates = [entry["update"] for entry in history]
    total = 4 * 8  # 4 epochs of 400 training points in batches of 50
    assert updates == list(range(4, total, 4)) + [total]  # the last entry is logged after training
    assert [u for u, _ in accuracies][:3] == [10, 20, 30]  # evaluations every 10 updates, while training
    assert history[0]["accuracy"] is None and history[-1]["accuracy"] == drv.registers["accuracy"]
    assert "update  epoch" in mlp.report(drv.registers)


def test_mlp_resumes_exactly():
    assert_same_run(lambda: mlp.build(samples=240, hidden=8, epochs=2, batch_size=40, eval_every=3, log_every=2),
                    seed=4)


def test_mlp_resumes_from_a_checkpoint_file_at_a_random_step(tmp_path):
    expected = resume_from_file(lambda: mlp.build(epochs=3), tmp_path, seed=5150)
    assert len(expected["registers"]["weights"]) == 6


def test_mlp_listing():
    assert str(mlp.build()) == "\n".join([
        "SEQ:",
        "    WEAVE 1 of 3 (weights 1, 0.01, 0.02):",
        "        REPEAT 20 (counter epoch):",
        "            REPEAT 32:",
        "                SEQ:",
        "                    batch = Batches.next_batch()",
        "                    loss = Trainer.train_step(batch)",
        "        LOOP:",
        "            accuracy = Trainer.evaluate(x_test, y_test)",
        "        LOOP:",
        "            history = Trainer.log(history, epoch, loss, accuracy)",
        "    accuracy = Trainer.evaluate(x_test, y_test)",
        "    history = Trainer.log(history, epoch, loss, accuracy)",
        "    weights = weights(Classifier)",
        "    model = TrainedMLP(Classifier)",
    ])


# ------------------------------------------------------------------ L-BFGS
def test_lbfgs_reaches_the_rosenbrock_minimum():
    drv = lbfgs.build().start()
    drv.run()
    regs = drv.registers
    assert np.allclose(regs["x"], np.ones(10), rtol=0, atol=1e-6)
    assert regs["loss"] < 1e-12 and regs["grad_norm"] <= 1e-8
    # one WHILE iteration (condition + step + loss + gradient) per L-BFGS iteration
    assert drv.steps == 4 * regs["iterations"] + 6
    assert lbfgs.model(regs).stop_reason == "gradient below tol"
    assert 20 < regs["iterations"] < 500


def test_lbfgs_matches_numpy_lstsq():
    drv = lbfgs.build(problem="least_squares", dim=6, seed=3).start()
    drv.run()
    problem = lbfgs.LeastSquares(6, seed=3)
    expected = np.linalg.lstsq(problem.a, problem.b, rcond=None)[0]
    assert np.allclose(drv.registers["x"], expected, rtol=0, atol=1e-7)


def test_lbfgs_uses_torch_lbfgs_with_a_closure():
    step = [el for _, el in walk(lbfgs.build()) if getattr(el, "fn", None) is not None
            and getattr(el.fn, "__name__", "") == "step"][0]
    assert isinstance(step.fn.__self__, torch.optim.LBFGS)
    (closure,) = step.args
    assert isinstance(closure, lbfgs.Rosenbrock) and closure.evaluations == 0
    loss = closure()
    assert closure.evaluations == 1 and closure.x.grad is not None and loss.item() > 0


def test_lbfgs_stops_at_max_iter_and_rejects_unknown_problems():
    drv = lbfgs.build(max_iter=7).start()
    drv.run()
    assert drv.registers["iterations"] == 7 and drv.registers["grad_norm"] > 1e-8
    assert lbfgs.model(drv.registers).stop_reason == "max_iter reached"
    with pytest.raises(ValueError, match="unknown problem 'sphere'"):
        lbfgs.build(problem="sphere")
    with pytest.raises(ValueError, match="dim >= 2"):
        lbfgs.build(dim=1)


@pytest.mark.parametrize("problem", lbfgs.PROBLEMS)
def test_lbfgs_resumes_exactly(problem):
    assert_same_run(lambda: lbfgs.build(problem=problem, dim=4, max_iter=12), seed=6)


def test_lbfgs_resumes_from_a_checkpoint_file_at_a_random_step(tmp_path):
    resume_from_file(lbfgs.build, tmp_path, seed=1789)


def test_lbfgs_listing():
    assert str(lbfgs.build()) == "\n".join([
        "SEQ:",
        "    loss = Rosenbrock.value()",
        "    grad_norm = Rosenbrock.grad_norm()",
        "    WHILE Stopping.keep_going(grad_norm, loss):",
        "        SEQ:",
        "            LBFGS.step(Rosenbrock)",
        "            loss = Rosenbrock.value()",
        "            grad_norm = Rosenbrock.grad_norm()",
        "    iterations = Stopping.iterations()",
        "    x = Rosenbrock.solution()",
        "    model = Stopping.result(x, loss, grad_norm)",
    ])


@pytest.mark.parametrize("module, options, error, text", [
    ("kmeans", {"restarts": 0}, ValueError, "kmeans: restarts must be >= 1, got 0"),
    ("kmeans", {"clusters": 0}, ValueError, "kmeans: clusters must be >= 1"),
    ("mlp", {"epochs": 0}, ValueError, "mlp: epochs must be >= 1, got 0"),
    ("mlp", {"lr": "fast"}, TypeError, "mlp: lr must be a number > 0, got str 'fast'"),
    ("rbm", {"batch_size": 2.5}, TypeError, "rbm: batch_size must be an int >= 1"),
    ("lbfgs", {"max_iter": 0}, ValueError, "lbfgs: max_iter must be >= 1"),
    ("sweep", {"epochs": 0}, ValueError, "sweep: epochs must be >= 1"),
    ("kmeans", {"samples": 3}, ValueError, "kmeans: 6 clusters need at least as many samples, got samples=3"),
])
def test_builders_refuse_options_that_leave_nothing_to_run_naming_the_option(module, options, error, text):
    import importlib

    with pytest.raises(error, match=text):
        importlib.import_module(f"flowvm.programs.{module}").build(**options)


def test_lbfgs_already_at_its_tolerance_runs_no_iteration_and_reports():
    drv = lbfgs.build(tol=1e9).start()
    drv.run()
    assert drv.registers["iterations"] == 0 and "L-BFGS: 0 iterations, loss" in lbfgs.report(drv.registers)
