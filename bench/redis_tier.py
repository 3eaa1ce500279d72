#!/usr/bin/env python3
"""hps-a lookups through the Redis Cluster shared tier, against local-only and against
two `embank serve` shards (docs/BENCHMARKS.md).

    .venv/bin/python bench/redis_tier.py [--rows 400000] [--dim 64] [--cache 8M] [--seconds 5]

Starts a 3-master Redis Cluster on loopback (Debian's redis-server and redis-cli) and
two local `embank serve` shards. Every store holds the same table (block medium, a
row cache of --cache). Zipf 1.2 batches of 500 ids (hps-a's skew):

- local-only: the store's row cache, then its medium;
- shared tier, warm: a second store reads through the cluster after the first
  store's reads filled it (what a serving node added to a warm fleet sees);
- shards: the same lookups through `embank.connect` to two `embank serve` shards.

Reports keys/s (min and median of 3 runs of --seconds) and the hit rates.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import embank
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples" / "dlrm"), str(ROOT / "tools")]
import redis_cluster  # noqa: E402
import shards  # noqa: E402


def zipf_batches(rows: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    p = ranks**-1.2
    p /= p.sum()
    perm = rng.permutation(rows).astype(np.uint64)  # hot keys spread over the key space
    return [perm[rng.choice(rows, size=500, p=p)] for _ in range(n)]


def load(store: Any, rows: int, dim: int) -> Any:
    t = store.create_table("items", dim=dim, medium="block", capacity=rows)
    rng = np.random.default_rng(0)
    for i in range(0, rows, 65536):
        n = min(65536, rows - i)
        t.push(np.arange(i, i + n, dtype=np.uint64), rng.standard_normal((n, dim), dtype=np.float32))
    return t


def run(t: Any, batches: list[np.ndarray], seconds: float) -> float:
    keys, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        t.lookup(batches[i % len(batches)])
        keys += 500
        i += 1
    return keys / (time.perf_counter() - t0)


def parse_bytes(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--cache", default="8M", help="row cache of every store")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    cache = parse_bytes(args.cache)
    root = Path(tempfile.mkdtemp(prefix="embank-redis-tier-"))
    procs, addrs = redis_cluster.start(root / "cluster")
    out: dict[str, Any] = {}
    try:
        batches = zipf_batches(args.rows, 2000, 1)
        tier = {"redis_cluster": addrs}
        # local-only
        s = embank.open(root / "local", cache_bytes=cache)
        t = load(s, args.rows, args.dim)
        run(t, batches, args.seconds)  # warm-up
        rates = [run(t, batches, args.seconds) for _ in range(3)]
        st = t.stats()
        out["local-only"] = (rates, st["cache_hit_rate"], None)
        s.close()
        # shared tier: a fills the cluster, b reads through it
        a = embank.open(root / "a", cache_bytes=cache, shared_tier=tier)
        ta = load(a, args.rows, args.dim)
        for b_ in batches:
            ta.lookup(b_)
        while (
            a.stats()["shared_tier"]["puts"] + a.stats()["shared_tier"]["puts_dropped"]
            < ta.stats()["medium_rows_read"]
        ):
            time.sleep(0.1)
        b = embank.open(root / "b", cache_bytes=cache, shared_tier=tier)
        tb = load(b, args.rows, args.dim)
        run(tb, batches, args.seconds)
        rates = [run(tb, batches, args.seconds) for _ in range(3)]
        stb, sh = tb.stats(), b.stats()["shared_tier"]
        out["shared tier (warm)"] = (
            rates,
            stb["cache_hit_rate"],
            sh["hits"] / max(1, sh["hits"] + sh["misses"]),
        )
        a.close()
        b.close()
        # two embank serve shards
        addrs_s = shards.start(root / "shards", 2, fresh=True)
        try:
            r = embank.connect(addrs_s)
            tr = r.create_table("items", dim=args.dim, medium="block", capacity=args.rows)
            rng = np.random.default_rng(0)
            for i in range(0, args.rows, 65536):
                n = min(65536, args.rows - i)
                tr.push(
                    np.arange(i, i + n, dtype=np.uint64), rng.standard_normal((n, args.dim), dtype=np.float32)
                )
            run(tr, batches, args.seconds)
            rates = [run(tr, batches, args.seconds) for _ in range(3)]
            out["2 embank serve shards"] = (rates, None, None)
            r.close()
        finally:
            shards.stop(root / "shards")
    finally:
        redis_cluster.stop(procs)
        shutil.rmtree(root, ignore_errors=True)
    print(f"hps-a lookups, {args.rows} rows of dim {args.dim}, row cache {args.cache} per store")
    for name, (rates, hit, shared_hit) in out.items():
        rates = sorted(rates)
        extra = "" if hit is None else f", row cache hits {hit * 100:.1f} %"
        extra += (
            "" if shared_hit is None else f", cluster hits {shared_hit * 100:.1f} % of the row cache's misses"
        )
        print(f"  {name}: {rates[0] / 1e3:.0f} / {rates[1] / 1e3:.0f} k keys/s (min / median){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
