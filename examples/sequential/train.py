#!/usr/bin/env python3
"""A sequential recommender (SASRec: a causal transformer over each user's item history
predicts the next item) whose item table is embank's, beside the same model on TorchRec's
``EmbeddingCollection``.

    python examples/sequential/train.py --work /tmp/seq

Synthetic histories: each user has a taste (one of ``--tastes`` groups of items) and
picks most items from it, popular ones more often, so the next item is predictable from
the ones before. One ``EmbeddingConfig`` (table ``item``) serves three features of each
batch: the history (``seq``), the next items (``pos``) and sampled negatives (``neg``),
as SASRec shares its item embeddings between input and output; the loss is SASRec's
binary cross-entropy of positives against negatives at every position.

The two models differ in one line (SWAP): TorchRec's ``EmbeddingCollection`` (its table
a parameter, trained by the dense optimizer with the rest) or
``embank.torch.EmbeddingCollection.from_configs`` (the rows in the store, trained by the
store's optimizer in backward: PyTorch's update of the rows a batch touched, which is
what the dense one does to the table). Both start from TorchRec's initial rows and the
same dense weights, and train step by step on the same batches, alternately. Prints one
JSON line: each side's loss every 20 steps, the largest per-step loss difference, and
each side's examples/s (median over steps 20 to the end, a step being forward, backward
and both optimizers).

``--optimizer sgd`` (default) keeps the two within float rounding (losses within 1e-6
over 200 steps). With ``adagrad`` they part by about 1e-3 within 200 steps, and neither
is wrong: some gradients are sums that cancel to almost nothing (an attention key's bias
has none at all in exact arithmetic), their last bits depend on the order each side sums
the rows' gradients in, and Adagrad's ``g / sqrt(sum of g**2)`` turns such a gradient into
a full step of either sign.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import embank
import embank.torch as et
import numpy as np
import torch
import torchrec

FEATURES = ["seq", "pos", "neg"]


def histories(args: argparse.Namespace, rng: np.random.Generator) -> np.ndarray:
    """``(users, length + 1)`` item ids: a taste per user, 85% of items from it (Zipf
    popularity within the taste), the rest from anywhere."""
    taste = rng.integers(0, args.tastes, size=(args.users, 1))
    per_taste = args.items // args.tastes
    within = (rng.zipf(1.2, size=(args.users, args.length + 1)) - 1) % per_taste
    items = taste * per_taste + within
    anywhere = rng.integers(0, args.items, size=items.shape)
    return np.where(rng.random(items.shape) < 0.85, items, anywhere)


def batch_kjt(seqs: np.ndarray, negatives: np.ndarray) -> Any:
    """The KJT of a batch: per user ``length`` ids of each feature (history, next items,
    negatives), one bag per user and feature."""
    users, length = seqs.shape[0], seqs.shape[1] - 1
    values = np.concatenate([seqs[:, :-1].ravel(), seqs[:, 1:].ravel(), negatives.ravel()])
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES,
        values=torch.from_numpy(values.astype(np.int64)),
        lengths=torch.full((3 * users,), length, dtype=torch.int64),
    )


class SASRec(torch.nn.Module):
    """Item rows (from the collection) plus learned positions, causal self-attention
    blocks, and dot products with the next item's and a negative's rows."""

    def __init__(self, items: torch.nn.Module, dim: int, length: int, blocks: int, heads: int) -> None:
        super().__init__()
        self.items, self.dim, self.length = items, dim, length
        self.positions = torch.nn.Embedding(length, dim)
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, kjt: Any) -> torch.Tensor:
        rows = self.items(kjt)  # {feature: JaggedTensor}, every id's row
        seq, pos, neg = (rows[f].values().view(-1, self.length, self.dim) for f in FEATURES)
        x = seq * math.sqrt(self.dim) + self.positions.weight
        h = self.norm(self.blocks(x, mask=self.causal, is_causal=True))
        logits = torch.stack([(h * pos).sum(-1), (h * neg).sum(-1)], -1)
        labels = torch.zeros_like(logits)
        labels[..., 0] = 1
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--tastes", type=int, default=50)
    p.add_argument("--users", type=int, default=25_600)
    p.add_argument("--length", type=int, default=20, help="history length (positions)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    p.add_argument("--lr", type=float, help="default: 5 for SGD (the loss is a mean), 0.05 for Adagrad")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else {"sgd": 5.0, "adagrad": 0.05}[args.optimizer]
    args.work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    data = histories(args, rng)
    batches = []
    for _ in range(args.steps):
        users = rng.integers(0, args.users, size=args.batch_size)
        negatives = rng.integers(0, args.items, size=(args.batch_size, args.length))
        batches.append(batch_kjt(data[users], negatives))

    tables = [
        torchrec.EmbeddingConfig(
            name="item", embedding_dim=args.dim, num_embeddings=args.items, feature_names=FEATURES
        )
    ]
    torch.manual_seed(0)
    torchrec_items = torchrec.EmbeddingCollection(tables=tables)
    store = embank.open(tempfile.mkdtemp(dir=args.work, prefix="store-"))
    optimizer = {"sgd": embank.optim.SGD, "adagrad": embank.optim.Adagrad}[args.optimizer](lr=lr)
    embank_items = et.EmbeddingCollection.from_configs(store, tables, optimizer=optimizer)  # SWAP
    et.load_state_dict(store, torchrec_items.state_dict())  # the same initial rows
    models, dense_optimizers = {}, {}
    for side, items in (("torchrec", torchrec_items), ("embank", embank_items)):
        torch.manual_seed(1)  # the same dense weights
        models[side] = SASRec(items, args.dim, args.length, args.blocks, args.heads)
        # TorchRec's table is one of these parameters; embank's rows are trained in backward.
        dense = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[args.optimizer]
        dense_optimizers[side] = dense(models[side].parameters(), lr=lr)

    losses: dict[str, list[float]] = {side: [] for side in models}
    seconds: dict[str, list[float]] = {side: [] for side in models}
    for kjt in batches:
        for side, model in models.items():
            t0 = time.perf_counter()
            loss = model(kjt)
            dense_optimizers[side].zero_grad()
            loss.backward()
            dense_optimizers[side].step()
            seconds[side].append(time.perf_counter() - t0)
            losses[side].append(float(loss.detach()))
    store.close()
    shutil.rmtree(store.path)

    rate = {side: args.batch_size / float(np.median(s[20:])) for side, s in seconds.items()}
    diff = np.abs(np.array(losses["embank"]) - np.array(losses["torchrec"]))
    result = {
        "steps": args.steps,
        "optimizer": args.optimizer,
        "loss_every_20": {side: [round(x, 4) for x in v[::20] + v[-1:]] for side, v in losses.items()},
        "loss_diff_max": float(diff.max()),
        "loss_diff_max_step": int(diff.argmax()),
        "examples_per_s": {side: round(r) for side, r in rate.items()},
        "embank_vs_torchrec": round(rate["embank"] / rate["torchrec"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
