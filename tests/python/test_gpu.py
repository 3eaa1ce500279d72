"""The GPU cache (`embank.gpu`): its PyTorch path against a model of what it must hold,
its Triton kernels (through Triton's interpreter on the CPU) against the PyTorch path,
and, where CUDA exists, on the device."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import embank
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from embank import gpu  # noqa: E402
from embank import torch as et  # noqa: E402
from embank.errors import InvalidInputError  # noqa: E402

DIM = 8


_names = itertools.count()


def _table(store: embank.Store, n: int = 300) -> embank.Table:
    t = store.create_table(f"t{next(_names)}", dim=DIM)
    keys = np.arange(n, dtype=np.uint64) * 7
    t.push(keys, np.random.default_rng(0).standard_normal((n, DIM)).astype(np.float32))
    return t


def _cached(cache: gpu.GpuCache) -> dict[int, Any]:
    k = cache.keys.reshape(-1)
    at = ((k != gpu.EMPTY) & (k != gpu.LOCKED)).nonzero().squeeze(1)
    return {int(x): cache.values[i].float().cpu().numpy() for x, i in zip(k[at].tolist(), at.tolist())}


def _run_model(cache: gpu.GpuCache, t: embank.Table, seed: int, steps: int) -> None:
    """Random lookups, writes through the table (invalidating), writes the cache is not
    told of then a refresh, and invalidations, checked at every step against the table
    (the model): every answer is the table's row, every cached row is the table's row,
    never more than ``rows_max`` rows."""
    rng = np.random.default_rng(seed)
    truth = {int(k): r for ks, rs in t.export() for k, r in zip(ks.tolist(), rs)}
    rows_max = cache.stats()["rows_max"]
    for step in range(steps):
        op = rng.integers(0, 10)
        if op < 6:  # a lookup: ids drawn Zipf-like, some the table lacks
            ids = (rng.zipf(1.3, 40) % 330) * 7
            scores = torch.as_tensor(rng.integers(0, 100, 40)) if cache.policy == "custom" else None
            if scores is not None:
                scores = scores.to(cache.device)
            out = (
                cache.lookup(torch.as_tensor(ids, dtype=torch.int64, device=cache.device), scores)
                .cpu()
                .numpy()
            )
            for i, k in enumerate(ids.tolist()):
                want = truth.get(k, np.zeros(DIM, np.float32))
                np.testing.assert_array_equal(out[i], want, err_msg=f"seed {seed} step {step} key {k}")
        elif op < 8:  # a write through the table (invalidates)
            ks = (rng.integers(0, 330, 5) * 7).astype(np.uint64)
            rows = rng.standard_normal((5, DIM)).astype(np.float32)
            t.push(ks, rows)
            truth.update({int(k): r for k, r in zip(ks.tolist(), rows)})
        elif op < 9:  # a write the cache is not told of (another process), then a refresh
            ks = (rng.integers(0, 330, 5) * 7).astype(np.uint64)
            rows = rng.standard_normal((5, DIM)).astype(np.float32)
            t._t.push(ks, rows)
            truth.update({int(k): r for k, r in zip(ks.tolist(), rows)})
            before = cache.stats()["rows_cached"]
            assert cache.refresh(batch=16)["rows"] == before
        else:
            ks = (rng.integers(0, 330, 4) * 7).astype(np.uint64)
            cache.invalidate(ks)
            held = _cached(cache)
            assert not any(int(k) in held for k in ks)
        held = _cached(cache)
        assert len(held) <= rows_max
        for k, row in held.items():  # every cached row is the table's row
            np.testing.assert_array_equal(
                row, truth[k], err_msg=f"seed {seed} step {step}: cached key {k} is stale"
            )


def test_an_insert_s_ranks_from_the_host_are_the_device_s(gpu_store: embank.Store) -> None:
    """The sync and background inserts rank their keys within their buckets on the host,
    where the keys are: the same ranks the device computes when every key is absent, so
    the same slots are taken (many keys a bucket: 8 buckets)."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, slots=8, device="cpu", insert="sync", kernels="torch")
    rng = np.random.default_rng(9)
    for n in (0, 1, 5, 300):
        keys = rng.permutation(np.unique(rng.integers(0, 10**12, n)).astype(np.int64))
        ids = torch.from_numpy(keys)
        _, present, _ = cache._find(ids, ids, touch=False, gather=False)
        assert (present < 0).all()
        host = cache._host_rank(keys)
        # What the insert computed on the device before: a stable sort of the buckets.
        kb = torch.where(present >= 0, cache.n_buckets, -1 - present)
        sorted_b, order = torch.sort(kb, stable=True)
        first = torch.searchsorted(sorted_b, sorted_b)
        device = torch.empty_like(order).scatter_(0, order, torch.arange(len(kb)) - first)
        assert np.array_equal(host, device.numpy()), n
        if n:  # each bucket's ranks are 0..k-1 in the keys' order
            b = (gpu.key_hash(keys) & 0x7FFFFFFFFFFFFFFF) % cache.n_buckets
            for bucket in np.unique(b):
                assert host[b == bucket].tolist() == list(range(int((b == bucket).sum())))
    cache.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_reference_path_against_a_model(gpu_store: embank.Store, policy: str) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, slots=8, device="cpu", insert="sync", kernels="torch", policy=policy)
    _run_model(cache, t, seed=1, steps=300)
    s = cache.stats()
    assert s["hits"] > 0 and s["misses"] > 0 and s["evictions"] > 0 and s["sync_inserts"] > 0
    assert 0 < s["hit_rate"] < 1 and s["refreshes"] > 0 and s["invalidated"] > 0
    cache.close()


