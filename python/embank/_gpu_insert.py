"""Inserts of the GPU cache's Python path: a lookup's misses answered and inserted (sync)
or queued (async), the bounded queue of keys waiting for the background inserter, and
the inserter's loop."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import numpy as np
import numpy.typing as npt
import torch

from ._gpu_buckets import EMPTY, LOCKED, _Buckets
from ._gpu_transfer import _Staging, _Transfers
from .errors import EmbankError

ASYNC_BATCH_KEYS_MAX = 1 << 16  # keys the background inserter takes at a time
# The inserter gathers the misses of a few lookups before it inserts: an insert costs the
# host about the same for 10 keys as for 10,000 (a dozen launches), and while it runs it
# holds the interpreter from the lookups (seen on an H100: a warmed cache inserting after
# every lookup doubled the lookups' p50).
ASYNC_GATHER_KEYS = 4096
ASYNC_GATHER_S = 0.005


class _AsyncQueue:
    """Keys waiting for a background insert: deduplicated, at most ``keys_max`` (the
    rest dropped and counted), and the first error of the inserter, kept until the
    cache's next call raises it. Holds no reference to the cache."""

    def __init__(self, keys_max: int) -> None:
        self.cond = threading.Condition()
        self.pending: dict[int, int] = {}  # key: score (the largest given; custom policy)
        self.keys_max = keys_max
        self.busy = 0
        self.dropped = 0
        self.errors = 0
        self.error: BaseException | None = None
        self.closed = False

    def put(self, keys: npt.NDArray[np.int64], scores: npt.NDArray[np.int64]) -> None:
        with self.cond:
            for k, score in zip(keys.tolist(), scores.tolist()):
                if k in self.pending:
                    self.pending[k] = max(score, self.pending[k])
                elif len(self.pending) >= self.keys_max:
                    self.dropped += 1
                else:
                    self.pending[k] = score
            self.cond.notify_all()

    def take(self, timeout: float) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """Up to ``ASYNC_BATCH_KEYS_MAX`` keys and their scores; none after ``timeout``;
        None once closed."""
        with self.cond:
            if not self.pending and not self.closed:
                self.cond.wait(timeout)
            deadline = time.monotonic() + ASYNC_GATHER_S
            while self.pending and len(self.pending) < ASYNC_GATHER_KEYS and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            if self.closed and not self.pending:
                return None
            take: list[int] = []
            for k in self.pending:
                take.append(k)
                if len(take) >= ASYNC_BATCH_KEYS_MAX:
                    break
            scores = [self.pending.pop(k) for k in take]
            self.busy += len(take)
            return np.array(take, dtype=np.int64), np.array(scores, dtype=np.int64)

    def done(self, n: int, error: BaseException | None) -> None:
        with self.cond:
            self.busy -= n
            if error is not None:
                self.errors += 1
                if self.error is None:
                    self.error = error
            self.cond.notify_all()

    def join(self) -> None:
        with self.cond:
            while self.pending or self.busy:
                self.cond.wait(0.1)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def raise_error(self) -> None:
        with self.cond:
            e, self.error = self.error, None
        if e is not None:
            raise EmbankError(f"a background insert of the GPU cache failed: {e!r}") from e


