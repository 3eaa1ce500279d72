#!/usr/bin/env python3
"""Knowledge-graph embeddings with their tables in embank: DistMult with 1-N scoring.

    make kge-data                      # the Nations and UMLS graphs the pykeen wheel ships
    python examples/kge/train.py --dataset nations --work /tmp/kge
    python examples/kge/train.py --dataset nations --work /tmp/kge --baseline

Model: an entity table and a relation table (reciprocal relations added, so every
test triple is scored both ways as tail prediction). A step scores a batch of
``(head, relation)`` pairs against *every* entity, ``(e_h * w_r) @ E^T``, with binary
cross-entropy against all true tails (1-N scoring, "KvsAll"): the entity table is read
twice a step (the batch's heads, and all entities), and its gradients from both reads
are summed into one Adagrad update per row in the store. ``--baseline`` trains the same
model with ``torch.nn.Embedding(sparse=True)`` and ``torch.optim.Adagrad`` in DRAM,
starting from the same rows. Evaluation: filtered MRR and Hits@1/3/10 on the test
triples (ties ranked at their mean position).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import embank
import embank.torch as et
import numpy as np
import torch
from torch import nn

DATA_DEFAULT = Path(__file__).resolve().parents[2] / "tools" / "kge" / "data"


def read_graph(root: Path, name: str) -> dict[str, np.ndarray]:
    """Train/valid/test triples as id arrays; entities and relations numbered in sorted order."""
    d = root / name
    if not (d / "train.txt").exists():
        raise SystemExit(f"{d}/train.txt not found: run `make kge-data` (or give --data-dir)")
    parts = {
        s: [line.rstrip("\n").split("\t") for line in (d / f"{s}.txt").open()]
        for s in ("train", "valid", "test")
    }
    ents = sorted({x for rows in parts.values() for h, _, t in rows for x in (h, t)})
    rels = sorted({r for rows in parts.values() for _, r, _ in rows})
    ei, ri = {e: i for i, e in enumerate(ents)}, {r: i for i, r in enumerate(rels)}
    out = {
        s: np.array([[ei[h], ri[r], ei[t]] for h, r, t in rows], dtype=np.int64) for s, rows in parts.items()
    }
    out["sizes"] = np.array([len(ents), len(rels)])
    return out


class DistMult(nn.Module):
    """``score(h, r, t) = <e_h, w_r, e_t>`` over all tails at once."""

    def __init__(self, ent_batch: nn.Module, ent_all: nn.Module, rel: nn.Module, n_ent: int) -> None:
        super().__init__()
        self.ent_batch, self.ent_all, self.rel = ent_batch, ent_all, rel
        self.register_buffer("all_ids", torch.arange(n_ent), persistent=False)

    def forward(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        q = self.ent_batch(h) * self.rel(r)
        return q @ self.ent_all(self.all_ids).T


def init_rows(store: embank.Store, n: int, dim: int, seed: int, scale: float) -> torch.Tensor:
    """The rows embank's initializer gives ids 0..n: the baseline starts where embank does."""
    t = store.create_table(
        "init-scratch", dim=dim, init=embank.init.normal(0, scale), seed=seed, missing="init"
    )
    rows, _ = t.lookup(np.arange(n, dtype=np.uint64))
    store.drop_table("init-scratch")
    return torch.from_numpy(rows)


