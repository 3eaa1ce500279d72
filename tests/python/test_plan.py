"""`embank.plan` gives the numbers `embank plan` prints, and they are right on a trace
whose answer is known."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import embank
import numpy as np
import pytest


def test_plan_function_matches_the_command_and_a_known_trace(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    keys = (rng.zipf(1.3, 200_000) % 50_000).astype(np.uint64)
    np.save(tmp_path / "t.npy", keys)
    p = embank.plan({"t": keys}, dim=32, dtype="int8", cache_bytes=["256K", "2M"], budget_gpu="1M")
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [sys.executable, "-m", "embank", "plan", "--trace", f"t={tmp_path / 't.npy'}", "--dim", "32",
         "--dtype", "int8", "--cache-bytes", "256K,2M", "--budget-gpu", "1M", "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    q = json.loads(out.read_text())
    for d in (p, q):
        d.pop("seconds")
    assert p == q
    t = p["tables"][0]
    assert t["shape"]["dtype"] == "int8" and t["bytes"]["cache_entry_bytes"] == 32 + 8 + 96
    # A cache of the whole table misses only first accesses (within a row lost to sharding).
    full = t["row_cache_curve"][-1]["hit_rate"]
    assert abs(full - (1 - len(np.unique(keys)) / len(keys))) < 1e-4
    assert t["at_cache_bytes"][0]["hit_rate"] < t["at_cache_bytes"][1]["hit_rate"] <= full + 1e-3
    assert 0 < t["at_budget_gpu"]["hit_rate"] <= full + 1e-3


def test_store_wide_prediction_matches_training_steps_on_the_store(tmp_path: Path) -> None:
    """The DLRM example's access pattern, on the real store: 26 tables share one row
    cache on the block medium; each step pulls every table's distinct ids of a batch
    and pushes gradients back, the next batch read ahead. The planner's store-wide
    prediction (`--criteo --training --lookahead`) must land within 3 points of the
    hit rate the store counts, and count exactly the reads the store counts."""
    from embank import datasets as ds
    from embank import torch as et

    data = tmp_path / "train.tsv"
    ds.write_synthetic(data, 12_000, seed=3, scale=20_000)
    batch, dim = 256, 16
    batches = [b.sparse.copy() for b in ds.read_criteo([data], batch)]
    results = {}
    # With lookahead, a size well above two steps' rows (about 1.1 MiB here): nearer to
    # it, the rows read ahead and the ones in use contend, and how much depends on how
    # far ahead the maintenance thread gets (this loop has no compute to hide it behind:
    # at 2 MiB it measures about 4 points under the prediction, the DLRM example 1-3).
    for budget, ahead in ((4 << 20, True), (1 << 20, False), (2 << 20, False), (4 << 20, False)):
        p = embank.plan(
            criteo=[data], training=True, lookahead=ahead, batch=batch, dim=dim,
            optimizer="adagrad", cache_bytes=[budget],
        )  # fmt: skip
        store = embank.open(tmp_path / f"store-{budget}-{ahead}", cache_bytes=budget)
        tables = [
            store.create_table(f"c{j + 1}", dim=dim, optimizer=embank.optim.Adagrad(lr=0.05), medium="block")
            for j in range(ds.NUM_SPARSE)
        ]

        def keys_of(s: Any, tables: list[embank.Table] = tables) -> dict[embank.Table, Any]:
            return {t: s[:, j] for j, t in enumerate(tables)}

        steps = et.lookahead(batches, keys_of) if ahead else batches
        for sparse in steps:
            for j, t in enumerate(tables):
                keys = np.unique(sparse[:, j].astype(np.uint64))
                t.pull(keys)
            for j, t in enumerate(tables):
                keys = np.unique(sparse[:, j].astype(np.uint64))
                t.push_grad(keys, np.full((len(keys), dim), 1e-3, dtype=np.float32))
        st = store.stats()
        hits = sum(t["cache_hits"] for t in st["tables"])
        misses = sum(t["cache_misses"] for t in st["tables"])
        store.close()
        shutil.rmtree(tmp_path / f"store-{budget}-{ahead}")  # 26 block tables each: keep the disk small
        assert p["store"]["accesses"] == hits + misses
        predicted = p["store"]["at_cache_bytes"][0]["hit_rate"]
        results[(budget, ahead)] = (predicted, hits / (hits + misses))
    for (budget, ahead), (predicted, measured) in results.items():
        # Without lookahead nothing is left to timing but write-back (modelled): tighter.
        assert abs(predicted - measured) < (0.03 if ahead else 0.015), (budget, ahead, results)


def test_a_gpu_budget_sizes_a_training_cache_with_its_optimizer_state(tmp_path: Path) -> None:
    """With an optimizer, --budget-gpu also answers for a TrainCache: its rows carry their
    state, so the same bytes hold fewer rows than an inference cache, and TrainCache's
    ``bytes_max`` makes the cache the plan counted."""
    torch = pytest.importorskip("torch")
    from embank import gpu

    rng = np.random.default_rng(5)
    keys = (rng.zipf(1.2, 100_000) % 20_000).astype(np.uint64)
    p = embank.plan({"t": keys}, dim=16, optimizer="adagrad", budget_gpu="256K")
    t = p["tables"][0]
    entry = t["bytes"]["train_cache_entry_bytes"]
    assert entry == 4 * (16 + 16) + 17
    train, infer = t["at_budget_gpu_train"], t["at_budget_gpu"]
    assert train["rows"] == (256 << 10) / entry < infer["rows"]
    assert 0 < train["hit_rate"] < infer["hit_rate"]
    store = embank.open(str(tmp_path / "s"))
    table = store.create_table("t", dim=16, optimizer=embank.optim.Adagrad(lr=0.1))
    cache = gpu.TrainCache(table, bytes_max=256 << 10, device="cpu")
    assert int(train["rows"]) - cache.slots < cache.rows_max <= int(train["rows"])
    assert torch is not None
    cache.close()
    store.close()
    # Without an optimizer nothing trains: no training cache.
    assert embank.plan({"t": keys}, dim=16, budget_gpu="256K")["tables"][0]["at_budget_gpu_train"] is None
