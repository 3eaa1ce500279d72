"""An :class:`~embank.torch.EmbeddingBagCollection` trained through **one**
:class:`~embank.gpu.TrainCache` over all its tables (``from_configs(...,
train_cache_rows=N, shared_train_cache=True)``): a step's ids of every feature are made
the cache's keys (``(table index << 48) | id``), deduplicated once, found and placed in
one call, pooled in one ``embedding_bag`` and their gradient applied in one update,
instead of one of each a feature. The results are the per-table caches' (the same rows,
the same update a step; a table read by several features sums their gradients in
another order, so within float rounding)."""

from __future__ import annotations

import itertools
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
        self._made: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        names: list[str],
        modes: list[str],
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        training: bool,
    ) -> list[torch.Tensor]:
        """Each feature's pooled rows ``(bags, dim)`` from ``inputs`` (values, bag
        starts, weights), in one find, one placement and one pooling. The features are
        joined in a few operations whatever their number (a model of 26 features pays
        no launch a feature): one copy of the sizes up, no wait but the bounds check's."""
        dev = self.cache.device
        values = [v.reshape(-1).to(dev, torch.int64) for v, _, _ in inputs]
        offsets = [o.reshape(-1).to(dev, torch.int64) for _, o, _ in inputs]
        counts = [v.numel() for v in values]
        bags = [o.numel() for o in offsets]
        total = sum(counts)
        bases = list(itertools.accumulate(counts, initial=0))[:-1]
        sizes = torch.tensor([counts, bags, bases], dtype=torch.int64).to(dev, non_blocking=True)
        counts_t, bags_t, bases_t = sizes  # each feature's ids, bags, first id
        bits, bounds = self._constants(dev)
        vals = torch.cat(values)
        if total:
            per_value = torch.repeat_interleave(
                torch.stack([bits, bounds]), counts_t, dim=1, output_size=total
            )
            if bool(((vals < 0) | (vals >= per_value[1])).any()):  # the step's one wait but the cache's
                self._refuse(names, values)
            keys = vals | per_value[0]
        else:
            keys = vals
        starts = torch.cat(offsets) + torch.repeat_interleave(bases_t, bags_t, output_size=sum(bags))
        mixed = len(set(modes)) > 1
        weighted = any(w is not None for _, _, w in inputs)
        weights = None
        if mixed or weighted:  # summed: MEAN bags weighted 1 / length, as the engine does
            parts = []
            for v, o, (_, _, w), mode in zip(values, offsets, inputs, modes):
                if mode == "mean" and mixed:
                    lengths = torch.diff(o, append=torch.tensor([v.numel()], device=dev))
                    parts.append(
                        torch.repeat_interleave(
                            1.0 / lengths.clamp(min=1).float(), lengths, output_size=v.numel()
                        )
                    )
                elif w is not None:
                    parts.append(w.reshape(-1).to(dev, torch.float32))
                else:
                    parts.append(torch.ones(v.numel(), device=dev))
            weights = torch.cat(parts)
        mode = "sum" if weights is not None else modes[0]
        return self._pool(keys, starts, bags, mode, weights, training)

    def forward_dense(self, names: list[str], features: torch.Tensor, training: bool) -> list[torch.Tensor]:
        """:meth:`forward` of a ``(batch, features)`` tensor of ids (one id a bag: MEAN
        pools as SUM), joined in a handful of operations, none a feature."""
        dev = self.cache.device
        ids = features.to(dev, torch.int64)
        n, nf = ids.shape
        bits, bounds = self._constants(dev)
        if ids.numel() and bool(((ids < 0) | (ids >= bounds)).any()):
            self._refuse(names, list(ids.t()))
        keys = (ids | bits).t().reshape(-1)  # feature by feature, as the jagged path
        starts = torch.arange(n * nf, dtype=torch.int64, device=dev)
        return self._pool(keys, starts, [n] * nf, "sum", None, training)

    def _pool(
        self,
        keys: torch.Tensor,
        starts: torch.Tensor,
        bags: list[int],
        mode: str,
        weights: torch.Tensor | None,
        training: bool,
    ) -> list[torch.Tensor]:
        """The bags of ``keys`` pooled from the cache's rows, one find, placement and
        update for all; each feature's ``(bags, dim)``."""
        cache = self.cache
        uniq, inverse = torch.unique(keys, return_inverse=True)
        rows = cache.pull_unique(uniq)
        if training:
            rows.requires_grad_(True)
            step = self.steps.next(cache.tables)

            def hook(grad: torch.Tensor) -> None:
                cache.add_grad(uniq, grad.detach().to(torch.float32), step)

            rows.register_hook(hook)  # type: ignore[no-untyped-call]
        pooled = F.embedding_bag(inverse, rows, starts, mode=mode, per_sample_weights=weights)
        return list(torch.split(pooled, bags))

    def _constants(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each feature's key bits (its table's index << 48) and id bound (its table's
        num_embeddings, at most 2**48), on ``dev``: made once."""
        if self._made is None or self._made[0].device != dev:
            top = 1 << TABLE_SHIFT
            bits = torch.tensor([i << TABLE_SHIFT for i in self.index], dtype=torch.int64, device=dev)
            bounds = torch.tensor([top if b is None else min(b, top) for b in self.bounds], device=dev)
            self._made = (bits, bounds.to(torch.int64))
        return self._made

    def _refuse(self, names: list[str], values: list[torch.Tensor]) -> None:
        """Raises for the first feature with an id out of its bounds (a step refused)."""
        for name, v, bound in zip(names, values, self.bounds):
            if not v.numel():
                continue
            low, top = (int(x) for x in torch.stack([v.min(), v.max()]).tolist())
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
        raise InvalidInputError("an id is out of its feature's bounds")  # not reached


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
