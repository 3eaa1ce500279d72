"""Measures embank's GPU cache (`embank.gpu.GpuCache`) against the limits of the same run.

(a) hit path, at each ``--dims`` and each batch size of ``--batch-sizes`` (512 to 64 k
    ids): a cache holding every id of the table (checked: no miss while timed), keys/s
    of the find-and-gather kernel alone and of the whole ``lookup`` (its one host sync
    included), against ``torch.nn.functional.embedding`` gathering the same ids from a
    fully resident table whose rows are randomly permuted (a gather as scattered as the
    cache's, the access pattern's limit);
(b) refresh: ``refresh()`` end to end (keys to the host, the table read, rows to the
    device, the versioned write), GB/s of the bytes it moved between host and device;
    and the device write alone (the refresh's kernel over rows already on the device);
(c) hit rate against cache size: Zipf ``--zipf`` batches over a ``--rows`` table, caches
    of ``--size-fractions`` of the rows (a PNG where matplotlib is installed);
(d) end to end: ``EmbeddingBag`` inference through a cache of ``--cache-fraction`` of
    the rows against the same model pulling from the CPU store every batch, p50/p99
    latency of warm batches, and the warm-up curve (hit rate by batch) for
    ``insert="auto"`` at thresholds 0, 0.5 and 1.0 (a PNG where matplotlib is installed);
(e) the miss path of compact tables: lookups of ``--fill-batch`` ids never seen (every id
    a miss, inserted sync) on an f16 and an int8 table of ``--fill-rows`` rows of dim
    128, the misses fetched as stored rows and decoded on the device
    (``stored_rows=True``, the default) against fetched as float32 rows: keys/s and the
    bytes each row took to the device.

Every timed call is run once before timing, so Triton compiles are never timed.

On a GPU machine: ``python examples/gpu_cache/bench.py --out W`` (defaults to CUDA, 10 M
rows). On the CPU, small sizes, as a smoke test: ``--device cpu --rows 20000``. Results
go to ``W/gpu_cache.json`` (and ``W/hit_rate.png``, ``W/warmup.png``).
"""

from __future__ import annotations

import argparse
import functools
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
from embank.gpu import KEEP, GpuCache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Any, device: torch.device) -> float:
    """Seconds of one call, the device's work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed(fn: Any, device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls, after one untimed call (compiles, caches)."""
    fn()
    return [seconds(fn, device) for _ in range(repeats)]


def bag_seconds(bag: Any, ids: torch.Tensor, offsets: torch.Tensor, device: torch.device) -> float:
    """Seconds of one batch through ``bag``, its ids and offsets moved to ``device`` included."""
    return seconds(lambda: bag(ids.to(device), offsets.to(device)), device)


def hits_between(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int]:
    """Hits and lookups (ids) between two of a cache's ``stats()``."""
    h = after["hits"] - before["hits"]
    return h, h + after["misses"] - before["misses"]


def rate(n: float, seconds: list[float]) -> dict[str, float]:
    return {"best": n / min(seconds), "median": n / float(np.median(seconds))}


@functools.lru_cache(maxsize=4)
def _zipf_cdf(rows: int, a: float) -> np.ndarray:
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -a)
    return cdf / cdf[-1]


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float) -> np.ndarray:
    """Zipf-distributed ids over ``rows`` (rank r drawn with weight 1/r^a, ranks scattered).
    The CDF is computed once per (rows, a): at 10 M rows, once per batch took ~0.3 s."""
    draw = np.minimum(np.searchsorted(_zipf_cdf(rows, a), rng.random(n)), rows - 1)
    return (draw * 2654435761) % rows  # hot ids spread over the key space


def load_table(
    store: embank.Store, rows: int, dim: int, name: str = "items", dtype: str = "f32"
) -> embank.Table:
    t = store.create_table(f"{name}{dim}_{rows}", dim=dim, capacity=rows, medium="mmap", dtype=dtype)
    chunk = 1 << 18
    rng = np.random.default_rng(0)
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        t.push(np.arange(i, i + n, dtype=np.uint64), rng.standard_normal((n, dim), dtype=np.float32))
    return t


