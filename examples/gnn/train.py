#!/usr/bin/env python3
"""A GraphSAGE-style GNN whose node features are learned embeddings in an embank table
larger than its row cache, with neighbour-sampled mini-batches and ``lookahead``.

    python examples/gnn/train.py --nodes 2000000 --work /tmp/gnn
    python examples/gnn/train.py --nodes 2000000 --work /tmp/gnn --no-lookahead

Graph: a synthetic power-law graph (each node links to ``--degree`` others drawn with
Zipf popularity, so a few hubs are everyone's neighbours). Task: link prediction, as in
unsupervised GraphSAGE: a step takes a batch of edges ``(u, v)`` and as many random
negatives ``(u, n)``, samples ``--fanout`` neighbours of every node involved, embeds
each node as ``relu(W [x_node ; mean(x_neighbours)])`` and trains with binary
cross-entropy on the dot products. ``x`` is a learned table in embank (block medium,
Adagrad in the store, a row cache of ``--cache-fraction`` of the table); ``W`` is dense
(torch Adagrad). With lookahead (the default) the next batch's sampled nodes are
handed to ``Table.lookahead`` while the current one trains. Reports the loss, edges
per second and the row cache's hit rate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import embank
import embank.torch as et
import numpy as np
import torch
from torch import nn


def power_law_graph(n: int, degree: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR adjacency (offsets, neighbours) of ``n`` nodes, each linked to ``degree``
    others of Zipf(1.1) popularity (ranks scrambled over the ids), both directions."""
    rng = np.random.default_rng(seed)
    src = np.repeat(np.arange(n, dtype=np.int64), degree)
    rank = (rng.zipf(1.1, n * degree) - 1) % n
    dst = (rank * 2654435761 + 12345) % n
    both_src = np.concatenate([src, dst])
    both_dst = np.concatenate([dst, src])
    order = np.argsort(both_src, kind="stable")
    nbrs = both_dst[order].astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(both_src, minlength=n), out=offsets[1:])
    return offsets, nbrs


class Batch:
    def __init__(self, nodes: np.ndarray, sampled: np.ndarray, pairs: np.ndarray, labels: np.ndarray) -> None:
        self.nodes = nodes  # (m,) distinct nodes the batch embeds
        self.sampled = sampled  # (m, fanout) neighbours of each (ids)
        self.pairs = pairs  # (b, 2) positions in `nodes`
        self.labels = labels  # (b,) 1 for an edge, 0 for a negative

    def all_ids(self) -> np.ndarray:
        return np.unique(np.concatenate([self.nodes, self.sampled.reshape(-1)]))


def batches(
    offsets: np.ndarray, nbrs: np.ndarray, n: int, size: int, fanout: int, steps: int, seed: int
) -> Iterator[Batch]:
    rng = np.random.default_rng(seed)
    deg = np.diff(offsets)
    for _ in range(steps):
        u = rng.integers(0, n, size)
        pick = offsets[u] + (rng.random(size) * deg[u]).astype(np.int64)
        v = nbrs[pick]
        neg = rng.integers(0, n, size)
        ends = np.concatenate([u, v, u, neg])
        nodes, inv = np.unique(ends, return_inverse=True)
        d = deg[nodes]
        sampled = nbrs[
            offsets[nodes][:, None] + (rng.random((len(nodes), fanout)) * d[:, None]).astype(np.int64)
        ]
        pairs = inv.reshape(4, size)
        pairs = np.concatenate([np.stack([pairs[0], pairs[1]], 1), np.stack([pairs[2], pairs[3]], 1)])
        labels = np.concatenate([np.ones(size, np.float32), np.zeros(size, np.float32)])
        yield Batch(nodes, sampled, pairs, labels)


