"""The convolutional classifier data-parallel on two ranks (gloo, this machine): an update averages the ranks'
gradients, `flowvm run convnet --nproc 2` trains and reports once, and a run stopped part way resumes from
its coordinated checkpoint bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from flowvm import CALL, SEQ, Batches, Registers
from flowvm.program.paths import walk
from flowvm.programs import convnet

pytestmark = pytest.mark.timeout(600)
OPTIONS = dict(channels=4, epochs=2, batch_size=32)
SETS = ["--set", "channels=8", "--set", "epochs=6"]  # on two ranks: 21 updates of 2 x 32 images an epoch


def flowvm(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowvm", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def called(program, name: str):
    """The object whose method `name` the program's CALL calls."""
    return [el for _, el in walk(program) if getattr(getattr(el, "fn", None), "__name__", "") == name][0].fn.__self__


def one_update(batch) -> torch.nn.Module:
    """convnet's network at its start after one Adam update on batch, in this process."""
    network = called(convnet.build(**OPTIONS), "train_step").model
    optimizer = torch.optim.Adam(network.parameters(), lr=0.005)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(network(batch[0]), batch[1]).backward()
    optimizer.step()
    return network


def weights(network: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in network.state_dict().items()}


def first_update():
    """convnet's first update, then its network's weights in a register (what launch() returns)."""
    program = convnet.build(**OPTIONS)
    trainer, batches = called(program, "train_step"), called(program, "next_batch")
    reg = Registers(batch=None, weights=None)
    return SEQ([CALL(batches.next_batch, store_to=reg("batch")), CALL(trainer.train_step, reg("batch")),
                CALL(weights, trainer.model, store_to=reg("weights"))])


def test_an_update_on_two_ranks_is_one_update_on_both_ranks_batches():
    """After one update on two ranks, rank 0's network is the one a single process makes from the two ranks'
    first batches together (DDP averages the ranks' gradients of their batch means: the mean over both)."""
    from flowvm.distributed import launch

    finished = launch(first_update, nproc=2)
    assert finished.done
    trained = finished.registers["weights"]
    source = called(convnet.build(**OPTIONS), "next_batch").source
    batches = [Batches(source, batch_size=32, seed=0, rank=r, world_size=2).next_batch() for r in (0, 1)]
    assert not torch.equal(batches[0][0], batches[1][0])  # each rank its own share of the epoch
    both = one_update((torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))
    assert trained.keys() == both.state_dict().keys()
    for name, want in both.state_dict().items():
        assert torch.allclose(trained[name], want, rtol=0, atol=1e-6), name
    alone = one_update(batches[0])
    assert not torch.allclose(alone.head.weight, trained["head.weight"], rtol=0, atol=1e-6)  # not rank 0's batch alone


def test_the_command_trains_convnet_on_two_ranks_and_resumes_bit_for_bit(tmp_path):
    straight = flowvm("run", "convnet", *SETS, "--nproc", "2", "--output", tmp_path / "straight.npz",
                      "--progress", "none", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert straight.stdout.count("convnet on digits: held-out accuracy") == 1  # rank 0 reports
    assert float(straight.stdout.split("accuracy ")[1].split()[0]) > 0.9
    ckpt = tmp_path / "run"
    cut = flowvm("run", "convnet", *SETS, "--nproc", "2", "--checkpoint", ckpt, "--every", "10", "--max-steps",
                 "97", "--progress", "none", cwd=tmp_path)
    assert cut.returncode == 0, cut.stderr[-3000:]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["steps"] == 97 and not manifest.get("done")
    resumed = flowvm("resume", ckpt, "--output", tmp_path / "resumed.npz", "--progress", "none", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    def report(out: str) -> str:  # the epochs' losses and accuracies, printed by rank 0
        return out.split("convnet on digits")[1].split("model written")[0]
    assert report(resumed.stdout) == report(straight.stdout)
    with np.load(tmp_path / "straight.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        assert all(np.array_equal(a[k], b[k]) for k in a.files)
