"""Reading ahead: the next batch's rows loaded into the store's row cache while this
batch trains (:func:`lookahead`; a collection's ``prefetch`` rests on it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Callable, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from ._jagged import _to_keys
from ._table import Table

B = TypeVar("B")


def lookahead(
    batches: Iterable[B], keys_of: Callable[[B], Mapping[Table, npt.ArrayLike | torch.Tensor] | None]
) -> Iterator[B]:
    """Yields ``batches`` one behind: while batch *i* trains, the rows of batch *i+1* are
    already being loaded by the store (``Table.lookahead``: the maintenance thread reads
    them into the row cache, the caller never waits).

    ``keys_of(batch)`` returns ``table -> keys`` of that batch (or starts the reads
    itself and returns None, as :meth:`EmbeddingBagCollection.prefetch` does).
    """
    it = iter(batches)
    try:
        current = next(it)
    except StopIteration:
        return
    _hint(keys_of(current))
    for nxt in it:
        _hint(keys_of(nxt))
        yield current
        current = nxt
    yield current


def _hint(keys: Mapping[Table, npt.ArrayLike | torch.Tensor] | None) -> None:
    if keys is None:  # keys_of hinted itself (EmbeddingBagCollection.prefetch)
        return
    for table, k in keys.items():
        if isinstance(k, torch.Tensor):
            k = _to_keys(k, "lookahead keys")
        table.lookahead(np.unique(np.asarray(k, dtype=np.uint64)))
