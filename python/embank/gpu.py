"""A GPU embedding cache over an embank table: the top tier, on the accelerator.

:class:`GpuCache` keeps the hot rows of a :class:`~embank.Table` (embedded or remote) in
device memory and answers lookups there; the misses of a batch are fetched from the
table in one batched ``lookup`` and inserted, before the lookup returns (``"sync"``) or
in the background with the table's missing default answered meanwhile (``"async"``);
``"auto"`` switches on the hit rate of the last batches, as HugeCTR's HPS did.

>>> import embank, embank.gpu, numpy as np, torch, tempfile, os
>>> store = embank.open(os.path.join(tempfile.mkdtemp(), "g"))
>>> items = store.create_table("item", dim=4)
>>> items.push([1, 2], np.array([[1.0] * 4, [2.0] * 4], dtype=np.float32))
>>> cache = embank.gpu.GpuCache(items, rows_max=1024, device="cpu", insert="sync")
>>> cache.lookup(torch.tensor([2, 1, 2]))[:, 0].tolist()
[2.0, 1.0, 2.0]
>>> cache.stats()["misses"], cache.lookup(torch.tensor([1]))[0, 0].item(), cache.stats()["hits"]
(2, 1.0, 1)
>>> items.push([1], np.full((1, 4), 5.0, dtype=np.float32))   # a write through the table invalidates the row
>>> cache.lookup(torch.tensor([1]))[0, 0].item()
5.0
>>> cache.close(); store.close()

The structure is set-associative (HPS's slab sets, HierarchicalKV's buckets): buckets
of ``slots`` entries holding keys, one-byte digests, scores (LRU clock or LFU count)
and rows in ``dtype``. The operations exist twice with the same results: in Triton
(``kernels="triton"``, the default on CUDA; on the CPU under ``TRITON_INTERPRET=1``) and
in plain PyTorch (``kernels="torch"``, the default elsewhere and the reference).

Use it in eval mode as the source of :class:`embank.torch.Embedding`/``EmbeddingBag``/
``EmbeddingBagCollection``: ``EmbeddingBag(GpuCache(table, ...))``. Writes made
through the same process's :class:`~embank.Table` objects of the store (``push``,
``push_grad``, ``delete``, a worker's pushes) invalidate the rows they touch; rows
written elsewhere (another process, the update stream) reach the cache through
:meth:`GpuCache.refresh` (or ``refresh_every=`` seconds in the background).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._store import Table
from .errors import InvalidInputError

__all__ = ["GpuCache", "key_hash"]

EMPTY = -1  # an empty slot's key (u64::MAX as int64: that key is never cached)


def key_hash(keys: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of int64 keys, in int64 arithmetic (the Triton kernels mix
    the same way): the low bits pick the bucket, the top byte is the digest."""
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


