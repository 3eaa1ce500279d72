"""The GPU cache's native path (``GpuCache(kernels="native")``, crates/embank-gpu) against
the limits and baselines of the same run: the checks of "the GPU tier earns its place".

(a) all-hit ``lookup`` of ``--small`` ids at dim 128, insert sync and async: latency of
    each call with the device's work (a sync after it), p50/p99 over ``--calls``; the
    host syncs a warm lookup makes (the cache's own count; PyTorch's sync debug mode
    on around the async calls, which raises on any sync of PyTorch's);
(b) find + gather throughput at dim 32: lookups of 64 k and 1 M ids (all hits, async:
    no host wait), back to back, against ``F.embedding`` gathering the same ids from a
    resident table whose rows are randomly permuted (the access pattern's limit);
(c) end to end: ``EmbeddingBag`` (``--bags`` x ``--bag-size`` ids, Zipf 0.99 and 1.2) over
    ``--rows`` rows through a cache of ``--cache-fraction`` of them, warmed by a trace,
    against the same bag pulling every row from the CPU store, p50/p99 of ``--batches``;
    inserts ``auto`` (async from a window hit rate of 0.8), ``async`` (every miss answered
    with the default row, inserted in the background) and ``sync`` (every miss fetched
    before the lookup returns); the Triton kernels' (``--triton``) beside them;
(d) refresh: a write of 1 % of the cached rows through the table reaches the cache by the
    next lookup (checked row for row), and a full ``refresh()`` of ``--refresh-rows`` rows
    of dim 128: GB/s of the bytes it moved.

(e) DLRM inference on the device through a cache per table against the CPU store
    (examples/s, and the largest difference between their predictions);

``python examples/gpu_cache/native_bench.py --out W`` (CUDA; ``W/native.json``). On the
CPU with the emulator build (``make test``'s): ``--device cpu --small-run`` as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import embank
import numpy as np
import torch
import torch.nn.functional as F
from embank import torch as et
from embank.gpu import GpuCache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float, cdf: dict[Any, np.ndarray]) -> np.ndarray:
    key = (rows, a)
    if key not in cdf:
        c = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -a)
        cdf[key] = c / c[-1]
    draw = np.minimum(np.searchsorted(cdf[key], rng.random(n)), rows - 1)
    return (draw * 2654435761) % rows


def load(store: embank.Store, name: str, rows: int, dim: int) -> embank.Table:
    t = store.create_table(name, dim=dim, capacity=rows, medium="mmap")
    rng = np.random.default_rng(0)
    chunk = 1 << 18
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        t.push(np.arange(i, i + n, dtype=np.uint64), rng.standard_normal((n, dim), dtype=np.float32))
    return t


def warm(cache: GpuCache, ids: torch.Tensor, step: int = 1 << 16) -> None:
    """Looks ``ids`` up in sync mode until they are cached, then back to the cache's mode."""
    mode = cache.insert_mode
    cache.insert_mode = "sync"
    for i in range(0, len(ids), step):
        cache.lookup(ids[i : i + step])
    cache.insert_mode = mode


