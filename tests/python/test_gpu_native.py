"""The GPU cache's native path (``GpuCache(kernels="native")``: crates/embank-gpu, one call
into Rust a lookup) against a model of what it must answer: on CUDA where there is a GPU,
and on the CPU through the kernels' emulator where the extension was built with it
(``make test`` builds it so). The same tests on both."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import embank
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from embank import _native, gpu  # noqa: E402
from embank import torch as et  # noqa: E402
from embank.errors import InvalidInputError  # noqa: E402

DIM = 8
_names = itertools.count()

DEVICES = (["cpu"] if _native.gpu_emulator() else []) + (["cuda"] if torch.cuda.is_available() else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="no CUDA and no GPU emulator in this build")


@pytest.fixture(params=DEVICES or ["none"])
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _table(store: embank.Store, n: int = 300, dim: int = DIM, dtype: str = "f32") -> embank.Table:
    t = store.create_table(f"n{next(_names)}", dim=dim, dtype=dtype)
    keys = np.arange(n, dtype=np.uint64) * 7
    t.push(keys, np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32))
    return t


def _ids(keys: Any, device: str) -> Any:
    return torch.as_tensor(np.asarray(keys, dtype=np.int64), device=device)


def _truth(t: embank.Table, keys: Any) -> np.ndarray[Any, Any]:
    rows, _ = t.lookup(np.asarray(keys, dtype=np.uint64))
    return rows


def test_a_model_of_lookups_writes_refreshes_and_invalidations(gpu_store: embank.Store, device: str) -> None:
    """Random lookups (Zipf-like, some keys the table lacks), writes through the table
    (their notices drop the rows before the next lookup), writes behind the cache's back
    then a refresh, invalidations: every answer is the table's row, never more than
    rows_max rows cached, in a cache far smaller than the table (evictions)."""
    for policy, insert in (("lru", "sync"), ("lfu", "sync"), ("lru", "auto")):
        t = _table(gpu_store)
        cache = gpu.GpuCache(t, rows_max=64, slots=8, device=device, insert=insert, kernels="native",
                             policy=policy)  # fmt: skip
        rng = np.random.default_rng(3)
        for step in range(40):
            op = rng.integers(0, 10)
            if op < 6:
                ids = (rng.zipf(1.3, 40) % 330) * 7
                out = cache.lookup(_ids(ids, device)).cpu().numpy()
                if insert == "sync":
                    np.testing.assert_array_equal(out, _truth(t, ids), err_msg=f"{policy} step {step}")
                else:  # an async miss answers the default row: the others are the table's
                    ok = (out == _truth(t, ids)).all(1) | (out == 0).all(1)
                    assert ok.all(), f"{policy}/{insert} step {step}"
                    cache.wait()
            elif op < 8:
                ks = (rng.integers(0, 330, 5) * 7).astype(np.uint64)
                t.push(ks, rng.standard_normal((5, DIM)).astype(np.float32))
            elif op < 9:
                ks = (rng.integers(0, 330, 5) * 7).astype(np.uint64)
                t._t.push(ks, rng.standard_normal((5, DIM)).astype(np.float32))  # no notice
                before = cache.stats()["rows_cached"]
                r = cache.refresh()
                assert r["rows"] == before
                # Where its seconds went (the native path's own account).
                parts = r["setup_seconds"] + r["read_seconds"] + r["wait_seconds"]
                assert r["reader_threads"] >= 1 and 0 <= parts <= r["seconds"] * 1.0001 + 1e-6
            else:
                cache.invalidate((rng.integers(0, 330, 4) * 7).astype(np.uint64))
            s = cache.stats()
            assert s["rows_cached"] <= s["rows_max"] == 64
        assert cache.stats()["evictions"] > 0
        cache.close()


def test_misses_then_hits_and_the_host_syncs_a_lookup_makes(gpu_store: embank.Store, device: str) -> None:
    t = _table(gpu_store)
    ids = _ids(np.arange(100) * 7, device)
    sync = gpu.GpuCache(t, rows_max=1024, device=device, insert="sync", kernels="native")
    np.testing.assert_array_equal(sync.lookup(ids).cpu().numpy(), _truth(t, np.arange(100) * 7))
    before = sync.stats()
    out = sync.lookup(ids.view(10, 10))
    assert out.shape == (10, 10, DIM) and out.device.type == device
    after = sync.stats()
    assert after["hits"] - before["hits"] == 100
    assert after["host_syncs"] - before["host_syncs"] == 1, "a sync lookup waits once: the miss count"
    sync.close()
    asy = gpu.GpuCache(t, rows_max=1024, device=device, insert="async", kernels="native", default=-1.5)
    first = asy.lookup(ids).cpu().numpy()
    assert (first == -1.5).all(), "async misses answer the default"
    asy.wait()
    np.testing.assert_array_equal(asy.lookup(ids).cpu().numpy(), _truth(t, np.arange(100) * 7))
    s = asy.stats()
    assert s["host_syncs"] == 0 and s["async_inserts"] == 100 and s["default_answers"] == 100
    asy.close()


def test_compact_tables_and_cached_row_types(gpu_store: embank.Store, device: str) -> None:
    for dtype, row_type in (("int8", torch.float32), ("f16", torch.float32), ("f32", torch.float16),
                            ("f32", torch.bfloat16)):  # fmt: skip
        t = _table(gpu_store, dim=13, dtype=dtype)  # an odd dim
        keys = np.arange(50) * 7
        want = _truth(t, keys)
        cache = gpu.GpuCache(t, rows_max=256, device=device, insert="sync", kernels="native", dtype=row_type)
        np.testing.assert_array_equal(cache.lookup(_ids(keys, device)).cpu().numpy(), want, err_msg=dtype)
        hit = cache.lookup(_ids(keys, device)).cpu()
        np.testing.assert_array_equal(hit.numpy(), torch.from_numpy(want).to(row_type).float().numpy())
        cache.close()


def test_custom_scores_keep_the_highest(gpu_store: embank.Store, device: str) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(
        t, rows_max=2, slots=2, device=device, insert="sync", kernels="native", policy="custom"
    )
    with pytest.raises(InvalidInputError, match="scores"):
        cache.lookup(_ids([7], device))
    cache.lookup(_ids([7, 14], device), torch.tensor([50, 60], device=device))
    cache.lookup(_ids([21], device), torch.tensor([10], device=device))  # below both: refused
    assert cache.stats()["insert_refused"] == 1
    cache.lookup(_ids([21], device), torch.tensor([55], device=device))  # evicts 7 (50)
    s = cache.stats()
    before = s["hits"]
    cache.lookup(_ids([14, 21], device), torch.tensor([0, 0], device=device))
    assert cache.stats()["hits"] - before == 2
    cache.close()


def test_two_threads_on_one_cache(gpu_store: embank.Store, device: str) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=128, slots=16, device=device, insert="sync", kernels="native")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(8):
                # Thread 1 writes keys 7 and 14 between its lookups (each must see its own
                # writes); thread 2 never reads them (its truth would race with the writes).
                ids = (rng.integers(0 if seed == 1 else 3, 330, 30) * 7).astype(np.int64)
                if device == "cuda":  # each thread on its own stream
                    with torch.cuda.stream(torch.cuda.Stream()):
                        out = cache.lookup(_ids(ids, device))
                        torch.cuda.current_stream().synchronize()
                else:
                    out = cache.lookup(_ids(ids, device))
                np.testing.assert_array_equal(out.cpu().numpy(), _truth(t, ids))
                if seed == 1:
                    t.push(
                        np.array([7, 14], dtype=np.uint64), rng.standard_normal((2, DIM)).astype(np.float32)
                    )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    cache.close()


def test_as_the_source_of_an_embedding_bag(gpu_store: embank.Store, device: str) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=512, device=device, insert="sync", kernels="native")
    bag = et.EmbeddingBag(cache, mode="sum").eval()
    ids = torch.as_tensor(np.arange(40) * 7, dtype=torch.int64)
    offsets = torch.arange(0, 40, 10)
    with torch.no_grad():
        got = bag(ids.to(device), offsets.to(device)).cpu().numpy()
    want = _truth(t, np.arange(40) * 7).reshape(4, 10, DIM).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    cache.close()


def test_strided_ids_offsets_weights_and_scores_are_read_as_given(
    gpu_store: embank.Store, device: str
) -> None:
    """A column of a batch (``sparse[:, j]``, DLRM's one feature) and other strided views:
    the kernels take an address and a count, so a view must not be read as the ids that
    follow its first in memory. Lookups, an ``EmbeddingBag`` over a column, pooled
    lookups with strided offsets and weights, custom scores."""
    t = _table(gpu_store)
    keys = np.arange(40, dtype=np.int64).reshape(10, 4) * 7
    sparse = torch.as_tensor(keys, device=device)
    for policy in ("lru", "custom"):
        cache = gpu.GpuCache(t, rows_max=512, device=device, insert="sync", kernels="native", policy=policy)
        scores = None
        if policy == "custom":
            scores = torch.arange(40, dtype=torch.int64, device=device).reshape(10, 4)
        for view in (sparse[:, 1], sparse[:, 1:3], sparse[::2], sparse.t()):
            sv = None if scores is None else scores.as_strided(view.shape, view.stride())
            got = cache.lookup(view, sv).cpu().numpy()
            np.testing.assert_array_equal(got, _truth(t, view.cpu().numpy().reshape(-1)).reshape(got.shape))
        cache.close()
    cache = gpu.GpuCache(t, rows_max=512, device=device, insert="sync", kernels="native")
    bag = et.EmbeddingBag(cache, mode="sum").eval()
    with torch.no_grad():
        got = bag(sparse[:, 2:3]).cpu().numpy()
    np.testing.assert_array_equal(got, _truth(t, keys[:, 2]))
    ids = sparse.reshape(-1)[::2]  # 20 ids, strided
    offsets = torch.tensor([0, 0, 5, 0, 9, 0, 14, 0], device=device)[::2]
    weights = (torch.arange(40, dtype=torch.float32, device=device) / 8)[::2]
    got = cache.lookup_pooled(ids, offsets, weights, "sum").cpu().numpy()
    rows = _truth(t, keys.reshape(-1)[::2]) * (np.arange(40, dtype=np.float32)[::2] / 8)[:, None]
    want = np.stack([rows[a:b].sum(0) for a, b in ((0, 5), (5, 9), (9, 14), (14, 20))])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cache.close()


def test_bad_input_is_refused_and_nothing_is_lost(gpu_store: embank.Store, device: str) -> None:
    t = _table(gpu_store)
    cache = gpu.GpuCache(t, rows_max=64, device=device, insert="sync", kernels="native")
    cache.lookup(_ids([7, 14], device))
    with pytest.raises(InvalidInputError, match="int64"):
        cache.lookup(torch.tensor([1.5], device=device))
    with pytest.raises(InvalidInputError, match="torch tensor"):
        cache.lookup([7])  # type: ignore[arg-type]
    cache.insert_mode = "never"
    with pytest.raises(InvalidInputError, match="insert must be"):
        cache.lookup(_ids([7], device))
    cache.insert_mode = "sync"
    assert cache.lookup(_ids([], device)).shape == (0, DIM)
    before = cache.stats()["hits"]
    cache.lookup(_ids([7, 14], device))
    assert cache.stats()["hits"] - before == 2, "the cached rows survived the refused calls"
    cache.close()
    with pytest.raises(embank.errors.EmbankError, match="closed"):
        cache.lookup(_ids([7], device))


@pytest.mark.skipif(_native.gpu_emulator(), reason="this build has the emulator")
def test_native_on_the_cpu_needs_the_emulator_build(gpu_store: embank.Store) -> None:
    with pytest.raises(InvalidInputError, match="emulator"):
        gpu.GpuCache(_table(gpu_store), rows_max=64, device="cpu", kernels="native")


@pytest.mark.parametrize("insert", ["sync", "async"])
def test_pooled_lookups_equal_embedding_bag(gpu_store: embank.Store, device: str, insert: str) -> None:
    """``lookup_pooled`` (one launch: find and pool) against ``F.embedding_bag`` over the
    table's rows: sum, weighted sum, mean, an empty bag, a key the table lacks."""
    import torch.nn.functional as F

    t = _table(gpu_store)
    keys = np.array([7, 14, 21, 14, 99_999, 35, 42], dtype=np.int64)
    offsets = torch.tensor([0, 3, 3, 5], device=device)
    weights = torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 1.0, 0.25], device=device)
    rows = torch.from_numpy(_truth(t, keys)).to(device)
    every = torch.arange(len(keys), device=device)
    cache = gpu.GpuCache(t, rows_max=256, device=device, insert=insert, kernels="native")
    cache.lookup(_ids(keys, device))  # cached (async: once the inserter is done)
    cache.wait()
    for mode, w in (("sum", None), ("sum", weights), ("mean", None)):
        got = cache.lookup_pooled(_ids(keys, device), offsets, w, mode)
        want = F.embedding_bag(every, rows, offsets, mode=mode, per_sample_weights=w)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(InvalidInputError, match="per_sample_weights"):
        cache.lookup_pooled(_ids(keys, device), offsets, weights, "mean")
    cache.close()


