"""flowvm sweep: a random search over any program's options, each trial a SPAWN, the best model kept, resumable
with trials in flight, on the local pool or a Dask cluster."""

from __future__ import annotations

import numpy as np

import flowvm
from flowvm.programs import kmeans, mlp, sweep

from toy import flowvm_cmd

SPACE = ["--space", "clusters=int:2:5", "--space", "restarts=choice:1,2"]


def test_a_sweep_resumed_with_trials_in_flight_keeps_the_best_model_of_the_uninterrupted_search(tmp_path):
    ckpt = tmp_path / "sweep.ckpt"
    flowvm_cmd("sweep", "kmeans", "--trials", "4", *SPACE, "--metric", "inertia", "--minimize",
               "--set", "samples=400", "--checkpoint", ckpt, "--max-steps", "3", "--progress", "none", cwd=tmp_path)
    assert not flowvm.read_header(ckpt)["done"]
    done = flowvm_cmd("resume", ckpt, "--output", tmp_path / "best.npz", "--progress", "none", cwd=tmp_path)
    assert "search of 4 trials; best: trial" in done.stdout and "model written to" in done.stdout
    straight = sweep.search("kmeans", [s for s in SPACE if s != "--space"], 4, "inertia", True,
                            {"samples": 400}).start()
    straight.run()
    best = straight.registers["best"]
    assert flowvm.load(ckpt).registers["best"]["metric"] == best["metric"]
    assert best["metric"] == min(straight.registers[f"trial_{i}"]["metric"] for i in range(4))
    # the kept model is the one the best configuration gives when run here
    alone = kmeans.build(samples=400, **best["config"]).start()
    alone.run()
    assert np.array_equal(np.load(tmp_path / "best.npz")["cluster_centers_"],
                          kmeans.model(alone.registers).cluster_centers_)


def test_a_sweep_of_mlp_trials_on_a_dask_cluster(tmp_path):
    done = flowvm_cmd("sweep", "mlp", "--trials", "2", "--space", "lr=loguniform:1e-3:1e-1",
                      "--space", "hidden=choice:8,16", "--set", "epochs=1", "--set", "samples=300",
                      "--executor", "dask", "--output", tmp_path / "best.pt", "--progress", "none",
                      cwd=tmp_path, timeout=300)
    assert "search of 2 trials" in done.stdout and (tmp_path / "best.pt").exists()
    configs = sweep.draw(sweep.parse_space(["lr=loguniform:1e-3:1e-1", "hidden=choice:8,16"]), 2, 0)
    accuracies = []
    for config in configs:
        drv = mlp.build(epochs=1, samples=300, **config).start()
        drv.run()
        accuracies.append(drv.registers["accuracy"])
    assert f"with {max(accuracies):.6g}" in done.stdout


def test_bad_search_dimensions_and_options_are_refused_before_anything_runs(tmp_path):
    bad = flowvm_cmd("sweep", "kmeans", "--space", "clusters=normal:1:2", cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "unknown kind 'normal'" in bad.stderr
    bad = flowvm_cmd("sweep", "kmeans", "--space", "nosuch=int:1:3", cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "has no option 'nosuch'" in bad.stderr