def all_hit(store: embank.Store, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    t = load(store, "small", 1 << 14, 128)
    out: dict[str, Any] = {}
    ids = torch.arange(args.small, dtype=torch.int64, device=device)
    for mode in ("sync", "async"):
        cache = GpuCache(t, rows_max=1 << 14, device=device, insert=mode, kernels="native")
        warm(cache, torch.arange(1 << 14, dtype=torch.int64, device=device))
        for _ in range(3):
            cache.lookup(ids)
        cache.wait()
        before = cache.stats()
        lat, host = [], []
        for _ in range(args.calls):
            sync(device)
            t0 = time.perf_counter()
            cache.lookup(ids)
            t1 = time.perf_counter()
            sync(device)
            t2 = time.perf_counter()
            host.append(t1 - t0)
            lat.append(t2 - t0)
        after = cache.stats()
        torch_syncs = "n/a"
        if device.type == "cuda" and mode == "async":
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(10):
                    cache.lookup(ids)
                torch_syncs = "0 (sync debug mode raised nothing)"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        calls = after["lookups"] - before["lookups"]
        out[mode] = {
            "ids": args.small,
            "p50_us": 1e6 * pct(lat, 50),
            "p99_us": 1e6 * pct(lat, 99),
            "host_p50_us": 1e6 * pct(host, 50),
            "host_syncs_per_lookup": (after["host_syncs"] - before["host_syncs"]) / max(1, calls),
            "misses": after["misses"] - before["misses"],
            "torch_syncs": torch_syncs,
        }
        cache.close()
    return out


def throughput(store: embank.Store, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rows, dim = args.big, 32
    t = load(store, "big", rows, dim)
    cache = GpuCache(t, rows_max=2 * rows, device=device, insert="async", kernels="native")
    warm(cache, torch.arange(rows, dtype=torch.int64, device=device))
    held = cache.stats()["rows_cached"]
    sync_cache = GpuCache(t, rows_max=2 * rows, device=device, insert="sync", kernels="native")
    warm(sync_cache, torch.arange(rows, dtype=torch.int64, device=device))
    weight = torch.randn(rows, dim, device=device)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(2)).to(device)
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"dim": dim, "rows": rows, "rows_cached": held, "batches": []}
    for batch in args.batch_sizes:
        ids = torch.randint(0, rows, (batch,), generator=g).to(device)
        permuted = perm[ids]
        res: dict[str, Any] = {"ids": batch}
        runs = (
            ("native", lambda i=ids: cache.lookup(i)),
            ("native_sync", lambda i=ids: sync_cache.lookup(i)),
            ("gather", lambda r=permuted: F.embedding(r, weight)),
        )
        for name, fn in runs:
            fn()
            sync(device)
            owner = {"native": cache, "native_sync": sync_cache}.get(name)
            before_stats = owner.stats() if owner is not None else None
            times, issued = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                issued.append((time.perf_counter() - t0) / args.reps)
                sync(device)
                times.append((time.perf_counter() - t0) / args.reps)
            res[f"{name}_keys_per_s_best"] = batch / min(times)
            res[f"{name}_keys_per_s_median"] = batch / float(np.median(times))
            # The host's time a call before the device's end (an async path that waits
            # for nothing shows here what it costs the host).
            res[f"{name}_host_us_per_call_median"] = float(np.median(issued)) * 1e6
            if owner is not None and before_stats is not None:
                after = owner.stats()
                res[f"{name}_stats_while_timed"] = {
                    k: after[k] - before_stats[k]
                    for k in (
                        "lookups",
                        "hits",
                        "misses",
                        "async_inserts",
                        "sync_inserts",
                        "host_syncs",
                        "scratch_allocations",
                    )
                    if k in after and k in before_stats
                }
        res["native_vs_gather"] = res["native_keys_per_s_median"] / res["gather_keys_per_s_median"]
        res["native_sync_vs_gather"] = res["native_sync_keys_per_s_median"] / res["gather_keys_per_s_median"]
        out["batches"].append(res)
    before = cache.stats()
    cache.lookup(torch.arange(min(rows, 1 << 16), dtype=torch.int64, device=device))
    cache.wait()
    out["misses_while_timed"] = cache.stats()["misses"] - before["misses"]
    cache.close()
    sync_cache.close()
    return out


