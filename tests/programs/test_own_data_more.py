"""rbm, mlp and lbfgs on the user's own data and objective (real data sets that ship inside scikit-learn),
checked against scikit-learn's BernoulliRBM and MLPClassifier and scipy's L-BFGS-B, with their fitted models,
exact resume from any step, and clear errors for bad data before the run starts."""

from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize, rosen, rosen_der
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.neural_network import BernoulliRBM, MLPClassifier
from sklearn.preprocessing import StandardScaler

import flowvm
from flowvm import DataError, load_data
from flowvm.programs import lbfgs, mlp, pca, rbm
from flowvm.testing import assert_same_run


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread (as the programs declare), and far faster than two on a loaded
    machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def digits01():
    """scikit-learn's 8x8 digits, scaled to [0, 1] (pixel values run 0..16)."""
    return load_digits().data / 16.0


# ------------------------------------------------------------------ RBM
def test_rbm_on_digits_learns_as_well_as_scikit_learns_bernoulli_rbm():
    x = digits01()
    order = np.random.default_rng(0).permutation(len(x))
    train, test = x[order[:1350]], x[order[1350:]]
    drv = rbm.build(data=train, hidden=64, epochs=5, batch_size=10, lr=0.1).start()
    drv.run()
    mine = rbm.model(drv.registers)
    assert mine.components_.shape == (64, 64) and mine.intercept_hidden_.shape == (64,) \
        and mine.intercept_visible_.shape == (64,)
    sk = BernoulliRBM(n_components=64, learning_rate=0.1, batch_size=10, n_iter=5, random_state=0).fit(train)
    theirs = rbm.RBMModel(sk.components_, sk.intercept_hidden_, sk.intercept_visible_)
    assert np.allclose(theirs.transform(test), sk.transform(test), rtol=0, atol=1e-12)  # the same names mean the same
    # scikit-learn's score_samples flips one random pixel per image; ours sums over every pixel: the same mean
    assert theirs.score_samples(test).mean() == pytest.approx(sk.score_samples(test).mean(), rel=0.1)
    # the baseline: independent pixels with the training data's means (an RBM without weights)
    p = train.mean(axis=0).clip(1e-3, 1 - 1e-3)
    base = rbm.RBMModel(np.zeros((1, 64)), np.zeros(1), np.log(p / (1 - p)))
    err = {name: m.reconstruction_error(test) for name, m in (("mine", mine), ("sk", theirs), ("base", base))}
    pl = {name: m.score_samples(test).mean() for name, m in (("mine", mine), ("sk", theirs), ("base", base))}
    # on held-out images both reconstruct better than the baseline, ours within 25% of scikit-learn's error
    # (measured: 0.032 ours, 0.048 scikit-learn's, 0.074 the baseline)
    assert err["mine"] < 0.8 * err["base"] and err["sk"] < 0.9 * err["base"]
    assert err["mine"] < 1.25 * err["sk"]
    # and both raise the pseudo-likelihood over the baseline's, ours by at least half as much as scikit-learn's
    # (measured per image: -19.3 ours, -21.4 scikit-learn's, -25.0 the baseline)
    assert pl["sk"] > pl["base"] and pl["mine"] - pl["base"] > 0.5 * (pl["sk"] - pl["base"])
    assert drv.registers["errors"][-1] < 0.6 * drv.registers["errors"][0]
    assert mine.reconstruction_error(train) == pytest.approx(drv.registers["error"], rel=1e-12)  # as measured
    assert mine.transform(test).shape == (len(test), 64)
    assert "64 visible, 64 hidden units" in rbm.report(drv.registers)


def test_rbm_on_data_resumes_exactly_from_any_step():
    x = digits01()[:120]
    assert_same_run(lambda: rbm.build(data=x, hidden=8, epochs=2, batch_size=32), seed=11)


