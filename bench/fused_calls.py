#!/usr/bin/env python3
"""Times the fused collection's three native calls per step (forward: pull and pool,
backward: per-row gradients, push: every table's Adagrad) on 26 tables of dim 16 with
DLRM-like Zipf ids, batch 512, without torch: ``python bench/fused_calls.py [STEPS]``."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import embank
import embank._native as native
import numpy as np

TABLES, BATCH = 26, 512


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    with embank.open(os.path.join(tempfile.mkdtemp(), "s")) as store:
        ts = [
            store.create_table(
                f"c{j}",
                dim=16,
                optimizer=embank.optim.Adagrad(lr=0.05),
                init=embank.init.uniform(-0.05, 0.05),
                capacity=1 << 17,
            )
            for j in range(TABLES)
        ]
        c = native.Collection([t._t for t in ts], list(range(TABLES)), [None] * TABLES, "sum", 1, 60.0)
        rng = np.random.default_rng(0)
        batches = [
            [np.ascontiguousarray((rng.zipf(1.2, BATCH) % 100_000).astype(np.int64)) for _ in range(TABLES)]
            for _ in range(50)
        ]
        starts = [np.arange(BATCH, dtype=np.int64)] * TABLES
        none: list[np.ndarray | None] = [None] * TABLES
        for b in batches[:10]:  # warm: the rows exist
            flat, step = c.forward(b, starts, none)
            c.push(c.backward(step, np.ones_like(flat)))
        tf = tb = tp = 0.0
        rows = 0
        for i in range(steps):
            b = batches[i % len(batches)]
            t0 = time.perf_counter()
            flat, step = c.forward(b, starts, none)
            t1 = time.perf_counter()
            g = c.backward(step, np.ones_like(flat))
            t2 = time.perf_counter()
            c.push(g)
            t3 = time.perf_counter()
            tf, tb, tp, rows = tf + t1 - t0, tb + t2 - t1, tp + t3 - t2, rows + step.rows
        print(
            f"per step: forward {tf / steps * 1e3:.3f} ms, backward {tb / steps * 1e3:.3f} ms, "
            f"push {tp / steps * 1e3:.3f} ms; {rows / steps:,.0f} distinct rows per step"
        )


if __name__ == "__main__":
    main()
