#!/usr/bin/env python3
"""TorchRec's own DLRM, its embedding tables swapped for embank's in one line.

    python examples/torchrec_swap/train.py --ebc torchrec --work /tmp/trec   # TorchRec, FBGEMM
    python examples/torchrec_swap/train.py --ebc embank --work /tmp/trec     # the same model in embank
    python examples/torchrec_swap/train.py --ebc embank --optimizer ftrl --work /tmp/trec

The model is ``torchrec.models.dlrm.DLRM`` over 26 pooled categorical features of
synthetic Criteo-format click logs (``embank.datasets``; ids modulo each table's size).
TorchRec trains the tables with FBGEMM's fused exact row-wise Adagrad on the CPU
(``FusedEmbeddingBagCollection``); embank with the same optimizer in the store. The
only difference between the two runs is the line marked SWAP. Both start from the same
rows (TorchRec's initial tables, loaded into embank with ``embank.torch.load_state_dict``)
and see the same batches; the dense part (Adagrad) is the same code. Prints one JSON
line: examples/s of the training loop (batches prebuilt, evaluation excluded), test AUC
and, for embank, the share of embedding values that are exactly zero.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import embank
import embank.datasets as ds
import embank.torch as et
import numpy as np
import torch
import torchrec
from torchrec.models.dlrm import DLRM
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

DIM = 16
FEATURES = [f"c{j + 1}" for j in range(ds.NUM_SPARSE)]


def load(path: Path, rows: int, part: int, sizes: list[int], batch: int) -> list[tuple[Any, Any, Any]]:
    """Batches of (dense, KeyedJaggedTensor, labels), the Criteo file parsed once (and
    kept beside it as .npz for the next run)."""
    parsed = path.with_suffix(f".{rows}.npz")
    if not parsed.exists():
        ds.write_synthetic(path, rows, seed=0, part=part)
        parts = list(ds.read_criteo(path, 65_536))
        np.savez(
            parsed,
            **{k: np.concatenate([getattr(b, k) for b in parts]) for k in ("dense", "sparse", "labels")},
        )
    with np.load(parsed) as f:
        dense, sparse, labels = f["dense"], f["sparse"], f["labels"]
    out = []
    for i in range(0, len(labels), batch):
        b = ds.Batch(dense[i : i + batch], sparse[i : i + batch], labels[i : i + batch].copy())
        ids = b.sparse % np.asarray(sizes, dtype=np.int64)  # one id per feature per example
        kjt = torchrec.KeyedJaggedTensor(
            keys=FEATURES,
            values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
            lengths=torch.ones(ids.size, dtype=torch.int32),
        )
        out.append((torch.from_numpy(b.dense), kjt, torch.from_numpy(b.labels)))
    return out


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ranks, ties averaged)."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ebc", choices=["torchrec", "embank"], required=True)
    p.add_argument("--optimizer", choices=["rowwise_adagrad", "ftrl"], default="rowwise_adagrad")
    p.add_argument("--rows", type=int, default=400_000, help="training examples (test: a fifth)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--l1", type=float, default=1e-4, help="FTRL's L1 strength")
    p.add_argument("--beta", type=float, default=0.0, help="FTRL's beta")
    p.add_argument("--ftrl-init", type=float, default=1e-6, help="FTRL's initial accumulator n")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    # Table sizes: twice each feature's distinct values (its ids hashed into them).
    sizes = [2 * c for c in ds.synthetic_cardinalities()]
    train = load(args.work / "train.tsv", args.rows, 0, sizes, args.batch_size)
    test = load(args.work / "test.tsv", args.rows // 5, 1, sizes, 8192)

    tables = [
        torchrec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
        for f, n in zip(FEATURES, sizes)
    ]
    optimizer: Any = (torchrec.optim.RowWiseAdagrad, {"lr": args.lr, "eps": 1e-8})
    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=optimizer[0], optimizer_kwargs=optimizer[1], device=torch.device("cpu")
    )
    if args.ebc == "embank":
        if args.optimizer == "ftrl":  # FBGEMM has no FTRL: embank's own optimizer object
            optimizer = embank.optim.Ftrl(
                lr=args.lr, l1=args.l1, beta=args.beta, initial_accumulator_value=args.ftrl_init
            )
        start = ebc.state_dict()  # the same starting rows as the TorchRec run
        store = embank.open(tempfile.mkdtemp(dir=args.work, prefix="store-"))
        ebc = et.EmbeddingBagCollection.from_configs(store, tables, optimizer=optimizer)  # SWAP
        et.load_state_dict(store, start)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=ds.NUM_DENSE,
        dense_arch_layer_sizes=[64, DIM],
        over_arch_layer_sizes=[64, 32, 1],
    )
    # The tables train in backward (fused); the dense optimizer sees the rest only.
    dense = [p for n, p in model.named_parameters() if "embedding_bag_collection" not in n]
    dense_optimizer = torch.optim.Adagrad(dense, lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    t0 = time.perf_counter()
    for x, kjt, y in train:
        loss = loss_fn(model(x, kjt).squeeze(1), y)
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
    seconds = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        scores = np.concatenate([torch.sigmoid(model(x, kjt)).squeeze(1).numpy() for x, kjt, _ in test])
    labels = np.concatenate([y.numpy() for _, _, y in test])
    result: dict[str, Any] = {
        "ebc": args.ebc,
        "optimizer": args.optimizer,
        "examples_per_s": round(sum(len(y) for *_, y in train) / seconds),
        "auc": round(auc(labels, scores), 4),
    }
    if args.ebc == "embank":
        # Exact zeros among the embedding values of the rows training touched (the
        # others keep their initial values): what FTRL's L1 leaves.
        zeros = total = 0
        for j, t in enumerate(tables):
            seen = np.unique(np.concatenate([kjt[FEATURES[j]].values().numpy() for _, kjt, _ in train]))
            rows, _ = store.table(t.name).lookup(seen.astype(np.uint64))
            zeros, total = zeros + int((rows == 0).sum()), total + rows.size
        result["zero_share_of_trained_rows"] = round(zeros / total, 4)
        store.close()
        shutil.rmtree(store.path)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