def test_rbm_refuses_data_outside_0_1_naming_row_and_column(tmp_path):
    raw = load_digits().data  # pixel values 0..16
    with pytest.raises(DataError, match=r"rbm data: row 1, column 3 holds 5\.0; a Bernoulli RBM needs every value "
                                        r"in \[0, 1\] \(this data runs from 0\.0 to 16\.0"):
        rbm.build(data=raw)
    x = digits01()[:20]
    x[7, 3] = -0.25
    np.savetxt(tmp_path / "pixels.csv", x, delimiter=",")
    with pytest.raises(DataError, match=r"pixels\.csv: row 8, column 4 holds -0\.25"):
        rbm.build(data=tmp_path / "pixels.csv")
    x[7, 3] = np.nan
    with pytest.raises(DataError, match=r"row 8, column 4 holds nan"):
        rbm.build(data=x)


def test_rbm_takes_a_npy_file_and_its_visible_units_from_the_data(tmp_path):
    x = digits01()[:100, :40]
    np.save(tmp_path / "x.npy", x)
    drv = rbm.build(data=tmp_path / "x.npy", hidden=5, epochs=1, batch_size=50).start()
    drv.run()
    fit = rbm.model(drv.registers)
    assert fit.components_.shape == (5, 40) and fit.n_features_in_ == 40
    assert drv.steps == 2 + (2 * 2 + 2) + 2


# ------------------------------------------------------------------ MLP
def standardized(loader):
    data = loader()
    return StandardScaler().fit_transform(data.data), data.target


@pytest.mark.parametrize("loader, floor", [(load_iris, 0.9), (load_wine, 0.9), (load_breast_cancer, 0.9)])
def test_mlp_on_data_is_as_accurate_as_scikit_learns_mlp_classifier(loader, floor):
    x, y = standardized(loader)
    drv = mlp.build(data=(x, y), val_fraction=0.3, hidden=32, epochs=20, batch_size=32, eval_every=1000,
                    log_every=1000).start()
    drv.run()
    net = mlp.model(drv.registers)
    assert isinstance(net, torch.nn.Module) and not net.training
    # the same held-out split as the program's: a seeded shuffle of the data
    train, held_out = load_data((x, y)).split(0.3, seed=0)
    assert len(held_out) == round(0.3 * len(x)) and len(drv.registers["y_test"]) == len(held_out)
    mine = float((net.predict(held_out.x) == held_out.y).mean())
    assert mine == pytest.approx(drv.registers["accuracy"], abs=1e-6)  # what the program measured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning
        sk = MLPClassifier(hidden_layer_sizes=(32, 32), max_iter=500, random_state=0).fit(train.x, train.y)
    theirs = sk.score(held_out.x, held_out.y)
    # measured (held-out accuracy, ours / scikit-learn's): iris 0.956 / 0.956 (45 flowers), wine 0.962 / 0.962
    # (53 wines), breast cancer 0.977 / 0.971 (171 tumours)
    assert mine >= floor and theirs >= floor
    assert mine >= theirs - 0.06, (mine, theirs)
    proba = net.predict_proba(torch.from_numpy(held_out.x))  # numpy or torch in, numpy out
    assert proba.shape == (len(held_out), len(np.unique(y))) and np.allclose(proba.sum(axis=1), 1, atol=1e-5)
    assert np.array_equal(proba.argmax(axis=1), net.predict(held_out.x))
    fit = drv.registers["model"]
    assert fit.layer_sizes_ == [x.shape[1], 32, 32, len(np.unique(y))] and fit.coefs_[0].shape == (x.shape[1], 32)


