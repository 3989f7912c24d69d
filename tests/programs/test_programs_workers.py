"""The bundled programs that read minibatches (mlp, rbm, convnet) take workers= and prefetch= (``--set workers=N``):
the same run, bit for bit, with any number of worker processes, and a run saved mid-epoch with workers
resumes without them exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flowvm
from flowvm.programs import convnet, mlp, rbm
from flowvm.testing import same
from toy import flowvm_cmd


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def finished(drv) -> dict:
    drv.run()
    return {k: v for k, v in drv.registers.items()}


@pytest.mark.parametrize("module, options", [
    (mlp, dict(samples=600, hidden=8, epochs=2, batch_size=32)),
    (rbm, dict(samples=300, hidden=6, epochs=2, batch_size=16)),
    (convnet, dict(channels=4, epochs=2, batch_size=32)),
])
def test_workers_give_the_run_workers_0_gives_and_resume_mid_epoch_with_any_workers(module, options, tmp_path):
    want = finished(module.build(**options).start())
    drv = module.build(workers=2, prefetch=3, **options).start()
    batches = next(fn.__self__ for fn in (getattr(el, "fn", None) for _, el in drv.program.walk())
                   if getattr(fn, "__name__", "") == "next_batch")
    assert batches.workers == 2 and len(batches.worker_pids) == 2
    assert same(finished(drv), want)
    for before, after in ((2, 0), (0, 2), (2, 1)):
        drv = module.build(workers=before, **options).start()
        drv.run(max_steps=37)  # mid-epoch: 9 or 10 batches into the first epoch
        flowvm.save_state(drv, tmp_path / "run.safetensors")
        resumed = flowvm.load_state(tmp_path / "run.safetensors", module.build(workers=after, **options))
        assert same(finished(resumed), want), (before, after)


def test_workers_and_prefetch_are_checked_naming_the_program_and_option():
    with pytest.raises(ValueError, match=r"mlp: workers must be >= 0"):
        mlp.build(workers=-1)
    with pytest.raises(TypeError, match=r"rbm: workers must be an int >= 0, got float 1.5"):
        rbm.build(workers=1.5)
    with pytest.raises(ValueError, match=r"mlp: prefetch must be >= 1, got 0"):
        mlp.build(prefetch=0)


def test_the_command_gives_the_same_model_with_workers_and_resumes_mid_epoch_with_none(tmp_path):
    common = ["--set", "epochs=1", "--set", "samples=1200", "--progress", "none"]
    flowvm_cmd("run", "mlp", *common, "--set", "workers=0", "--output", tmp_path / "w0.npz", cwd=tmp_path)
    flowvm_cmd("run", "mlp", *common, "--set", "workers=2", "--output", tmp_path / "w2.npz", cwd=tmp_path)
    # saved mid-epoch (an epoch is 13 updates of 2 steps each, woven with evaluation and logging) with workers=2
    flowvm_cmd("run", "mlp", *common, "--set", "workers=2", "--checkpoint", tmp_path / "run.safetensors",
               "--max-steps", "15", cwd=tmp_path)
    flowvm_cmd("resume", tmp_path / "run.safetensors", "--set", "workers=0", "--output", tmp_path / "resumed.npz",
               "--progress", "none", cwd=tmp_path)
    w0, w2, resumed = (np.load(tmp_path / f"{name}.npz") for name in ("w0", "w2", "resumed"))
    assert sorted(w0) == sorted(w2) == sorted(resumed) and "coefs_0" in w0
    for key in w0:
        assert np.array_equal(w0[key], w2[key]) and np.array_equal(w0[key], resumed[key]), key