def evaluate(model: nn.Module, g: dict[str, np.ndarray], split: str) -> dict[str, float]:
    """Filtered ranks of the true tail of (h, r, ?) and, through the reciprocal relation,
    of the true head of (?, r, t)."""
    n_ent, n_rel = int(g["sizes"][0]), int(g["sizes"][1])
    known: dict[tuple[int, int], set[int]] = {}
    for s in ("train", "valid", "test"):
        for h, r, t in g[s].tolist():
            known.setdefault((h, r), set()).add(t)
            known.setdefault((t, r + n_rel), set()).add(h)
    triples = g[split]
    queries = np.concatenate(
        [triples[:, [0, 1, 2]], np.stack([triples[:, 2], triples[:, 1] + n_rel, triples[:, 0]], 1)]
    )
    ranks = []
    model.eval()
    with torch.no_grad():
        for lo in range(0, len(queries), 256):
            q = queries[lo : lo + 256]
            scores = model(torch.from_numpy(q[:, 0]), torch.from_numpy(q[:, 1])).numpy().astype(np.float64)
            for i, (h, r, t) in enumerate(q.tolist()):
                s = scores[i]
                target = s[t]
                others = [x for x in known[(h, r)] if x != t]
                s[others] = -np.inf
                greater = int((s > target).sum())
                equal = int((s == target).sum()) - 1
                ranks.append(1 + greater + equal / 2)
    model.train()
    r = np.array(ranks)
    del n_ent
    return {
        "mrr": float(np.mean(1 / r)),
        "hits@1": float(np.mean(r <= 1)),
        "hits@3": float(np.mean(r <= 3)),
        "hits@10": float(np.mean(r <= 10)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["nations", "umls"], default="nations")
    p.add_argument("--data-dir", type=Path, default=DATA_DEFAULT, help="where `make kge-data` put the graphs")
    p.add_argument("--work", type=Path, required=True, help="directory for the store")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1, help="Adagrad learning rate of both tables")
    p.add_argument("--init-std", type=float, default=0.1, help="rows start normal(0, init-std)")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--baseline", action="store_true", help="torch.nn.Embedding(sparse=True) + torch Adagrad in DRAM"
    )
    p.add_argument("--metrics-out", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = read_graph(args.data_dir, args.dataset)
    n_ent, n_rel = int(g["sizes"][0]), int(g["sizes"][1])
    args.work.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.rmtree(args.work / "store", ignore_errors=True)
    store = embank.open(args.work / "store")
    opt = embank.optim.Adagrad(lr=args.lr, eps=1e-10)
    if args.baseline:
        ent = nn.Embedding(n_ent, args.dim, sparse=True)
        rel = nn.Embedding(2 * n_rel, args.dim, sparse=True)
        with torch.no_grad():
            ent.weight.copy_(init_rows(store, n_ent, args.dim, args.seed, args.init_std))
            rel.weight.copy_(init_rows(store, 2 * n_rel, args.dim, args.seed + 1, args.init_std))
        model = DistMult(ent, ent, rel, n_ent)
        sparse: Any = torch.optim.Adagrad([ent.weight, rel.weight], lr=args.lr, eps=1e-10)
    else:
        init = embank.init.normal(0, args.init_std)
        ents = store.create_table("entities", dim=args.dim, init=init, seed=args.seed, optimizer=opt)
        rels = store.create_table("relations", dim=args.dim, init=init, seed=args.seed + 1, optimizer=opt)
        # The entity table is read twice a step: the batch's heads, and every entity.
        model = DistMult(et.Embedding(ents), et.Embedding(ents), et.Embedding(rels), n_ent)
        sparse = et.SparseOptimizer(model)

    # 1-N training pairs: (h, r) -> all true tails, with reciprocal relations.
    tr = g["train"]
    pairs: dict[tuple[int, int], list[int]] = {}
    for h, r, t in tr.tolist():
        pairs.setdefault((h, r), []).append(t)
        pairs.setdefault((t, r + n_rel), []).append(h)
    keys = np.array(sorted(pairs), dtype=np.int64)
    loss_fn = nn.BCEWithLogitsLoss()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        order = rng.permutation(len(keys))
        total = 0.0
        for lo in range(0, len(order), args.batch_size):
            b = keys[order[lo : lo + args.batch_size]]
            target = torch.zeros(len(b), n_ent)
            for i, (h, r) in enumerate(b.tolist()):
                target[i, pairs[(h, r)]] = 1.0
            target = target * (1 - args.label_smoothing) + args.label_smoothing / n_ent
            logits = model(torch.from_numpy(b[:, 0]), torch.from_numpy(b[:, 1]))
            loss = loss_fn(logits, target)
            sparse.zero_grad()
            loss.backward()
            sparse.step()
            total += loss.item() * len(b)
            steps += 1
        if not args.quiet:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {total / len(keys):.5f}", file=sys.stderr)
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "mode": "baseline" if args.baseline else "embank",
        "dataset": args.dataset,
        "entities": n_ent,
        "relations": n_rel,
        "epochs": args.epochs,
        "steps": steps,
        "seconds": seconds,
        "triples_per_s": args.epochs * 2 * len(tr) / seconds,
        "final_loss": total / len(keys),
        **evaluate(model, g, "test"),
    }
    print(
        f"{result['mode']}: test MRR {result['mrr']:.4f}, Hits@1 {result['hits@1']:.4f}, "
        f"Hits@10 {result['hits@10']:.4f} ({result['triples_per_s']:,.0f} triples/s)",
        file=sys.stderr,
    )
    if args.metrics_out:
        args.metrics_out.write_text(json.dumps(result, indent=1))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