def test_mlp_reads_a_csv_with_a_named_label_column_and_writes_its_model(tmp_path):
    x, y = standardized(load_iris)
    rows = np.column_stack([y, x])  # the label first
    np.savetxt(tmp_path / "iris.csv", rows, delimiter=",", header="species,a,b,c,d", comments="", fmt="%.6f")
    drv = mlp.build(data=tmp_path / "iris.csv", label="species", val_fraction=0.2, hidden=16, epochs=15,
                    batch_size=16).start()
    drv.run()
    net = mlp.model(drv.registers)
    assert net.sizes == [4, 16, 16, 3] and drv.registers["accuracy"] >= 0.85
    assert f"MLP on {tmp_path / 'iris.csv'}: held-out accuracy" in mlp.report(drv.registers)
    from flowvm.programs import save_model

    save_model(net, tmp_path / "mlp.pt")
    saved = torch.load(tmp_path / "mlp.pt", weights_only=True)  # what plain torch.load reads on torch >= 2.6
    again = mlp.Classifier(saved["layer_sizes_"])
    again.load_state_dict(saved["state_dict"])
    assert np.array_equal(again.predict(x), net.predict(x))
    assert [c.shape for c in saved["coefs_"]] == [(4, 16), (16, 16), (16, 3)] and saved["n_classes_"] == 3
    # a torch Dataset of (x, y) items, and nothing held out: the accuracy is the training data's
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x[:60]), torch.from_numpy(y[:60]))
    drv = mlp.build(data=dataset, val_fraction=0, hidden=8, epochs=1).start()
    drv.run()
    assert drv.registers["held_out"] == 0 and "training accuracy" in mlp.report(drv.registers)


def test_mlp_on_data_resumes_exactly_from_any_step():
    x, y = standardized(load_wine)
    assert_same_run(lambda: mlp.build(data=(x[::3], y[::3]), val_fraction=0.25, hidden=8, epochs=2, batch_size=16,
                                      eval_every=3, log_every=2), seed=7)


def test_mlp_refuses_labels_that_are_not_the_classes_0_to_c_minus_1(tmp_path):
    x, y = standardized(load_iris)
    with pytest.raises(DataError, match=r"class 0 has no sample \(labels run from 0 to 3\)"):
        mlp.build(data=(x, y + 1))
    with pytest.raises(DataError, match=r"label of row 1 is 0\.5, not an integer class"):
        mlp.build(data=(x, y + 0.5))
    with pytest.raises(DataError, match=r"label of row 51 is -1, not a class 0..C-1"):
        mlp.build(data=(x, np.where(y == 1, -1, y)))
    with pytest.raises(DataError, match=r"mlp data: this program needs labels: give \(x, y\)"):
        mlp.build(data=x)
    with pytest.raises(DataError, match="every label is 0: a classifier needs at least 2 classes"):
        mlp.build(data=(x, np.zeros(len(x), dtype=int)))
    with pytest.raises(DataError, match=r"150 samples but labels of shape \(149,\)"):
        mlp.build(data=(x, y[:-1]))
    np.savetxt(tmp_path / "iris.csv", np.column_stack([x, y]), delimiter=",", header="a,b,c,d,species", comments="")
    with pytest.raises(DataError, match=r"iris\.csv: no column named 'kind'"):
        mlp.build(data=tmp_path / "iris.csv", label="kind")
    text = (tmp_path / "iris.csv").read_text().splitlines()
    text[3] = text[3].rsplit(",", 1)[0] + ",setosa"
    (tmp_path / "named.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(DataError, match=r"named\.csv \(label column\): the label of row 3 is 'setosa', the first "
                                        r"row's '0\.000000000000000000e\+00': labels are all numbers"):
        mlp.build(data=tmp_path / "named.csv")
    with pytest.raises(ValueError, match="label= names the label column of a .csv file"):
        mlp.build(data=(x, y), label="species")
    with pytest.raises(ValueError, match=r"val_fraction must be a number in \[0, 1\), got 1\.5"):
        mlp.build(data=(x, y), val_fraction=1.5)


# ------------------------------------------------------------------ L-BFGS
class Logistic:
    """L2-regularized logistic regression loss of weights w (the last one the intercept), in torch; the same
    with its gradient in numpy for scipy."""

    def __init__(self, x: np.ndarray, y: np.ndarray, lam: float = 1e-2):
        self.a = np.hstack([x, np.ones((len(x), 1))])
        self.s = 2.0 * y - 1  # labels -1, +1
        self.lam = lam
        self.ta, self.ts = torch.from_numpy(self.a), torch.from_numpy(self.s)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(-self.ts * (self.ta @ w)).mean() + 0.5 * self.lam * (w[:-1] ** 2).sum()

    def numpy(self, w: np.ndarray):
        z = self.s * (self.a @ w)
        grad = self.a.T @ (-self.s / (1 + np.exp(z))) / len(z)
        grad[:-1] += self.lam * w[:-1]
        return np.logaddexp(0, -z).mean() + 0.5 * self.lam * (w[:-1] ** 2).sum(), grad


