"""flowvm.load_data: the user's data in every form the programs take, refused with the file, row or column at
fault, and a memory-mapped .npy that a checkpoint references instead of copying."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import flowvm
from flowvm import DataError, load_data


def test_arrays_tensors_pairs_and_datasets_become_float_rows_and_integer_labels():
    x = np.arange(12).reshape(6, 2)
    y = np.array([0, 1, 2, 0, 1, 2])
    for given in (x, torch.tensor(x), x.tolist()):
        d = load_data(given)
        assert d.x.dtype == np.float64 and d.x.shape == (6, 2) and d.y is None
    d = load_data((torch.tensor(x), torch.tensor(y)))
    assert np.array_equal(d.x, x) and np.array_equal(d.y, y) and d.classes == 3
    dataset = torch.utils.data.TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))
    d = load_data(dataset)
    assert np.array_equal(d.x, x) and np.array_equal(d.y, y)
    images = np.zeros((5, 3, 4))
    assert load_data(images).x.shape == (5, 12)  # one flat row per sample
    train, held = load_data((x, y)).split(0.5, seed=1)
    assert len(train) == 3 and len(held) == 3 and sorted(np.r_[train.x[:, 0], held.x[:, 0]]) == list(x[:, 0])


def test_files_npy_npz_and_csv_with_a_header_and_a_label_column(tmp_path):
    x = np.random.default_rng(0).standard_normal((7, 3))
    y = np.array([0, 1, 1, 0, 2, 2, 1])
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    rows = "\n".join(",".join(f"{v!r}" for v in r) + f",{c}" for r, c in zip(x.tolist(), y))
    (tmp_path / "plain.csv").write_text(rows + "\n")
    (tmp_path / "named.csv").write_text("a,b,c,kind\n" + rows + "\n")
    assert np.array_equal(load_data(tmp_path / "x.npy").x, x)
    d = load_data(tmp_path / "xy.npz")
    assert np.array_equal(d.x, x) and np.array_equal(d.y, y)
    d = load_data(tmp_path / "plain.csv", supervised=True)  # the last column by default
    assert np.array_equal(d.x, x) and np.array_equal(d.y, y)
    d = load_data(str(tmp_path / "named.csv"), label="kind")
    assert np.array_equal(d.x, x) and np.array_equal(d.y, y)
    assert load_data(tmp_path / "named.csv").x.shape == (7, 4)  # unsupervised: every column is data


@pytest.mark.parametrize("text, words", [
    ("1,2\n3,nan\n", "row 2, column 2 holds nan"),
    ("1,2\n3,inf\n", "row 2, column 2 holds inf"),
    ("1,2\n3,4,5\n", "line 2 has 3 values, the first row 2"),
    ("a,b\n1,2\n3,x\n", "line 3, column 2 ('b') holds 'x', not a number"),
])
def test_bad_csv_files_name_the_row_and_column(tmp_path, text, words):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(DataError, match="bad.csv") as info:
        load_data(tmp_path / "bad.csv")
    assert words in str(info.value)


def test_bad_labels_and_arrays_are_refused_before_any_run():
    x = np.ones((4, 2))
    with pytest.raises(DataError, match=r"label of row 2 is 0.5, not an integer class"):
        load_data((x, np.array([0, 0.5, 1, 1])))
    with pytest.raises(DataError, match="class 1 has no sample"):
        load_data((x, np.array([0, 2, 2, 0])))
    with pytest.raises(DataError, match="label of row 3 is -1"):
        load_data((x, np.array([0, 1, -1, 0])))
    with pytest.raises(DataError, match=r"row 4, column 1 holds nan"):
        load_data(np.array([[1.0, 2], [1, 2], [1, 2], [np.nan, 2]]))
    with pytest.raises(DataError, match="rows of different lengths"):
        load_data([[1, 2], [3]])
    with pytest.raises(DataError, match="no such file"):
        load_data("/nonexistent/data.csv")
    with pytest.raises(DataError, match="needs labels"):
        load_data(x, supervised=True)


def test_a_memory_mapped_npy_pickles_as_a_checked_reference_to_its_file(tmp_path):
    big = np.random.default_rng(1).standard_normal((20000, 50))  # 8 MB
    path = tmp_path / "big.npy"
    np.save(path, big)
    d = load_data(path)
    assert isinstance(d.x, np.memmap) and np.array_equal(d.x, big)
    blob = pickle.dumps(d.x)
    assert len(blob) < 2000  # a reference, not the data
    again = pickle.loads(blob)
    assert np.array_equal(again, big)
    assert len(pickle.dumps(d.x[:10])) > 10 * 50 * 8  # a slice is its own data
    # through a checkpoint too, and a changed file is refused when the run is loaded
    reg = flowvm.Registers(x=d.x, total=0.0)
    drv = flowvm.CALL(np.sum, reg("x"), store_to=reg("total")).start()
    flowvm.save(drv, tmp_path / "run.ckpt")
    assert (tmp_path / "run.ckpt").stat().st_size < 100_000
    assert flowvm.load(tmp_path / "run.ckpt").run() == pytest.approx(big.sum())
    changed = big.copy()
    changed[-1, -1] += 1
    np.save(path, changed)
    with pytest.raises(flowvm.CheckpointError, match="the data file changed since the run was saved"):
        flowvm.load(tmp_path / "run.ckpt")


# ------------------------------------------------------------------ files from anyone
def test_pickled_data_files_are_data_errors_that_do_not_suggest_unpickling(tmp_path):
    npy = tmp_path / "objects.npy"
    np.save(npy, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    npz = tmp_path / "objects.npz"
    np.savez(npz, x=np.array([[1.0, 2.0]]), y=np.array([object()], dtype=object))
    for path in (npy, npz):
        with pytest.raises(DataError, match="holds Python objects") as err:
            load_data(path)
        assert "allow_pickle" not in str(err.value) and str(path) in str(err.value)


def test_a_csv_of_nul_bytes_is_a_data_error_in_bounded_memory(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bounded import bounded

    path = tmp_path / "nul.csv"
    with open(path, "wb") as f:
        f.truncate(256 << 20)  # 256 MiB of NUL bytes, no line break
    got = bounded(lambda: load_data(path), extra_mb=128)
    assert got[:2] == ("raised", "DataError") and str(path) in got[2], got
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"1,2\n\xff\xfe,3\n")
    with pytest.raises(DataError, match="not a UTF-8 text file"):
        load_data(binary)
