"""The GPU cache's reproductions (issue 32, "Why"): each failed on the cache as it was
before the HierarchicalKV-shaped rewrite and passes now. They run on the CPU with the
PyTorch reference path (the Triton kernels are checked against it in test_gpu.py); those
that need CUDA skip without it."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import embank
import numpy as np
import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")
from embank import gpu  # noqa: E402
from embank.errors import EmbankError  # noqa: E402
from test_gpu import DIM, _cached, _table  # noqa: E402


class _Hooked:
    """Stands in for the cache's table: runs ``hook`` once, inside the next ``lookup``
    (the cache's unlocked fetch), after the rows were read: what a writer on another
    thread can do at that moment."""

    def __init__(self, table: embank.Table, hook: Callable[[], object]) -> None:
        self._t = table
        self._hook: Callable[[], object] | None = hook

    def lookup(self, keys: Any, *a: Any, **k: Any) -> Any:
        rows = self._t.lookup(keys, *a, **k)
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def test_refresh_never_writes_back_a_row_older_than_a_write(gpu_store: embank.Store) -> None:
    """Item 1: a key written, invalidated and inserted again (into the slot it left)
    during refresh's fetch got the fetched, older row back."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=8, slots=8, device="cpu", insert="sync", kernels="torch")
    cache.lookup(torch.tensor([7]))

    def write_and_read_again() -> None:
        t.push([7], np.full((1, DIM), 99.0, dtype=np.float32))
        assert cache.lookup(torch.tensor([7]))[0, 0].item() == 99.0

    cache.table = _Hooked(t, write_and_read_again)  # type: ignore[assignment]
    cache.refresh()
    cache.table = t
    got = cache.lookup(torch.tensor([7]))[0, 0].item()
    assert got == 99.0, f"after refresh the cache answers {got}, the table holds 99.0"
    cache.close()


def test_a_write_during_a_fetch_drops_only_the_inserts_of_its_bucket(gpu_store: embank.Store) -> None:
    """Item 2: one epoch per table: a write to any key during a miss fetch discarded the
    whole batch's inserts (200 misses, 0 inserted)."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=4096, device="cpu", insert="sync", kernels="torch")
    other = 7 * 250
    cache.table = _Hooked(t, lambda: t.push([other], np.ones((1, DIM), dtype=np.float32)))  # type: ignore[assignment]
    ids = torch.arange(200, dtype=torch.int64) * 7
    cache.lookup(ids)
    cache.table = t
    b, _ = cache._bucket_digest(ids)
    ob, _ = cache._bucket_digest(torch.tensor([other]))
    expected = int((b != ob).sum())
    held = cache.stats()["rows_cached"]
    assert held == expected >= 150, f"{held} of 200 misses inserted, {expected} expected"
    cache.close()


def test_lfu_counts_uses_and_refuses_a_key_scoring_below_its_bucket(gpu_store: embank.Store) -> None:
    """Item 4: inserts and updates set the score to the clock, so a key used 50 times was
    evicted before two keys used once."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=4, slots=4, device="cpu", insert="sync", kernels="torch", policy="lfu")
    for _ in range(50):
        cache.lookup(torch.tensor([7]))
    cache.lookup(torch.tensor([14, 21, 28]))  # the one bucket is full
    cache.lookup(torch.tensor([35, 42]))  # two new keys: they take slots of keys used once
    held = set(_cached(cache))
    assert 7 in held, f"the key used 50 times was evicted; cached: {sorted(held)}"
    assert held == {7, 28, 35, 42}, sorted(held)
    cache.lookup(torch.tensor([28, 35, 42]))  # every key used twice or more now
    cache.lookup(torch.tensor([49]))  # used once: below every slot of its full bucket
    assert set(_cached(cache)) == {7, 28, 35, 42}
    assert cache.stats()["insert_refused"] == 1
    cache.close()


@pytest.mark.parametrize("insert", ["sync", "async"])
def test_a_key_given_twice_is_inserted_with_the_larger_of_its_scores(
    gpu_store: embank.Store, insert: str
) -> None:
    """With custom scores, a new key given twice in one lookup took the score of whichever
    occurrence came first among the misses: batch order on the PyTorch path, the order
    the misses were compacted in on a GPU (no fixed order), so the compiled kernels
    cached other keys than the PyTorch path (seen on an H100). It takes the larger."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(
        t, rows_max=4, slots=4, device="cpu", insert=insert, kernels="torch", policy="custom"
    )
    cache.lookup(torch.tensor([7, 14, 21, 28]), torch.tensor([20, 20, 20, 20]))  # the one bucket is full
    cache.wait()
    assert set(_cached(cache)) == {7, 14, 21, 28}
    # 35's smaller score first, 42's larger first: both beat the bucket's lowest (20).
    cache.lookup(torch.tensor([35, 35, 42, 42]), torch.tensor([5, 50, 50, 5]))
    cache.wait()
    held = set(_cached(cache))
    assert {35, 42} <= held, f"a key given twice was scored by one occurrence; cached: {sorted(held)}"
    assert len(held) == 4 and cache.stats()["insert_refused"] == 0
    cache.close()


def test_ids_across_the_whole_u64_range(gpu_store: embank.Store) -> None:
    """Item 9: ids >= 2^63 were refused (embank keys are u64)."""
    t = gpu_store.create_table("u64", dim=DIM)
    keys = np.array([2**63 + 5, 2**64 - 3, 2**64 - 1, 11], dtype=np.uint64)  # 2^64 - 1 is reserved
    rows = np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM)
    t.push(keys, rows)
    cache = gpu.GpuCache(t, rows_max=64, slots=8, device="cpu", insert="sync", kernels="torch")
    for _ in range(2):
        out = cache.lookup(torch.from_numpy(keys.copy()).view(torch.uint64))
        np.testing.assert_array_equal(out.numpy(), rows)
    out = cache.lookup(torch.from_numpy(keys.view(np.int64).copy()))  # int64: the same bits
    np.testing.assert_array_equal(out.numpy(), rows)
    assert set(_cached(cache)) == {-(2**63) + 5, -3, 11}  # the reserved key is answered, not cached
    assert cache.invalidate(keys[:2]) == 2
    assert cache.invalidate(torch.from_numpy(keys[3:].copy())) == 1  # a tensor on the cache's device
    cache.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_invalidate_takes_tensors_on_the_cuda_device(gpu_store: embank.Store) -> None:
    """Item 9: ``invalidate`` failed on CUDA tensors (it went through numpy)."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=256, device="cuda", insert="sync")
    ids = torch.tensor([7, 14], device="cuda")
    cache.lookup(ids)
    assert cache.invalidate(ids) == 2
    cache.close()


def test_bf16_rows(gpu_store: embank.Store) -> None:
    """Item 9: no bf16 cache rows."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, device="cpu", insert="sync", dtype=torch.bfloat16, kernels="torch")
    ids = torch.tensor([7, 14, 21])
    want = torch.from_numpy(t.lookup([7, 14, 21])[0]).to(torch.bfloat16).float()
    cache.lookup(ids)
    assert torch.equal(cache.lookup(ids), want)
    assert cache.stats()["hits"] == 3 and cache.stats()["dtype"] == "bfloat16"
    cache.close()


def test_rows_max_is_a_bound(gpu_store: embank.Store) -> None:
    """Item 9: ``rows_max=500`` held 512 rows (rounded up to whole buckets)."""
    t = _table(gpu_store, n=2000)
    cache = gpu.GpuCache(t, rows_max=500, device="cpu", insert="sync", kernels="torch")
    assert cache.stats()["rows_max"] <= 500
    for i in range(0, 2000, 250):
        cache.lookup(torch.arange(i, i + 250, dtype=torch.int64) * 7)
    held = cache.stats()["rows_cached"]
    assert 0 < held <= 500, f"{held} rows cached with rows_max=500"
    cache.close()


def test_keys_fit_at_three_quarters_load(gpu_store: embank.Store) -> None:
    """Item 7: one bucket of 32 slots a key: 1 M keys in 1 M slots left 7 % unable to
    fit. With 128-slot buckets a cache three quarters full holds every key."""
    t = _table(gpu_store, n=6144)
    cache = gpu.GpuCache(t, rows_max=8192, device="cpu", insert="sync", kernels="torch")
    for i in range(0, 6144, 1024):
        cache.lookup(torch.arange(i, i + 1024, dtype=torch.int64) * 7)
    s = cache.stats()
    assert s["rows_cached"] == 6144 and s["evictions"] == 0, (s["rows_cached"], s["evictions"])
    cache.close()


def test_the_async_queue_is_bounded_and_deduplicated(gpu_store: embank.Store) -> None:
    """Item 8: the async queue was unbounded and kept every repeat of a key."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=256, device="cpu", insert="async", kernels="torch", queue_keys_max=10)
    release = threading.Event()
    cache.table = _Hooked(t, lambda: release.wait(30))  # type: ignore[assignment]
    cache.lookup(torch.tensor([0]))  # the inserter takes it and waits in the table
    for _ in range(50):
        if cache._queue.busy:
            break
        threading.Event().wait(0.05)
    ids = torch.arange(1, 16, dtype=torch.int64) * 7
    cache.lookup(ids)
    cache.lookup(ids)  # the same 15 keys again: 10 are waiting already, 5 dropped again
    s = cache.stats()
    assert len(cache._queue.pending) == 10 and s["async_dropped"] == 10, (len(cache._queue.pending), s)
    release.set()
    cache.wait()
    assert cache.stats()["async_inserts"] == 11
    cache.close()


def test_a_failed_background_insert_reaches_the_next_call(gpu_store: embank.Store) -> None:
    """Item 8: the inserter swallowed every exception (the cache stayed silently cold)."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=256, device="cpu", insert="async", kernels="torch")

    def fail() -> None:
        raise OSError("the table is gone")

    cache.table = _Hooked(t, fail)  # type: ignore[assignment]
    cache.lookup(torch.tensor([7, 14]))
    with pytest.raises(EmbankError, match="the table is gone"):
        cache.wait()
    assert cache.stats()["async_errors"] == 1
    cache.wait()  # raised once
    cache.close()


def test_a_dropped_cache_is_collected(gpu_store: embank.Store) -> None:
    """Item 8: the inserter thread held the cache (a bound method), forever."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=256, device="cpu", insert="async", kernels="torch", refresh_every=60.0)
    cache.lookup(torch.tensor([7, 14]))
    cache.wait()
    ref, inserter = weakref.ref(cache), cache._inserter
    del cache
    gc.collect()
    assert ref() is None, "a GpuCache nobody holds is kept alive"
    inserter.join(5)
    assert not inserter.is_alive()


def test_kernels_do_not_specialize_on_counters() -> None:
    """Item 6: ``clock`` and ``n_buckets`` were specialized: a recompile at lookups 1, 2,
    16, ... on a GPU."""
    pytest.importorskip("triton")
    from embank import _triton

    for kernel in (_triton._find, _triton._choose, _triton._write, _triton._invalidate):
        names = {p.name for p in kernel.params if p.do_not_specialize}
        counters = {"n", "n_buckets", "clock", "policy"} & {p.name for p in kernel.params}
        assert counters <= names, f"{kernel.fn.__name__} specializes {counters - names}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_warm_lookup_syncs_once_on_cuda(gpu_store: embank.Store) -> None:
    """Item 5: an all-hit lookup waited for the device 3 times, one with misses ~20. No
    tensor operation of a warm lookup waits (the one wait is on an event)."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=1024, device="cuda", insert="sync")
    ids = torch.arange(100, device="cuda") * 7
    cache.lookup(ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.lookup(ids)
        cache.lookup(torch.arange(100, 200, device="cuda") * 7)  # misses: still no tensor-op sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cache.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_lookups_on_a_side_stream_while_another_thread_writes(gpu_store: embank.Store, kernels: str) -> None:
    """Item 3: launches ran on the default stream whatever the caller's stream, so a
    lookup under ``torch.cuda.stream(s)`` could read a row being written."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=128, slots=32, device="cuda", insert="sync", kernels=kernels)
    stop = threading.Event()

    def writer() -> None:
        rng = np.random.default_rng(5)
        while not stop.is_set():
            k = (rng.integers(0, 300, 8) * 7).astype(np.uint64)
            t.push(k, rng.standard_normal((8, DIM)).astype(np.float32))

    th = threading.Thread(target=writer)
    th.start()
    s = torch.cuda.Stream()
    rng = np.random.default_rng(6)
    try:
        with torch.cuda.stream(s):
            for _ in range(200):
                cache.lookup(torch.as_tensor((rng.integers(0, 300, 64) * 7), device="cuda"))
    finally:
        stop.set()
        th.join()
    torch.cuda.synchronize()
    if kernels == "native":  # its rows are not exposed: every answer, hits included, is the table's
        keys = np.arange(300) * 7
        before = cache.stats()["hits"]
        out = cache.lookup(torch.as_tensor(keys, device="cuda")).cpu().numpy()
        assert cache.stats()["hits"] > before
        np.testing.assert_array_equal(out, t.lookup(keys.astype(np.uint64))[0])
    else:
        for k, row in _cached(cache).items():
            np.testing.assert_array_equal(row, t.lookup([k])[0][0], err_msg=f"cached key {k} is stale")
    cache.close()


def test_the_background_inserter_gathers_a_few_lookups_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H100 a warmed cache inserting in the background after every lookup (a dozen
    launches and ~1 ms of the interpreter each time) doubled the lookups' p50: the
    inserter now waits for more misses, up to a time or a count, before it takes them."""
    import time

    from embank import _gpu_insert as sup

    monkeypatch.setattr(sup, "ASYNC_GATHER_S", 0.5)
    monkeypatch.setattr(sup, "ASYNC_GATHER_KEYS", 4)
    q = sup._AsyncQueue(1 << 10)
    got: list[Any] = []
    q.put(np.array([1], dtype=np.int64), np.array([0], dtype=np.int64))
    taker = threading.Thread(target=lambda: got.append(q.take(1.0)))
    taker.start()
    time.sleep(0.1)  # a second lookup's misses, while the inserter waits for more
    q.put(np.array([2], dtype=np.int64), np.array([0], dtype=np.int64))
    taker.join()
    assert got[0] is not None and sorted(got[0][0].tolist()) == [1, 2], "took one lookup's misses alone"
    q.done(2, None)
    # Enough keys: taken at once, without the wait.
    q.put(np.arange(10, 14, dtype=np.int64), np.zeros(4, dtype=np.int64))
    t0 = time.monotonic()
    taken = q.take(1.0)
    assert taken is not None and len(taken[0]) == 4 and time.monotonic() - t0 < 0.3
    q.done(4, None)
    # Closing ends the wait.
    q.put(np.array([20], dtype=np.int64), np.array([0], dtype=np.int64))
    q.close()
    assert q.take(1.0) is not None and q.take(1.0) is None


def test_an_insert_of_more_keys_than_a_counting_chunk_counts_them_all(gpu_store: embank.Store) -> None:
    """Insert outcomes are counted in chunks of `ONES_CHUNK` keys (a buffer of ones
    allocated once): an insert of more keys than that counts every one."""
    n = gpu.ONES_CHUNK + 4000
    t = gpu_store.create_table("many", dim=2)
    t.push(np.arange(n, dtype=np.uint64), np.ones((n, 2), dtype=np.float32))
    cache = gpu.GpuCache(t, rows_max=2 * n, device="cpu", insert="sync", kernels="torch")
    cache.lookup(torch.arange(n))
    s = cache.stats()
    assert s["sync_inserts"] + s["insert_refused"] == n, s
    assert s["sync_inserts"] == s["rows_cached"] > gpu.ONES_CHUNK, s
    cache.close()