def breast_cancer_logistic() -> Logistic:
    x, y = standardized(load_breast_cancer)
    return Logistic(x, y.astype(np.float64))


def test_lbfgs_minimizes_a_user_objective_to_scipys_minimum_and_stops_early():
    loss = breast_cancer_logistic()
    ref = minimize(loss.numpy, np.zeros(31), jac=True, method="L-BFGS-B",
                   options=dict(gtol=1e-10, ftol=1e-15, maxiter=1000))
    loose = minimize(loss.numpy, np.zeros(31), jac=True, method="L-BFGS-B")  # scipy's defaults
    drv = lbfgs.build(objective=loss, dim=31).start()
    drv.run()
    fit = lbfgs.model(drv.registers)
    # measured: the same minimum to 1.4e-14, the solutions within 6.4e-7, after 32 iterations (scipy: 31)
    assert fit.loss_ == pytest.approx(ref.fun, rel=1e-10) and fit.loss_ <= loose.fun + 1e-12
    assert np.allclose(fit.x_, ref.x, rtol=0, atol=1e-5)
    assert fit.stop_reason == "gradient below tol" and fit.status_ == 0 and fit.converged
    assert fit.grad_norm_ <= 1e-8 and fit.n_iter_ < 100 and fit.n_evaluations_ >= fit.n_iter_
    assert np.array_equal(fit.x_, drv.registers["x"]) and fit.loss_ == drv.registers["loss"]
    # a gradient tolerance float64 cannot reach: the loss stops changing, and the run stops there, at the
    # same minimum, instead of running all max_iter iterations (measured: after 42 iterations, 3e-16 from
    # scipy's minimum)
    drv = lbfgs.build(objective=loss, dim=31, tol=1e-14).start()
    drv.run()
    stuck = lbfgs.model(drv.registers)
    assert stuck.stop_reason == "loss stopped changing" and stuck.status_ == 1 and not stuck.converged
    assert stuck.n_iter_ < 100 and stuck.loss_ == pytest.approx(ref.fun, rel=1e-12)
    assert "stopped: loss stopped changing" in lbfgs.report(drv.registers)
    drv = lbfgs.build(objective=loss, dim=31, max_iter=5).start()
    drv.run()
    assert lbfgs.model(drv.registers).stop_reason == "max_iter reached" and drv.registers["iterations"] == 5
    # a looser tolerance_change stops sooner, still near the minimum
    drv = lbfgs.build(objective=loss, dim=31, tol=1e-14, tolerance_change=1e-9).start()
    drv.run()
    early = lbfgs.model(drv.registers)
    assert early.stop_reason == "loss stopped changing" and early.n_iter_ < stuck.n_iter_
    assert early.loss_ == pytest.approx(ref.fun, rel=1e-7)


ROSENBROCK = '''
def rosenbrock(x):
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


def as_numpy(x):
    return float(rosenbrock(x).detach())
'''


def test_lbfgs_imports_an_objective_named_module_function_and_finds_scipys_minimum(tmp_path, monkeypatch):
    (tmp_path / "my_objectives.py").write_text(ROSENBROCK)
    monkeypatch.syspath_prepend(str(tmp_path))
    drv = lbfgs.build(objective="my_objectives:rosenbrock", dim=10, x0=[-1.2, 1.0] * 5).start()
    drv.run()
    fit = lbfgs.model(drv.registers)
    ref = minimize(rosen, np.resize([-1.2, 1.0], 10), jac=rosen_der, method="L-BFGS-B")
    assert ref.fun < 1e-8 and np.allclose(ref.x, 1, atol=1e-3)
    assert fit.loss_ < 1e-12 and np.allclose(fit.x_, 1, rtol=0, atol=1e-6) and fit.n_iter_ < 500
    assert fit.stop_reason in lbfgs.STOP_REASONS[:2]
    assert drv.registers["optimum"] is None and "distance to the known optimum" not in lbfgs.report(drv.registers)
    assert "x = UserObjective.solution()" in str(drv.program)


