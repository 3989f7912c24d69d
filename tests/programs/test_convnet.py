"""The convolutional classifier: its accuracy against scikit-learn's logistic regression on the same split,
exact resume, its listing, the user's own images, and the options it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from flowvm import DataError
from flowvm.program.paths import walk
from flowvm.programs import convnet
from flowvm.testing import assert_same_run

from test_programs import resume_from_file


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(convnet.THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_run():
    drv = convnet.build().start()
    drv.run()
    return drv


def test_convnet_is_as_accurate_as_a_logistic_regression_on_the_same_split(default_run):
    regs = default_run.registers
    digits = load_digits()
    x, y = digits.images.reshape(len(digits.images), -1) / 16.0, digits.target
    order = np.random.default_rng(0).permutation(len(x))  # the split the program makes: a seeded quarter held out
    held = np.sort(order[-round(len(x) * 0.25):])
    train = np.setdiff1d(np.arange(len(x)), held)
    assert regs["held_out"] == len(held) == len(regs["y_test"])
    assert np.array_equal(regs["y_test"].numpy(), y[held])
    reference = LogisticRegression(max_iter=5000).fit(x[train], y[train]).score(x[held], y[held])
    assert regs["accuracy"] >= reference - 0.02, (regs["accuracy"], reference)
    assert regs["accuracy"] >= 0.95
    # the kept model is the trained network: its predictions give the accuracy the run measured
    net = convnet.model(regs)
    assert isinstance(net, torch.nn.Module)
    assert (net.predict(x[held]) == y[held]).mean() == pytest.approx(regs["accuracy"], abs=1e-6)
    assert np.allclose(net.predict_proba(digits.images[held] / 16.0).sum(axis=1), 1.0, atol=1e-5)
    assert [e["epoch"] for e in regs["history"]] == list(range(1, 11)) and regs["epoch"] == 10
    assert "convnet on digits: held-out accuracy" in convnet.report(regs)


def test_convnet_trains_with_sgd_too():
    drv = convnet.build(optimizer="sgd", epochs=6).start()
    drv.run()
    assert drv.registers["accuracy"] >= 0.93
    step = [el for _, el in walk(drv.program) if getattr(el, "fn", None) is not None
            and getattr(el.fn, "__name__", "") == "train_step"][0]
    assert isinstance(step.fn.__self__.optimizer, torch.optim.SGD)


def test_convnet_resumes_exactly():
    assert_same_run(lambda: convnet.build(channels=4, epochs=2, batch_size=128), seed=11)


def test_convnet_resumes_from_a_checkpoint_file_at_a_random_step(tmp_path):
    expected = resume_from_file(lambda: convnet.build(channels=8, epochs=2), tmp_path, seed=8128)
    assert set(expected["registers"]["model"].weights_) == {"features.0.weight", "features.0.bias",
                                                            "features.3.weight", "features.3.bias",
                                                            "head.weight", "head.bias"}


def test_convnet_listing():
    assert str(convnet.build()) == "\n".join([
        "SEQ:",
        "    REPEAT 10 (counter epoch):",
        "        SEQ:",
        "            REPEAT 43:",
        "                SEQ:",
        "                    batch = Batches.next_batch()",
        "                    loss = Trainer.train_step(batch)",
        "            accuracy = Trainer.evaluate(x_test, y_test)",
        "            history = Trainer.log(history, epoch, loss, accuracy)",
        "    model = TrainedConvNet(ConvNet)",
    ])


def test_convnet_on_the_users_images_in_each_layout(tmp_path):
    rng = np.random.default_rng(3)
    y = rng.integers(2, size=120)
    x = rng.normal(size=(120, 2, 6, 4)).astype(np.float32)
    x[y == 1, 1, :3] += 2.0  # class 1: a bright upper half in the second channel
    np.savez(tmp_path / "images.npz", x=x, y=y)
    for data, shape in [((x, y), (2, 6, 4)), (tmp_path / "images.npz", (2, 6, 4)),
                        ((x[:, 1], y), (1, 6, 4)), ((x[:, 1, :4].reshape(120, 16), y), (1, 4, 4))]:
        drv = convnet.build(data=data, channels=4, epochs=4, batch_size=16, val_fraction=0.25).start()
        drv.run()
        net = convnet.model(drv.registers)
        assert net.shape == shape and drv.registers["accuracy"] >= 0.9, (shape, drv.registers["accuracy"])
    with pytest.raises(DataError, match="rows of 10 values are no square image"):
        convnet.build(data=(rng.normal(size=(20, 10)), y[:20]))
    with pytest.raises(DataError, match="images of 1 x 5 pixels are too small"):
        convnet.build(data=(rng.normal(size=(20, 1, 5)), y[:20]))
    with pytest.raises(ValueError, match=r"takes images of shape \(1, 4, 4\); got an array of shape \(3, 5\)"):
        net.predict(np.zeros((3, 5)))


@pytest.mark.parametrize("options, error, text", [
    ({"epochs": 0}, ValueError, "convnet: epochs must be >= 1, got 0"),
    ({"channels": 2.5}, TypeError, "convnet: channels must be an int >= 1"),
    ({"lr": -1}, ValueError, "convnet: lr must be > 0, got -1"),
    ({"optimizer": "rmsprop"}, ValueError, "convnet: optimizer must be 'adam' or 'sgd', got 'rmsprop'"),
    ({"val_fraction": 1}, ValueError, r"convnet: val_fraction must be a number in \[0, 1\), got 1"),
])
def test_convnet_refuses_bad_options_naming_them(options, error, text):
    with pytest.raises(error, match=text):
        convnet.build(**options)


def test_the_command_runs_convnet_and_writes_its_model(tmp_path):
    from toy import flowvm_cmd

    done = flowvm_cmd("run", "convnet", "--set", "epochs=2", "--set", "channels=4", "--output",
                      tmp_path / "net.pt", "--progress", "none", cwd=tmp_path)
    assert "convnet on digits: held-out accuracy" in done.stdout
    saved = torch.load(tmp_path / "net.pt")
    net = convnet.ConvNet(saved["shape_"], saved["channels_"], saved["n_classes_"])
    net.load_state_dict(saved["state_dict"])
    digits = load_digits()
    assert (net.predict(digits.images / 16.0) == digits.target).mean() > 0.8