def end_to_end(store: embank.Store, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    t = load(store, "e2e", args.rows, 32)
    out: dict[str, Any] = {"rows": args.rows, "cache_rows": int(args.rows * args.cache_fraction)}
    cdf: dict[Any, np.ndarray] = {}
    n_ids = args.bags * args.bag_size
    offsets = torch.arange(0, n_ids, args.bag_size, dtype=torch.int64)
    variants = [("native", m) for m in ("auto", "async", "sync")] + (
        [("triton", "auto")] if args.triton else []
    )
    for a in (0.99, 1.2):
        rng = np.random.default_rng(7)
        batches = [torch.as_tensor(zipf_ids(rng, n_ids, args.rows, a, cdf)) for _ in range(args.batches + 1)]
        res: dict[str, Any] = {}
        plain = et.EmbeddingBag(t, mode="sum").eval()
        with torch.no_grad():
            plain(batches[0].to(device), offsets.to(device))
            lat = []
            for ids in batches[1:]:
                sync(device)
                t0 = time.perf_counter()
                plain(ids.to(device), offsets.to(device))
                sync(device)
                lat.append(time.perf_counter() - t0)
        res["cpu_store"] = {"p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
        trace = torch.as_tensor(zipf_ids(np.random.default_rng(11), args.trace_ids, args.rows, a, cdf))
        for k, mode in variants:
            cache = GpuCache(t, rows_max=out["cache_rows"], device=device, insert="sync", kernels=k)
            for part in trace.split(1 << 16):
                cache.lookup(part.to(device))
            cache.insert_mode = mode
            bag = et.EmbeddingBag(cache, mode="sum").eval()
            before = cache.stats()
            lat = []
            with torch.no_grad():
                bag(batches[0].to(device), offsets.to(device))
                for ids in batches[1:]:
                    sync(device)
                    t0 = time.perf_counter()
                    bag(ids.to(device), offsets.to(device))
                    sync(device)
                    lat.append(time.perf_counter() - t0)
            cache.wait()
            after = cache.stats()
            h = after["hits"] - before["hits"]
            n = h + after["misses"] - before["misses"]
            res[f"gpu_cache_{k}_{mode}"] = {
                "p50_ms": 1e3 * pct(lat, 50),
                "p99_ms": 1e3 * pct(lat, 99),
                "hit_rate": h / max(1, n),
                "vs_cpu_store_p50": pct(lat, 50) * 1e3 / res["cpu_store"]["p50_ms"],
                "default_answers": after["default_answers"] - before["default_answers"],
            }
            cache.close()
        out[f"zipf_{a}"] = res
    return out


def refresh(store: embank.Store, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rows, dim = args.refresh_rows, 128
    t = load(store, "fresh", rows, dim)
    cache = GpuCache(t, rows_max=2 * rows, device=device, insert="sync", kernels="native")
    warm(cache, torch.arange(rows, dtype=torch.int64, device=device))
    cached = cache.stats()["rows_cached"]
    # A write of 1 % of the cached rows through the table: the next lookup answers them.
    keys = np.random.default_rng(5).choice(rows, size=max(1, rows // 100), replace=False).astype(np.uint64)
    fresh = np.full((len(keys), dim), 3.25, dtype=np.float32)
    t.push(keys, fresh)
    got = cache.lookup(torch.as_tensor(keys.astype(np.int64), device=device)).cpu().numpy()
    reached = bool((got == fresh).all())
    runs = [cache.refresh() for _ in range(3)]
    best = min(runs, key=lambda r: r["seconds"])
    cache.close()
    return {
        "rows_cached": cached,
        "written": len(keys),
        "write_reached_next_lookup": reached,
        "refresh_rows": best["rows"],
        "refresh_bytes": best["bytes"],
        "refresh_seconds": best["seconds"],
        "refresh_gb_per_s": best["bytes"] / best["seconds"] / 1e9,
        "refresh_gb_per_s_all": [r["bytes"] / r["seconds"] / 1e9 for r in runs],
        # Where the best run's seconds went (the first run allocates the buffers).
        "refresh_setup_seconds": best.get("setup_seconds"),
        "refresh_read_seconds": best.get("read_seconds"),
        "refresh_wait_seconds": best.get("wait_seconds"),
        "refresh_setup_seconds_all": [r.get("setup_seconds") for r in runs],
        "refresh_reader_threads": best.get("reader_threads"),
        "refresh_read_gb_per_s": (
            best["rows"] * dim * 4 / best["read_seconds"] / 1e9 if best.get("read_seconds") else None
        ),
    }


class _Bags(torch.nn.Module):
    """DLRM's tables as one bag module per feature: ``(n, 26)`` ids in, pooled rows out
    (one id a bag, as Criteo's features)."""

    def __init__(self, bags: list[torch.nn.Module], device: torch.device) -> None:
        super().__init__()
        self.bags = torch.nn.ModuleList(bags)
        self.device = device

    def forward(self, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        offsets = torch.arange(sparse.shape[0], dtype=torch.int64, device=sparse.device)
        return {f"C{j + 1}": bag(sparse[:, j].contiguous(), offsets) for j, bag in enumerate(self.bags)}


def dlrm(store: embank.Store, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """(e) DLRM inference on the device (examples/dlrm/model.py's model, 26 tables of
    ``--dlrm-rows`` rows, Zipf 1.05 ids, batches of ``--dlrm-batch``): tables read from
    the CPU store every batch against through a GpuCache per table (sync inserts, so
    every row is the table's: the predictions must be equal)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "dlrm"))
    from model import DLRM  # type: ignore[import-not-found]

    dim, rows, nf = 16, args.dlrm_rows, 26
    tables = [load(store, f"dlrm{j}", rows, dim) for j in range(nf)]
    torch.manual_seed(0)
    cdf: dict[Any, np.ndarray] = {}
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(args.dlrm_batches + args.dlrm_warm):
        sparse = np.stack([zipf_ids(rng, args.dlrm_batch, rows, 1.05, cdf) for _ in range(nf)], axis=1)
        dense = torch.randn(args.dlrm_batch, 13)
        batches.append((dense.to(device), torch.as_tensor(sparse, dtype=torch.int64).to(device)))
    out: dict[str, Any] = {"tables": nf, "rows": rows, "batch": args.dlrm_batch}
    preds: dict[str, list[torch.Tensor]] = {}
    for name in ("cpu_store", "gpu_cache"):
        caches = []
        if name == "gpu_cache":
            caches = [
                GpuCache(t, rows_max=args.dlrm_cache_rows, device=device, insert="sync") for t in tables
            ]
            bags = [et.EmbeddingBag(c, mode="sum") for c in caches]
        else:
            bags = [et.EmbeddingBag(t, mode="sum") for t in tables]
        torch.manual_seed(0)
        model = DLRM(_Bags(bags, device), dim, [64, 32], [128, 64]).to(device).eval()
        got = []
        with torch.no_grad():
            for dense, sparse in batches[: args.dlrm_warm]:  # warms the caches
                model(dense, sparse)
            sync(device)
            t0 = time.perf_counter()
            for dense, sparse in batches[args.dlrm_warm :]:
                got.append(model(dense, sparse))
            sync(device)
            secs = time.perf_counter() - t0
        preds[name] = got
        res: dict[str, Any] = {"examples_per_s": args.dlrm_batch * args.dlrm_batches / secs}
        if caches:
            st = [c.stats() for c in caches]
            h, m = sum(x["hits"] for x in st), sum(x["misses"] for x in st)
            res["hit_rate"] = h / max(1, h + m)
            for c in caches:
                c.close()
        out[name] = res
    diff = max(float((a - b).abs().max()) for a, b in zip(preds["cpu_store"], preds["gpu_cache"]))
    out["max_prediction_difference"] = diff
    out["speedup"] = out["gpu_cache"]["examples_per_s"] / out["cpu_store"]["examples_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="work directory (stores, native.json)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", type=int, default=512, help="ids of (a)'s lookups")
    p.add_argument("--calls", type=int, default=2000, help="timed lookups of (a)")
    p.add_argument("--big", type=int, default=1 << 20, help="rows of (b)'s table (all cached)")
    p.add_argument("--batch-sizes", default="65536,1048576", help="ids a lookup for (b)")
    p.add_argument("--reps", type=int, default=20, help="back-to-back lookups a timing of (b)")
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of (c)'s table")
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--bags", type=int, default=50)
    p.add_argument("--bag-size", type=int, default=10)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--trace-ids", type=int, default=4_000_000, help="ids that warm (c)'s cache")
    p.add_argument("--triton", action="store_true", help="also (c) through the Triton kernels")
    p.add_argument("--refresh-rows", type=int, default=1 << 20, help="rows cached for (d), dim 128")
    p.add_argument("--dlrm-rows", type=int, default=1_000_000, help="rows of each of (e)'s 26 tables")
    p.add_argument("--dlrm-cache-rows", type=int, default=100_000, help="rows of (e)'s caches, each")
    p.add_argument("--dlrm-batch", type=int, default=512)
    p.add_argument("--dlrm-batches", type=int, default=100, help="timed batches of (e)")
    p.add_argument("--dlrm-warm", type=int, default=200, help="batches that warm (e)'s caches, untimed")
    p.add_argument("--only", default="a,b,c,d,e", help="sections to run")
    p.add_argument("--json", type=Path, default=None, help="the results (default: OUT/native.json)")
    p.add_argument("--small-run", action="store_true", help="tiny sizes (a CPU smoke test)")
    args = p.parse_args(argv)
    if args.small_run:
        args.small, args.calls, args.big, args.batch_sizes, args.reps = 64, 5, 4096, "1024", 1
        args.rows, args.batches, args.trace_ids, args.refresh_rows = 20_000, 3, 2000, 2000
        args.bags, args.bag_size = 4, 4
        args.dlrm_rows, args.dlrm_cache_rows, args.dlrm_batch, args.dlrm_batches, args.dlrm_warm = (
            500,
            100,
            8,
            2,
            2,
        )
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    }
    sections = {"a": ("all_hit", all_hit), "b": ("throughput", throughput), "c": ("end_to_end", end_to_end),
                "d": ("refresh", refresh), "e": ("dlrm", dlrm)}  # fmt: skip
    with embank.open(str(args.out / "store"), create=True) as store:
        for key in args.only.split(","):
            name, fn = sections[key]
            t0 = time.perf_counter()
            try:
                result[name] = fn(store, args, device)
            except Exception as e:  # one section failing on a lent GPU must not cost the others
                traceback.print_exc()
                result[name] = {"error": f"{type(e).__name__}: {e}"}
            result[name]["section_seconds"] = time.perf_counter() - t0
            print(json.dumps({name: result[name]}, indent=1, default=str), flush=True)
            # After each section: a run cut short keeps the sections done.
            (args.json or args.out / "native.json").write_text(json.dumps(result, indent=1, default=str))
            for tname in list(store.tables()):
                store.drop_table(tname)
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
