#!/usr/bin/env python3
"""The embedding half of the DLRM step alone, embank against TorchRec, in one process.

Both sides train the same 26 features of dim 16 (Adagrad, lr 0.05, sum pooling, batch
512, one id per feature and example, DLRM-like Zipf ids over 100,000 rows each) through
their PyTorch modules, as ``bench/dlrm_compare.py`` uses them:

- embank: ``embank.torch.EmbeddingBagCollection`` over 26 tables on the mmap medium,
  forward, ``backward`` of the pooled output, ``SparseOptimizer.step``;
- TorchRec: ``FusedEmbeddingBagCollection`` (fbgemm's CPU kernels, Adagrad fused into
  backward) over the same ids, forward and backward.

The loss is the same linear function of the pooled output on both sides (a fixed random
projection), so both do the same work per step: no dense network, whose cost is the
same for both in the DLRM run. Rounds alternate between the two on the same batches;
torch runs on 2 threads (``--threads``). Reports examples/s per round, the medians and
their ratio. Needs TorchRec and fbgemm-gpu-cpu (``pip install --no-deps torchrec
fbgemm-gpu-cpu``; only for this comparison)::

    python bench/ebc_vs_torchrec.py [--rounds 7] [--steps 150] [--threads 2] [--ids zipf|dlrm]

``--swap``: the drop-in of issue 35 instead: exact row-wise Adagrad on both sides (lr
0.05, eps 1e-8), embank's collection made by ``EmbeddingBagCollection.from_configs`` from
the same ``torchrec.EmbeddingBagConfig``s (``KeyedTensor`` out, the update in backward,
no ``SparseOptimizer``), both fed the same ``KeyedJaggedTensor``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import embank
import embank.torch as et
import numpy as np
import torch
from embank.datasets import synthetic_cardinalities

TABLES, DIM, BATCH, ROWS, LR = 26, 16, 512, 100_000, 0.05


def batches(n: int, seed: int, ids: str = "zipf") -> list[torch.Tensor]:
    """``n`` batches of (BATCH, TABLES) ids. ``zipf``: Zipf 1.2 folded onto ROWS rows per
    feature. ``dlrm``: as the DLRM example's synthetic set draws them, a power law of
    exponent 1.1 over each feature's cardinality (from ROWS down to 10, like Criteo's)."""
    rng = np.random.default_rng(seed)
    if ids == "zipf":
        return [torch.from_numpy((rng.zipf(1.2, (BATCH, TABLES)) % ROWS).astype(np.int64)) for _ in range(n)]
    cards = synthetic_cardinalities(ROWS)
    a = 1.0 - 1.1
    out = []
    for _ in range(n):
        cols = []
        for card in cards:
            x = ((float(card + 1) ** a - 1.0) * rng.random(BATCH) + 1.0) ** (1.0 / a)
            cols.append(np.clip(np.floor(x).astype(np.int64) - 1, 0, card - 1))
        out.append(torch.from_numpy(np.stack(cols, axis=1)))
    return out


class Embank:
    def __init__(self, path: str) -> None:
        self.store = embank.open(path)
        tables = [
            self.store.create_table(
                f"c{j}",
                dim=DIM,
                optimizer=embank.optim.Adagrad(lr=LR, eps=1e-10),
                init=embank.init.uniform(-0.05, 0.05),
                capacity=ROWS,
            )
            for j in range(TABLES)
        ]
        self.ebc = et.EmbeddingBagCollection({f"c{j}": t for j, t in enumerate(tables)}, mode="sum")
        self.opt = et.SparseOptimizer(self.ebc)

    def step(self, ids: torch.Tensor, proj: torch.Tensor) -> None:
        pooled = torch.stack(list(self.ebc(ids).values()), dim=1)  # (BATCH, TABLES, DIM)
        self.opt.zero_grad()
        (pooled * proj).sum().backward()
        self.opt.step()


class Swapped:
    """embank's from_configs collection, as a TorchRec model would hold it."""

    def __init__(self, path: str, torchrec: TorchRec) -> None:
        self.store = embank.open(path)
        optimizer = ("exact_rowwise_adagrad", {"lr": LR, "eps": 1e-8})
        self.ebc = et.EmbeddingBagCollection.from_configs(self.store, torchrec.configs, optimizer=optimizer)
        self.torchrec = torchrec

    def step(self, ids: torch.Tensor, proj: torch.Tensor) -> None:
        pooled = self.ebc(self.torchrec.features(ids)).to_dict()
        out = torch.stack([pooled[n] for n in self.torchrec.names], dim=1)
        (out * proj).sum().backward()  # row-wise Adagrad runs inside backward


