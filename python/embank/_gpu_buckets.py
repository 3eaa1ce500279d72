"""The GPU cache's buckets as device tensors, the Python path of :class:`embank.gpu.GpuCache`
(``kernels="triton"`` or ``"torch"``): after HierarchicalKV, buckets of ``slots`` keys,
one-byte digests, scores and rows, and one version a bucket; the operations on them
(find, choose a slot, write, invalidate), each in Triton kernels (``_triton.py``) or in
PyTorch with the same results; and the order of the cache's launches across streams."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

EMPTY = -1  # an empty slot's key: u64::MAX (never cached)
LOCKED = -2  # a slot being written: u64::MAX - 1 (never cached)
KEEP = -2  # a score meaning "leave it"
ONES_CHUNK = 1 << 16  # the outcome counter's ones: allocated once (a reallocation could be
# freed while another stream still reads it)


_Keys = TypeVar("_Keys", torch.Tensor, "npt.NDArray[np.int64]")


def key_hash(keys: _Keys) -> _Keys:
    """splitmix64's finalizer of int64 keys, in int64 arithmetic (the Triton kernels mix
    the same way): the low bits pick the bucket, the top byte is the digest. A tensor or
    a numpy array (the same bits: both wrap on overflow, both shift arithmetically)."""
    h = keys ^ ((keys >> 30) & 0x3FFFFFFFF)
    h = h * -4658895280553007687
    h = h ^ ((h >> 27) & 0x1FFFFFFFFF)
    h = h * -7723592293110705685
    return h ^ ((h >> 31) & 0x1FFFFFFFF)


def _triton_usable(device: torch.device) -> bool:
    try:
        import triton  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class _Buckets:
    """The structure and its operations; :class:`embank.gpu.GpuCache` holds the state
    (made in its constructor) and calls them under :meth:`_ordered`."""

    kernels: str
    device: torch.device
    dtype: torch.dtype
    slots: int
    n_buckets: int
    clock: int
    _policy: int
    keys: torch.Tensor
    digests: torch.Tensor
    scores: torch.Tensor
    values: torch.Tensor
    versions: torch.Tensor
    _counts: torch.Tensor
    _outcomes: torch.Tensor
    _ones: torch.Tensor
    _lock: threading.RLock
    _order: Any
    _streams: set[int]
    _side: Any

    # ---- ordering ----

    @contextlib.contextmanager
    def _ordered(self) -> Iterator[None]:
        """Under the lock: this launch waits for the cache's previous one (on whatever
        stream it ran) and the next waits for this one. No host wait."""
        with self._lock:
            if self._side is None:
                yield
                return
            stream = torch.cuda.current_stream(self.device)
            if stream.stream_id not in self._streams:  # the cache's tensors are used there too
                self._streams.add(stream.stream_id)
                for t in (self.keys, self.digests, self.scores, self.values, self.versions, self._counts,
                          self._outcomes, self._ones):  # fmt: skip
                    t.record_stream(stream)
            if self._order is not None:
                stream.wait_event(self._order)
            try:
                yield
            finally:
                self._order = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._order.record(stream)

    # ---- the operations (Triton or PyTorch, same results) ----

    def _bucket_digest(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = key_hash(ids)
        return (h & 0x7FFFFFFFFFFFFFFF) % self.n_buckets, ((h >> 56) & 0xFF).to(torch.uint8)

    def _find(
        self, ids: torch.Tensor, given: torch.Tensor, *, touch: bool, gather: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows (float32; zeros where absent), flat slots (``-1 - bucket`` where absent:
        negative, and the bucket an insert needs) and, for the ids absent, their buckets'
        versions (0 for a hit: an insert checks misses only) of ``ids`` (duplicates
        allowed; each hit touches its score)."""
        if self.kernels == "triton":
            from . import _triton

            out, slots, vers, _, _ = _triton.find(
                ids, given, self.keys, self.digests, self.scores, self.versions, self.values, self.clock,
                self._policy, touch=touch, gather=gather,
            )  # fmt: skip
            return out, slots, vers
        b, d = self._bucket_digest(ids)
        usable = (ids != EMPTY) & (ids != LOCKED)
        match = (self.digests[b] == d[:, None]) & (self.keys[b] == ids[:, None]) & usable[:, None]
        found = match.any(1)
        flat = torch.where(found, b * self.slots + match.to(torch.int8).argmax(1), -1 - b)
        at = flat.clamp(min=0)
        if touch:
            scores = self.scores.view(-1)
            if self._policy == 1:
                scores.index_add_(0, at, found.to(torch.int64))
            else:
                given_score = given if self._policy == 2 else torch.full_like(at, self.clock)
                scores.scatter_reduce_(0, at, torch.where(found, given_score, scores[at]), "amax")
        if gather:
            out = torch.where(found[:, None], self.values[at].to(torch.float32), 0.0)
        else:
            out = torch.zeros((len(ids), 1), dtype=torch.float32, device=ids.device)
        return out, flat, torch.where(found, 0, self.versions[b])

    def _lookup_find(
        self, flat: torch.Tensor, given: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A lookup's find: rows, versions, ``payload`` (the miss count, then the miss
        ids) and ``miss_at`` (the misses' places in the batch), both valid up to the
        count. Triton compacts in the find's launch (misses in no fixed order); the
        PyTorch path in batch order."""
        if self.kernels == "triton":
            from . import _triton

            out, _, vers, payload, miss_at = _triton.find(
                flat, given, self.keys, self.digests, self.scores, self.versions, self.values, self.clock,
                self._policy, touch=True, gather=True, compact=True,
            )  # fmt: skip
            return out, vers, payload, miss_at
        n = len(flat)
        out, slots, vers = self._find(flat, given, touch=True, gather=True)
        miss = slots < 0
        at = torch.zeros(n + 1, dtype=torch.int64, device=flat.device)
        at.scatter_(0, torch.where(miss, torch.cumsum(miss, 0) - 1, n), torch.arange(n, device=flat.device))
        miss_at = at[:n]
        payload = torch.cat([miss.sum().view(1), flat[miss_at.clamp(max=max(n - 1, 0))]])
        return out, vers, payload, miss_at

    def _choose(
        self,
        ids: torch.Tensor,
        present: torch.Tensor,
        rank: torch.Tensor,
        given: torch.Tensor,
        snap: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A new key's slot (-1: refused, present, reserved, or its version moved), the
        key that slot holds, and the new key's score."""
        if self.kernels == "triton":
            from . import _triton

            return _triton.choose(
                ids,
                present,
                rank,
                given,
                snap,
                self.keys,
                self.scores,
                self.versions,
                self.clock,
                self._policy,
            )
        s = self.slots
        b, _ = self._bucket_digest(ids)
        packed = torch.sort((self.scores[b] + 1) * s + torch.arange(s, device=ids.device), dim=1).values
        pick = packed.gather(1, rank.clamp(max=s - 1)[:, None]).squeeze(1)
        if self._policy == 0:
            score = torch.full_like(ids, self.clock)
        elif self._policy == 1:
            score = torch.ones_like(ids)
        else:
            score = given.clone()
        usable = (self.versions[b] == snap) & (ids != EMPTY) & (ids != LOCKED) & (present < 0)
        admit = usable & (rank < s) & (score >= pick // s - 1)
        slot = torch.where(admit, b * s + pick % s, -1)
        expect = torch.where(slot >= 0, self.keys.view(-1)[slot.clamp(min=0)], LOCKED)
        return slot, expect, score

    def _write(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        slot: torch.Tensor,
        expect: torch.Tensor,
        score: torch.Tensor,
        snap: torch.Tensor,
    ) -> torch.Tensor:
        """Claims each slot holding ``expect`` where the bucket's version is ``snap``,
        writes key, digest, score (unless KEEP) and row. Per key: 0 (not written), else
        1 | 2 (the row changed) | 4 (another key was evicted)."""
        if self.kernels == "triton":
            from . import _triton

            return _triton.write(
                ids, rows, slot, expect, score, snap, self.keys, self.digests, self.scores, self.versions,
                self.values,
            )  # fmt: skip
        at = slot.clamp(min=0)
        keys_flat, values = self.keys.view(-1), self.values
        claimed = (
            (slot >= 0)
            & (self.versions[at // self.slots] == snap)
            & (expect != LOCKED)
            & (keys_flat[at] == expect)
        )
        new = rows.to(self.dtype)
        changed = (values[at] != new).any(1) & claimed
        evicted = claimed & (expect != ids) & (expect != EMPTY)
        done = torch.where(claimed, 1 + 2 * changed.to(torch.int64) + 4 * evicted.to(torch.int64), 0)
        w = at[claimed]
        _, d = self._bucket_digest(ids)
        keys_flat[w] = ids[claimed]
        self.digests.view(-1)[w] = d[claimed]
        keep = claimed & (score != KEEP)
        self.scores.view(-1)[at[keep]] = score[keep]
        values[w] = new[claimed]
        return done

    def _invalidate(self, ids: torch.Tensor) -> torch.Tensor:
        """Bumps the version of each key's bucket and empties its slot; 1 where emptied."""
        if self.kernels == "triton":
            from . import _triton

            return _triton.invalidate(ids, self.keys, self.digests, self.scores, self.versions)
        b, _ = self._bucket_digest(ids)
        self.versions.index_add_(0, b, torch.ones_like(b))
        _, flat, _ = self._find(ids, ids, touch=False, gather=False)
        found = flat >= 0
        first = torch.zeros_like(found)  # a key given twice is emptied once
        if len(ids):
            order = torch.argsort(flat, stable=True)
            sf = flat[order]
            first[order] = torch.cat([sf[:1] >= 0, (sf[1:] != sf[:-1]) & (sf[1:] >= 0)])
        at = flat[first]
        self.keys.view(-1)[at] = EMPTY
        self.digests.view(-1)[at] = 0
        self.scores.view(-1)[at] = -1
        return first.to(torch.int64)

    def _host_rank(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Each of ``keys``' rank among the keys of its bucket, in order: what an insert
        needs so that its keys take distinct slots (:meth:`_upsert`), computed on the host,
        where the callers have the keys. On the device it took a sort and four more
        launches: a fifth of a missing lookup's time on an H200 (docs/BENCHMARKS.md)."""
        b = (key_hash(keys) & 0x7FFFFFFFFFFFFFFF) % self.n_buckets
        order = np.argsort(b, kind="stable")
        sorted_b = b[order]
        rank = np.empty(len(keys), dtype=np.int64)
        rank[order] = np.arange(len(keys)) - np.searchsorted(sorted_b, sorted_b)
        return rank

    def _upsert(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        snap: torch.Tensor,
        given: torch.Tensor,
        rank: torch.Tensor,
    ) -> torch.Tensor:
        """Inserts unique ``ids`` not cached yet (a key cached meanwhile keeps its row,
        as fresh as this one: the versions say so). A key of ``rank`` r in its bucket
        (:meth:`_host_rank`) takes the bucket's r-th lowest-score slot, so a batch's keys
        never take one slot twice."""
        _, present, _ = self._find(ids, given, touch=False, gather=False)
        slot, expect, score = self._choose(ids, present, rank, given, snap)
        done = self._write(ids, rows, slot, expect, score, snap)
        return done

    def _count_inserts(self, done: torch.Tensor, which: int) -> None:
        """Adds an insert's outcome to the device counters (no sync): evictions, keys
        inserted (counter ``which``: 1 sync, 2 async), keys refused."""
        at = done + 8 * which
        for i in range(0, len(at), ONES_CHUNK):  # one launch but for inserts of > 64 k keys
            part = at[i : i + ONES_CHUNK]
            self._outcomes.view(-1).index_add_(0, part, self._ones[: len(part)])
