"""The README's PCA example with a real streaming PCA, checked against numpy's SVD."""

from __future__ import annotations

import pickle

import numpy as np

import flowvm
from flowvm import BUFFER, CALL, INCOMPLETE, SEQ, Registers
from flowvm.testing import assert_same_run

from flowvm.programs import pca


def svd_components(data, k):
    centered = data - data.mean(axis=0)
    _, s, vt = np.linalg.svd(centered, full_matrices=False)
    return vt[:k], s ** 2 / (s ** 2).sum()


def same_up_to_sign(a, b):
    return all(np.allclose(x, y, atol=1e-8) or np.allclose(x, -y, atol=1e-8) for x, y in zip(a, b))


def test_readme_example_matches_numpy_svd():
    dataset = pca.GaussianStream(dim=13, seed=123)
    analysis = pca.StreamingPCA(n_components=3)
    reg = Registers()
    train_pca = SEQ([
        BUFFER(1000, CALL(dataset.next), store_to=reg("x")),
        CALL(analysis.analyze, reg("x")),
    ])
    components = train_pca.run()
    assert reg["x"].shape == (1000, 13)
    expected, _ = svd_components(reg["x"], 3)
    assert same_up_to_sign(components, expected)


def test_stepped_pickled_and_resumed_pca_matches_svd():
    program = pca.build(samples=200, batches=3, dim=6, components=2, seed=7)
    drv = program.start()
    while drv.step() is INCOMPLETE and drv.steps < 250:
        pass
    later = pickle.loads(pickle.dumps(drv))
    later.run()
    reference = pca.GaussianStream(dim=6, seed=7)
    data = np.stack([reference.next() for _ in range(600)])
    expected, ratios = svd_components(data, 2)
    assert same_up_to_sign(later.registers["components"], expected)
    assert np.allclose(later.registers["explained"], ratios[:2], atol=1e-6)


def test_pca_resumes_exactly_from_any_step():
    assert_same_run(lambda: pca.build(samples=50, batches=2, dim=4), cuts=[0, 1, 37, 51, 60, 103])


def test_pca_listing():
    assert str(pca.build()) == "\n".join([
        "SEQ:",
        "    REPEAT 5 (counter batch):",
        "        SEQ:",
        "            x = BUFFER 1000:",
        "                GaussianStream.next()",
        "            components = StreamingPCA.analyze(x)",
        "            explained = StreamingPCA.explained()",
        "    components = StreamingPCA.components()",
        "    model = StreamingPCA.model()",
    ])


def test_checkpoint_in_fresh_process_via_cli(tmp_path):
    """The flowvm command saves mid-run; resuming in a new process gives the uninterrupted result."""
    import subprocess
    import sys

    ckpt = tmp_path / "pca.ckpt"
    common = [sys.executable, "-m", "flowvm"]
    subprocess.run(common + ["run", "pca", "--set", "batches=2", "--set", "samples=300", "--checkpoint", str(ckpt),
                             "--max-steps", "457"], check=True, capture_output=True)
    assert flowvm.read_header(ckpt)["steps"] == 457
    subprocess.run(common + ["resume", str(ckpt)], check=True, capture_output=True)
    resumed = flowvm.load(ckpt)
    straight = pca.build(batches=2, samples=300).start()
    straight.run()
    assert resumed.done and resumed.steps == straight.steps
    assert np.array_equal(resumed.registers["components"], straight.registers["components"])
    assert np.array_equal(resumed.registers["x"], straight.registers["x"])


def test_the_report_counts_in_words_that_agree_with_the_numbers():
    from flowvm.programs import pca as program

    drv = program.build(batches=1, samples=20, dim=4, components=1).start()
    drv.run()
    head = program.report(drv.registers).splitlines()[0]
    assert head == "1 principal component of 4-dimensional data (1 batch of 20 samples)", head