@pytest.mark.skipif(not _native.gpu_emulator(), reason="the small run needs the kernels' emulator")
def test_the_native_bench_runs_on_the_cpu(tmp_path: Any) -> None:
    """examples/gpu_cache/native_bench.py, the GPU check's script, at tiny sizes through the
    emulator: every section runs and writes native.json, and what holds on any device
    holds here (a warm all-hit lookup's host syncs 0 async / 1 sync, a write through the
    table in the next lookup, the DLRM predictions equal, the refresh's account)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "examples" / "gpu_cache" / "native_bench.py"
    subprocess.run(
        [sys.executable, str(bench), "--device", "cpu", "--small-run", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    r = json.loads((tmp_path / "native.json").read_text())
    assert r["all_hit"]["async"]["host_syncs_per_lookup"] == 0.0
    assert r["all_hit"]["sync"]["host_syncs_per_lookup"] == 1.0
    (b,) = r["throughput"]["batches"]
    assert (
        b["native_stats_while_timed"]["misses"] == 0 and b["native_sync_stats_while_timed"]["host_syncs"] == 5
    )
    assert r["throughput"]["misses_while_timed"] == 0
    for zipf in ("zipf_0.99", "zipf_1.2"):
        assert 0 < r["end_to_end"][zipf]["gpu_cache_native_sync"]["hit_rate"] < 1
    d = r["refresh"]
    assert d["write_reached_next_lookup"] and d["refresh_rows"] == d["rows_cached"]
    assert d["refresh_reader_threads"] >= 1 and d["refresh_setup_seconds_all"][0] > 0
    assert r["dlrm"]["max_prediction_difference"] == 0.0
