#!/usr/bin/env python3
"""`embank reshard` as a benchmark: ROWS rows of one table (dim DIM, Adagrad state: a
record is the row and DIM accumulators) on 2 shard stores, resharded to 3 stores RUNS
times, each run beside a plain copy of the same source files (``cp -r``), both ending
with ``sync``, so the copy is the bound to compare with.

    python bench/reshard.py --rows 10000000 --dim 64 --dir /tmp/reshard-bench --runs 3 \\
        --embank target/release/embank

The 2 sources are made by the command under test: one store of ROWS rows (written with
``push_with_state``, checkpointed), resharded 1 -> 2. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import embank
import numpy as np

CHUNK = 1 << 18


def du(path: Path) -> int:
    """Bytes the files under ``path`` occupy (allocated blocks)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--embank", default=None, help="the embank binary (default: python -m embank)")
    a = p.parse_args()
    cli = [a.embank] if a.embank else [sys.executable, "-m", "embank"]
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)
    one, src = a.dir / "one", [a.dir / f"src{i}" for i in range(2)]
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    with embank.open(one) as store:
        t = store.create_table(
            "t", dim=a.dim, capacity=a.rows, optimizer=embank.optim.Adagrad(lr=0.01), init=embank.init.zeros()
        )
        for start in range(0, a.rows, CHUNK):
            keys = np.arange(start, min(start + CHUNK, a.rows), dtype=np.uint64) * np.uint64(2654435761)
            records = rng.random((len(keys), 2 * a.dim), dtype=np.float32)
            t.push_with_state(keys, records)
        store.checkpoint(1, b"bench")
    made = time.perf_counter() - t0
    split = timed([*cli, "reshard", "--quiet", "--from", str(one), "--to", *map(str, src)])
    shutil.rmtree(one)
    dst = [a.dir / f"dst{i}" for i in range(3)]
    copy = a.dir / "copy"
    runs: list[dict[str, float]] = []
    for _ in range(a.runs):
        for d in [*dst, copy]:
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        r = timed([*cli, "reshard", "--quiet", "--from", *map(str, src), "--to", *map(str, dst)])
        copy.mkdir()
        c = timed(["cp", "-r", *map(str, src), str(copy)])
        runs.append({"reshard_s": r, "cp_s": c})
    src_bytes, dst_bytes = sum(du(s) for s in src), sum(du(d) for d in dst)
    rs, cs = [r["reshard_s"] for r in runs], [r["cp_s"] for r in runs]
    out = {
        "rows": a.rows,
        "dim": a.dim,
        "record_bytes_decoded": 4 * 2 * a.dim,
        "made_s": made,
        "reshard_1_to_2_s": split,
        "source_bytes": src_bytes,
        "target_bytes": dst_bytes,
        "runs": runs,
        "reshard_s_min": min(rs),
        "reshard_s_median": statistics.median(rs),
        "cp_s_min": min(cs),
        "cp_s_median": statistics.median(cs),
        "reshard_rows_per_s_median": a.rows / statistics.median(rs),
        "reshard_mib_per_s_median": src_bytes / statistics.median(rs) / 2**20,
        "cp_mib_per_s_median": src_bytes / statistics.median(cs) / 2**20,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
