"""The DLRM model and its evaluation, shared by ``train.py`` and ``bench/dlrm_compare.py``.

Bottom MLP over the 13 integer features, one pooled embedding per categorical feature,
pairwise dot interaction of the 27 vectors, top MLP to one logit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import embank.datasets as ds
import numpy as np
import torch
from torch import nn


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``tables``: one module taking the ``(n, 26)`` ids and returning ``feature name ->
    (n, dim)`` pooled rows in feature order (``embank.torch.EmbeddingBagCollection``
    does); its parameters, if any, are not the dense part's."""

    def __init__(self, tables: nn.Module, dim: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        self.tables = tables
        self.bottom = mlp([ds.NUM_DENSE, *bottom, dim], last_relu=True)
        f = ds.NUM_SPARSE + 1
        self.top = mlp([dim + f * (f - 1) // 2, *top, 1], last_relu=False)
        self.register_buffer("tri", torch.triu_indices(f, f, offset=1), persistent=False)

    def dense_parameters(self) -> list[nn.Parameter]:
        """What a torch optimizer trains: every parameter outside ``tables``."""
        return [p for n, p in self.named_parameters() if not n.startswith("tables.")]

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.stack([x, *self.tables(sparse).values()], dim=1)  # (n, f, dim)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order]
    ranks = np.empty(len(s), dtype=np.float64)
    i = 0
    while i < len(s):  # average ranks of ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def evaluate(model: DLRM, batches: Iterable[ds.Batch], ranks: Any = None) -> dict[str, float]:
    """AUC and log loss; with ``ranks`` (``ranks.Ranks``) every rank scores its share of
    each batch and the scores of all ranks are gathered, in the order one process
    would have them."""
    model.eval()
    labels, scores = [], []
    with torch.no_grad():
        for b in batches:
            scores.append(torch.sigmoid(model(torch.from_numpy(b.dense), torch.from_numpy(b.sparse))).numpy())
            labels.append(b.labels)
    model.train()
    if ranks is not None:
        labels, scores = ranks.gather(labels, scores)
    y, p = np.concatenate(labels), np.concatenate(scores).astype(np.float64)
    pc = np.clip(p, 1e-7, 1 - 1e-7)
    return {
        "auc": auc(y, p),
        "logloss": float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc))),
        "examples": len(y),
    }
