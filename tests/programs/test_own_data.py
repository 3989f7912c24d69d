"""The bundled programs on the user's own data (real data sets that ship inside scikit-learn), checked against
scikit-learn, with their fitted models under scikit-learn's names, and exact resume from any step."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits, load_iris, load_wine
from sklearn.decomposition import PCA

from flowvm import DataError
from flowvm.programs import kmeans, pca
from flowvm.testing import assert_same_run


@pytest.mark.parametrize("loader, components", [(load_digits, 10), (load_iris, 2)])
def test_pca_on_data_matches_scikit_learn(loader, components):
    x = loader().data
    drv = pca.build(data=x, samples=128, components=components).start()
    drv.run()
    got, ref = pca.model(drv.registers), PCA(n_components=components).fit(x)
    assert np.allclose(got.mean_, ref.mean_, rtol=0, atol=1e-12)
    assert np.allclose(got.components_, ref.components_, rtol=0, atol=1e-9)  # the same signs too
    assert np.allclose(got.explained_variance_, ref.explained_variance_, rtol=1e-10)
    assert np.allclose(got.explained_variance_ratio_, ref.explained_variance_ratio_, rtol=1e-10)
    assert np.allclose(got.transform(x), ref.transform(x), rtol=0, atol=1e-8)
    assert drv.registers["batch"] == -(-len(x) // 128)  # batches from the data: no samples x batches == N


def test_pca_on_data_resumes_exactly_from_any_step():
    x = load_iris().data
    assert_same_run(lambda: pca.build(data=x, samples=16, components=3), seed=3)


@pytest.mark.parametrize("loader, k", [(load_iris, 3), (load_wine, 3)])
def test_kmeans_on_data_matches_scikit_learns_inertia(loader, k):
    x = loader().data
    drv = kmeans.build(data=x, clusters=k, restarts=10).start()
    drv.run()
    got = kmeans.model(drv.registers)
    ref = KMeans(n_clusters=k, n_init=10, random_state=0).fit(x)
    assert got.inertia_ <= ref.inertia_ * (1 + 1e-9)
    assert np.array_equal(got.predict(x), got.labels_) and got.cluster_centers_.shape == (k, x.shape[1])
    assert got.n_iter_ >= 1 and "inertia" in kmeans.report(drv.registers)  # no built-in centres to compare


def test_kmeans_on_data_resumes_exactly_and_refuses_too_few_distinct_points():
    x = load_iris().data
    assert_same_run(lambda: kmeans.build(data=x, clusters=3, restarts=2), seed=5)
    with pytest.raises(DataError, match="4 clusters need at least 4 distinct points; the data has 3"):
        kmeans.build(data=np.repeat(np.eye(3), 5, axis=0), clusters=4)
    with pytest.raises(DataError, match="row 3, column 2 holds nan"):
        kmeans.build(data=np.array([[0, 1.0], [1, 2], [2, np.nan]]), clusters=2)


def test_the_command_line_takes_data_files_and_writes_the_fitted_models(tmp_path):
    from toy import flowvm_cmd

    iris = load_iris().data
    np.savetxt(tmp_path / "iris.csv", iris, delimiter=",", header="a,b,c,d", comments="")
    done = flowvm_cmd("run", "kmeans", "--data", tmp_path / "iris.csv", "--set", "clusters=3", "--set", "restarts=10",
                      "--output", tmp_path / "km.npz", "--progress", "none", cwd=tmp_path)
    assert "model written to" in done.stdout
    km = np.load(tmp_path / "km.npz")
    assert km["inertia_"] <= KMeans(n_clusters=3, n_init=10, random_state=0).fit(iris).inertia_ * (1 + 1e-9)
    assert km["cluster_centers_"].shape == (3, 4) and km["labels_"].shape == (150,)
    digits = load_digits().data
    np.save(tmp_path / "digits.npy", digits)
    flowvm_cmd("run", "pca", "--data", tmp_path / "digits.npy", "--set", "components=4", "--checkpoint",
               tmp_path / "pca.ckpt", "--max-steps", "7", "--progress", "none", cwd=tmp_path)
    assert (tmp_path / "pca.ckpt").stat().st_size < digits.nbytes  # the data file is referenced, not copied
    flowvm_cmd("resume", tmp_path / "pca.ckpt", "--output", tmp_path / "pca.npz", "--progress", "none", cwd=tmp_path)
    fit, ref = np.load(tmp_path / "pca.npz"), PCA(n_components=4).fit(digits)
    assert np.allclose(fit["components_"], ref.components_, atol=1e-9)
    assert np.allclose(fit["explained_variance_ratio_"], ref.explained_variance_ratio_, rtol=1e-10)
    bad = flowvm_cmd("run", "kmeans", "--data", tmp_path / "missing.csv", cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "missing.csv: no such file" in bad.stderr and "Traceback" not in bad.stderr