class Sage(nn.Module):
    def __init__(self, features: nn.Module, dim: int, hidden: int) -> None:
        super().__init__()
        self.x = features
        self.lin = nn.Linear(2 * dim, hidden)

    def forward(self, b: Batch) -> torch.Tensor:
        ids = torch.from_numpy(b.all_ids())
        rows = self.x(ids)  # one pull for the batch's nodes and sampled neighbours
        pos = torch.from_numpy(np.searchsorted(b.all_ids(), b.nodes))
        npos = torch.from_numpy(np.searchsorted(b.all_ids(), b.sampled))
        h = torch.relu(self.lin(torch.cat([rows[pos], rows[npos].mean(1)], 1)))
        p = torch.from_numpy(b.pairs)
        return (h[p[:, 0]] * h[p[:, 1]]).sum(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--nodes", type=int, default=2_000_000)
    ap.add_argument("--degree", type=int, default=8)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--fanout", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=512, help="positive edges per step (as many negatives)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--cache-fraction", type=float, default=0.05, help="row cache as this fraction of the table"
    )
    ap.add_argument("--no-lookahead", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--metrics-out", type=Path, default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    offsets, nbrs = power_law_graph(args.nodes, args.degree, args.seed)
    graph_s = time.perf_counter() - t0
    store_dir = args.work / "store"
    shutil.rmtree(store_dir, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    # A row's record: the row and its Adagrad state, dim floats each.
    table_bytes = args.nodes * args.dim * 8
    store = embank.open(store_dir, cache_bytes=max(1 << 20, int(table_bytes * args.cache_fraction)))
    x = store.create_table(
        "nodes",
        dim=args.dim,
        init=embank.init.normal(0, 0.1),
        seed=args.seed,
        medium="block",
        capacity=args.nodes,
        optimizer=embank.optim.Adagrad(lr=args.lr, eps=1e-10),
    )
    # Every node has its row before training (a graph's embeddings exist; pulls then
    # read them from the medium instead of creating them).
    t2 = time.perf_counter()
    for lo in range(0, args.nodes, 1 << 16):
        x.pull(np.arange(lo, min(args.nodes, lo + (1 << 16)), dtype=np.uint64))
    store.flush()
    load_s = time.perf_counter() - t2
    model = Sage(et.Embedding(x), args.dim, args.hidden)
    dense = torch.optim.Adagrad(model.lin.parameters(), lr=args.lr)
    sparse = et.SparseOptimizer(model)
    loss_fn = nn.BCEWithLogitsLoss()
    it: Iterator[Batch] = batches(
        offsets, nbrs, args.nodes, args.batch_size, args.fanout, args.steps, args.seed
    )
    if not args.no_lookahead:
        it = et.lookahead(it, lambda b: {x: b.all_ids()})
    losses: list[float] = []
    base = x.stats()
    t1 = time.perf_counter()
    for step, b in enumerate(it):
        logits = model(b)
        loss = loss_fn(logits, torch.from_numpy(b.labels))
        dense.zero_grad()
        sparse.zero_grad()
        loss.backward()
        dense.step()
        sparse.step()
        losses.append(loss.item())
        if not args.quiet and (step + 1) % 50 == 0:
            print(f"step {step + 1}: loss {np.mean(losses[-50:]):.4f}", file=sys.stderr)
    seconds = time.perf_counter() - t1
    st = x.stats()
    hits, misses = st["cache_hits"] - base["cache_hits"], st["cache_misses"] - base["cache_misses"]
    k = max(1, len(losses) // 10)
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "edges": len(nbrs),
        "graph_seconds": graph_s,
        "load_seconds": load_s,
        "lookahead": not args.no_lookahead,
        "cache_bytes": store.stats()["cache"]["budget_bytes"],
        "table_rows": st["rows"],
        "steps": len(losses),
        "seconds": seconds,
        "edges_per_s": len(losses) * 2 * args.batch_size / seconds,
        "loss_first": float(np.mean(losses[:k])),
        "loss_last": float(np.mean(losses[-k:])),
        "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
        "lookahead_rows": st["lookahead_rows"] - base["lookahead_rows"],
    }
    print(
        f"{'with' if result['lookahead'] else 'without'} lookahead: loss {result['loss_first']:.4f} -> "
        f"{result['loss_last']:.4f}, {result['edges_per_s']:,.0f} edges/s, row-cache hit rate "
        f"{(result['cache_hit_rate'] or 0) * 100:.1f} %",
        file=sys.stderr,
    )
    if args.metrics_out:
        args.metrics_out.write_text(json.dumps(result, indent=1))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
