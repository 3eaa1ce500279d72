"""Bounded staleness from Python, embedded and through two shards: concurrent
workers never see a row more than `bound` updates behind; timeouts name the key;
release frees a worker's holds."""

from __future__ import annotations

import collections
import threading

import embank
import numpy as np
import pytest
from embank import errors


@pytest.mark.parametrize("bound", [0, 2])
def test_concurrent_workers_respect_the_bound(store: embank.Store, bound: int) -> None:
    # SGD, lr 1, gradient -1: every update adds exactly 1 to the row.
    t = store.create_table("t", dim=1, optimizer=embank.optim.SGD(lr=1.0), staleness_bound=bound)
    assert t.staleness_bound == bound
    seen: list[tuple[int, float]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            with t.worker(timeout=20) as w:
                for _ in range(40):
                    keys = rng.choice(5, size=rng.integers(1, 4), replace=False).astype(np.uint64)
                    rows = w.pull(keys)
                    with lock:
                        seen.extend(zip(keys.tolist(), rows[:, 0].tolist()))
                    w.push_grad(keys, np.full((len(keys), 1), -1.0, dtype=np.float32))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures
    counts = collections.Counter(seen)
    assert max(counts.values()) <= bound + 1, counts.most_common(3)
    final = t.pull(np.arange(5, dtype=np.uint64))[:, 0]
    for k in range(5):
        assert final[k] == sum(1 for key, _ in seen if key == k)
    assert t.stats()["holds_outstanding"] == 0


def test_timeout_names_the_key_and_release_frees(store: embank.Store) -> None:
    t = store.create_table("t", dim=2, optimizer=embank.optim.SGD(lr=0.1), staleness_bound=0)
    a, b = t.worker(), t.worker(timeout=0.05)
    a.pull([7, 8])
    with pytest.raises(errors.EmbankTimeoutError, match="key 8"):
        b.pull([8])
    with pytest.raises(TimeoutError):
        b.pull([7])
    assert a.release() == 2
    b.pull([7, 8])
    b.push_grad([7, 8], np.ones((2, 2), dtype=np.float32))
    assert t.stats()["holds_outstanding"] == 0
    asp = store.create_table("asp", dim=2, optimizer=embank.optim.SGD(lr=0.1))
    w = asp.worker(timeout=0)
    for _ in range(10):
        w.pull([1])  # ASP: never waits
    with pytest.raises(errors.ConfigError):
        store.create_table("bad", dim=2, staleness_bound=-1)
