"""The history of a run's metrics (flowvm/command/history.py): exactly the uninterrupted run's points after
any stop and resume, drawn by `flowvm plot`, and written as TensorBoard scalars that never double."""

from __future__ import annotations

import shutil

import numpy as np

import flowvm
from flowvm.command.history import plot_history

from toy import flowvm_cmd

PCA = ["pca", "--set", "batches=30", "--set", "samples=20", "--set", "dim=4", "--set", "components=2"]


def history_of(path) -> dict:
    return flowvm.read_header(path)["meta"]["history"]


def test_a_run_stopped_and_resumed_records_the_uninterrupted_runs_history(tmp_path):
    flowvm_cmd("run", *PCA, "--checkpoint", tmp_path / "straight.ckpt", "--progress", "none")
    straight = history_of(tmp_path / "straight.ckpt")
    assert straight["names"] == ["batch", "explained"] and straight["every"] == 662 // 200
    steps = [p[0] for p in straight["points"]["batch"]]
    assert steps[0] <= 3 and steps[-1] == 662  # (the counter register exists from the first step on) and all(s % 3 == 0 for s in steps[:-1]) and len(steps) > 150
    assert isinstance(straight["points"]["explained"][-1][1], list)
    flowvm_cmd("run", *PCA, "--checkpoint", tmp_path / "cut.ckpt", "--max-steps", "101", "--progress", "none")
    for more in ("77", "200"):
        flowvm_cmd("resume", tmp_path / "cut.ckpt", "--max-steps", more, "--progress", "none")
    flowvm_cmd("resume", tmp_path / "cut.ckpt", "--progress", "none")
    assert history_of(tmp_path / "cut.ckpt") == straight


def test_a_longer_run_than_its_program_tells_keeps_a_bounded_history_the_same_way_resumed_or_not():
    import pickle

    from flowvm import CALL, WHILE, Registers

    def program():  # a WHILE: no step count the program fixes, so the interval starts at 1 and doubles
        reg = Registers(x=0)
        return WHILE(CALL(lambda x: x < 5_000, reg("x")), CALL(lambda x: x + 1, reg("x"), store_to=reg("x")))

    def recorded(stops):
        drv = program().start().watch("x")
        for stop in stops:
            drv.run(max_steps=stop - drv.steps)
            drv = pickle.loads(pickle.dumps(drv))  # a resumed run, from a copy
        drv.run()
        return drv._watch

    whole = recorded([])
    assert whole == recorded([333, 5000, 5001]) and 200 <= len(whole["points"]["x"]) <= 402
    assert whole["every"] > 1 and all(p[0] % whole["every"] == 0 for p in whole["points"]["x"][:-1])


def test_flowvm_plot_draws_one_panel_with_one_line_per_metric(tmp_path):
    import matplotlib.image
    ckpt = tmp_path / "run.ckpt"
    flowvm_cmd("run", *PCA, "--checkpoint", ckpt, "--progress", "none")
    out = flowvm_cmd("plot", ckpt, "batch", "-o", tmp_path / "curves.png")
    assert "wrote" in out.stdout and "batch over 662 steps" in out.stdout
    image = matplotlib.image.imread(tmp_path / "curves.png")
    assert image.shape[0] >= 200 and image.shape[1] >= 600 and image.std() > 0.01  # a drawn picture
    fig = plot_history(history_of(ckpt), ["batch", "explained"], str(tmp_path / "both.png"))
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["batch", "explained"] and axes[-1].get_xlabel() == "step"
    assert len(axes[0].get_lines()) == 1 and len(axes[1].get_lines()) == 2  # explained holds two ratios
    line = axes[0].get_lines()[0]
    assert np.array_equal(line.get_xdata(), [p[0] for p in history_of(ckpt)["points"]["batch"]])
    bad = flowvm_cmd("plot", ckpt, "nosuch", check=False)
    assert bad.returncode != 0 and "no history of nosuch" in bad.stderr


def test_tensorboard_scalars_of_a_run_resumed_from_an_older_checkpoint_never_double(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    straight = tmp_path / "straight.ckpt"
    flowvm_cmd("run", *PCA, "--checkpoint", straight, "--progress", "none")
    logs, ckpt = tmp_path / "tb", tmp_path / "run.ckpt"
    flowvm_cmd("run", *PCA, "--checkpoint", ckpt, "--max-steps", "200", "--tensorboard", logs, "--progress", "none")
    shutil.copy(ckpt, tmp_path / "at200.ckpt")
    # the run goes on past its checkpoint, then is lost (killed): its points past step 200 must not count
    flowvm_cmd("resume", ckpt, "--max-steps", "150", "--tensorboard", logs, "--progress", "none")
    flowvm_cmd("resume", tmp_path / "at200.ckpt", "--tensorboard", logs, "--progress", "none")
    events = EventAccumulator(str(logs))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("batch")]
    expected = [(s, v) for s, v in history_of(straight)["points"]["batch"]]
    assert [s for s, _ in got] == [s for s, _ in expected]  # each step once, in order
    assert np.allclose([v for _, v in got], [v for _, v in expected])
    assert "explained/0" in events.Tags()["scalars"]


def test_a_resumed_run_keeps_writing_where_the_run_it_continues_wrote(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for suffix in (".ckpt", ".safetensors"):
        logs, ckpt, model = tmp_path / f"tb{suffix}", tmp_path / f"run{suffix}", tmp_path / f"pca{suffix}.npz"
        flowvm_cmd("run", *PCA, "--checkpoint", ckpt, "--max-steps", "200", "--tensorboard", logs, "--output", model,
                   "--progress", "none", cwd=tmp_path)
        assert not model.exists()  # the run paused: no model yet
        other = tmp_path / "elsewhere"
        other.mkdir(exist_ok=True)
        flowvm_cmd("resume", ckpt, "--progress", "none", cwd=other)  # no output option given again
        events = EventAccumulator(str(logs))
        events.Reload()
        steps = [e.step for e in events.Scalars("batch")]
        assert steps[-1] == 662 and steps == sorted(set(steps)) and min(steps) < 200, suffix
        assert np.load(model)["components_"].shape == (2, 4)  # written where the run was told, at its end
    # an option given anew replaces the recorded one, for this resume and the later ones
    ckpt = tmp_path / "again.ckpt"
    flowvm_cmd("run", *PCA, "--checkpoint", ckpt, "--max-steps", "100", "--tensorboard", tmp_path / "a",
               "--progress", "none")
    flowvm_cmd("resume", ckpt, "--max-steps", "100", "--tensorboard", tmp_path / "b", "--progress", "none")
    flowvm_cmd("resume", ckpt, "--progress", "none")
    events = EventAccumulator(str(tmp_path / "b"))
    events.Reload()
    assert [e.step for e in events.Scalars("batch")][-1] == 662
    assert flowvm.read_header(ckpt)["meta"]["outputs"] == {"tensorboard": str(tmp_path / "b")}
