"""Batches(workers=N): batches made ahead in worker processes, served in the order workers=0 serves,
resumed exactly with any number of workers; per-sample transforms; worker failures; no orphans."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from flowvm import CALL, REPEAT, SEQ, Batches, Registers
from flowvm.base.batching import sample_rng
from flowvm.base.workers import WorkerError
from flowvm.testing import same

X = np.arange(41 * 3, dtype=np.float64).reshape(41, 3)
FORK = "fork"  # the tests of order and resume fork, whatever threads earlier tests left running (fast starts)
Y = np.arange(41)


def jitter(sample, rng):
    x, y = sample
    return x + rng.standard_normal(x.shape), y


def served(data, n):
    return [data.next_batch() for _ in range(n)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(5, 41), batch_size=st.integers(1, 9), before=st.sampled_from([0, 1, 2, 3]),
       after=st.sampled_from([0, 1, 2]), prefetch=st.integers(1, 3),
       cuts=st.lists(st.integers(0, 12), min_size=1, max_size=3), drop_last=st.booleans(),
       world=st.sampled_from([1, 2, 3]))
def test_resume_with_any_workers_at_any_cut_serves_the_same_batches(n, batch_size, before, after, prefetch, cuts,
                                                                    drop_last, world):
    source = (X[:n], Y[:n])
    options = dict(batch_size=batch_size, seed=5, transform=jitter, drop_last=drop_last, rank=world - 1,
                   world_size=world)
    try:
        probe = Batches(source, **options)
    except ValueError:  # an epoch with no batch, or a last batch without a sample for each rank
        assume(False)
    total = 3 * len(probe) + 1  # over epoch ends
    straight = served(Batches(source, **options), total)
    data = Batches(source, workers=before, prefetch=prefetch, start_method=FORK, **options)
    got, taken = [], 0
    for cut in sorted(min(c, total) for c in cuts):
        got += served(data, cut - taken)
        taken = cut
        state = pickle.dumps(data)
        data.close()
        data = pickle.loads(state)
        data.workers = after  # the resumed run's choice: the next batch starts that many workers
    got += served(data, total - taken)
    data.next_batch()  # (one more: the last cut may be at the end)
    assert len(data.worker_pids) == data.workers and "_pool" in data.__dict__ if data.workers else \
        "_pool" not in data.__dict__
    data.close()
    assert same(got, straight)


def test_three_resumes_within_one_epoch_of_a_program():
    def build(workers):
        data = Batches((X, Y), batch_size=4, seed=2, transform=jitter, workers=workers, start_method=FORK)
        reg = Registers(total=0.0, data=data)
        body = SEQ([CALL(Batches.next_batch, reg("data"), store_to=reg("batch")),
                    CALL(lambda b, t: t + float(b[0].sum()), reg("batch"), reg("total"), store_to=reg("total"))])
        return REPEAT(2 * len(data), body)

    straight = build(0).start()
    straight.run()
    drv = build(2).start()
    for steps, workers in ((3, 1), (4, 0), (5, 3)):  # three cuts inside the first epoch (11 batches)
        drv.run(max_steps=steps)
        old, drv = drv, pickle.loads(pickle.dumps(drv))
        old.registers["data"].close()
        drv.registers["data"].workers = workers
    assert drv.registers["data"].epoch == 0
    drv.run()
    assert drv.registers["total"] == straight.registers["total"]
    drv.registers["data"].close()


def test_the_transform_gets_the_generator_of_seed_epoch_and_index_whichever_worker_runs_it():
    def draw(sample, rng):
        return np.array([sample, rng.integers(1 << 30)])

    data = Batches(np.arange(12), batch_size=5, seed=7, transform=draw, workers=3, prefetch=1, start_method=FORK)
    for epoch in range(2):
        for batch in served(data, len(data)):
            for index, value in batch:
                assert value == sample_rng(7, epoch, index).integers(1 << 30)
    data.close()


def test_workers_are_reused_across_epochs_and_stop_when_closed():
    data = Batches(X, batch_size=8, workers=2)
    pids = data.worker_pids
    assert len(pids) == 2 and not any(gone(p) for p in pids)
    served(data, 3 * len(data))
    assert data.worker_pids == pids and data.epoch == 3
    data.close()
    assert wait_gone(pids)
    ref = Batches(X, batch_size=8)
    ref.load_state_dict(data.state_dict())
    assert same(data.next_batch(), ref.next_batch())
    assert set(data.worker_pids).isdisjoint(pids)
    data.close()


class Raising:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 13:
            return 1 / 0
        return np.full(2, float(i))


def test_a_worker_raising_is_an_error_naming_the_sample_with_its_traceback():
    data = Batches(Raising(), batch_size=4, shuffle=False, workers=2)
    served(data, 3)
    with pytest.raises(WorkerError) as info:
        data.next_batch()
    text = str(info.value)
    assert "sample 13" in text and "ZeroDivisionError" in text and "__getitem__" in text and "samples [12, 13" in text
    assert (data.epoch, data.position) == (0, 3)  # left where it was
    with pytest.raises(WorkerError, match="sample 13"):
        data.next_batch()
    data.close()
    plain = Batches(Raising(), batch_size=4, shuffle=False)
    served(plain, 3)
    with pytest.raises(ZeroDivisionError) as info:
        plain.next_batch()
    assert "sample 13" in "".join(getattr(info.value, "__notes__", []))


class Slow:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        time.sleep(0.05)
        return np.full(2, float(i))


def test_a_worker_killed_is_an_error_not_a_hang_and_the_next_batch_starts_new_workers():
    data = Batches(Slow(), batch_size=3, seed=1, workers=1, prefetch=1)
    first = data.next_batch()
    pid = data.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        data.next_batch()
    assert time.monotonic() - start < 5
    assert f"pid {pid}" in str(info.value) and "SIGKILL" in str(info.value) and "samples [" in str(info.value)
    assert (data.epoch, data.position) == (0, 1)
    ref = Batches(Slow(), batch_size=3, seed=1)
    assert same([first, data.next_batch()], served(ref, 2))
    assert pid not in data.worker_pids
    data.close()


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np
    from flowvm import Batches
    if __name__ == "__main__":
        data = Batches(np.arange(100.0), batch_size=10, workers=2, start_method=sys.argv[1] or None)
        data.next_batch()
        print(" ".join(map(str, data.worker_pids)), flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_killing_the_parent_leaves_no_worker_behind(tmp_path, method):
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE, env=env, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_gone(pids), [psutil.Process(p).status() for p in pids if not gone(p)]
    finally:
        proc.kill()
        proc.wait()


def test_with_other_threads_running_the_workers_start_without_fork_and_in_the_background():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        start = time.monotonic()
        data = Batches((X, Y), batch_size=6, seed=3, transform=lambda s, rng: (s[0] * rng.random(), s[1]),
                       workers=2)
        assert time.monotonic() - start < 0.5  # does not wait for the processes
        assert data._pool.method in ("forkserver", "spawn")
        got = served(data, 9)
    finally:
        stop.set()
        thread.join()
    ref = Batches((X, Y), batch_size=6, seed=3, transform=lambda s, rng: (s[0] * rng.random(), s[1]))
    assert same(got, served(ref, 9))
    data.close()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_share_each_epoch_each_sample_once(world_size):
    ranks = [Batches(np.arange(23), batch_size=4, seed=9, rank=r, world_size=world_size) for r in range(world_size)]
    for epoch in range(2):
        seen = np.concatenate([np.concatenate(served(d, len(d))) for d in ranks])
        assert sorted(seen.tolist()) == list(range(23))
        assert all(d.epoch == epoch + 1 for d in ranks)
    again = Batches(np.arange(23), batch_size=4, seed=9, rank=world_size - 1, world_size=world_size, workers=2)
    assert same(served(again, 2 * len(again)), [ranks[-1].gather(ranks[-1].indices(e, p), e)
                                                 for e in range(2) for p in range(len(again))])
    again.close()
    assert len({tuple(d.order(0)) for d in ranks}) == world_size


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), batch_size=st.integers(1, 7), before=st.integers(1, 4), after=st.integers(1, 9),
       cut=st.integers(0, 30), drop_last=st.booleans())
def test_a_world_of_another_size_takes_the_rest_of_each_global_batch_once_in_as_many_batches(
        n, batch_size, before, after, cut, drop_last):
    """What a resume on another number of ranks does (flowvm/distributed/coordinated.py reshard): the ranks'
    Batches at one position, given the new rank and world size, the global batch kept."""
    try:
        old = [Batches(np.arange(n), batch_size=batch_size, seed=2, drop_last=drop_last, rank=r, world_size=before)
               for r in range(before)]
    except ValueError:
        assume(False)
    per_epoch = len(old[0])
    assert all(len(d) == per_epoch for d in old)
    cut = cut % (per_epoch + 1)
    taken = [i for d in old for _ in range(cut) for i in d.next_batch().tolist()]
    new = []
    for r in range(after):
        d = pickle.loads(pickle.dumps(old[0]))
        d.rank, d.world_size = r, after
        new.append(d)
    empty = [r for r, d in enumerate(new) if any(len(d.indices(0, k)) == 0 for k in range(per_epoch))]
    try:
        new[0].check_shards()
    except ValueError as err:  # refused: exactly when a rank would take an empty batch, naming the first
        assert empty and f"so rank {empty[0]} and above would take an empty batch" in str(err)
        assert empty == list(range(empty[0], after))
        return
    assert not empty
    assert all(len(d) == per_epoch for d in new)  # loops counted by len() keep their counts
    rest = [i for d in new for _ in range(per_epoch - cut) for i in d.next_batch().tolist()]
    kept = per_epoch * old[0].global_batch if drop_last else n
    assert len(taken) + len(rest) == kept and len(set(taken + rest)) == kept  # each sample once
    assert all(d.epoch == 1 and d.position == 0 for d in new)


def test_bad_rank_and_worker_options_are_named():
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        Batches(X, rank=2, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size"):
        Batches(X, rank=0)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        Batches(X, workers=-1)
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        Batches(X, prefetch=0)
    with pytest.raises(TypeError, match="transform must be a function"):
        Batches(X, transform=3)
    with pytest.raises(ValueError, match="start_method 'nope'"):
        Batches(X, workers=1, start_method="nope")
    with pytest.raises(ValueError, match="batch_size=3 for each of 3 ranks but only 7 samples"):
        Batches(np.arange(7), rank=2, world_size=3, batch_size=3, drop_last=True)
    with pytest.raises(ValueError, match=r"the last batch of all 3 ranks together holds 1 sample \(7 samples in "
                                         r"global batches of 6\), so rank 1 and above would take an empty batch"):
        Batches(np.arange(7), rank=0, world_size=3, batch_size=2)


def test_load_state_dict_with_batches_in_flight_serves_the_batch_of_that_state():
    data = Batches((X, Y), batch_size=5, seed=4, transform=jitter, workers=2, prefetch=3, start_method=FORK)
    ref = Batches((X, Y), batch_size=5, seed=4, transform=jitter)
    served(data, 3)
    for state in ({"seed": 4, "epoch": 0, "position": 1}, {"seed": 6, "epoch": 2, "position": 7},
                  {"seed": 4, "epoch": 0, "position": 8}):
        data.load_state_dict(state)
        ref.load_state_dict(state)
        assert same(served(data, 4), served(ref, 4))
    data.close()


def test_a_forked_copy_of_the_process_starts_workers_of_its_own():
    data = Batches(X, batch_size=4, seed=1, workers=2)
    want = served(Batches(X, batch_size=4, seed=1), 3)
    assert same(data.next_batch(), want[0])
    parents = set(data.worker_pids)
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers are not its own
        ok = same(data.next_batch(), want[1]) and not parents & set(data.worker_pids)
        data.close()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert same(served(data, 2), want[1:]) and set(data.worker_pids) == parents
    data.close()


def test_a_torch_dataset_in_workers_gives_the_tensors_workers_0_gives():
    import torch

    ds = torch.utils.data.TensorDataset(torch.randn(30, 3, generator=torch.Generator().manual_seed(0)),
                                        torch.arange(30))
    data = Batches(ds, batch_size=7, seed=2, workers=2, start_method=FORK)
    got = served(data, 9)
    data.close()
    assert all(isinstance(b[0], torch.Tensor) for b in got)
    assert same(got, served(Batches(ds, batch_size=7, seed=2), 9))
