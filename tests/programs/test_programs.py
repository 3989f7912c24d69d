"""The numpy programs (k-means, RBM): results against plain references, exact resume, listings.

Also the checks every bundled program must pass (build(), SHOW, report, verify).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import random

import numpy as np
import pytest

import flowvm
import flowvm.programs
from flowvm.programs import kmeans, rbm
from flowvm.testing import assert_same_run, diff, outcome

BUNDLED = sorted(m.name for m in pkgutil.iter_modules(flowvm.programs.__path__)
                 if not m.name.startswith("_") and m.name != "event_loop_example")


def resume_from_file(build, tmp_path, seed: int) -> dict:
    """Run build() straight; run another copy to a random step, flowvm.save, flowvm.load, finish; compare."""
    reference = build().start()
    reference.run()
    expected = outcome(reference)
    cut = random.Random(seed).randint(1, expected["steps"] - 1)
    drv = build().start()
    drv.run(max_steps=cut)
    path = tmp_path / f"cut{cut}.ckpt"
    flowvm.save(drv, path)
    for _ in range(3):  # whatever the global generators do meanwhile
        np.random.rand()
    later = flowvm.load(path)
    assert later.steps == cut and not later.done
    later.run()
    problems = diff(expected, outcome(later))
    assert not problems, f"resumed after step {cut} of {expected['steps']}: " + "; ".join(problems)
    return expected


# ------------------------------------------------------------------ every program
@pytest.mark.parametrize("name", BUNDLED)
def test_each_bundled_program_has_a_documented_builder_with_defaults(name):
    module = importlib.import_module(f"flowvm.programs.{name}")
    assert (module.__doc__ or "").strip(), f"{name} has no module docstring (flowvm list prints its first line)"
    params = inspect.signature(module.build).parameters.values()
    assert all(p.default is not inspect.Parameter.empty for p in params), f"{name}.build needs defaults"
    assert isinstance(getattr(module, "SHOW", None), list)
    assert callable(getattr(module, "report", None))
    program = module.build()
    flowvm.verify(program)
    assert isinstance(program, flowvm.Element)


# ------------------------------------------------------------------ k-means
def lloyd_reference(x, centers, tol, max_iter):
    """Lloyd's algorithm written plainly."""
    centers = centers.copy()
    iterations, shift = 0, np.inf
    while shift > tol and iterations < max_iter:
        labels = np.array([np.argmin([np.sum((p - c) ** 2) for c in centers]) for p in x])
        new = centers.copy()
        for j in range(len(centers)):
            members = x[labels == j]
            if len(members):
                new[j] = members.mean(axis=0)
        shift = max(np.linalg.norm(a - b) for a, b in zip(new, centers))
        centers = new
        iterations += 1
    labels = np.array([np.argmin([np.sum((p - c) ** 2) for c in centers]) for p in x])
    return centers, labels, float(sum(np.sum((p - centers[k]) ** 2) for p, k in zip(x, labels))), iterations


@pytest.mark.parametrize("options", [dict(samples=600, clusters=4, restarts=3, seed=2),
                                     dict(samples=400, clusters=5, dim=3, spread=2.0, restarts=2, seed=7)])
def test_kmeans_matches_a_plain_numpy_lloyd(options):
    drv = kmeans.build(**options).start()
    drv.run()
    best = drv.registers["best"]
    x = drv.registers["x"]
    starts = kmeans.Lloyd(options["clusters"], seed=options["seed"] + 1)
    runs = [lloyd_reference(x, starts.init_centers(x), 1e-6, 100) for _ in range(options["restarts"])]
    centers, labels, inertia, iterations = min(runs, key=lambda r: r[2])
    assert np.allclose(best["centers"], centers, rtol=1e-12, atol=1e-12)
    assert np.array_equal(best["labels"], labels)
    assert best["inertia"] == pytest.approx(inertia, rel=1e-12)
    assert best["iterations"] == iterations
    assert drv.registers["restart"] == options["restarts"]


def test_kmeans_default_run_finds_the_true_centers():
    drv = kmeans.build().start()
    drv.run()
    found, truth = drv.registers["best"]["centers"], drv.registers["true_centers"]
    nearest = np.sqrt(((truth[:, None, :] - found[None, :, :]) ** 2).sum(axis=2)).min(axis=1)
    assert nearest.max() < 0.2
    assert "largest distance from a true center" in kmeans.report(drv.registers)


def test_kmeans_plus_plus_starts_are_distinct_data_points():
    x, _ = kmeans.make_blobs(300, 5, seed=1)
    starts = kmeans.Lloyd(5, seed=3).init_centers(x)
    assert len({tuple(c) for c in starts}) == 5
    assert all(any(np.array_equal(c, p) for p in x) for c in starts)
    with pytest.raises(ValueError, match="5 clusters but only 3 points"):
        kmeans.Lloyd(5).init_centers(x[:3])