def miss_fill(store: embank.Store, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """(e): all-miss lookups on compact tables, misses fetched as stored rows or as float32."""
    out: dict[str, Any] = {}
    batch, dim = args.fill_batch, 128
    for dtype in ("f16", "int8"):
        t = load_table(store, args.fill_rows, dim, f"fill_{dtype}_", dtype)
        out[dtype] = {}
        for stored in (True, False):
            cache = GpuCache(
                t,
                rows_max=args.fill_rows,
                device=device,
                insert="sync",
                kernels=args.kernels,
                stored_rows=stored,
            )
            order = torch.randperm(args.fill_rows, generator=torch.Generator().manual_seed(1))
            chunks = [order[i : i + batch].to(device) for i in range(0, args.fill_rows - batch + 1, batch)]
            chunks = chunks[: args.repeats + 1]  # the first one untimed (compiles)
            cache.lookup(chunks[0])
            before = cache.stats()
            times = [seconds(functools.partial(cache.lookup, ids), device) for ids in chunks[1:]]
            after = cache.stats()
            hits, looked = hits_between(before, after)
            out[dtype]["stored" if stored else "float32"] = {
                "keys_per_s": rate(batch, times),
                "misses": looked - hits,
                "ids": looked,
                "bytes_per_row_to_device": t.row_bytes if stored else dim * 4,
            }
            cache.close()
        s, f = out[dtype]["stored"], out[dtype]["float32"]
        out[dtype]["stored_vs_float32"] = s["keys_per_s"]["median"] / f["keys_per_s"]["median"]
    return out


def hit_path(t: embank.Table, dim: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cached = args.hit_rows
    cache = GpuCache(t, rows_max=cached * 2, device=device, insert="sync", kernels=args.kernels)
    ids_all = torch.arange(cached, dtype=torch.int64, device=device)
    for i in range(0, cached, 1 << 16):
        cache.lookup(ids_all[i : i + (1 << 16)])
    held = cache.stats()["rows_cached"]
    weight = torch.randn(cached, dim, device=device)
    perm = torch.randperm(cached, generator=torch.Generator().manual_seed(2)).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    out: dict[str, Any] = {"dim": dim, "rows_cached": held, "rows_wanted": cached, "batches": []}
    for batch in args.batch_sizes:
        ids = torch.randint(0, cached, (batch,), generator=g).to(device)
        rows_index = perm[ids]  # the same ids, at randomly permuted rows
        before = cache.stats()["misses"]
        k_times = timed(lambda i=ids: cache._find(i, i, touch=True, gather=True), device, args.repeats)
        l_times = timed(lambda i=ids: cache.lookup(i), device, args.repeats)
        g_times = timed(lambda r=rows_index: F.embedding(r, weight), device, args.repeats)
        # Back to back, one wait at the end: what the device sustains when launches queue
        # up (the timings above wait for each call, so small batches measure the launch).
        k_run = timed(lambda i=ids: [cache._find(i, i, touch=True, gather=True) for _ in range(args.repeats)],
                      device, 3)  # fmt: skip
        g_run = timed(lambda r=rows_index: [F.embedding(r, weight) for _ in range(args.repeats)], device, 3)
        misses = cache.stats()["misses"] - before
        out["batches"].append(
            {
                "batch_ids": batch,
                "all_hit": misses == 0,
                "kernel_keys_per_s": rate(batch, k_times),
                "lookup_keys_per_s": rate(batch, l_times),
                "lookup_p99_ms": 1e3 * float(np.percentile(l_times, 99)),
                "permuted_gather_keys_per_s": rate(batch, g_times),
                "kernel_back_to_back_keys_per_s": rate(batch * args.repeats, k_run),
                "gather_back_to_back_keys_per_s": rate(batch * args.repeats, g_run),
                "kernel_vs_gather": min(g_times) / min(k_times),
                "kernel_vs_gather_back_to_back": min(g_run) / min(k_run),
                "lookup_vs_gather": min(g_times) / min(l_times),
            }
        )
    # (b) refresh: end to end, and the device write alone over rows already there.
    ref = [cache.refresh() for _ in range(max(1, args.repeats // 2) + 1)][1:]
    best = min(ref, key=lambda r: r["seconds"])
    at = ((cache.keys.view(-1) != -1) & (cache.keys.view(-1) != -2)).nonzero().squeeze(1)
    keys = cache.keys.view(-1)[at]
    vers = cache.versions[at // cache.slots]
    fresh = torch.randn(len(at), dim, device=device)
    keep = torch.full_like(keys, KEEP)
    w_times = timed(lambda: cache._write(keys, fresh, at, keys, keep, vers), device, args.repeats)
    write_bytes = len(at) * dim * (4 + cache.values.element_size())  # float32 rows read, cache rows written
    out["refresh"] = {
        "rows": best["rows"],
        "bytes_moved": best["bytes"],
        "gb_per_s_end_to_end": best["bytes"] / best["seconds"] / 1e9,
        "device_write_gb_per_s": rate(write_bytes / 1e9, w_times),
    }
    cache.close()
    return out


def trace(args: argparse.Namespace, a: float, seed: int) -> list[torch.Tensor]:
    """``--trace-ids`` Zipf ids in batches of ``--trace-batch``: long enough for a cache of a
    fifth of the rows to fill many times over (a short trace measures first-time misses)."""
    rng = np.random.default_rng(seed)
    ids = torch.as_tensor(zipf_ids(rng, args.trace_ids, args.rows, a), dtype=torch.int64)
    return list(ids.split(args.trace_batch))


def hit_rate_by_size(t: embank.Table, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in args.zipf:
        batches = trace(args, a, 3)
        curve = []
        for frac in args.size_fractions:
            cache = GpuCache(
                t, rows_max=max(1, int(args.rows * frac)), device=device, insert="sync", kernels=args.kernels
            )
            rates = []
            for ids in batches:
                before = cache.stats()
                cache.lookup(ids.to(device))
                h, n = hits_between(before, cache.stats())
                rates.append(h / max(1, n))
            curve.append({"fraction": frac, "hit_rate_last_half": float(np.mean(rates[len(rates) // 2 :]))})
            cache.close()
        out[f"zipf_{a}"] = curve
    return out


def end_to_end(t: embank.Table, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows_max = int(args.rows * args.cache_fraction)
    for a in args.zipf:
        rng = np.random.default_rng(7)
        batches = [
            torch.as_tensor(zipf_ids(rng, args.bags * args.bag_size, args.rows, a), dtype=torch.int64)
            for _ in range(args.batches + 1)
        ]
        warm_up, batches = batches[0], batches[1:]  # an untimed first batch: compiles
        offsets = torch.arange(0, args.bags * args.bag_size, args.bag_size, dtype=torch.int64)
        res: dict[str, Any] = {}
        plain = et.EmbeddingBag(t, mode="sum").eval()
        with torch.no_grad():
            plain(warm_up.to(device), offsets.to(device))
            lat = [bag_seconds(plain, ids, offsets, device) for ids in batches]
        res["cpu_store"] = {"p50_ms": 1e3 * np.percentile(lat, 50), "p99_ms": 1e3 * np.percentile(lat, 99)}
        for threshold in (0.0, 0.5, 1.0):
            cache = GpuCache(
                t, rows_max=rows_max, device=device, insert="auto", hit_rate_threshold=threshold,
                kernels=args.kernels,
            )  # fmt: skip
            bag = et.EmbeddingBag(cache, mode="sum").eval()
            lat, curve = [], []
            with torch.no_grad():
                bag(warm_up.to(device), offsets.to(device))
                for ids in batches:
                    before = cache.stats()
                    lat.append(bag_seconds(bag, ids, offsets, device))
                    h, n = hits_between(before, cache.stats())
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
        # Steady state: a cache warmed by the long trace first (as a server's is), then the
        # same batches, timed (insert="auto" at its default threshold).
        cache = GpuCache(t, rows_max=rows_max, device=device, insert="sync", kernels=args.kernels)
        for ids in trace(args, a, 11):
            cache.lookup(ids.to(device))
        cache.insert_mode = "auto"
        bag = et.EmbeddingBag(cache, mode="sum").eval()
        before = cache.stats()
        with torch.no_grad():
            lat = [bag_seconds(bag, ids, offsets, device) for ids in batches]
        h, n = hits_between(before, cache.stats())
        if args.profile:  # fresh batches of the same law, untimed, under cProfile: the host's share
            import cProfile
            import io
            import pstats

            rng = np.random.default_rng(13)
            fresh = [
                torch.as_tensor(zipf_ids(rng, args.bags * args.bag_size, args.rows, a), dtype=torch.int64)
                for _ in range(args.batches)
            ]
            prof = cProfile.Profile()
            with torch.no_grad():
                prof.enable()
                for ids in fresh:
                    bag(ids.to(device), offsets.to(device))
                sync(device)
                prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
            res["profile_prewarmed"] = text.getvalue()
        res["gpu_cache_prewarmed"] = {
            "hit_rate": h / max(1, n),
            "p50_ms": 1e3 * np.percentile(lat, 50),
            "p99_ms": 1e3 * np.percentile(lat, 99),
        }
        cache.close()
        out[f"zipf_{a}"] = res
    return out


def profile_lookup(t: embank.Table, args: argparse.Namespace, device: torch.device) -> str:
    """torch.profiler's table of 50 warm all-hit lookups of 512 ids: where a lookup's
    time goes on the host and the device."""
    from torch.profiler import ProfilerActivity, profile

    cache = GpuCache(t, rows_max=2 * 4096, device=device, insert="sync", kernels=args.kernels)
    ids = torch.arange(512, dtype=torch.int64, device=device)
    for _ in range(5):
        cache.lookup(ids)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(50):
            cache.lookup(ids)
        sync(device)
    cache.close()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def draw(result: dict[str, Any], out: Path) -> list[Path]:
    """The hit-rate-by-size and warm-up PNGs; none (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in result["hit_rate_by_size"].items():
        ax.plot([100 * c["fraction"] for c in curve], [100 * c["hit_rate_last_half"] for c in curve], "o-",
                label=name.replace("_", " "))  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("cache size, % of the table's rows")
    ax.set_ylabel("hit rate %")
    ax.set_title(f"hit rate against cache size ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=100)
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
    fig.savefig(out / "warmup.png", dpi=100)
    return [out / "hit_rate.png", out / "warmup.png"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="work directory (store, JSON, PNGs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of the table for (c) and (d)")
    p.add_argument("--dims", default="32,128", help="row sizes for (a) and (b)")
    p.add_argument("--e2e-dim", type=int, default=32, help="row size for (c) and (d)")
    p.add_argument("--hit-rows", type=int, default=1_000_000, help="rows cached for (a) and (b)")
    p.add_argument("--batch-sizes", default="512,4096,16384,65536", help="ids a lookup for (a)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--cache-fraction", type=float, default=0.1, help="cache size for (d), of the rows")
    p.add_argument("--size-fractions", default="0.001,0.01,0.05,0.1,0.2", help="cache sizes for (c)")
    p.add_argument("--zipf", default="0.99,1.2")
    p.add_argument("--batches", type=int, default=200, help="timed batches of (d)")
    p.add_argument(
        "--trace-ids",
        type=int,
        default=0,
        help="ids of the trace for (c) and (d)'s warmed cache (default: twice --rows)",
    )
    p.add_argument("--trace-batch", type=int, default=65536, help="ids a lookup of that trace")
    p.add_argument(
        "--profile", action="store_true", help="write profile.txt: torch.profiler of a warm lookup"
    )
    p.add_argument("--fill-rows", type=int, default=1_000_000, help="rows of the compact tables of (e)")
    p.add_argument("--fill-batch", type=int, default=4096, help="ids a lookup of (e), every one a miss")
    p.add_argument("--bags", type=int, default=50, help="bags per batch")
    p.add_argument("--bag-size", type=int, default=10, help="ids per bag (50 x 10 = 500 ids a batch)")
    args = p.parse_args(argv)
    args.zipf = [float(x) for x in args.zipf.split(",")]
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.size_fractions = [float(x) for x in args.size_fractions.split(",")]
    args.trace_ids = args.trace_ids or 2 * args.rows
    args.trace_batch = min(args.trace_batch, max(1, args.trace_ids // 16))  # a half to measure
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.out / "store", ignore_errors=True)
    store = embank.open(args.out / "store")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hit_path": [],
    }
    for dim in [int(x) for x in args.dims.split(",")]:
        r = hit_path(load_table(store, args.hit_rows, dim), dim, args, device)
        result["hit_path"].append(r)
        for b in r["batches"]:
            print(
                f"dim {dim}, {b['batch_ids']} ids: kernel "
                f"{b['kernel_keys_per_s']['best'] / 1e9:.3f} G keys/s "
                f"({b['kernel_vs_gather']:.2f}x the permuted gather), lookup "
                f"{b['lookup_keys_per_s']['best'] / 1e9:.3f} G keys/s ({b['lookup_vs_gather']:.2f}x), "
                f"back to back: kernel {b['kernel_back_to_back_keys_per_s']['best'] / 1e9:.3f} G keys/s, "
                f"gather {b['gather_back_to_back_keys_per_s']['best'] / 1e9:.3f}, all hit: {b['all_hit']}",
                file=sys.stderr,
            )
        f = r["refresh"]
        print(
            f"dim {dim}: refresh() {f['gb_per_s_end_to_end']:.2f} GB/s moved, device write "
            f"{f['device_write_gb_per_s']['best']:.1f} GB/s",
            file=sys.stderr,
        )
    save = lambda: (args.out / "gpu_cache.json").write_text(json.dumps(result, indent=1))  # noqa: E731
    save()  # each section is written as it ends: a run stopped early keeps what it measured
    t = load_table(store, args.rows, args.e2e_dim, "trace")
    result["hit_rate_by_size"] = hit_rate_by_size(t, args, device)
    for name, curve in result["hit_rate_by_size"].items():
        pts = ", ".join(f"{100 * c['fraction']:g} %: {c['hit_rate_last_half']:.3f}" for c in curve)
        print(f"hit rate by cache size, {name}: {pts}", file=sys.stderr)
    save()
    result["end_to_end"] = end_to_end(t, args, device)
    for name, res in result["end_to_end"].items():
        cpu = res["cpu_store"]
        print(f"{name}: CPU store p50 {cpu['p50_ms']:.2f} ms p99 {cpu['p99_ms']:.2f} ms", file=sys.stderr)
        for k, v in res.items():
            if k == "gpu_cache_prewarmed":
                print(f"  warmed by the trace: hits {v['hit_rate']:.3f}, p50 {v['p50_ms']:.2f} ms "
                      f"p99 {v['p99_ms']:.2f} ms", file=sys.stderr)  # fmt: skip
            elif k.startswith("gpu_cache"):
                print(
                    f"  {k}: hits {v['hit_rate']:.3f} (last half {v['hit_rate_last_half']:.3f}), "
                    f"warm p50 {v['p50_ms_warm']:.2f} ms p99 {v['p99_ms_warm']:.2f} ms, "
                    f"{v['default_answers']} default answers",
                    file=sys.stderr,
                )
    result["miss_fill"] = miss_fill(store, args, device)
    for dtype, res in result["miss_fill"].items():
        s, f = res["stored"], res["float32"]
        print(
            f"miss path, {dtype} x 128, {args.fill_batch} misses a lookup: stored rows "
            f"{s['keys_per_s']['median'] / 1e6:.2f} M keys/s ({s['bytes_per_row_to_device']} B a row), "
            f"float32 rows {f['keys_per_s']['median'] / 1e6:.2f} M keys/s "
            f"({f['bytes_per_row_to_device']} B): {res['stored_vs_float32']:.2f}x",
            file=sys.stderr,
        )
    save()
    if args.profile:
        text = profile_lookup(t, args, device)
        for name, res in result["end_to_end"].items():
            text += f"\n\ncProfile of {args.batches} fresh batches through the warmed cache, {name}:\n"
            text += res.pop("profile_prewarmed", "")
        (args.out / "profile.txt").write_text(text)
    save()
    pngs = draw(result, args.out)
    store.close()
    print(f"wrote {args.out / 'gpu_cache.json'} {' '.join(map(str, pngs))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
