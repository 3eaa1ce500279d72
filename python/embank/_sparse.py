"""The sparse optimizer of :mod:`embank.torch`: pushes the gradients its modules gathered
to their tables' own optimizers, once a step (delayed, or averaged over the ranks of a
``torch.distributed`` run)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ._collection import EmbeddingBagCollection, _FusedPending
from ._embedding import _Lookup
from ._gpu_shared import apply_global
from ._gpu_train import TrainCache
from ._gradients import _Pending, _StepCounter
from ._table import Source, _table_of
from .errors import InvalidInputError

__all__ = ["SparseOptimizer"]


def _lookups(modules: Iterable[torch.nn.Module]) -> list[_Lookup]:
    found: list[_Lookup] = []
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, _Lookup) and sub not in found:
                found.append(sub)
    return found


class SparseOptimizer:
    r"""Pushes the gradients gathered by embank modules to their tables' optimizers.

    ``modules``: the model (or its embank modules); every embank lookup inside is found.
    Call :meth:`step` where you call the dense optimizer's ``step`` and :meth:`zero_grad`
    with its ``zero_grad`` (drops what was gathered and not pushed). The update rule and
    learning rate are the table's (``create_table(optimizer=...)``, ``Table.set_lr``).

    ``delay=k`` pushes each step's gradients ``k`` steps later (stale synchronous
    training: the next k steps pull rows without them). With modules over
    :class:`~embank.Worker` objects of tables whose ``staleness_bound`` is at least k the store
    enforces the bound. :meth:`flush` pushes everything still delayed (before a
    checkpoint, an evaluation, the end).

    ``distributed=True`` (many trainer processes under ``torch.distributed``, e.g.
    ``torchrun``, the tables on shared ``embank serve`` shards): each step gathers every
    rank's gradients of each table, averages them as ``DistributedDataParallel``
    averages the dense ones, and pushes each row once, from the rank that owns it (key
    modulo world size), then waits at a barrier: every row gets one update per step
    with the whole global batch's gradient, whatever the ranks' timing, so a run is
    reproducible and matches one process training on the global batch. Modules over a
    :class:`~embank.gpu.TrainCache` made with ``write="through"`` train on each rank's
    device: each rank applies the global gradient to the rows it caches as the owner's
    push applies it to the table, so every cached row equals the table's after each step.

    Each step is numbered, from the tables' own :attr:`~embank.Table.optimizer_step` at
    the first one: every push of step t carries t, which FBGEMM's optimizers
    (:class:`~embank.optim.FbgemmAdam`, :class:`~embank.optim.Lamb`, ...) bias-correct
    every row of the step with, tables the step skips included. After
    ``store.restore(batch)``, make a new ``SparseOptimizer``: it counts on from the
    checkpoint's step.
    """

    def __init__(
        self,
        modules: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        delay: int = 0,
        distributed: bool = False,
    ) -> None:
        mods = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        lookups = _lookups(mods)
        collections = [
            sub for m in mods for sub in m.modules() if isinstance(sub, EmbeddingBagCollection) and sub.fused
        ]
        self._fused: list[_FusedPending] = []
        for c in collections:
            if c.push == "step" and c.pending not in self._fused:
                self._fused.append(c.pending)
        if not lookups and not collections:
            raise InvalidInputError("no embank Embedding/EmbeddingBag/EmbeddingBagCollection module found")
        if delay < 0:
            raise InvalidInputError(f"delay must be >= 0, got {delay}")
        self.delay = delay
        self.distributed = distributed
        if distributed and any(lk.trainer is not None and lk.trainer.write != "through" for lk in lookups):
            raise InvalidInputError(
                "distributed=True averages every rank's gradients in the tables: a write-back TrainCache "
                'keeps its rows on one trainer (make each rank\'s cache with write="through")'
            )
        if distributed and any(lk.trainer is not None and lk.push != "step" for lk in lookups):
            raise InvalidInputError(
                "distributed=True applies each step's global gradient: a TrainCache's modules "
                'need push="step" (with push="backward" each rank\'s cache sees only its own gradients)'
            )
        if distributed:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise InvalidInputError(
                    "distributed=True needs torch.distributed initialized (init_process_group)"
                )
            if delay:
                raise InvalidInputError("distributed=True pushes every step: no delay")
        self._pending: list[_Pending] = []
        for lk in lookups:
            if lk.push == "step" and lk.pending not in self._pending:
                self._pending.append(lk.pending)
        self._late: list[tuple[int, list[tuple[Any, Any]]]] = []
        self._steps = _StepCounter()

    def step(self) -> int:
        """One ``push_grad`` per table of everything gathered since the last step (or,
        with a delay, since the step ``delay`` steps ago); returns how many keys were pushed."""
        # Every rank numbers the step before the gather: none pushes before all have.
        step = self._steps.next(self._sources())
        if self.distributed:
            return self._step_distributed(step)
        gathered: list[tuple[Any, Any]] = [(p, got) for p in self._pending if (got := p.take()) is not None]
        gathered += [(f, fg) for f in self._fused if (fg := f.take()) is not None]
        self._late.append((step, gathered))
        n = 0
        while len(self._late) > self.delay:
            n += self._push(*self._late.pop(0))
        return n

    def _sources(self) -> list[Source]:
        """Every table source this optimizer pushes to."""
        return [p.source for p in self._pending] + [s for f in self._fused for s in f.collection._sources]

    def _step_distributed(self, step: int) -> int:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        # One entry per table source, in an order every rank shares: the per-table
        # modules', then each fused collection's tables.
        sources: list[Any] = [p.source for p in self._pending]
        # A TrainCache's gradients are device tensors: gathered as numpy, as the tables'.
        mine: list[Any] = [_host(p.take()) for p in self._pending]
        for f in self._fused:
            got = f.take()
            by_source = dict((id(s), kg) for s, kg in f.per_table(got)) if got else {}
            for src in f.collection._sources:
                sources.append(src)
                mine.append(by_source.get(id(src)))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        n = 0
        for i, source in enumerate(sources):
            parts = [r[i] for r in every if r[i] is not None]
            if not parts:
                continue
            keys = np.concatenate([k for k, _ in parts])
            grads = np.concatenate([g for _, g in parts]) / np.float32(world)
            own = (keys % np.uint64(world)) == np.uint64(rank)
            if isinstance(source, TrainCache):
                n += apply_global(source, keys, grads, step, own)
            elif own.any():
                source.push_grad(keys[own], np.ascontiguousarray(grads[own]), step)
                n += int(own.sum())
        dist.barrier()  # no rank pulls the next batch before every row is updated
        return n

    def flush(self) -> int:
        """Pushes every delayed step now; returns how many keys were pushed."""
        n = 0
        while self._late:
            n += self._push(*self._late.pop(0))
        return n

    @staticmethod
    def _push(step: int, gathered: list[tuple[Any, Any]]) -> int:
        n = 0
        for p, got in gathered:
            if isinstance(p, _FusedPending):
                n += p.push(got, step)
                continue
            keys, grads = got
            p.source.push_grad(keys, grads, step)
            n += len(keys)
        return n

    def zero_grad(self) -> None:
        """Drops gradients gathered since the last step (not the delayed ones)."""
        for p in self._pending:
            p.clear()
        for f in self._fused:
            f.clear()

    @property
    def tables(self) -> list[str]:
        names = [_table_of(p.source).name for p in self._pending]
        for f in self._fused:
            names += [_table_of(s).name for s in f.collection._sources]
        return names


def _host(got: Any) -> Any:
    """A pending's ``(keys, grads)`` as numpy (a TrainCache's are device tensors)."""
    if got is None or isinstance(got[0], np.ndarray):
        return got
    keys, grads = got
    host = np.ascontiguousarray(grads.to("cpu", torch.float32).numpy())
    return keys.to("cpu").numpy().astype(np.uint64), host
