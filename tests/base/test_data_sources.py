"""Batches over .npy shards (local, glob, fsspec URLs), and the loaders users have in a program: a
StatefulDataLoader resumes from its state_dict, an iterator over a plain DataLoader is refused at save."""

from __future__ import annotations

import pickle

import fsspec
import numpy as np
import pytest
import torch

from flowvm import CALL, REPEAT, SEQ, Batches, Registers
from flowvm.testing import same

ROWS = np.arange(37 * 4, dtype=np.float32).reshape(37, 4)


@pytest.fixture
def shards(tmp_path):
    paths = []
    for i, (a, b) in enumerate(((0, 10), (10, 11), (11, 37))):
        path = tmp_path / f"x-{i}.npy"
        np.save(path, ROWS[a:b])
        np.save(tmp_path / f"y-{i}.npy", np.arange(a, b))
        paths.append(str(path))
    return paths


def served(data, n):
    return [data.next_batch() for _ in range(n)]


def test_a_list_of_npy_shards_serves_what_the_joined_array_serves(shards):
    want = served(Batches(ROWS, batch_size=6, seed=1), 14)
    assert same(served(Batches(shards, batch_size=6, seed=1), 14), want)
    from_glob = Batches(shards[0].replace("x-0", "x-*"), batch_size=6, seed=1, workers=2)
    assert same(served(from_glob, 14), want)
    from_glob.close()
    maps = Batches(shards, batch_size=6).source._arrays()
    assert all(isinstance(m, np.memmap) for m in maps)


def test_shards_pickle_as_their_paths_and_resume(shards):
    data = Batches({"x": shards, "y": [p.replace("x-", "y-") for p in shards]}, batch_size=5, seed=2)
    first = served(data, 4)
    blob = pickle.dumps(data)
    assert len(blob) < 3000  # the paths, not the rows
    from flowvm.persist.pickler import names_in

    assert ("flowvm", "Batches._open_shards") in names_in(blob)
    assert not [m for m, _ in names_in(blob) if m.startswith("flowvm.")]  # stable names only
    again = pickle.loads(blob)
    rest = served(again, 6)
    ref = Batches({"x": ROWS, "y": np.arange(37)}, batch_size=5, seed=2)
    assert same(first + rest, served(ref, 10))
    assert np.array_equal(rest[0]["x"][:, 0] / 4, rest[0]["y"])


def test_shards_behind_fsspec_urls(shards):
    local = Batches([f"file://{p}" for p in shards], batch_size=7, seed=3)
    assert same(served(local, 6), served(Batches(ROWS, batch_size=7, seed=3), 6))
    fs = fsspec.filesystem("memory")
    for i, p in enumerate(shards):
        with fs.open(f"/flowvm-test/x-{i}.npy", "wb") as f:
            f.write(open(p, "rb").read())
    remote = Batches("memory://flowvm-test/x-*.npy", batch_size=7, seed=3)
    assert remote.size == 37 and len(remote.source.paths) == 3
    assert same(served(remote, 6), served(Batches(ROWS, batch_size=7, seed=3), 6))