class _Inserts(_Buckets, _Transfers):
    """The inserts of :class:`embank.gpu.GpuCache`'s Python path (its state: made in its
    constructor)."""

    dim: int
    insert_mode: str
    threshold: float
    default_row: torch.Tensor
    _queue: _AsyncQueue
    _stats: dict[str, int]
    _window: list[tuple[int, int]]

    def _misses(
        self,
        staging: _Staging,
        miss_ids: npt.NDArray[np.int64],
        miss_at: torch.Tensor,
        flat: torch.Tensor,
        out: torch.Tensor,
        vers: torch.Tensor,
        given: torch.Tensor,
        asynchronous: bool,
        miss_scores: npt.NDArray[np.int64] | None,
    ) -> None:
        """Answers a lookup's misses (``miss_at``: their places in ``out``) and inserts them."""
        if asynchronous:
            with self._ordered():
                out.index_copy_(0, miss_at, self.default_row.expand(len(miss_at), self.dim))
            uniq, inverse = np.unique(miss_ids, return_inverse=True)
            best = np.zeros_like(uniq)
            if miss_scores is not None:  # a key given twice: the larger of its scores
                best[:] = -1
                np.maximum.at(best, inverse.reshape(-1), miss_scores)
            self._queue.put(uniq, best)
            with self._lock:
                self._stats["default_answers"] += len(miss_ids)
            return
        uniq, first, inverse = np.unique(miss_ids, return_index=True, return_inverse=True)
        rows, exists = self._fetch(uniq)
        keep = exists & (uniq != EMPTY) & (uniq != LOCKED)
        # One copy to the device: each miss's place among the unique keys, then for the
        # keys kept (their rows inserted) their first occurrence among the misses, their
        # ranks in their buckets, the keys themselves and their places among the unique
        # keys. What the host knows goes with the copy, not computed by indexing there.
        n_miss, n_uniq = len(miss_ids), len(uniq)
        kept_at = np.flatnonzero(keep)
        n_keep = len(kept_at)
        kept_keys = uniq[kept_at]
        packed = np.concatenate(
            [inverse.reshape(-1), first[kept_at], self._host_rank(kept_keys), kept_keys, kept_at]
        ).astype(np.int64)
        with self._ordered():
            idx, dev_rows = self._to_device(staging, packed, np.ascontiguousarray(rows))
            assert dev_rows is not None
            out.index_copy_(0, miss_at, dev_rows[idx[:n_miss]])
            if n_keep:
                kept, rank, keys, u_of = idx[n_miss:].view(4, n_keep)
                at = miss_at[kept]  # the first occurrence's place in the batch
                if self._policy == 2:  # a key given twice: the larger of its scores
                    larger = torch.full((n_uniq,), -1, dtype=torch.int64, device=self.device)
                    larger.scatter_reduce_(0, idx[:n_miss], given[miss_at], "amax")
                    key_given = larger[u_of]
                else:
                    key_given = keys  # the lookup's ids stand for scores the policy ignores
                kept_rows = dev_rows if n_keep == n_uniq else dev_rows[u_of]
                done = self._upsert(keys, kept_rows, vers[at], key_given, rank)
                self._count_inserts(done, 1)

    def _async(self) -> bool:
        if self.insert_mode != "auto":
            return self.insert_mode == "async"
        hits = sum(h for h, _ in self._window)
        total = sum(n for _, n in self._window)
        rate = hits / total if total else 0.0
        return rate >= self.threshold

    def _fill(self, keys: npt.NDArray[np.int64], scores: npt.NDArray[np.int64]) -> None:
        """The background insert of ``keys`` (unique): those still missing are fetched
        and inserted, on the cache's side stream (CUDA). Waits for the host: it is off
        the lookup's path."""
        stream = torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
        staging = self._take_staging()
        try:
            with stream:
                with self._ordered():
                    ids, _ = self._to_device(staging, keys, None)
                    _, slots, vers = self._find(ids, ids, touch=False, gather=False)
                    host, copied = self._to_host(staging, slots)
                if copied is not None:
                    copied.synchronize()  # outside the lock
                missing = (host.numpy() < 0) & (keys != EMPTY) & (keys != LOCKED)
                if not missing.any():
                    return
                rows, exists = self._fetch(keys[missing])
                pick = np.flatnonzero(missing)[exists]
                if not len(pick):
                    return
                with self._ordered():
                    picked = keys[pick]
                    ranks = self._host_rank(picked)
                    packed = np.concatenate([pick, scores[pick], ranks, picked]).astype(np.int64)
                    both, dev_rows = self._to_device(staging, packed, np.ascontiguousarray(rows[exists]))
                    assert dev_rows is not None
                    at, given, rank, picked_ids = both.view(4, len(pick))
                    done = self._upsert(picked_ids, dev_rows, vers[at], given, rank)
                    self._count_inserts(done, 2)
        finally:
            self._give_staging(staging)


def _insert_loop(ref: weakref.ref[_Inserts], q: _AsyncQueue) -> None:
    """The background inserter. Holds the cache only while it inserts a batch, so a
    cache nobody else holds is collected (and this thread ends)."""
    while True:
        taken = q.take(0.2)
        if taken is None:
            return
        keys, scores = taken
        if not len(keys):
            if ref() is None:
                return
            continue
        error: BaseException | None = None
        cache = ref()
        try:
            if cache is None:
                return
            cache._fill(keys, scores)
        except BaseException as e:
            error = e
        finally:
            del cache
            q.done(len(keys), error)
