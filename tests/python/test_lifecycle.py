"""Admission by access count and eviction by TTL and capacity, from Python (embedded and,
where the policy is per table rather than per shard, through two shards)."""

from __future__ import annotations

import embank
import numpy as np
import numpy.typing as npt
import pytest
from embank import errors

K = np.array


def keys(*k: int) -> npt.NDArray[np.uint64]:
    return K(k, dtype=np.uint64)


def test_rows_are_admitted_at_the_nth_sighting(store: embank.Store) -> None:
    t = store.create_table(
        "t", dim=2, init=embank.init.constant(0.5), optimizer=embank.optim.SGD(lr=1.0), admit_after=3
    )
    for _ in range(2):
        np.testing.assert_array_equal(t.pull(keys(7, 7, 8)), np.full((3, 2), 0.5, np.float32))
    assert len(t) == 0
    t.push_grad(keys(7), np.ones((1, 2), np.float32))  # not admitted: dropped
    life = t.stats()["lifecycle"]
    assert life["grads_dropped"] == 1 and life["admission_pending"] == 2
    t.pull(keys(7))  # third sighting of 7 (8 has two)
    assert len(t) == 1
    t.push_grad(keys(7), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(t.pull(keys(7)), [[-0.5, -0.5]])
    t.push(keys(9), np.zeros((1, 2), np.float32))  # an explicit write always creates
    assert len(t) == 2 and t.stats()["lifecycle"]["admitted"] == 1


@pytest.mark.local_only("rows_max and the TTL clock are per shard")
def test_a_full_table_evicts_the_least_recently_used(store: embank.Store) -> None:
    t = store.create_table("t", dim=1, rows_max=10)
    t.push(np.arange(10, dtype=np.uint64), np.arange(10, dtype=np.float32).reshape(10, 1))
    t.pull(np.arange(5, dtype=np.uint64))  # 0..4 used again; 5..9 not since the push
    t.push(keys(100, 101), np.ones((2, 1), np.float32))
    # 2 over: victims 5 and 6 (same last use: smaller key first)
    _, found = t.lookup(np.arange(10, dtype=np.uint64))
    assert found.tolist() == [True] * 5 + [False] * 2 + [True] * 3
    assert len(t) == 10 and t.stats()["lifecycle"]["evicted_capacity"] == 2


@pytest.mark.local_only("rows_max and the TTL clock are per shard")
def test_lfu_keeps_the_frequent_rows(store: embank.Store) -> None:
    t = store.create_table("t", dim=1, rows_max=4, evict="lfu")
    for _ in range(3):
        t.pull(keys(1, 2, 3))
    t.pull(keys(4))
    t.pull(keys(5))  # evicts 4: one touch, fewer than 1..3
    assert sorted(k for ks, _ in t.export() for k in ks.tolist()) == [1, 2, 3, 5]


@pytest.mark.local_only("rows_max and the TTL clock are per shard")
def test_the_old_name_max_rows_still_bounds_the_table(store: embank.Store) -> None:
    with pytest.warns(DeprecationWarning, match="max_rows= is deprecated: use rows_max="):
        t = store.create_table("t", dim=1, max_rows=4)
    for k in range(1, 6):
        t.pull(keys(k))
    assert len(t) == 4


@pytest.mark.local_only("rows_max and the TTL clock are per shard")
def test_rows_untouched_for_ttl_steps_are_evicted(store: embank.Store) -> None:
    t = store.create_table("t", dim=1, optimizer=embank.optim.SGD(lr=0.1), ttl_steps=2)
    t.pull(keys(1, 2))
    g = np.ones((1, 1), np.float32)
    t.push_grad(keys(1), g)
    assert t.evict_expired() == 0
    t.push_grad(keys(1), g)  # 2 untouched for two steps
    assert t.evict_expired() == 1
    assert [k for ks, _ in t.export() for k in ks.tolist()] == [1]
    life = t.stats()["lifecycle"]
    assert life["evicted_ttl"] == 1 and life["step"] == 2


def test_evict_expired_over_every_backend(store: embank.Store) -> None:
    t = store.create_table("t", dim=1, ttl_seconds=60.0)
    t.pull(keys(1, 2, 3))
    assert t.evict_expired() == 0 and len(t) == 3
    plain = store.create_table("plain", dim=1)
    assert plain.evict_expired() == 0 and plain.stats()["lifecycle"] is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"evict": "mru"}, "evict"),
        ({"ttl_steps": 0}, "ttl_steps"),
        ({"ttl_seconds": -1.0}, "ttl_seconds"),
        ({"rows_max": 0}, "rows_max"),
        ({"admit_after": -1}, "admit_after"),
    ],
)
def test_bad_options_name_the_option(store: embank.Store, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(errors.ConfigError, match=needle):
        store.create_table("t", dim=1, **kwargs)  # type: ignore[arg-type]
    assert "t" not in store.tables()