def test_bad_shards_are_named(tmp_path, shards):
    np.save(tmp_path / "odd.npy", np.zeros((3, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="odd.npy' holds float32\\[5\\] rows"):
        Batches(shards + [str(tmp_path / "odd.npy")])
    with pytest.raises(FileNotFoundError, match="no .npy file matches"):
        Batches(str(tmp_path / "nothing-*.npy"))
    with pytest.raises(OSError, match="missing.npy"):
        Batches([str(tmp_path / "missing.npy")])


class ResumableLoader(torch.utils.data.DataLoader):
    """A stand-in following torchdata's StatefulDataLoader protocol: state_dict() is the position of the
    iterator it made last, and load_state_dict(state) makes its next iterator resume there."""

    def __init__(self, dataset, batch_size):
        super().__init__(dataset, batch_size=batch_size, shuffle=False)
        self._iterator = None
        self.next_iter_state = None

    def __iter__(self):
        start = (self.next_iter_state or {}).get("yielded", 0)
        self.next_iter_state = None
        self._iterator = _Resumed(self, start)
        return self._iterator

    def state_dict(self):
        return {"yielded": 0 if self._iterator is None else self._iterator.yielded}

    def load_state_dict(self, state):
        self._iterator = None
        self.next_iter_state = state


class _Resumed:
    def __init__(self, loader, start):
        self.batches = list(super(ResumableLoader, loader).__iter__())  # the plain loader's batches
        self.yielded = start

    def __iter__(self):
        return self

    def __next__(self):
        if self.yielded >= len(self.batches):
            raise StopIteration
        self.yielded += 1
        return self.batches[self.yielded - 1]


def loader_program(make_loader):
    reg = Registers(loader=make_loader(torch.utils.data.TensorDataset(torch.arange(10.0)), 3), seen=[])
    return REPEAT(9, SEQ([CALL(Batches.next_from, reg("loader"), store_to=reg("b")),
                          CALL(lambda b, s: s + [b[0].tolist()], reg("b"), reg("seen"), store_to=reg("seen"))]))


def resumed_twice(make_loader):
    straight = loader_program(make_loader).start()
    straight.run()
    drv = loader_program(make_loader).start()
    for steps in (3, 4):  # twice inside the first epoch (4 batches), then into the next
        drv.run(max_steps=steps)
        drv = pickle.loads(pickle.dumps(drv))
    drv.run()
    return straight.registers["seen"], drv.registers["seen"]


def test_a_stateful_loader_in_a_register_resumes_from_its_state_dict():
    straight, resumed = resumed_twice(ResumableLoader)
    assert resumed == straight and len(straight) == 9 and straight[4] == [0.0, 1.0, 2.0]
    from flowvm.persist.pickler import names_in, pickle_bytes

    loader = ResumableLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), 3)
    Batches.next_from(loader)
    assert ("flowvm", "Batches._restore_loader") in names_in(pickle_bytes(loader))  # a stable name
    assert pickle.loads(pickle_bytes(loader)).next_iter_state == {"yielded": 1}


def test_torchdata_stateful_dataloader_resumes_from_its_state_dict():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    straight, resumed = resumed_twice(lambda ds, b: stateful.StatefulDataLoader(ds, batch_size=b))
    assert resumed == straight


def test_an_iterator_over_a_plain_dataloader_is_refused_at_save():
    drv = loader_program(lambda ds, b: torch.utils.data.DataLoader(ds, batch_size=b)).start()
    drv.run(max_steps=3)
    with pytest.raises(pickle.PicklingError, match="flowvm.Batches .*StatefulDataLoader"):
        pickle.dumps(drv)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4.0)))
    reg = Registers(it=iter(loader))
    with pytest.raises(pickle.PicklingError, match="_SingleProcessDataLoaderIter"):
        pickle.dumps(REPEAT(1, CALL(next, reg("it"))).start())
    assert pickle.loads(pickle.dumps(REPEAT(1, CALL(len, loader)).start())) is not None  # the loader alone


def test_state_files_keep_a_stateful_loaders_state_dict_and_batches_position(tmp_path):
    import flowvm

    built = []

    def build():
        data = Batches((np.arange(20.0), np.arange(20)), batch_size=3, seed=1, workers=2)
        loader = ResumableLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), 3)
        reg = Registers(seen=[])
        built.append(data)
        return REPEAT(9, SEQ([CALL(Batches.next_from, loader, store_to=reg("b")),  # state files: in a CALL
                              CALL(data.next_batch, store_to=reg("d")),
                              CALL(lambda b, d, s: s + [b[0].tolist(), d[1].tolist()], reg("b"), reg("d"),
                                   reg("seen"), store_to=reg("seen"))]))

    straight = build().start()
    straight.run()
    drv = build().start()
    drv.run(max_steps=7)  # 2 rounds and one batch of each source in
    flowvm.save_state(drv, tmp_path / "run.safetensors")
    again = flowvm.load_state(tmp_path / "run.safetensors", build())
    again.run()
    assert again.registers["seen"] == straight.registers["seen"]
    assert again.registers["seen"][6] == [9.0]  # the loader's fourth batch, taken after the resume
    for data in built:
        data.close()