def test_lbfgs_on_a_user_objective_resumes_exactly_from_any_step(tmp_path, monkeypatch):
    loss = breast_cancer_logistic()
    assert_same_run(lambda: lbfgs.build(objective=loss, dim=31, max_iter=12), seed=13)
    (tmp_path / "my_objectives.py").write_text(ROSENBROCK)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert_same_run(lambda: lbfgs.build(objective="my_objectives:rosenbrock", dim=4, tol=1e-14), seed=14)


def test_lbfgs_refuses_objectives_it_cannot_import_or_use(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"objective 'no_such_module_here:loss': cannot import module "
                                         r"'no_such_module_here' \(ModuleNotFoundError"):
        lbfgs.build(objective="no_such_module_here:loss", dim=3)
    with pytest.raises(ValueError, match=r"objective 'math': give 'module:function'"):
        lbfgs.build(objective="math", dim=3)
    with pytest.raises(ValueError, match=r"objective 'math:nothing': math .* has no 'nothing'"):
        lbfgs.build(objective="math:nothing", dim=3)
    with pytest.raises(ValueError, match=r"objective 'math:pi' is a float, not a function"):
        lbfgs.build(objective="math:pi", dim=3)
    (tmp_path / "my_objectives.py").write_text(ROSENBROCK)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"my_objectives:as_numpy returned float; it must return a scalar float "
                                         r"tensor computed from its argument with torch operations"):
        lbfgs.build(objective="my_objectives:as_numpy", dim=3)
    with pytest.raises(ValueError, match="returned a tensor of shape \\(3,\\)"):
        lbfgs.build(objective=lambda x: x * 2, dim=3)
    with pytest.raises(ValueError, match="does not depend on its argument"):
        lbfgs.build(objective=lambda x: torch.tensor(1.0), dim=3)
    with pytest.raises(ValueError, match=r"raised RuntimeError at the start \(a float64 tensor of 3 values\)"):
        lbfgs.build(objective=breast_cancer_logistic(), dim=3)
    with pytest.raises(ValueError, match="x0 has 2 values but dim=3"):
        lbfgs.build(objective="my_objectives:rosenbrock", dim=3, x0=[1, 2])
    with pytest.raises(ValueError, match="give objective= or problem=, not both"):
        lbfgs.build(objective="my_objectives:rosenbrock", problem="least_squares")
    with pytest.raises(ValueError, match="tolerance_change must be a number >= 0"):
        lbfgs.build(tolerance_change=-1.0)