def test_concurrent_lookups_and_writers_against_a_model(gpu_store: embank.Store) -> None:
    """Two threads looking up (as two streams would) while a third writes through the
    table: every answer is a row the key held at some time, and once they stop every
    cached row is the table's row."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, slots=8, device="cpu", insert="sync", kernels="torch")
    history: dict[int, list[Any]] = {k * 7: [np.zeros(DIM, np.float32)] for k in range(330)}  # missing: zeros
    for ks, rs in t.export():
        for k, r in zip(ks.tolist(), rs):
            history[int(k)] = [r]
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []

    def writer() -> None:
        rng = np.random.default_rng(11)
        while not stop.is_set():
            ks = (rng.integers(0, 330, 4) * 7).astype(np.uint64)
            rows = rng.standard_normal((4, DIM)).astype(np.float32)
            with lock:
                for k, r in zip(ks.tolist(), rows):
                    history.setdefault(int(k), []).append(r)
            t.push(ks, rows)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for step in range(150):
            ids = (rng.zipf(1.3, 32) % 330) * 7
            out = cache.lookup(torch.as_tensor(ids, dtype=torch.int64)).numpy()
            with lock:
                for i, k in enumerate(ids.tolist()):
                    if not any(np.array_equal(out[i], r) for r in history[k]):
                        errors.append(f"reader {seed} step {step}: key {k} answered a row it never held")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in (2, 3)]
    for th in threads:
        th.start()
    for th in threads[1:]:
        th.join()
    stop.set()
    threads[0].join()
    assert not errors, errors[:5]
    for k, row in _cached(cache).items():
        np.testing.assert_array_equal(row, t.lookup([k])[0][0], err_msg=f"cached key {k} is stale")
    cache.close()


@pytest.mark.parametrize("insert", ["sync", "async"])
def test_a_lookup_missing_more_ids_than_it_copies_with_the_count(
    gpu_store: embank.Store, insert: str
) -> None:
    """A lookup copies the miss count and at most twice the previous lookup's misses (at
    least 1,024) in one copy; more misses take a second copy, scores included."""
    t = _table(gpu_store, n=3000)
    cache = gpu.GpuCache(t, rows_max=4096, device="cpu", insert=insert, kernels="torch", policy="custom")
    ids = torch.arange(3000, dtype=torch.int64) * 7
    scores = torch.arange(3000, dtype=torch.int64) + 1
    out = cache.lookup(ids, scores)
    if insert == "sync":
        np.testing.assert_array_equal(out.numpy(), t.lookup(ids.numpy().astype(np.uint64))[0])
    cache.wait()
    assert cache.stats()["rows_cached"] > 2900
    held = cache.scores.view(-1)[(cache.keys.view(-1) >= 0)]
    assert int(held.min()) >= 1  # every key inserted with its score, the later ones too
    np.testing.assert_array_equal(
        cache.lookup(ids, scores).numpy(), t.lookup(ids.numpy().astype(np.uint64))[0][:, :]
    )
    cache.close()


def test_launches_from_two_streams_wait_for_the_cache_s_previous_launch(
    gpu_store: embank.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two CUDA streams simulated (fake streams and events, no CUDA): two threads, each
    on its own current stream, launch through the cache; every launch waits on the
    event recorded after the cache's previous launch, whichever stream recorded it, and
    records its own on its own stream: the device runs them in the order they were made."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, slots=8, device="cpu", insert="sync", kernels="torch")
    log: list[tuple[str, str, int]] = []
    events = itertools.count(1)

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name, self.stream_id = name, hash(name)

        def wait_event(self, e: Any) -> None:
            log.append(("wait", self.name, e.id))

    class FakeEvent:
        def __init__(self) -> None:
            self.id = next(events)

        def record(self, stream: FakeStream) -> None:
            log.append(("record", stream.name, self.id))

    local = threading.local()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: local.stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(cache, "_side", FakeStream("side"))  # the CUDA branch of the ordering

    def launches(name: str) -> None:
        local.stream = FakeStream(name)
        for _ in range(50):
            with cache._ordered():
                log.append(("launch", name, 0))

    threads = [threading.Thread(target=launches, args=(n,)) for n in ("s1", "s2")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    monkeypatch.undo()
    last = None
    i = 0
    while i < len(log):
        if last is not None:
            kind, _, event = log[i]
            assert (kind, event) == ("wait", last), f"entry {i}: {log[i]}, expected a wait on event {last}"
            i += 1
        (k1, s1, _), (k2, s2, event) = log[i], log[i + 1]
        assert k1 == "launch" and k2 == "record" and s1 == s2, (i, log[i : i + 2])
        if last is not None:
            assert log[i - 1][1] == s1, f"entry {i}: the wait is not on the launching stream"
        last, i = event, i + 2
    assert {entry[1] for entry in log} == {"s1", "s2"}
    cache.close()


def test_lru_keeps_the_recent_rows(gpu_store: embank.Store) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=8, slots=8, device="cpu", insert="sync", kernels="torch")
    cache.lookup(torch.tensor([0, 7, 14, 21, 28, 35, 42, 49]))  # fills the one bucket
    cache.lookup(torch.tensor([0, 7]))  # used again
    cache.lookup(torch.tensor([56, 63]))  # two new: evict two of the oldest, not 0 or 7
    held = set(_cached(cache))
    assert {0, 7, 56, 63} <= held and len(held) == 8
    cache.close()


def test_async_answers_the_default_then_inserts(gpu_store: embank.Store) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, device="cpu", insert="async", default=-1.0)
    out = cache.lookup(torch.tensor([7, 14]))
    assert (out == -1.0).all()
    cache.wait()
    out = cache.lookup(torch.tensor([7, 14]))
    np.testing.assert_array_equal(out.numpy(), t.lookup([7, 14])[0])
    s = cache.stats()
    assert s["default_answers"] == 2 and s["async_inserts"] == 2 and s["hits"] == 2
    # auto: sync while cold, async once the window's hit rate reaches the threshold
    auto = gpu.GpuCache(t, rows_max=64, device="cpu", insert="auto", hit_rate_threshold=0.5, window=2)
    first = auto.lookup(torch.tensor([21]))
    np.testing.assert_array_equal(first.numpy(), t.lookup([21])[0])  # sync: the real row
    auto.lookup(torch.tensor([21]))
    auto.lookup(torch.tensor([21]))  # window hit rate 1.0 now
    assert (auto.lookup(torch.tensor([28])) == 0).all()  # async: the default
    auto.close()
    cache.close()


def test_modules_use_the_cache_in_eval_mode_only(gpu_store: embank.Store) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=128, device="cpu", insert="sync")
    bag, plain = et.EmbeddingBag(cache, mode="sum"), et.EmbeddingBag(t, mode="sum")
    ids, offsets = torch.tensor([7, 14, 14, 21]), torch.tensor([0, 2])
    bag.eval()
    with torch.no_grad():
        np.testing.assert_allclose(bag(ids, offsets).numpy(), plain(ids, offsets).numpy(), rtol=1e-6)
    bag.train()
    with pytest.raises(InvalidInputError, match="eval mode"):
        bag(ids, offsets)
    with pytest.raises(InvalidInputError, match="GpuCache"):
        et.EmbeddingBag(cache, pooled=True)
    with pytest.raises(InvalidInputError, match="power of two"):
        gpu.GpuCache(t, rows_max=8, slots=6)
    cache.close()


_KERNELS_SCRIPT = r"""
import numpy as np, torch, embank
from embank import gpu
store = embank.open(__import__("sys").argv[1])
t = store.create_table("t", dim=5)
keys = np.arange(200, dtype=np.uint64) * 3
t.push(keys, np.random.default_rng(0).standard_normal((200, 5)).astype(np.float32))
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for policy in ("lru", "lfu", "custom"):
        caches = [gpu.GpuCache(t, rows_max=32, slots=8, device="cpu", insert="sync", kernels=k,
                               dtype=dtype, policy=policy) for k in ("torch", "triton")]
        rng = np.random.default_rng(2)
        for step in range(12):
            ids = torch.as_tensor((rng.zipf(1.2, 30) % 220) * 3, dtype=torch.int64)
            scores = torch.as_tensor(rng.integers(0, 50, 30))
            outs = [c.lookup(ids, scores) for c in caches]
            assert torch.equal(outs[0], outs[1]), (step, "lookup")
            want = torch.from_numpy(t.lookup(ids.numpy().astype(np.uint64))[0])
            tol = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]  # hits are rounded
            assert torch.allclose(outs[0], want, rtol=tol, atol=tol), (step, "the table's rows", dtype)
            if step % 5 == 3:
                for c in caches:
                    assert c.invalidate(ids[:3].numpy()) >= 0
            if step % 5 == 4:
                t._t.push(ids[:2].numpy().astype(np.uint64), np.full((2, 5), float(step), np.float32))
                assert caches[0].refresh(batch=8)["changed"] == caches[1].refresh(batch=8)["changed"]
            a, b = caches
            for name in ("keys", "digests", "scores", "values", "versions"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (step, name, dtype, policy)
        # find's slots: the same on both paths; an absent key's is -1 - its bucket (an
        # insert takes the bucket from there), a present key's lies in its bucket.
        probe = torch.arange(0, 700, dtype=torch.int64)
        found = [c._find(probe, probe, touch=False, gather=False)[1] for c in caches]
        assert torch.equal(found[0], found[1]), "find's slots"
        home, _ = caches[0]._bucket_digest(probe)
        absent = found[0] < 0
        assert absent.any() and (~absent).any()
        assert torch.equal(found[0][absent], -1 - home[absent]), "an absent key's bucket"
        assert torch.equal(found[0][~absent] // caches[0].slots, home[~absent]), "a present key's bucket"
        sa, sb = (c.stats() for c in caches)
        for k in ("evictions", "hits", "sync_inserts", "insert_refused", "invalidated", "refresh_changed"):
            assert sa[k] == sb[k], (k, sa[k], sb[k], dtype, policy)
        assert sa["evictions"] > 0
        for c in caches:
            c.close()
# Concurrent writers: lookups while another thread writes through the table (each write
# launches the invalidation kernel); once it stops, every cached row is the table's.
import threading
c = gpu.GpuCache(t, rows_max=32, slots=8, device="cpu", insert="sync", kernels="triton")
stop = threading.Event()
def writer():
    rng = np.random.default_rng(9)
    while not stop.wait(0.01):
        ks = (rng.integers(0, 220, 3) * 3).astype(np.uint64)
        t.push(ks, rng.standard_normal((3, 5)).astype(np.float32))
th = threading.Thread(target=writer)
th.start()
rng = np.random.default_rng(4)
for step in range(20):
    c.lookup(torch.as_tensor((rng.zipf(1.2, 30) % 220) * 3, dtype=torch.int64))
stop.set()
th.join()
k = c.keys.view(-1)
at = (k >= 0).nonzero().squeeze(1)
assert len(at) > 0
for key, i in zip(k[at].tolist(), at.tolist()):
    assert torch.equal(c.values[i], torch.from_numpy(t.lookup([key])[0][0])), ("stale", key)
assert c.stats()["invalidated"] > 0
c.close()
print("kernels agree")
"""


def _run_script(script: str, store: Path, device: str = "cpu") -> str:
    """Runs ``script`` (given a store path and a device) in a fresh Python; its stdout. On
    the CPU with Triton's interpreter on; on ``cuda`` with it off: compiled kernels."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    if device != "cpu":
        env.pop("TRITON_INTERPRET")
    args = [sys.executable, "-c", script, str(store), device]
    r = subprocess.run(args, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_triton_kernels_match_the_reference_in_the_interpreter(tmp_path: Path) -> None:
    assert "kernels agree" in _run_script(_KERNELS_SCRIPT, tmp_path / "s")


_STORED_SCRIPT = r"""
import sys
import embank, numpy as np, torch
from embank import gpu, _gpu_transfer, _triton
store = embank.open(sys.argv[1])
dev = sys.argv[2] if len(sys.argv) > 2 else "cpu"
rng = np.random.default_rng(5)
# The decoders: Triton (interpreted) and PyTorch, bit for bit the store's decode.
for dim in (1, 3, 24, 128):
    t = store.create_table(f"d{dim}", dim=dim, dtype="int8")
    keys = np.arange(300, dtype=np.uint64)
    rows = (rng.standard_normal((300, dim)) * rng.uniform(0.01, 100, (300, 1))).astype(np.float32)
    rows[7] = 2.5  # a constant row: scale 0
    t.push(keys, rows)
    stored, found = t.lookup_stored(np.concatenate([keys, [10**6]]).astype(np.uint64))
    want, _ = t.lookup(np.concatenate([keys, [10**6]]).astype(np.uint64))
    assert found[:-1].all() and not found[-1]
    for kernels in ("triton", "torch"):
        got = _gpu_transfer.decode_rows(torch.from_numpy(stored.reshape(-1)).to(dev), "int8", dim, kernels)
        assert got.device.type == dev and torch.equal(got.cpu(), torch.from_numpy(want)), (dim, kernels)
    assert np.array_equal(embank.decode_rows(stored, "int8", dim), want), dim
# The cache on compact tables: misses fetched as stored and decoded on the device; every
# answer and every cached row is exactly the table's (float32 cache rows), with both
# kernel sets; a refresh moves the stored bytes, not float32 rows.
for dtype in ("f16", "int8"):
    t = store.create_table(f"c_{dtype}", dim=24, dtype=dtype)
    keys = np.arange(400, dtype=np.uint64) * 3
    t.push(keys, rng.standard_normal((400, 24)).astype(np.float32))
    moved = {}
    for kernels in ("triton", "torch"):
        for stored_rows in (True, False):
            c = gpu.GpuCache(t, rows_max=64, slots=8, device=dev, insert="sync", kernels=kernels,
                             stored_rows=stored_rows)
            for step in range(12):
                ids = torch.as_tensor((rng.zipf(1.2, 40) % 450) * 3, dtype=torch.int64)
                out = c.lookup(ids.to(dev)).cpu()
                want = torch.from_numpy(t.lookup(ids.numpy().astype(np.uint64))[0])
                assert torch.equal(out, want), (dtype, kernels, stored_rows, step)
            c.wait()
            t._t.push(keys[:50], rng.standard_normal((50, 24)).astype(np.float32))
            r = c.refresh(batch=16)
            assert r["rows"] > 0
            moved[stored_rows] = r["bytes"] / r["rows"]
            k = c.keys.view(-1).cpu()
            at = (k >= 0).nonzero().squeeze(1)
            values = c.values.cpu()
            for key, i in zip(k[at].tolist(), at.tolist()):
                want_row = torch.from_numpy(t.lookup([key])[0][0])
                assert torch.equal(values[i], want_row), (dtype, kernels, key)
            c.close()
    row_bytes = {"f16": 48, "int8": 32}[dtype]
    assert moved == {True: 8 + row_bytes, False: 8 + 96}, (dtype, moved)
print("stored rows agree")
"""


def test_compact_tables_fill_the_cache_with_rows_decoded_on_the_device(tmp_path: Path) -> None:
    assert "stored rows agree" in _run_script(_STORED_SCRIPT, tmp_path / "s")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_compact_tables_fill_the_cache_with_rows_decoded_on_the_device(tmp_path: Path) -> None:
    """The same checks on the device with the compiled decode kernel: the int8 decode a
    GPU runs (no fused multiply-add) gives the store's rows bit for bit."""
    assert "stored rows agree" in _run_script(_STORED_SCRIPT, tmp_path / "s", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_on_cuda_the_kernels_match_the_reference(gpu_store: embank.Store, policy: str, dtype: str) -> None:
    """The compiled Triton kernels (not the interpreter) against the PyTorch path, on the
    device: the same answers and the same cache state after every batch."""
    t = _table(gpu_store)
    caches = [
        gpu.GpuCache(t, rows_max=64, slots=8, device="cuda", insert="sync", kernels=k, policy=policy,
                     dtype=getattr(torch, dtype))
        for k in ("torch", "triton")
    ]  # fmt: skip
    rng = np.random.default_rng(3)
    for step in range(50):
        ids = torch.as_tensor((rng.zipf(1.2, 100) % 330) * 7, dtype=torch.int64, device="cuda")
        scores = torch.as_tensor(rng.integers(0, 100, 100), device="cuda") if policy == "custom" else None
        a, b = (c.lookup(ids, scores) for c in caches)
        assert torch.equal(a, b), f"step {step}: answers differ"
        if step % 10 == 9:
            ks = (rng.integers(0, 330, 4) * 7).astype(np.uint64)
            t.push(ks, rng.standard_normal((4, DIM)).astype(np.float32))
            for c in caches:
                c.invalidate(ks)
        for name in ("keys", "values", "versions"):
            assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), (
                f"step {step}: {name} differ"
            )
    for c in caches:
        c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_on_cuda_the_triton_kernels_against_a_model(gpu_store: embank.Store, policy: str) -> None:
    """The model test of the PyTorch path (`test_reference_path_against_a_model`), run by
    the compiled Triton kernels on the device."""
    t = _table(gpu_store)
    cache = gpu.GpuCache(
        t, rows_max=64, slots=8, device="cuda", insert="sync", kernels="triton", policy=policy
    )
    _run_model(cache, t, seed=1, steps=300)
    s = cache.stats()
    assert s["hits"] > 0 and s["misses"] > 0 and s["evictions"] > 0 and s["refreshes"] > 0
    cache.close()


def test_the_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """`examples/gpu_cache/bench.py` at small sizes, without matplotlib (it is optional):
    what a GPU machine runs at full size. Then its PNGs, where matplotlib is installed."""
    bench = Path(__file__).resolve().parents[2] / "examples" / "gpu_cache" / "bench.py"
    args = ["--out", str(tmp_path), "--device", "cpu", "--rows", "20000", "--hit-rows", "5000",
            "--batch-sizes", "512,4096", "--batches", "16", "--repeats", "2", "--dims", "32",
            "--size-fractions", "0.01,0.1", "--fill-rows", "20000", "--fill-batch", "512"]  # fmt: skip
    no_matplotlib = (
        "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    r = subprocess.run(
        [sys.executable, "-c", no_matplotlib, str(bench), *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "matplotlib is not installed" in r.stderr
    import json

    res = json.loads((tmp_path / "gpu_cache.json").read_text())
    hit = res["hit_path"][0]
    assert hit["rows_cached"] == hit["rows_wanted"] == 5000
    assert [b["batch_ids"] for b in hit["batches"]] == [512, 4096] and all(
        b["all_hit"] for b in hit["batches"]
    )
    assert hit["refresh"]["rows"] == 5000 and hit["refresh"]["bytes_moved"] >= 5000 * 32 * 4
    for z in ("zipf_0.99", "zipf_1.2"):
        small, large = res["hit_rate_by_size"][z]
        assert small["hit_rate_last_half"] < large["hit_rate_last_half"]
        e = res["end_to_end"][z]
        assert e["gpu_cache_threshold_1.0"]["default_answers"] == 0  # sync until every id hits
        assert 0 < e["gpu_cache_threshold_1.0"]["hit_rate"] < 1
    for dtype, row_bytes in (("f16", 256), ("int8", 136)):
        fill = res["miss_fill"][dtype]
        assert fill["stored"]["misses"] == fill["stored"]["ids"] == 2 * 512, fill  # every id a miss
        assert fill["stored"]["bytes_per_row_to_device"] == row_bytes
        assert fill["float32"]["misses"] == 2 * 512 and fill["stored_vs_float32"] > 0
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("gpu_cache_bench", bench)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for png in module.draw(res, tmp_path):
        assert png.stat().st_size > 1000
