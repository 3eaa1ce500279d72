"""Gradients of the per-table modules of :mod:`embank.torch` gathered between steps:
one list per table (or worker) object, so modules sharing it push the sum of all their
lookups in one ``push_grad`` a step (:class:`embank.torch.SparseOptimizer`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from ._table import Source, Table, _table_of
from .errors import InvalidInputError


class _StepCounter:
    """The training step whose gradients a module or optimizer pushes (``push_grad``'s
    ``step``): FBGEMM's optimizers bias-correct every row of a step with it, however many
    calls or ranks the step takes, and tables a step skips still reach it at their next
    push. Counts from the tables' own step (the largest), read at the first push: a
    store restored to a checkpoint continues from the checkpoint's step."""

    def __init__(self) -> None:
        self._last: int | None = None

    def next(self, sources: Iterable[Source]) -> int:
        """The next step of the gradients of ``sources``."""
        if self._last is None:
            tables: list[Table] = [_table_of(s) for s in sources]
            self._last = max((t.optimizer_step for t in tables), default=0)
        self._last += 1
        return self._last


class _Pending:
    """Gradients gathered for one source since the last step."""

    def __init__(self, source: Source) -> None:
        self._source = weakref.ref(source)
        self.keys: list[npt.NDArray[np.uint64]] = []
        self.grads: list[npt.NDArray[np.float32]] = []
        self.lock = threading.Lock()

    def add(self, keys: npt.NDArray[np.uint64], grads: npt.NDArray[np.float32]) -> None:
        with self.lock:
            self.keys.append(keys)
            self.grads.append(grads)

    def take(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]] | None:
        with self.lock:
            if not self.keys:
                return None
            keys, grads = self.keys, self.grads
            self.keys, self.grads = [], []
        if len(keys) == 1:
            return keys[0], grads[0]
        if not isinstance(keys[0], np.ndarray):  # a TrainCache's: device tensors
            import torch

            return torch.cat(keys), torch.cat(grads)
        return np.concatenate(keys), np.concatenate(grads)

    def clear(self) -> None:
        with self.lock:
            self.keys, self.grads = [], []

    @property
    def source(self) -> Source:
        s = self._source()
        if s is None:
            raise InvalidInputError("the table of this lookup was dropped")
        return s


# One pending list per source object: modules sharing a Table (or Worker) object share it,
# so a step pushes the sum of all their lookups once. Weak: a dropped table takes its list.
_pending_by_source: weakref.WeakKeyDictionary[Source, _Pending] = weakref.WeakKeyDictionary()
_pending_lock = threading.Lock()


def _pending_for(source: Source) -> _Pending:
    with _pending_lock:
        p = _pending_by_source.get(source)
        if p is None:
            p = _Pending(source)
            _pending_by_source[source] = p
        return p