class TorchRec:
    def __init__(self, rowwise: bool = False) -> None:
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.modules.embedding_configs import PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        self.kjt = KeyedJaggedTensor
        self.names = [f"c{j}" for j in range(TABLES)]
        self.configs = [
            EmbeddingBagConfig(
                name=f"t_{n}",
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=[n],
                pooling=PoolingType.SUM,
            )
            for n in self.names
        ]
        if rowwise:
            from torchrec.optim import RowWiseAdagrad

            kind, kwargs = RowWiseAdagrad, {"lr": LR, "eps": 1e-8}
        else:
            kind, kwargs = torch.optim.Adagrad, {"lr": LR, "eps": 1e-10}
        self.ebc = FusedEmbeddingBagCollection(
            self.configs, optimizer_type=kind, optimizer_kwargs=kwargs, device=torch.device("cpu")
        )
        self.lengths = torch.ones(BATCH * TABLES, dtype=torch.int32)

    def features(self, ids: torch.Tensor) -> object:
        return self.kjt.from_lengths_sync(keys=self.names, values=ids.t().reshape(-1), lengths=self.lengths)

    def step(self, ids: torch.Tensor, proj: torch.Tensor) -> None:
        pooled = self.ebc(self.features(ids)).to_dict()
        out = torch.stack([pooled[n] for n in self.names], dim=1)
        (out * proj).sum().backward()  # Adagrad runs inside backward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds of each (default 7)")
    p.add_argument("--steps", type=int, default=150, help="steps per round (default 150)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument(
        "--ids",
        choices=["zipf", "dlrm"],
        default="zipf",
        help="zipf: Zipf 1.2 over 100,000 rows per feature (default); dlrm: the DLRM example's "
        "synthetic draw (power law 1.1 over cardinalities from 100,000 down to 10)",
    )
    p.add_argument("--swap", action="store_true", help="row-wise Adagrad, embank through from_configs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = batches(50, seed=0, ids=args.ids)
    proj = torch.randn(BATCH, TABLES, DIM, generator=torch.Generator().manual_seed(1))
    reference = TorchRec(rowwise=args.swap)
    path = os.path.join(tempfile.mkdtemp(), "s")
    emb: Embank | Swapped = Swapped(path, reference) if args.swap else Embank(path)
    sides: dict[str, Embank | Swapped | TorchRec] = {"embank": emb, "torchrec": reference}
    for side in sides.values():  # warm: every row of the data exists, caches are warm
        for ids in data:
            side.step(ids, proj)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides.items()) if r % 2 == 0 else list(reversed(sides.items()))
        for name, side in order:
            t0 = time.perf_counter()
            for i in range(args.steps):
                side.step(data[i % len(data)], proj)
            rates[name].append(args.steps * BATCH / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:,.0f}" for n in sides) + " examples/s")
    med = {n: statistics.median(v) for n, v in rates.items()}
    per_round = [e / t for e, t in zip(rates["embank"], rates["torchrec"])]
    print(
        f"medians: embank {med['embank']:,.0f}, torchrec {med['torchrec']:,.0f} examples/s; "
        f"embank/torchrec {med['embank'] / med['torchrec']:.2f}x (ratio of medians), "
        f"{statistics.median(per_round):.2f}x (median of per-round ratios, "
        f"min {min(per_round):.2f}, max {max(per_round):.2f})"
    )
    emb.store.close()


if __name__ == "__main__":
    main()