class GpuCache:
    """The rows of ``table`` most used, in ``device`` memory (see the module's text).

    Args:
        table: an embank :class:`~embank.Table` (embedded or remote).
        rows_max: rows the cache holds at most (rounded up to whole buckets).
        device: where the cache lives (default: ``"cuda"`` if available, else the CPU).
        insert: ``"sync"``, ``"async"`` or ``"auto"`` (async once the hit rate over the
            last ``window`` lookups reaches ``hit_rate_threshold``).
        dtype: element type of the cached rows (``torch.float32`` or ``torch.float16``);
            lookups return float32.
        slots: entries per bucket (a power of two, at most 256).
        policy: ``"lru"`` (score: the clock of the last use) or ``"lfu"`` (uses).
        kernels: ``"triton"``, ``"torch"`` or ``"auto"``.
        default: the row an async miss is answered with (a number or ``dim`` values);
            default: the table's ``missing`` default when it is a number, else zeros.
        refresh_every: also refresh in the background every this many seconds.
    """

    def __init__(
        self,
        table: Table,
        rows_max: int,
        *,
        device: str | torch.device | None = None,
        insert: str = "auto",
        hit_rate_threshold: float = 0.8,
        dtype: torch.dtype = torch.float32,
        slots: int = 32,
        policy: str = "lru",
        kernels: str = "auto",
        window: int = 32,
        default: float | Any = None,
        refresh_every: float | None = None,
    ) -> None:
        if not isinstance(table, Table):
            raise InvalidInputError(f"GpuCache caches an embank Table, got {type(table).__name__}")
        if rows_max < 1:
            raise InvalidInputError(f"rows_max must be >= 1, got {rows_max}")
        if insert not in ("sync", "async", "auto"):
            raise InvalidInputError(f'insert must be "sync", "async" or "auto", got {insert!r}')
        if not 0.0 <= hit_rate_threshold <= 1.0:
            raise InvalidInputError(f"hit_rate_threshold must be in [0, 1], got {hit_rate_threshold}")
        if dtype not in (torch.float32, torch.float16):
            raise InvalidInputError(f"dtype must be torch.float32 or torch.float16, got {dtype}")
        if slots < 1 or slots > 256 or slots & (slots - 1):
            raise InvalidInputError(f"slots must be a power of two up to 256, got {slots}")
        if policy not in ("lru", "lfu"):
            raise InvalidInputError(f'policy must be "lru" or "lfu", got {policy!r}')
        self.table = table
        self.dim = table.dim
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" and _triton_usable(self.device) else "torch"
        if kernels not in ("triton", "torch"):
            raise InvalidInputError(f'kernels must be "triton", "torch" or "auto", got {kernels!r}')
        if kernels == "triton" and not _triton_usable(self.device):
            raise InvalidInputError("Triton kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
        self.kernels = kernels
        self.insert_mode, self.threshold, self.policy = insert, hit_rate_threshold, policy
        self.slots = slots
        self.n_buckets = max(1, -(-rows_max // slots))
        self.dtype = dtype
        dev = self.device
        self.keys = torch.full((self.n_buckets, slots), EMPTY, dtype=torch.int64, device=dev)
        self.digests = torch.zeros((self.n_buckets, slots), dtype=torch.uint8, device=dev)
        self.scores = torch.full((self.n_buckets, slots), -1, dtype=torch.int64, device=dev)
        self.values = torch.zeros((self.n_buckets * slots, self.dim), dtype=dtype, device=dev)
        fill = default
        if fill is None:
            missing = table.options.get("missing")
            fill = float(missing) if isinstance(missing, (int, float)) else 0.0
        self.default_row = torch.as_tensor(fill, dtype=torch.float32).expand(self.dim).to(dev).clone()
        self.clock = 0
        self._lock = threading.RLock()
        self._epoch = 0  # bumped by every write through the table: a fetch older than it is not inserted
        self._window: list[tuple[int, int]] = []
        self._window_len = max(1, window)
        self._stats = dict.fromkeys(
            ("lookups", "hits", "misses", "sync_inserts", "async_inserts", "default_answers", "evictions",
             "insert_dropped", "invalidated", "refreshes", "refresh_rows", "refresh_changed",
             "refresh_bytes"),
            0,
        )  # fmt: skip
        self._refresh_seconds = 0.0
        self._queue: queue.Queue[torch.Tensor | None] = queue.Queue()
        self._closed = False
        self._side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._inserter = threading.Thread(target=self._insert_loop, name="embank-gpu-insert", daemon=True)
        self._inserter.start()
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()
        if refresh_every is not None:
            self.start_refresh(refresh_every)
        table._write_listeners().add(self._on_write)

    # ---- the operations (Triton or PyTorch, same results) ----

    def _bucket_digest(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = key_hash(ids)
        return (h & 0x7FFFFFFFFFFFFFFF) % self.n_buckets, ((h >> 56) & 0xFF).to(torch.uint8)

    def _find(self, ids: torch.Tensor, *, touch: bool, gather: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (float32; zeros where absent) and flat slots (-1 where absent) of unique ``ids``."""
        if self.kernels == "triton":
            from . import _triton

            return _triton.find_gather(
                ids, self.keys, self.digests, self.scores, self.values, self.clock,
                touch=touch, lfu=self.policy == "lfu", gather=gather,
            )  # fmt: skip
        b, d = self._bucket_digest(ids)
        match = (self.digests[b] == d[:, None]) & (self.keys[b] == ids[:, None])
        found = match.any(1)
        flat = torch.where(found, b * self.slots + match.to(torch.int8).argmax(1), -1)
        hit = flat[found]
        if touch:
            sc = self.scores.view(-1)
            sc[hit] = sc[hit] + 1 if self.policy == "lfu" else self.clock
        out = torch.zeros((len(ids), self.dim if gather else 1), dtype=torch.float32, device=ids.device)
        if gather:
            out[found] = self.values[hit].to(torch.float32)
        return out, flat

    def _insert(self, ids: torch.Tensor, rows: torch.Tensor) -> int:
        """Inserts or replaces unique ``ids`` with ``rows`` (float32, on the device). New
        keys take, in their bucket, the slots of lowest score (empty ones first); more
        new keys than a bucket has slots are dropped. Returns the keys inserted."""
        _, flat = self._find(ids, touch=False, gather=False)
        present = flat >= 0
        if present.any():
            at = flat[present]
            self.values[at] = rows[present].to(self.dtype)
            self.scores.view(-1)[at] = self.clock
        new = ~present
        kn, rn = ids[new], rows[new]
        if not len(kn):
            return int(present.sum())
        b, d = self._bucket_digest(kn)
        order = torch.argsort(b, stable=True)
        kn, rn, b, d = kn[order], rn[order], b[order], d[order]
        first = torch.searchsorted(b, b, right=False)
        rank = torch.arange(len(b), device=b.device) - first
        keep = rank < self.slots
        self._stats["insert_dropped"] += int((~keep).sum())
        kn, rn, b, d, rank = kn[keep], rn[keep], b[keep], d[keep], rank[keep]
        if self.kernels == "triton":
            from . import _triton

            slot = _triton.choose(kn, rank, self.scores)
        else:
            by_score = torch.argsort(self.scores[b], dim=1, stable=True)
            slot = b * self.slots + by_score.gather(1, rank[:, None]).squeeze(1)
        self._stats["evictions"] += int((self.keys.view(-1)[slot] != EMPTY).sum())
        if self.kernels == "triton":
            _triton.write(
                kn, rn.contiguous(), slot, self.keys, self.digests, self.scores, self.values, self.clock
            )
        else:
            self.keys.view(-1)[slot] = kn
            self.digests.view(-1)[slot] = d
            self.scores.view(-1)[slot] = self.clock
            self.values[slot] = rn.to(self.dtype)
        return int(present.sum()) + len(kn)

    # ---- the public interface ----

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (any shape, integer) as ``(*ids.shape, dim)`` float32 on the
        cache's device. Never creates rows: an id the table lacks answers its missing
        default (and is not cached)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError(f"ids must be an int64 or int32 tensor, got {ids.dtype}")
        flat = ids.reshape(-1).to(self.device, torch.int64)
        if len(flat) and int(flat.min()) < 0:
            raise InvalidInputError(f"ids hold a negative id ({int(flat.min())}); embank keys are >= 0")
        uniq, inverse = torch.unique(flat, return_inverse=True)
        with self._lock:
            self.clock += 1
            rows, slots = self._find(uniq, touch=True, gather=True)
            epoch = self._epoch
            asynchronous = self._async()
        found = slots >= 0
        n_miss = int((~found).sum())
        if n_miss:
            miss = uniq[~found]
            if asynchronous:
                rows[~found] = self.default_row
                self._queue.put(miss)
                self._stats["default_answers"] += n_miss
            else:
                fetched, exists = self._fetch(miss)
                rows[~found] = fetched
                with self._lock:
                    if self._epoch == epoch and bool(exists.any()):
                        self._stats["sync_inserts"] += self._insert(miss[exists], fetched[exists])
        with self._lock:
            self._stats["lookups"] += 1
            self._stats["hits"] += len(uniq) - n_miss
            self._stats["misses"] += n_miss
            self._window.append((len(uniq) - n_miss, len(uniq)))
            if len(self._window) > self._window_len:
                self._window.pop(0)
        return rows[inverse].reshape(*ids.shape, self.dim)

    def _async(self) -> bool:
        if self.insert_mode != "auto":
            return self.insert_mode == "async"
        hits = sum(h for h, _ in self._window)
        total = sum(n for _, n in self._window)
        rate = hits / total if total else 0.0
        return rate >= self.threshold

    def _fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` from the table (one batched ``lookup``), on the device, and
        which exist. On CUDA: through a pinned buffer, copied on a side stream."""
        keys = ids.to("cpu").numpy().astype(np.uint64)
        rows, found = self.table.lookup(keys)
        host = torch.from_numpy(rows)
        exists = torch.from_numpy(found)
        if self._side is not None:
            pinned = host.pin_memory()
            with torch.cuda.stream(self._side):
                dev = pinned.to(self.device, non_blocking=True)
                ex = exists.to(self.device, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            dev.record_stream(torch.cuda.current_stream(self.device))
            return dev, ex
        return host.to(self.device), exists.to(self.device)

    def _insert_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                with self._lock:
                    epoch = self._epoch
                    _, slots = self._find(item, touch=False, gather=False)
                ids = item[slots < 0]  # another lookup may have brought some in
                if len(ids):
                    rows, exists = self._fetch(ids)
                    with self._lock:
                        if self._epoch == epoch and bool(exists.any()):
                            self._stats["async_inserts"] += self._insert(ids[exists], rows[exists])
            except Exception:  # pragma: no cover - a closed table: the cache is being dropped
                pass
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Waits until the background inserts queued so far are done."""
        self._queue.join()

    def invalidate(self, keys: Any) -> int:
        """Drops ``keys`` from the cache (a later lookup reads them from the table again).
        Returns how many were cached."""
        ids = torch.as_tensor(np.asarray(keys, dtype=np.uint64).astype(np.int64), device=self.device).reshape(
            -1
        )
        with self._lock:
            self._epoch += 1
            if not len(ids):
                return 0
            _, slots = self._find(torch.unique(ids), touch=False, gather=False)
            at = slots[slots >= 0]
            self.keys.view(-1)[at] = EMPTY
            self.digests.view(-1)[at] = 0
            self.scores.view(-1)[at] = -1
            self._stats["invalidated"] += len(at)
            return len(at)

    def _on_write(self, keys: npt.NDArray[np.uint64]) -> None:
        self.invalidate(keys)

    def refresh(self, batch: int = 65_536) -> dict[str, float]:
        """Re-reads every cached key from the table in batches and replaces the rows that
        changed (a key the table no longer holds is dropped). Returns rows, changed,
        bytes and seconds of this refresh."""
        t0 = time.perf_counter()
        with self._lock:
            occupied = (self.keys.view(-1) != EMPTY).nonzero().squeeze(1)
        rows_done = changed = 0
        for i in range(0, len(occupied), batch):
            at = occupied[i : i + batch]
            with self._lock:
                ids = self.keys.view(-1)[at].clone()
            live = ids != EMPTY
            at, ids = at[live], ids[live]
            if not len(ids):
                continue
            fresh, exists = self._fetch(ids)
            with self._lock:
                still = self.keys.view(-1)[at] == ids  # not replaced meanwhile
                gone = still & ~exists
                self.keys.view(-1)[at[gone]] = EMPTY
                self.scores.view(-1)[at[gone]] = -1
                upd = still & exists
                new = fresh[upd].to(self.dtype)
                diff = (new != self.values[at[upd]]).any(1)
                self.values[at[upd][diff]] = new[diff]
                changed += int(diff.sum()) + int(gone.sum())
            rows_done += len(ids)
        seconds = time.perf_counter() - t0
        nbytes = rows_done * self.dim * self.values.element_size()
        with self._lock:
            self._stats["refreshes"] += 1
            self._stats["refresh_rows"] += rows_done
            self._stats["refresh_changed"] += changed
            self._stats["refresh_bytes"] += nbytes
            self._refresh_seconds += seconds
        return {"rows": rows_done, "changed": changed, "bytes": nbytes, "seconds": seconds}

    def start_refresh(self, every: float) -> None:
        """Refreshes in a background thread every ``every`` seconds until :meth:`close`."""
        if every <= 0:
            raise InvalidInputError(f"refresh every must be > 0 seconds, got {every}")
        if self._refresher is not None:
            raise InvalidInputError("a periodic refresh is already running")
        ref = weakref.ref(self)

        def loop() -> None:
            while True:
                me = ref()
                if me is None or me._stop.wait(every):
                    return
                me.refresh()
                del me

        self._refresher = threading.Thread(target=loop, name="embank-gpu-refresh", daemon=True)
        self._refresher.start()

    def stats(self) -> dict[str, Any]:
        """Hits, misses, hit rate (all and over the window), inserts (sync, async),
        misses answered with the default, evictions, refresh rows/bytes/seconds/GB/s,
        rows cached, bytes of the structure and, on CUDA, memory allocated."""
        with self._lock:
            s: dict[str, Any] = dict(self._stats)
            total = s["hits"] + s["misses"]
            s["hit_rate"] = s["hits"] / total if total else None
            wt = sum(n for _, n in self._window)
            s["window_hit_rate"] = sum(h for h, _ in self._window) / wt if wt else None
            s["refresh_seconds"] = self._refresh_seconds
            s["refresh_gb_per_s"] = (
                s["refresh_bytes"] / self._refresh_seconds / 1e9 if self._refresh_seconds else None
            )
            s["rows_cached"] = int((self.keys != EMPTY).sum())
        s["rows_max"] = self.n_buckets * self.slots
        s["bytes"] = sum(
            t.numel() * t.element_size() for t in (self.keys, self.digests, self.scores, self.values)
        )
        s["device"], s["kernels"], s["insert"], s["policy"] = (
            str(self.device),
            self.kernels,
            self.insert_mode,
            self.policy,
        )
        s["dtype"] = str(self.dtype).replace("torch.", "")
        if self.device.type == "cuda":
            s["cuda_memory_allocated"] = torch.cuda.memory_allocated(self.device)
        return s

    def close(self) -> None:
        """Stops the background threads (queued inserts are finished first)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._queue.put(None)
        self._inserter.join()
        if self._refresher is not None:
            self._refresher.join()
        self.table._write_listeners().discard(self._on_write)

    def __enter__(self) -> GpuCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GpuCache(table={self.table.name!r}, rows_max={self.n_buckets * self.slots}, "
            f"device={str(self.device)!r}, insert={self.insert_mode!r}, kernels={self.kernels!r})"
        )
