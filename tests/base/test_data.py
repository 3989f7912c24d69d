"""flowvm.Batches: epochs, shuffling, sources, and exact resume mid-epoch."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.base.data import Batches, stack_items
from flowvm.testing import assert_same_run, same


def served(data: Batches, n: int) -> list:
    return [data.next_batch() for _ in range(n)]


def test_every_epoch_visits_each_sample_once_in_a_new_order():
    data = Batches(np.arange(23), batch_size=5, seed=4)
    assert len(data) == 5 and data.batches_per_epoch == 5
    epochs = []
    for e in range(3):
        assert (data.epoch, data.position) == (e, 0)
        batches = served(data, 5)
        assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
        order = np.concatenate(batches)
        assert sorted(order.tolist()) == list(range(23))
        epochs.append(order.tolist())
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert data.batches_taken == 15


def test_the_order_depends_on_seed_and_epoch_only():
    a, b = Batches(np.arange(50), batch_size=7, seed=1), Batches(np.arange(50), batch_size=7, seed=1)
    np.random.seed(0)
    first = served(a, 20)
    np.random.seed(99)
    torch.manual_seed(5)  # global generators do not matter
    assert all(np.array_equal(x, y) for x, y in zip(first, served(b, 20)))
    other = Batches(np.arange(50), batch_size=7, seed=2)
    assert not np.array_equal(np.concatenate(served(other, 8)), np.concatenate(first[:8]))
    assert np.array_equal(Batches(np.arange(50), seed=1).order(3), a.order(3))


def test_no_shuffle_and_drop_last():
    data = Batches(np.arange(10), batch_size=4, shuffle=False, drop_last=True)
    assert len(data) == 2
    assert [b.tolist() for b in served(data, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert data.epoch == 1


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 5, 9])
@pytest.mark.parametrize("how", ["pickle", "deepcopy", "state_dict"])
def test_stopping_anywhere_resumes_on_exactly_the_next_batch(cut, how):
    x = np.random.default_rng(0).standard_normal((17, 3))
    y = np.arange(17)
    straight = served(Batches((x, y), batch_size=4, seed=8), 12)
    data = Batches((x, y), batch_size=4, seed=8)
    before = served(data, cut)
    if how == "pickle":
        data = pickle.loads(pickle.dumps(data))
    elif how == "deepcopy":
        data = copy.deepcopy(data)
    else:
        fresh = Batches((x, y), batch_size=4, seed=0)
        fresh.load_state_dict(data.state_dict())
        data = fresh
    got = before + served(data, 12 - cut)
    assert same(got, straight)


def test_a_pickled_source_carries_no_order_cache_and_only_plain_state():
    data = Batches(np.arange(1000), batch_size=10, seed=3)
    served(data, 3)
    assert "_order" in data.__dict__
    state = data.__getstate__()
    assert "_order" not in state
    assert {k: state[k] for k in ("seed", "epoch", "position")} == {"seed": 3, "epoch": 0, "position": 3}


def test_tensor_tuple_and_dict_sources():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    xb, yb = Batches((x, y), batch_size=4, seed=1).next_batch()
    assert isinstance(xb, torch.Tensor) and xb.shape == (4, 2)
    assert torch.equal(xb[:, 0] / 2, yb.float())  # rows stay paired
    batch = Batches({"x": x.numpy(), "y": y.numpy()}, batch_size=3).next_batch()
    assert set(batch) == {"x", "y"} and np.array_equal(batch["x"][:, 0] / 2, batch["y"])
    assert Batches(x, batch_size=5).next_batch().shape == (5, 2)


def test_torch_dataset_and_list_of_samples():
    x, y = torch.randn(10, 3), torch.arange(10)
    ds = torch.utils.data.TensorDataset(x, y)
    xb, yb = Batches(ds, batch_size=4, seed=2).next_batch()
    assert xb.shape == (4, 3) and torch.equal(xb, x[yb])
    samples = [(np.full(2, i, dtype=float), i) for i in range(7)]
    xb, yb = Batches(samples, batch_size=3, seed=0).next_batch()
    assert xb.shape == (3, 2) and np.array_equal(xb[:, 0], yb)
    joined = Batches(samples, batch_size=3, collate=lambda items: [i for _, i in items]).next_batch()
    assert isinstance(joined, list) and len(joined) == 3


def test_stack_items_recurses_into_dicts_and_lists():
    out = stack_items([{"a": 1, "b": [np.zeros(2), 2]}, {"a": 3, "b": [np.ones(2), 4]}])
    assert out["a"].tolist() == [1, 3]
    assert out["b"][0].shape == (2, 2) and out["b"][1].tolist() == [2, 4]


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((np.arange(5),), {"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ((np.arange(5),), {"batch_size": 2.0}, TypeError, "batch_size must be an int"),
    ((np.zeros(0),), {}, ValueError, "no samples"),
    (((np.arange(5), np.arange(4)),), {}, ValueError, "differ in length (0: 5, 1: 4)"),
    (((np.arange(5), "labels"),), {}, TypeError, "source item 1 must be"),
    ((np.array(3.0),), {}, ValueError, "0-dimensional"),
    ((42,), {}, TypeError, "got int"),
    ((np.arange(3),), {"batch_size": 5, "drop_last": True}, ValueError, "every epoch would be empty"),
])
def test_bad_input_is_named(args, kwargs, error, words):
    with pytest.raises(error) as info:
        Batches(*args, **kwargs)
    assert words in str(info.value)


def test_load_state_dict_rejects_a_position_outside_the_epoch():
    data = Batches(np.arange(10), batch_size=5)
    with pytest.raises(ValueError, match="position 2 of epoch 0"):
        data.load_state_dict({"seed": 0, "epoch": 0, "position": 2})
    with pytest.raises(ValueError, match="expected a dict"):
        data.load_state_dict({"epoch": 1})


def build_training_stream():
    """A program that draws batches and also uses the global numpy generator."""
    np.random.seed(0)
    reg = Registers(total=0.0)
    data = Batches(np.random.default_rng(1).standard_normal((29, 2)), batch_size=6, seed=5)
    noisy = lambda b, t: t + float(b.sum()) + np.random.rand()  # noqa: E731
    return SEQ([
        REPEAT(3, REPEAT(len(data), SEQ([
            CALL(data.next_batch, store_to=reg("batch")),
            CALL(noisy, reg("batch"), reg("total"), store_to=reg("total")),
        ])), counter=reg("epoch")),
        CALL(lambda: data.state_dict(), store_to=reg("position")),
    ])


def test_a_program_drawing_batches_resumes_exactly_from_random_steps():
    expected = assert_same_run(build_training_stream, seed=11)
    assert expected["registers"]["position"] == {"seed": 5, "epoch": 3, "position": 0}


def test_checkpoint_mid_epoch_resumes_on_the_next_batch(tmp_path):
    prog = build_training_stream()
    drv = prog.start()
    drv.run(max_steps=8)  # mid-epoch: 4 batches of 5 taken, the short last batch is next
    data = drv.program.children[0].body.body.children[0].fn.__self__
    assert (data.epoch, data.position) == (0, 4)
    expected_next = data.gather(data.indices())
    flowvm.save(drv, tmp_path / "mid.ckpt")
    later = flowvm.load(tmp_path / "mid.ckpt")
    later.run(max_steps=1)
    assert later.registers["batch"].shape == (5, 2)
    assert np.array_equal(later.registers["batch"], expected_next)


def test_a_negative_seed_and_non_integer_positions_are_refused():
    import numpy as np

    with pytest.raises(ValueError, match="seed must be >= 0"):
        flowvm.Batches(np.arange(10), 4, seed=-1)
    data = flowvm.Batches(np.arange(10), 4)
    with pytest.raises(ValueError, match="expected a dict with int 'seed', 'epoch' and 'position'"):
        data.load_state_dict({"seed": 0, "epoch": 0.7, "position": 1.9})
    assert data.state_dict() == {"seed": 0, "epoch": 0, "position": 0}


def test_bad_options_and_an_iterable_dataset_are_refused_when_built_and_namedtuples_collate():
    import collections

    xs = np.arange(6.0)
    for name, bad in (("shuffle", "no"), ("drop_last", "no")):
        with pytest.raises(TypeError, match=f"Batches: {name} must be True or False"):
            Batches(xs, batch_size=2, **{name: bad})
    with pytest.raises(TypeError, match="collate must be a function"):
        Batches(xs, batch_size=2, collate=5)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

        def __len__(self):
            return 3

        def __getitem__(self, i):  # an IterableDataset: not meant to be indexed
            raise NotImplementedError

    with pytest.raises(TypeError, match="Stream is an IterableDataset"):
        Batches(Stream(), batch_size=2)

    Pair = collections.namedtuple("Pair", "x y")
    batch = Batches([Pair(np.float32(i), i % 2) for i in range(4)], batch_size=4, shuffle=False).next_batch()
    assert type(batch) is Pair and batch.x.tolist() == [0, 1, 2, 3] and batch.y.tolist() == [0, 1, 0, 1]


def test_iterating_batches_gives_the_rest_of_the_epoch_and_pickles_with_its_place():
    import pickle

    import numpy as np

    data = Batches(np.arange(10), batch_size=4, seed=1)
    want = [data.indices(0, k) for k in range(3)]
    got = list(data)
    assert [b.tolist() for b in got] == [w.tolist() for w in want] and (data.epoch, data.position) == (1, 0)
    it = iter(data)  # epoch 1
    first = next(it)
    copy_it, copy_data = pickle.loads(pickle.dumps((it, data)))
    assert copy_it.batches is copy_data and copy_it.__length_hint__() == 2
    assert [b.tolist() for b in copy_it] == [b.tolist() for b in it]  # the same rest of epoch 1, then stops
    assert first.tolist() == data.indices(1, 0).tolist()
    assert list(it) == [] and (data.epoch, data.position) == (2, 0)
