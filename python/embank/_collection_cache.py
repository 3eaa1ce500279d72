"""An :class:`~embank.torch.EmbeddingBagCollection` trained through **one**
:class:`~embank.gpu.TrainCache` over all its tables (``from_configs(...,
train_cache_rows=N, shared_train_cache=True)``): a step's ids of every feature are made
the cache's keys (``(table index << 48) | id``), deduplicated once, found and placed in
one call, pooled in one ``embedding_bag`` and their gradient applied in one update,
instead of one of each a feature. The results are the per-table caches' (the same rows,
the same update a step; a table read by several features sums their gradients in
another order, so within float rounding)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._gpu_writer import TABLE_SHIFT
from ._gradients import _StepCounter
from .errors import InvalidInputError
from .gpu import TrainCache


class SharedCacheBags:
    """The collection's side of a shared cache: each feature's table index in it, the
    step counter (push="backward": each backward is a training step)."""

    def __init__(self, cache: TrainCache, index: list[int], bounds: list[int | None]) -> None:
        self.cache = cache
        self.index = index  # each feature's table in the cache
        self.bounds = bounds  # each feature's num_embeddings (None: unbounded)
        self.steps = _StepCounter()

    def forward(
        self,
        names: list[str],
        modes: list[str],
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        training: bool,
    ) -> list[torch.Tensor]:
        """Each feature's pooled rows ``(bags, dim)`` from ``inputs`` (values, bag
        starts, weights), in one find, one placement and one pooling."""
        cache, dev = self.cache, self.cache.device
        values = [v.reshape(-1).to(dev, torch.int64) for v, _, _ in inputs]
        offsets = [o.reshape(-1).to(dev, torch.int64) for _, o, _ in inputs]
        self._check(names, values)
        keys = torch.cat([v | (i << TABLE_SHIFT) for v, i in zip(values, self.index)])
        starts, at = [], 0
        for v, o in zip(values, offsets):
            starts.append(o + at)
            at += v.numel()
        mixed = len(set(modes)) > 1
        weighted = any(w is not None for _, _, w in inputs)
        weights = None
        if mixed or weighted:  # summed: MEAN bags weighted 1 / length, as the engine does
            parts = []
            for v, o, (_, _, w), mode in zip(values, offsets, inputs, modes):
                if mode == "mean" and mixed:
                    lengths = torch.diff(o, append=torch.tensor([v.numel()], device=dev))
                    parts.append(torch.repeat_interleave(1.0 / lengths.clamp(min=1).float(), lengths))
                elif w is not None:
                    parts.append(w.reshape(-1).to(dev, torch.float32))
                else:
                    parts.append(torch.ones(v.numel(), device=dev))
            weights = torch.cat(parts)
        uniq, inverse = torch.unique(keys, return_inverse=True)
        rows = cache.pull_unique(uniq)
        if training:
            rows.requires_grad_(True)
            step = self.steps.next(cache.tables)

            def hook(grad: torch.Tensor) -> None:
                cache.add_grad(uniq, grad.detach().to(torch.float32), step)

            rows.register_hook(hook)  # type: ignore[no-untyped-call]
        mode = "sum" if weights is not None else modes[0]
        pooled = F.embedding_bag(inverse, rows, torch.cat(starts), mode=mode, per_sample_weights=weights)
        return list(torch.split(pooled, [o.numel() for o in offsets]))

    def _check(self, names: list[str], values: list[torch.Tensor]) -> None:
        """Ids non-negative, below 2**48 and each table's ``num_embeddings``: one wait for
        the device for every feature."""
        present = [(n, v, b) for n, v, b in zip(names, values, self.bounds) if v.numel()]
        if not present:
            return
        ends = torch.stack([torch.stack([v.min(), v.max()]) for _, v, _ in present]).tolist()
        for (name, _, bound), (low, top) in zip(present, ends):
            if low < 0:
                raise InvalidInputError(f"feature {name!r}: ids must be non-negative, got {low}")
            if bound is not None and top >= bound:
                raise InvalidInputError(
                    f"feature {name!r}: id {top} is not below num_embeddings {bound} "
                    "(TorchRec's collection refuses it too); from_configs(..., "
                    "allow_ids_beyond_num_embeddings=True) lets the table grow past it"
                )
            if top >> TABLE_SHIFT:
                raise InvalidInputError(
                    f"feature {name!r}: id {top} is not below 2**{TABLE_SHIFT} (a shared train cache's)"
                )


def shared_inputs(features: Any, names: list[str], jagged: Any) -> list[Any]:
    """Each feature's (values, offsets, weights) tensors, from a ``(batch, features)``
    tensor (one id a bag) or the jagged input (``jagged``: the collection's reading)."""
    if isinstance(features, torch.Tensor):
        if features.dim() != 2 or features.shape[1] != len(names):
            raise InvalidInputError(
                f"a tensor of ids must be (batch, {len(names)}): one id per feature per example; "
                f"got shape {tuple(features.shape)}"
            )
        starts = torch.arange(features.shape[0], dtype=torch.int64, device=features.device)
        return [(features[:, j], starts, None) for j in range(len(names))]
    out = []
    for name in names:
        v, o, *w = jagged[name]
        wt = w[0] if w else None
        out.append(
            (
                torch.as_tensor(v),
                torch.as_tensor(o),
                None if wt is None else torch.as_tensor(wt),
            )
        )
    return out
