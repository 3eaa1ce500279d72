"""``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag`` over one embank table (or a
worker of it, in eval mode a :class:`embank.gpu.GpuCache`, or a
:class:`embank.gpu.TrainCache`): each forward pulls the batch's unique rows, backward
hands their gradient to the table's optimizer (a TrainCache's: on its device)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ._device import _to_device, gather_rows
from ._gradients import _pending_for, _StepCounter
from ._jagged import _to_keys
from ._table import Source, Table, Worker, _table_of
from .errors import InvalidInputError
from .gpu import GpuCache, TrainCache

__all__ = ["Embedding", "EmbeddingBag"]


class _Lookup(torch.nn.Module):
    """Pulls the unique rows of a batch as a leaf tensor whose gradient goes to the store."""

    _where: torch.Tensor

    def __init__(self, source: Source | GpuCache | TrainCache, push: str) -> None:
        super().__init__()
        self.cache: GpuCache | None = None
        # Training on the device: pulls from it, gradients applied there (see embank.gpu).
        self.trainer: TrainCache | None = None
        if isinstance(source, GpuCache):
            # Eval-mode lookups answered on the cache's device (see embank.gpu).
            self.cache, source = source, source.table
        if isinstance(source, TrainCache):
            if len(source.tables) > 1:
                raise InvalidInputError(
                    "a module pulls one table: a TrainCache over several is pulled by keys_of(table, ids)"
                )
            self.trainer, source = source, source.table
        if push not in ("step", "backward"):
            raise InvalidInputError(f'push must be "step" or "backward", got {push!r}')
        if not isinstance(source, (Table, Worker)):
            raise InvalidInputError(f"expected an embank Table or Worker, got {type(source).__name__}")
        self.source = source
        self.push = push
        self.table = _table_of(source)
        self.dim = self.table.dim
        # A TrainCache's gradients go to it (as device tensors), a step's summed there.
        self.pending = _pending_for(self.trainer if self.trainer is not None else source)  # type: ignore[arg-type]
        # push="backward": each backward is a training step (FBGEMM's fused backward).
        self._steps = _StepCounter()
        # Moved by ``module.to(device)`` with the model: where outputs go (not saved).
        self.register_buffer("_where", torch.empty(0), persistent=False)

    def output_device(self, ids: torch.Tensor) -> torch.device:
        """Where outputs go: the ids' device when it is not the CPU, else the module's."""
        return ids.device if ids.device.type != "cpu" else self._where.device

    def cached_rows(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Every id's row (no unique) from the GpuCache, on ``device``."""
        assert self.cache is not None
        if torch.is_grad_enabled() and self.training:
            raise InvalidInputError(
                "a GpuCache answers lookups in eval mode or under torch.no_grad(); train through the table"
            )
        # No torch.unique: it would wait for the device, and the cache answers repeats
        # from the device anyway (one host sync a lookup).
        return self.cache.lookup(ids.reshape(-1)).to(device)

    def unique_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unique rows ``(u, dim)`` on the host (a TrainCache's: on its device; a leaf
        that requires grad when training) and the inverse index of ``ids``."""
        training = torch.is_grad_enabled() and self.training
        if self.trainer is not None:
            return self._trainer_rows(ids, training)
        uniq, inverse = torch.unique(ids.reshape(-1).to("cpu"), sorted=True, return_inverse=True)
        keys = _to_keys(uniq, "ids")
        # A worker's pull holds keys until their gradient is pushed: only when training.
        rows = torch.from_numpy((self.source if training else self.table).pull(keys))
        if training:
            rows.requires_grad_(True)
            rows.register_hook(self._hook(keys))  # type: ignore[no-untyped-call]
        return rows, inverse

    def _trainer_rows(self, ids: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        trainer = self.trainer
        assert trainer is not None
        uniq, inverse = torch.unique(ids.reshape(-1).to(trainer.device), return_inverse=True)
        rows = trainer.pull_unique(uniq)
        if training:
            rows.requires_grad_(True)

            def hook(grad: torch.Tensor) -> None:
                g = grad.detach().to(torch.float32)
                if self.push == "backward":
                    # One update a step: a table's features each have a module.
                    trainer.add_grad(uniq, g, self._steps.next([self.table]))
                else:
                    self.pending.add(uniq, g)  # type: ignore[arg-type]

            rows.register_hook(hook)  # type: ignore[no-untyped-call]
        return rows, inverse

    def _hook(self, keys: npt.NDArray[np.uint64]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            g = np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy())
            if self.push == "backward":
                self.source.push_grad(keys, g, self._steps.next([self.source]))
            else:
                self.pending.add(keys, g)

        return hook

    def extra_repr(self) -> str:
        return f"table={self.table.name!r}, dim={self.dim}, push={self.push!r}"


class Embedding(_Lookup):
    """``torch.nn.Embedding`` over an embank table: ``forward(ids)`` of any shape returns
    ``(*ids.shape, dim)``. Each unique id is pulled once per call."""

    def __init__(self, table: Source | GpuCache | TrainCache, *, push: str = "step") -> None:
        super().__init__(table, push)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = self.output_device(input)
        if self.cache is not None:
            return self.cached_rows(input, device).reshape(*input.shape, self.dim)
        rows, inverse = self.unique_rows(input)
        if self.trainer is not None:  # on the cache's device already
            return gather_rows(rows, inverse).reshape(*input.shape, self.dim).to(device)
        # On a device: the unique rows and the inverse go up, the rows' gradient comes down.
        rows, inverse = _to_device(rows, device), _to_device(inverse, device)
        return gather_rows(rows, inverse).reshape(*input.shape, self.dim)


class EmbeddingBag(_Lookup):
    """``torch.nn.EmbeddingBag`` over an embank table: ``forward(input, offsets,
    per_sample_weights)`` with the same meaning (1-D ``input`` with ``offsets``, or 2-D
    ``input`` of fixed-size bags), pooled by ``mode`` ``"sum"`` or ``"mean"``.

    ``pooled=True`` (inference): in eval mode, or under ``torch.no_grad()``, bags are
    pooled in the store by :meth:`embank.Table.lookup_pooled`, so a store opened with
    ``pooled_cache_bytes`` answers bags it has pooled before from its pooled-embedding
    cache. Ids are then read as ``lookup`` reads them: a missing id counts as the
    table's missing default (create the table with ``missing="init"`` to match what a
    pull would create) and nothing is stored."""

    def __init__(
        self,
        table: Source | GpuCache | TrainCache,
        mode: str = "sum",
        *,
        push: str = "step",
        pooled: bool = False,
    ) -> None:
        super().__init__(table, push)
        if pooled and self.trainer is not None:
            raise InvalidInputError("pooled=True pools in the store: it does not combine with a TrainCache")
        if pooled and self.cache is not None:
            raise InvalidInputError("pooled=True pools in the store: it does not combine with a GpuCache")
        if mode not in ("sum", "mean"):
            raise InvalidInputError(f'mode must be "sum" or "mean", got {mode!r}')
        self.mode = mode
        self.pooled = pooled

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input.dim() == 2:
            if offsets is not None:
                raise InvalidInputError("offsets must be None when input is 2-D (fixed-size bags)")
            n, size = input.shape
            offsets = torch.arange(0, n * size, size, dtype=torch.int64, device=input.device)
            input = input.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif input.dim() != 1 or offsets is None:
            raise InvalidInputError("input must be 1-D with offsets, or 2-D without")
        if per_sample_weights is not None and self.mode != "sum":
            raise InvalidInputError('per_sample_weights need mode="sum" (as in torch.nn.EmbeddingBag)')
        device = self.output_device(input)
        if self.pooled and not (torch.is_grad_enabled() and self.training):
            keys = _to_keys(input.reshape(-1).to("cpu"), "ids")
            w = (
                None
                if per_sample_weights is None
                else per_sample_weights.detach().to("cpu", torch.float32).numpy()
            )
            out = self.table.lookup_pooled(keys, offsets.to("cpu").numpy(), w, self.mode)
            return _to_device(torch.from_numpy(out), device)
        if self.cache is not None:
            if torch.is_grad_enabled() and self.training:
                raise InvalidInputError(
                    "a GpuCache answers lookups in eval mode or under torch.no_grad(); "
                    "train through the table"
                )
            # Found and pooled on the cache's device (one launch on the native path).
            pooled = self.cache.lookup_pooled(input, offsets, per_sample_weights, self.mode)
            return pooled.to(device)
        # Pooled on the host: on a device only the pooled rows go up and their gradient
        # comes down.
        rows, inverse = self.unique_rows(input)
        at = rows.device  # a TrainCache's device, else the host
        weights = None if per_sample_weights is None else per_sample_weights.to(at)
        pooled = F.embedding_bag(inverse, rows, offsets.to(at), mode=self.mode, per_sample_weights=weights)
        if self.trainer is not None:
            return pooled.to(device)
        return _to_device(pooled, device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}" + (", pooled=True" if self.pooled else "")