def test_kmeans_an_empty_cluster_keeps_its_center():
    run = kmeans.Lloyd(2)
    x = np.array([[0.0, 0.0], [1.0, 0.0]])
    centers = np.array([[0.5, 0.0], [9.0, 9.0]])
    new = run.update(x, kmeans.assign(x, centers), centers)
    assert np.array_equal(new, [[0.5, 0.0], [9.0, 9.0]]) and run.shift == 0.0


def test_kmeans_resumes_exactly():
    assert_same_run(lambda: kmeans.build(samples=200, clusters=3, restarts=2, seed=5), seed=1)


def test_kmeans_resumes_from_a_checkpoint_file_at_a_random_step(tmp_path):
    resume_from_file(kmeans.build, tmp_path, seed=2026)


def test_kmeans_listing():
    assert str(kmeans.build()) == "\n".join([
        "SEQ:",
        "    REPEAT 3 (counter restart):",
        "        SEQ:",
        "            centers = Lloyd.init_centers(x)",
        "            WHILE Lloyd.running():",
        "                SEQ:",
        "                    labels = assign(x, centers)",
        "                    centers = Lloyd.update(x, labels, centers)",
        "            labels = assign(x, centers)",
        "            inertia = inertia(x, centers, labels)",
        "            best = Lloyd.keep_best(best, centers, labels, inertia)",
        "    model = KMeansModel(best)",
    ])


# ------------------------------------------------------------------ RBM
def test_bars_and_stripes_are_bars_or_stripes():
    images = rbm.bars_and_stripes(200, side=4, flip=0.0, seed=3).reshape(-1, 4, 4)
    rows_equal = (images == images[:, :, :1]).all(axis=(1, 2))
    cols_equal = (images == images[:, :1, :]).all(axis=(1, 2))
    assert (rows_equal | cols_equal).all() and rows_equal.any() and cols_equal.any()


def test_rbm_reconstruction_error_falls_under_cd1():
    drv = rbm.build().start()
    drv.run()
    errors = drv.registers["errors"]
    assert len(errors) == 16  # before training and after each of 15 epochs
    assert errors[-1] < 0.1 * errors[0]
    assert all(b <= a + 1e-4 for a, b in zip(errors, errors[1:])), errors
    assert drv.registers["batch_error"] < 0.05


def test_rbm_one_call_is_one_cd1_update_by_the_textbook_formula():
    machine = rbm.RBM(4, 3, lr=0.3, seed=9)
    machine.w = np.random.default_rng(0).standard_normal((4, 3))
    v0 = rbm.bars_and_stripes(8, side=2, flip=0.1, seed=1)
    before = copy.deepcopy(machine)
    error = machine.cd1(v0)
    # by hand, drawing the same uniforms
    u = before.rng.random((8, 3))
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    ph0 = sig(v0 @ before.w + before.c)
    h0 = (u < ph0) * 1.0
    pv1 = sig(h0 @ before.w.T + before.b)
    ph1 = sig(pv1 @ before.w + before.c)
    assert np.allclose(machine.w, before.w + 0.3 * (v0.T @ ph0 - pv1.T @ ph1) / 8, rtol=0, atol=1e-14)
    assert np.allclose(machine.b, before.b + 0.3 * (v0 - pv1).mean(axis=0), rtol=0, atol=1e-14)
    assert np.allclose(machine.c, before.c + 0.3 * (ph0 - ph1).mean(axis=0), rtol=0, atol=1e-14)
    assert error == pytest.approx(((v0 - pv1) ** 2).mean())
    assert machine.updates == 1


def test_rbm_has_one_call_per_cd1_update():
    drv = rbm.build(samples=100, epochs=3, batch_size=10).start()
    drv.run()
    cd1 = [el for _, el in flowvm.program.paths.walk(drv.program) if isinstance(el, flowvm.CALL) and el.fn.__name__ == "cd1"]
    assert len(cd1) == 1
    assert cd1[0].fn.__self__.updates == 30  # 3 epochs of 10 batches, counted by the machine itself
    assert drv.steps == 2 + 3 * (10 * 2 + 2) + 2  # the last two: the parameters and the fitted model


def test_rbm_resumes_exactly():
    assert_same_run(lambda: rbm.build(samples=60, side=3, hidden=4, epochs=3, batch_size=16), seed=3)


def test_rbm_resumes_from_a_checkpoint_file_at_a_random_step(tmp_path):
    resume_from_file(lambda: rbm.build(epochs=4), tmp_path, seed=77)


def test_rbm_listing():
    assert str(rbm.build()) == "\n".join([
        "SEQ:",
        "    error = RBM.reconstruction_error(x)",
        "    errors = append(errors, error)",
        "    REPEAT 15 (counter epoch):",
        "        SEQ:",
        "            REPEAT 100:",
        "                SEQ:",
        "                    v = Batches.next_batch()",
        "                    batch_error = RBM.cd1(v)",
        "            error = RBM.reconstruction_error(x)",
        "            errors = append(errors, error)",
        "    parameters = RBM.parameters()",
        "    model = RBM.model()",
    ])
