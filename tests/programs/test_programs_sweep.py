"""The sweep program: trials in parallel with SPAWN, the best kept, resumable while trials are in flight."""

from __future__ import annotations

import random

import pytest
import torch

import flowvm
from flowvm import INCOMPLETE, SPAWN
from flowvm.program.paths import walk
from flowvm.programs import mlp, sweep
from flowvm.testing import same

pytestmark = pytest.mark.timeout(240)

SMALL = dict(trials=2, epochs=2, samples=600, seed=3)


@pytest.fixture(autouse=True, scope="module")
def free_the_workers():
    """The trials' workers hold torch; let them go after this module."""
    yield
    from flowvm.processes.executors import shutdown_default_executor

    shutdown_default_executor()


def in_process(config: dict) -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(mlp.THREADS)
    try:
        drv = mlp.build(**config).start()
        drv.run()
    finally:
        torch.set_num_threads(before)
    return drv.registers


@pytest.fixture(scope="module")
def reference():
    drv = sweep.build(**SMALL).start()
    drv.run()
    return drv


def test_each_trial_is_the_mlp_program_run_elsewhere_and_the_best_is_kept(reference):
    regs = reference.registers
    results = [regs["trial_0"], regs["trial_1"]]
    for result in results:
        expected = in_process(result["config"])
        assert same(result["accuracy"], expected["accuracy"]) and same(result["loss"], expected["loss"])
        assert same(result["weights"], expected["weights"])
    best = max(range(2), key=lambda i: (results[i]["accuracy"], -results[i]["loss"]))
    assert regs["best"]["trial"] == best and regs["best_accuracy"] == results[best]["accuracy"]
    assert "best: trial" in sweep.report(regs)


def test_all_trials_are_in_flight_at_once():
    drv = sweep.build(**SMALL).start()
    assert [drv.step(), drv.step()] == [INCOMPLETE, INCOMPLETE]  # each SPAWN's first step submits its trial
    assert len(drv.live) == 2
    spawns = [el for _, el in walk(drv.program) if isinstance(el, SPAWN)]
    assert len(spawns) == 2 and all(el.executor is None for el in spawns)
    drv.run()
    assert drv.done and drv.live == {}


def test_a_run_saved_while_trials_are_in_flight_resumes_to_the_same_registers(reference, tmp_path):
    cut = random.Random(8).randint(1, 4)  # trials submitted, none finished
    drv = sweep.build(**SMALL).start()
    drv.run(max_steps=cut)
    assert not drv.done and drv.live
    flowvm.save(drv, tmp_path / "sweep.ckpt")
    later = flowvm.load(tmp_path / "sweep.ckpt")
    assert later.live == {} and later.steps == cut
    later.run()
    assert later.registers.keys() == reference.registers.keys()
    for name in reference.registers:
        assert same(later.registers[name], reference.registers[name]), name
    drv.run()  # the original finishes too
    assert same(drv.registers["best"], reference.registers["best"])


def test_configs_are_drawn_from_the_seed_and_alternate_optimizers():
    a, b = sweep.draw_configs(5, 3, 900, seed=1), sweep.draw_configs(5, 3, 900, seed=1)
    assert a == b and a != sweep.draw_configs(5, 3, 900, seed=2)
    assert [c["optimizer"] for c in a] == ["adam", "sgd", "adam", "sgd", "adam"]
    assert all(1e-3 <= c["lr"] <= 3e-1 and c["hidden"] in (16, 32, 64) and c["epochs"] == 3 for c in a)


def test_best_of_prefers_accuracy_then_loss_then_order():
    results = [{"accuracy": 0.9, "loss": 0.3}, {"accuracy": 0.95, "loss": 0.5}, {"accuracy": 0.95, "loss": 0.2},
               {"accuracy": 0.95, "loss": 0.2}]
    assert sweep.best_of(results)["trial"] == 2
    with pytest.raises(ValueError, match="trials must be >= 1"):
        sweep.build(trials=0)


def test_sweep_listing():
    assert str(sweep.build(trials=2)) == "\n".join([
        "SEQ:",
        "    WEAVE all of 2:",
        "        SPAWN:",
        "            trial_0 = run_trial(config_0)",
        "        SPAWN:",
        "            trial_1 = run_trial(config_1)",
        "    best = best_of([trial_0, trial_1])",
        "    best_accuracy = accuracy_of(best)",
    ])


def test_the_built_in_sweep_trains_on_the_users_data_from_a_file_through_the_command_line(tmp_path):
    import numpy as np
    from sklearn.datasets import load_iris
    from sklearn.preprocessing import StandardScaler

    from toy import flowvm_cmd

    iris = load_iris()
    x = StandardScaler().fit_transform(iris.data)
    rows = np.column_stack([iris.target, x])
    np.savetxt(tmp_path / "iris.csv", rows, delimiter=",", header="species,a,b,c,d", comments="", fmt="%.6f")
    done = flowvm_cmd("run", "sweep", "--data", tmp_path / "iris.csv", "--set", "label='species'", "--set",
                      "val_fraction=0.25", "--set", "trials=2", "--set", "epochs=15", "--checkpoint",
                      tmp_path / "sweep.ckpt", "--output", tmp_path / "best.pt", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    drv = flowvm.load(tmp_path / "sweep.ckpt")
    config = drv.registers["config_0"]
    assert config["data"] == str(tmp_path / "iris.csv") and "samples" not in config
    # each trial is the mlp program on that file, as built and run here
    alone = in_process(config)
    assert drv.registers["trial_0"]["accuracy"] == alone["accuracy"] and alone["held_out"] == 38
    assert drv.registers["best_accuracy"] >= 0.85
    saved = torch.load(tmp_path / "best.pt", weights_only=True)  # the best trial's network
    net = mlp.Classifier(saved["layer_sizes_"])
    net.load_state_dict(saved["state_dict"])
    assert float((net.predict(x) == iris.target).mean()) >= 0.85


def test_a_built_in_sweep_saved_by_flowvm_0_2_gives_its_best_network():
    from pathlib import Path

    drv = flowvm.load(Path(__file__).resolve().parents[1] / "fixtures" / "sweep-0.2.0.ckpt")
    drv.run()
    net = sweep.model(drv.registers)
    assert isinstance(net, mlp.Classifier) and not net.training
    x, y = mlp.spirals(300, seed=7)
    assert net.predict(x).shape == (300,)
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), drv.registers["best"]["weights"]))


def test_the_built_in_sweep_refuses_bad_data_before_any_trial_starts():
    import numpy as np

    with pytest.raises(flowvm.DataError, match="label"):
        sweep.build(data=(np.zeros((10, 2)), np.arange(10) * 0.5), trials=2)