# ------------------------------------------------------------------ the command line
def test_the_command_line_runs_them_on_files_and_objectives_and_writes_the_models(tmp_path):
    from toy import flowvm_cmd

    x, y = standardized(load_wine)
    np.savez(tmp_path / "wine.npz", x=x, y=y)
    (tmp_path / "my_objectives.py").write_text(ROSENBROCK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    flowvm_cmd("run", "mlp", "--data", tmp_path / "wine.npz", "--set", "epochs=5", "--set", "hidden=16",
               "--set", "val_fraction=0.25", "--output", tmp_path / "mlp.npz", "--progress", "none", cwd=tmp_path)
    weights = np.load(tmp_path / "mlp.npz")
    # scikit-learn's names: coefs_[i] (inputs x outputs) and intercepts_[i], one array per layer
    assert sorted(weights) == ["coefs_0", "coefs_1", "coefs_2", "intercepts_0", "intercepts_1", "intercepts_2",
                               "layer_sizes_", "n_classes_", "n_features_in_"]
    assert weights["coefs_0"].shape == (13, 16) and weights["coefs_2"].shape == (16, 3)
    assert list(weights["layer_sizes_"]) == [13, 16, 16, 3] and weights["intercepts_2"].shape == (3,)
    done = flowvm_cmd("run", "lbfgs", "--set", "objective=my_objectives:rosenbrock", "--set", "dim=6",
                      "--output", tmp_path / "fit.npz", "--progress", "none", cwd=tmp_path, env=env)
    assert "stopped: " in done.stdout
    fit = np.load(tmp_path / "fit.npz")
    assert np.allclose(fit["x_"], 1, atol=1e-6) and fit["status_"] in (0, 1) and fit["n_iter_"] < 500
    bad = flowvm_cmd("run", "lbfgs", "--set", "objective=nowhere_to_be_found:f", cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "cannot import module 'nowhere_to_be_found'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_finished_run_keeps_its_model_in_checkpoints_and_state_checkpoints(tmp_path):
    x, y = standardized(load_iris)
    cases = [(rbm, dict(data=digits01()[:60], hidden=4, epochs=1), rbm.RBMModel),
             (mlp, dict(data=(x, y), hidden=8, epochs=1), mlp.TrainedMLP),
             (lbfgs, dict(objective=breast_cancer_logistic(), dim=31, max_iter=3), lbfgs.LBFGSResult)]
    for module, options, cls in cases:
        drv = module.build(**options).start()
        drv.run()
        want = vars(drv.registers["model"])
        flowvm.save(drv, tmp_path / "run.ckpt")
        flowvm.save_state(drv, tmp_path / "run.safetensors")
        for loaded in (flowvm.load(tmp_path / "run.ckpt"),
                       flowvm.load_state(tmp_path / "run.safetensors", module.build(**options), classes=[cls])):
            assert type(loaded.registers["model"]) is cls
            assert flowvm.testing.same(vars(loaded.registers["model"]), want), module.__name__


def test_class_names_in_a_csv_label_column_are_encoded_and_kept_in_the_model(tmp_path):
    from sklearn.datasets import load_iris

    iris = load_iris()
    x, _ = standardized(load_iris)
    rows = [",".join(f"{v:.6f}" for v in r) + f",{iris.target_names[t]}" for r, t in zip(x, iris.target)]
    (tmp_path / "iris.csv").write_text("a,b,c,d,species\n" + "\n".join(rows) + "\n")
    drv = mlp.build(data=tmp_path / "iris.csv", label="species", hidden=16, epochs=15, batch_size=16).start()
    drv.run()
    net = mlp.model(drv.registers)
    assert list(net.classes_) == ["setosa", "versicolor", "virginica"]  # sorted, class i is classes_[i]
    assert float((net.classes_[net.predict(x)] == iris.target_names[iris.target]).mean()) >= 0.85
    from flowvm.programs import save_model

    save_model(net, tmp_path / "mlp.pt")
    assert torch.load(tmp_path / "mlp.pt", weights_only=True)["classes_"] == ["setosa", "versicolor", "virginica"]
    save_model(net, tmp_path / "mlp.npz")
    assert list(np.load(tmp_path / "mlp.npz")["classes_"]) == ["setosa", "versicolor", "virginica"]


def test_every_data_program_leaves_out_the_columns_drop_names(tmp_path):
    from sklearn.datasets import load_iris

    from toy import flowvm_cmd

    iris = load_iris()
    rows = [",".join(f"{v:.2f}" for v in r) + f",{iris.target_names[t]}" for r, t in zip(iris.data, iris.target)]
    (tmp_path / "iris.csv").write_text("a,b,c,d,species\n" + "\n".join(rows) + "\n")
    assert load_data(tmp_path / "iris.csv", drop="species").x.shape == (150, 4)
    assert load_data(tmp_path / "iris.csv", drop=["species", 0]).x.shape == (150, 3)
    with pytest.raises(DataError, match=r"line 2, column 5 \('species'\) holds 'setosa', not a number"):
        load_data(tmp_path / "iris.csv")  # k-means would otherwise cluster the label column too: refused
    done = flowvm_cmd("run", "kmeans", "--data", tmp_path / "iris.csv", "--set", "drop='species'", "--set",
                      "clusters=3", "--output", tmp_path / "km.npz", "--progress", "none", cwd=tmp_path)
    assert np.load(tmp_path / "km.npz")["cluster_centers_"].shape == (3, 4), done.stdout
    for program in (pca, rbm):
        assert "drop" in inspect.signature(program.build).parameters
    assert "drop" in inspect.signature(mlp.build).parameters
