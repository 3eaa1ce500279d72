"""Measures embank's GPU cache (`embank.gpu.GpuCache`) against the limits of the same run.

(a) hit path: lookups of ids all cached, keys/s, at each ``--dims``, against a fully
    resident ``torch.nn.functional.embedding`` gather of the same ids (the access
    pattern's limit): the kernel alone (find + gather of unique ids) and the whole
    ``lookup`` (unique, find, gather, inverse gather);
(b) replace bandwidth: rows rewritten in place for cached keys (what a refresh does on
    the device once the rows are there), GB/s; and ``refresh()`` end to end from the
    table, which is bound by the host store;
(c) end to end: ``EmbeddingBag`` inference over a ``--rows`` table with a cache of
    ``--cache-fraction`` of the rows, Zipf ``--zipf`` batches, hit rate and latency per
    batch against the same model pulling from the CPU store every batch; and the warm-up
    curve (hit rate by batch) for ``insert="auto"`` at thresholds 0, 0.5 and 1.0 (PNG).

On a GPU machine: ``python examples/gpu_cache/bench.py --out W`` (defaults to CUDA, 10 M
rows). On the CPU, small sizes, as a smoke test: ``--device cpu --rows 200000``. Results
go to ``W/gpu_cache.json`` and ``W/warmup.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
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


def timed(fn: Any, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float) -> np.ndarray:
    """Zipf-distributed ids over ``rows`` (rank r drawn with weight 1/r^a, ranks scattered)."""
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    p = ranks**-a
    p /= p.sum()
    draw = rng.choice(rows, size=n, p=p)
    return (draw * 2654435761) % rows  # hot ids spread over the key space


def load_table(store: embank.Store, rows: int, dim: int) -> embank.Table:
    t = store.create_table(f"items{dim}", dim=dim, capacity=rows, medium="mmap")
    chunk = 1 << 18
    rng = np.random.default_rng(0)
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        t.push(np.arange(i, i + n, dtype=np.uint64), rng.standard_normal((n, dim), dtype=np.float32))
    return t


def hit_path(t: embank.Table, dim: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cached = min(args.hit_rows, args.rows)
    cache = GpuCache(t, rows_max=cached * 2, device=device, insert="sync", kernels=args.kernels)
    ids_all = torch.arange(cached, dtype=torch.int64, device=device)
    for i in range(0, cached, 1 << 16):
        cache.lookup(ids_all[i : i + (1 << 16)])
    held = cache.stats()["rows_cached"]
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cached, (args.hit_batch,), generator=g).to(device)
    uniq = torch.unique(ids)
    weight = torch.randn(cached, dim, device=device)
    k_times = timed(lambda: cache._find(uniq, uniq, touch=True, gather=True), device, args.repeats)
    l_times = timed(lambda: cache.lookup(ids), device, args.repeats)
    g_times = timed(lambda: F.embedding(ids, weight), device, args.repeats)
    gu_times = timed(lambda: F.embedding(uniq, weight), device, args.repeats)
    # (b) replace: rewrite the rows of cached keys in place.
    r_times = timed(lambda: cache.refresh(), device, args.repeats)
    t0 = time.perf_counter()
    ref = cache.refresh()
    refresh_s = time.perf_counter() - t0
    cache.close()
    med = lambda xs: float(np.median(xs))  # noqa: E731
    row_bytes = dim * 4
    return {
        "dim": dim,
        "rows_cached": held,
        "batch_ids": args.hit_batch,
        "unique_ids": len(uniq),
        "kernel_keys_per_s": {"min_time": len(uniq) / min(k_times), "median": len(uniq) / med(k_times)},
        "gather_unique_keys_per_s": {
            "min_time": len(uniq) / min(gu_times),
            "median": len(uniq) / med(gu_times),
        },
        "lookup_keys_per_s": {"min_time": len(ids) / min(l_times), "median": len(ids) / med(l_times)},
        "gather_keys_per_s": {"min_time": len(ids) / min(g_times), "median": len(ids) / med(g_times)},
        "kernel_vs_gather": min(gu_times) / min(k_times),
        "lookup_vs_gather": min(g_times) / min(l_times),
        "replace_gb_per_s": {
            "min_time": len(uniq) * row_bytes / min(r_times) / 1e9,
            "median": len(uniq) * row_bytes / med(r_times) / 1e9,
        },
        "refresh_from_table": {"rows": ref["rows"], "gb_per_s": ref["bytes"] / refresh_s / 1e9},
    }


def end_to_end(t: embank.Table, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows_max = int(args.rows * args.cache_fraction)
    for a in args.zipf:
        rng = np.random.default_rng(7)
        batches = [
            torch.as_tensor(zipf_ids(rng, args.bags * args.bag_size, args.rows, a), dtype=torch.int64)
            for _ in range(args.batches)
        ]
        offsets = torch.arange(0, args.bags * args.bag_size, args.bag_size, dtype=torch.int64)
        res: dict[str, Any] = {}
        plain = et.EmbeddingBag(t, mode="sum").eval()
        lat = []
        with torch.no_grad():
            for ids in batches:
                sync(device)
                t0 = time.perf_counter()
                plain(ids.to(device), offsets.to(device))
                sync(device)
                lat.append(time.perf_counter() - t0)
        res["cpu_store"] = {"p50_ms": 1e3 * np.percentile(lat, 50), "p99_ms": 1e3 * np.percentile(lat, 99)}
        for threshold in (0.0, 0.5, 1.0):
            cache = GpuCache(
                t, rows_max=rows_max, device=device, insert="auto", hit_rate_threshold=threshold,
                kernels=args.kernels,
            )  # fmt: skip
            bag = et.EmbeddingBag(cache, mode="sum").eval()
            lat, curve = [], []
            with torch.no_grad():
                for ids in batches:
                    before = cache.stats()
                    sync(device)
                    t0 = time.perf_counter()
                    bag(ids.to(device), offsets.to(device))
                    sync(device)
                    lat.append(time.perf_counter() - t0)
                    after = cache.stats()
                    h = after["hits"] - before["hits"]
                    n = h + after["misses"] - before["misses"]
                    curve.append(h / n if n else 0.0)
            cache.wait()
            st = cache.stats()
            warm = lat[len(lat) // 2 :]
            res[f"gpu_cache_threshold_{threshold}"] = {
                "hit_rate": st["hit_rate"],
                "hit_rate_last_half": float(np.mean(curve[len(curve) // 2 :])),
                "p50_ms": 1e3 * np.percentile(lat, 50),
                "p99_ms": 1e3 * np.percentile(lat, 99),
                "p50_ms_warm": 1e3 * np.percentile(warm, 50),
                "p99_ms_warm": 1e3 * np.percentile(warm, 99),
                "default_answers": st["default_answers"],
                "sync_inserts": st["sync_inserts"],
                "async_inserts": st["async_inserts"],
                "curve": curve,
            }
            cache.close()
        out[f"zipf_{a}"] = res
    return out


def draw(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return
    e2e = result["end_to_end"]
    fig, axes = plt.subplots(1, len(e2e), figsize=(6 * len(e2e), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], e2e.items()):
        for k, v in res.items():
            if k.startswith("gpu_cache_threshold_"):
                ax.plot(np.array(v["curve"]) * 100, label=f"threshold {k.rsplit('_', 1)[1]}")
        ax.set_title(f"warm-up, {name.replace('_', ' ')} ({result['device']})")
        ax.set_xlabel("batch")
        ax.set_ylabel("hit rate %")
        ax.set_ylim(0, 100)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="work directory (store, JSON, PNG)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of the table for (c)")
    p.add_argument("--dims", default="32,128", help="row sizes for (a) and (b)")
    p.add_argument("--e2e-dim", type=int, default=32, help="row size for (c)")
    p.add_argument("--hit-rows", type=int, default=1_000_000, help="rows cached for (a)")
    p.add_argument("--hit-batch", type=int, default=1_000_000, help="ids per hit-path lookup")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--zipf", default="0.99,1.2")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--bags", type=int, default=50, help="bags per batch")
    p.add_argument("--bag-size", type=int, default=10, help="ids per bag (50 x 10 = 500 ids a batch)")
    args = p.parse_args(argv)
    args.zipf = [float(x) for x in args.zipf.split(",")]
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.out / "store", ignore_errors=True)
    store = embank.open(args.out / "store")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    }
    result["hit_path"] = []
    for dim in [int(x) for x in args.dims.split(",")]:
        t = load_table(store, max(args.hit_rows, 1), dim)
        r = hit_path(t, dim, args, device)
        result["hit_path"].append(r)
        print(
            f"dim {dim}: kernel {r['kernel_keys_per_s']['min_time'] / 1e9:.3f} G keys/s "
            f"({r['kernel_vs_gather']:.2f}x the gather of the same unique ids), lookup "
            f"{r['lookup_keys_per_s']['min_time'] / 1e9:.3f} G keys/s ({r['lookup_vs_gather']:.2f}x "
            f"the gather), replace {r['replace_gb_per_s']['min_time']:.1f} GB/s",
            file=sys.stderr,
        )
    t = store.table(f"items{args.e2e_dim}") if f"items{args.e2e_dim}" in store.tables() else None
    if t is None or len(t) < args.rows:
        if t is not None:
            store.drop_table(t.name)
        t = load_table(store, args.rows, args.e2e_dim)
    result["end_to_end"] = end_to_end(t, args, device)
    for name, res in result["end_to_end"].items():
        cpu = res["cpu_store"]
        print(f"{name}: CPU store p50 {cpu['p50_ms']:.2f} ms p99 {cpu['p99_ms']:.2f} ms", file=sys.stderr)
        for k, v in res.items():
            if k.startswith("gpu_cache"):
                print(
                    f"  {k}: hits {v['hit_rate']:.3f} (last half {v['hit_rate_last_half']:.3f}), "
                    f"warm p50 {v['p50_ms_warm']:.2f} ms p99 {v['p99_ms_warm']:.2f} ms, "
                    f"{v['default_answers']} default answers",
                    file=sys.stderr,
                )
    (args.out / "gpu_cache.json").write_text(json.dumps(result, indent=1))
    draw(result, args.out / "warmup.png")
    store.close()
    print(f"wrote {args.out / 'gpu_cache.json'} and {args.out / 'warmup.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
