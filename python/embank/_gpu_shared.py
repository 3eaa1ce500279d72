"""A :class:`~embank.gpu.TrainCache` written through (``write="through"``): many trainers
over one table, each rank's cache a copy of the rows it uses, updated as the table is.

The table stays the truth: every gradient applied to cached rows on the device is pushed
to the table too, whose optimizer applies it on the host. Alone, a trainer pushes each
step's gradients itself (:func:`push_through`). Under
``SparseOptimizer(distributed=True)`` every rank takes part in each step
(:func:`apply_global`): the step's gradients of every rank, averaged, are applied by each
rank to the rows it caches (never bringing a row in for it), and each row is pushed to the
table once, by the rank that owns it (key modulo world size), before the step's barrier.
So after every step a row a rank caches equals the table's: the same update of the same
values, bit for bit where the device rounds as the host does (the CPU; a GPU's update may
differ in the last bit, which ``refresh_every`` bounds). A rank never reads a row older
than the last step (BSP), and rows changed in the table by anyone outside the group reach
a cache within ``refresh_every`` steps (every cached row read afresh then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from . import _gpu_train_native
from ._device import sum_rows
from ._gpu_buckets import EMPTY, key_hash
from ._gpu_writer import split_keys
from .errors import InvalidInputError

if TYPE_CHECKING:
    from ._gpu_train import TrainCache


def push_through(cache: TrainCache, uniq: torch.Tensor, summed: torch.Tensor, step: int) -> None:
    """Pushes one step's gradients (``uniq`` unique ids, ``summed`` their gradients, as
    the cache applies them next) to the table: first, so a push that fails (the table
    closed, a full disk) leaves the cache as the table."""
    keys = uniq.to("cpu").numpy().astype(np.uint64)
    grads = np.ascontiguousarray(summed.detach().to("cpu", torch.float32).numpy())
    for table, at, ids in split_keys(cache.tables, keys):
        table.push_grad(ids, grads if at is None else np.ascontiguousarray(grads[at]), step)


def apply_global(
    cache: TrainCache,
    keys: npt.NDArray[np.uint64],
    grads: npt.NDArray[np.float32],
    step: int,
    own: npt.NDArray[np.bool_],
) -> int:
    """One step of ``SparseOptimizer(distributed=True)`` for this rank's cache: ``keys``
    and ``grads`` are every rank's (averaged, duplicates not summed yet), ``own`` marks
    the keys this rank pushes to the table. Returns the keys pushed."""
    if len(cache.tables) > 1:
        raise InvalidInputError("SparseOptimizer(distributed=True) takes caches of one table")
    with cache._lock:
        cache._check_open()
        cache._apply_gathered()
        step = cache._next_step(step)
        if own.any():  # the table first, as push_through
            cache.table.push_grad(keys[own], np.ascontiguousarray(grads[own]), step)
        if keys.size:
            k = torch.from_numpy(keys.astype(np.int64)).to(cache.device)
            uniq, inverse = torch.unique(k, return_inverse=True)
            g = torch.from_numpy(np.ascontiguousarray(grads, dtype=np.float32)).to(cache.device)
            summed = sum_rows(inverse, g, uniq.numel())
            slot = _find(cache, uniq)
            held = slot >= 0
            if bool(held.any()):
                # Only the rows this rank caches: the others are read from the table when
                # missed, after the owners' pushes of this step.
                cache._apply(slot[held], None, summed[held], step, int(held.sum()))
            else:
                count_step(cache)
            cache._last_pull = None
        else:
            count_step(cache)
    return int(own.sum())


def _find(cache: TrainCache, uniq: torch.Tensor) -> torch.Tensor:
    """The slots of ``uniq`` (unique ids) in the cache, -1 where absent; nothing placed."""
    if cache._nk is not None:
        return _gpu_train_native.find(cache, uniq)
    s, nb = cache.slots, cache.n_buckets
    bucket = torch.remainder(key_hash(uniq), nb)
    eq = cache.keys.view(nb, s)[bucket] == uniq[:, None]
    eq &= uniq[:, None] != EMPTY
    hit = eq.any(dim=1)
    return torch.where(hit, bucket * s + eq.to(torch.int8).argmax(dim=1), torch.full_like(bucket, -1))


def count_step(cache: TrainCache) -> None:
    """Counts a step applied (``TrainCache._apply``): every ``refresh_every`` steps, drops
    every cached row (none is dirty)."""
    cache._steps_since_refresh += 1
    if cache.refresh_every is not None and cache._steps_since_refresh >= cache.refresh_every:
        cache._clear_for_store()
        cache._steps_since_refresh = 0
        cache._stats["refreshes"] += 1
