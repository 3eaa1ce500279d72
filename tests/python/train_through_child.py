"""One rank of test_train_through's torchrun run: trains a bag over a shared table on
`embank serve` shards, through a write-through TrainCache (``--cached``) or the table
alone, under SparseOptimizer(distributed=True); with the cache, checks after every step
that each row it caches equals the table's. Rank 0 writes the table's records at the end."""

from __future__ import annotations

import argparse
import os

import embank
import embank.optim as eo
import numpy as np
import torch
import torch.distributed as dist
from embank import gpu
from embank import torch as et
from embank._gpu_buckets import EMPTY

DIM, KEYS, STEPS = 8, 300, 12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addrs", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--optimizer", default="adagrad")
    ap.add_argument("--cached", action="store_true")
    ap.add_argument("--kernels", default="torch", help="the caches' kernels")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = embank.connect(a.addrs.split(","))
    opt = {"sgd": eo.SGD(lr=0.1), "adagrad": eo.Adagrad(lr=0.1), "adam": eo.Adam(lr=0.01)}[a.optimizer]
    if rank == 0:
        store.create_table(a.table, dim=DIM, optimizer=opt)
    dist.barrier()
    table = store.table(a.table)
    # Small buckets: rows evicted and read again every step.
    cache = (
        gpu.TrainCache(table, rows_max=48, slots=8, device="cpu", write="through", kernels=a.kernels)
        if a.cached
        else None
    )
    bag = et.EmbeddingBag(cache if cache is not None else table, mode="sum")
    sparse = et.SparseOptimizer(bag, distributed=True)
    w = torch.linspace(-1.0, 1.0, DIM)
    checked = 0
    for step in range(1, STEPS + 1):
        rng = np.random.default_rng(step * 100 + rank)
        ids = torch.from_numpy(((rng.zipf(1.3, 64) - 1) % KEYS).astype(np.int64)).reshape(16, 4)
        pooled = bag(ids)
        # A loss whose gradient depends on the rows: a stale row changes every later step.
        loss = (pooled * w).sum() + 0.5 * (pooled**2).sum()
        loss.backward()
        sparse.step()  # every rank's pushes done when it returns (a barrier)
        if cache is not None:
            held = cache.keys != EMPTY
            keys = cache.keys[held].numpy().astype(np.uint64)
            rec, found = table.lookup_with_state(keys)
            assert found.all(), f"rank {rank}, step {step}: a cached row the table lacks"
            got = cache.records[held].numpy()
            bad = np.nonzero((got != rec).any(axis=1))[0]
            assert bad.size == 0, (
                f"rank {rank}, step {step}: {bad.size} cached rows differ from the table's, "
                f"key {keys[bad[0]]}: {got[bad[0]]} against {rec[bad[0]]}"
            )
            checked += int(keys.size)
        dist.barrier()  # no rank reads the table for the check while another pushes
    if rank == 0:
        rec, found = table.lookup_with_state(np.arange(KEYS, dtype=np.uint64))
        rec[~found] = np.nan
        np.save(a.out, rec)
    if cache is not None:
        st = cache.stats()
        assert st["dirty"] == 0 and st["written_back"] == 0, st
        print(f"rank {rank}: {checked} cached rows checked, {st['evicted']} evicted, {st['hits']} hits")
        cache.close()
    store.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
