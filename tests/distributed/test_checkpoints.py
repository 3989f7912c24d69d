"""Coordinated checkpoints and the rank API in one process (a world of one, no process group): the layout, the
manifest written last, a save that fails part way, damaged and signed parts, S3, and Batches resharded for
another number of ranks."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import flowvm
from flowvm import CALL, REPEAT, SEQ, Batches, CheckpointError, Registers
from flowvm.distributed import coordinated
from flowvm.persist import storage

from moto_s3 import moto_endpoint, s3_bucket  # noqa: F401  (fixtures)


def program(samples: int = 20):
    data = Batches(np.arange(samples), batch_size=3, seed=1)
    reg = Registers(seen=[])
    take = SEQ([CALL(data.next_batch, store_to=reg("batch")),
                CALL(lambda seen, b: seen + b.tolist(), reg("seen"), reg("batch"), store_to=reg("seen"))])
    return REPEAT(2, REPEAT(len(data), take))


def test_rank_and_world_size_outside_a_distributed_run():
    assert (flowvm.rank(), flowvm.world_size()) == (0, 1)  # as for a single process
    assert flowvm.distributed.launched() is False
    shout = flowvm.rank0(str.upper)
    assert shout("a") == "A"
    assert b"flowvm.distributed\nRank0" in pickle.dumps(shout) or b"Rank0" in pickle.dumps(shout)
    assert pickle.loads(pickle.dumps(shout))("b") == "B"
    with pytest.raises(TypeError, match="rank0: expected a function"):
        flowvm.rank0(3)


def test_a_save_writes_its_parts_then_the_manifest_and_resumes_exactly(tmp_path):
    straight = program().start()
    straight.run()
    drv = program().start()
    drv.run(max_steps=9)
    manifest = coordinated.save(drv, tmp_path / "run")
    folder = tmp_path / "run" / manifest["folder"]
    assert sorted(p.name for p in folder.iterdir()) == ["rank-00000.json", "shared.ckpt"]
    part = json.loads((folder / "rank-00000.json").read_text())
    assert part["batches"][0]["position"] == 5 and part["steps"] == 9  # plain data
    drv.run(max_steps=4)
    second = coordinated.save(drv, tmp_path / "run")
    assert not folder.exists() and (tmp_path / "run" / second["folder"]).is_dir()  # the older save removed
    again = coordinated.load(tmp_path / "run")
    again.run()
    assert again.registers["seen"] == straight.registers["seen"]


def test_a_save_that_fails_before_its_manifest_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    drv = program().start()
    drv.run(max_steps=5)
    coordinated.save(drv, tmp_path / "run")
    drv.run(max_steps=6)
    real = storage.open_write

    def failing(target):
        if str(target).endswith(coordinated.MANIFEST):
            raise CheckpointError(target, "cannot save: disk full")
        return real(target)

    monkeypatch.setattr(storage, "open_write", failing)
    with pytest.raises(CheckpointError, match="the previous checkpoint is kept"):
        coordinated.save(drv, tmp_path / "run")
    monkeypatch.undo()
    assert len([p for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")]) == 2  # one unnamed
    assert coordinated.load(tmp_path / "run").steps == 5
    saved = coordinated.save(drv, tmp_path / "run")  # the next complete save removes the half-written one
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")] == [saved["folder"]]


def test_a_changed_part_or_a_wrong_key_is_refused(tmp_path):
    drv = program().start()
    drv.run(max_steps=5)
    manifest = coordinated.save(drv, tmp_path / "signed", key="k1")
    with pytest.raises(CheckpointError, match="is signed"):
        coordinated.load(tmp_path / "signed")
    with pytest.raises(CheckpointError, match="signature does not match"):
        coordinated.load(tmp_path / "signed", key="k2")
    assert coordinated.load(tmp_path / "signed", key="k1").steps == 5
    part = tmp_path / "signed" / manifest["folder"] / "rank-00000.json"
    changed = json.loads(part.read_text())
    changed["batches"][0]["position"] = 0
    part.write_text(json.dumps(changed))
    with pytest.raises(CheckpointError, match="checksum differs"):
        coordinated.load(tmp_path / "signed", key="k1")


def test_checkpoints_on_s3(s3_bucket):
    straight = program().start()
    straight.run()
    drv = program().start()
    drv.run(max_steps=7)
    location = f"s3://{s3_bucket}/runs/a"
    coordinated.save(drv, location)
    drv.run(max_steps=3)
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.pipe_file(f"{s3_bucket}/runs/a/step-00000008-deadbeef/rank-00000.json", b"{}")  # a kill mid-save
    saved = coordinated.save(drv, location)
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_bucket}/runs/a") if "step-" in p] == [saved["folder"]]
    assert coordinated.is_checkpoint(location) and not coordinated.is_checkpoint(f"s3://{s3_bucket}/runs/b")
    again = coordinated.load(location)
    assert again.steps == 10
    again.run()
    assert again.registers["seen"] == straight.registers["seen"]


def test_a_driver_resharded_for_one_rank_takes_the_rest_of_the_epoch_once():
    two = [Batches(np.arange(23), batch_size=3, seed=4, rank=r, world_size=2) for r in range(2)]
    taken = [x for b in two for x in b.next_batch().tolist() + b.next_batch().tolist()]
    parts = [{"batches": [dict(b.state_dict(), batch_size=3, size=23, rank=r, world_size=2, global_batch=6)],
              "environment": None} for r, b in enumerate(two)]
    data = Batches(np.arange(23), batch_size=3, seed=4, rank=0, world_size=2)
    drv = CALL(data.next_batch).start()
    coordinated.reshard(drv, parts)  # outside a process group: a world of one
    (found,) = coordinated.find_batches(drv)
    assert found is data and (found.rank, found.world_size, found.position, found.global_batch) == (0, 1, 2, 6)
    assert len(data) == len(two[0]) == 4  # as many batches an epoch: loops counted by len() stay right
    rest = []
    while data.epoch == 0:
        rest.append(data.next_batch().tolist())
    assert [len(b) for b in rest] == [6, 5]  # the global batches the two ranks took together
    assert sorted(taken + sum(rest, [])) == list(range(23))  # no sample skipped or taken twice
    assert data.position == 0 and len(data) == 4  # the next epoch is a whole one
    assert sorted(sum((data.next_batch().tolist() for _ in range(4)), [])) == list(range(23))


def test_more_ranks_than_a_global_batch_holds_are_refused_naming_the_ranks_left_without_a_sample():
    b = Batches(np.arange(23), batch_size=3, seed=4, rank=0, world_size=2)
    b.world_size = 7  # as a resume on 7 ranks sets it (reshard): a global batch of 6 leaves the seventh nothing,
    # and the last one (5 samples) the sixth too
    with pytest.raises(ValueError, match=r"the last batch of all 7 ranks together holds 5 samples \(23 samples in "
                                         r"global batches of 6\), so rank 5 and above would take an empty batch: "
                                         r"use at most 6 ranks"):
        b.check_shards()
    b = Batches(np.arange(24), batch_size=3, seed=4, rank=0, world_size=2)
    b.world_size = 7
    with pytest.raises(ValueError, match=r"each batch of all 7 ranks together holds 6 samples \(24 samples in "
                                         r"global batches of 6\), so rank 6 and above would take an empty batch: "
                                         r"use at most 6 ranks"):
        b.check_shards()
    b.world_size = 6
    b.check_shards()  # 6 ranks: a sample each


