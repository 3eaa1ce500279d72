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
(3, 1.0, 1)
>>> items.push([1], np.full((1, 4), 5.0, dtype=np.float32))   # a write through the table invalidates the row
>>> cache.lookup(torch.tensor([1]))[0, 0].item()
5.0
>>> cache.close(); store.close()

**Structure** (after NVIDIA's HierarchicalKV): buckets of ``slots`` entries (128 by
default) holding keys, one-byte digests, scores and rows in ``dtype``, and one version a
bucket. A key lives in the bucket its hash picks; a lookup compares the bucket's digests
first and reads keys only where a digest matches. A new key takes the lowest-score slot
of its bucket (empty ones first) and is refused when it scores below that slot; slots
are claimed by compare-and-swap of the key. Policies: ``"lru"`` (score: the clock of
the last use), ``"lfu"`` (score: uses, counted on every hit; a new key starts at 1, so
it is refused by a bucket of keys used more often) and ``"custom"`` (the caller's
scores, given to :meth:`GpuCache.lookup`; a hit keeps the larger).

**Consistency.** Every invalidation (a write through the table) bumps the version of the
key's bucket; the misses a lookup fetches carry the version their find saw, and are
inserted only where it has not moved, so a write drops only the inserts of its own
buckets (not the whole batch). :meth:`GpuCache.refresh` checks the same versions, so it
never writes a row it fetched before a write over the row written after it.

**Streams and syncs** (CUDA). Every launch goes to the current stream of the cache's
device, under the cache's lock, after waiting on an event recorded by the cache's
previous launch: the cache's operations run on the device in the order they were
called, whichever streams they come from. With async inserts a native lookup waits for
nothing: its miss count is read once its copy is done, by a later call or the background
inserter. Otherwise a lookup waits for the host once: on the event
after its miss count and miss ids reach a pinned buffer (one device-to-host copy of
the count and of as many miss ids as twice the previous lookup's misses, at least
1,024; an all-hit lookup waits for it too). A lookup missing more than that waits a
second time, for the rest of its miss ids. Then, with misses: the table is read on the host, the
rows (an f16 or int8 table's as stored, decoded on the device: ``stored_rows``) go to the
device through a pinned buffer reused across calls (before reusing it,
the host waits for the previous call's copy from it, done long before in practice; a
buffer too small is reallocated, pinned), and they are scattered into the answer and
inserted, with no further wait. The background inserter and ``refresh`` wait for
their own copies on the cache's side stream or the caller's, never under the lock. With
``kernels="torch"`` on CUDA the same holds except that the insert's bookkeeping may wait
too; ``invalidate`` (its return value), ``refresh`` and ``stats`` wait for the device.

**Kernels.** ``kernels="native"`` (the default on CUDA): the cache is one object of
crates/embank-gpu, and a lookup is one call into it: the CUDA kernels of
``crates/embank-gpu/kernels/cache.cu`` are launched from Rust on the caller's stream (find,
gather and the misses compacted in one launch; a sync lookup's misses answered and inserted
in one more), ids and rows passed by address, the GIL released while misses are read from
the table, nothing allocated per call but the output. A write through an embedded store
reaches the cache by its next lookup (the store's change notices). On the CPU it runs only
on the kernels' emulator, in a build made for tests. ``kernels="triton"`` and ``"torch"``
(the default elsewhere and the reference) are the Python path, with the same results:
Triton kernels (on the CPU under ``TRITON_INTERPRET=1``) or plain PyTorch.

**When it pays** (measured on an H200; docs/BENCHMARKS.md, "The GPU cache"). Native: an
all-hit lookup of 512 ids costs ~20 µs with the device's work (~12 µs of host time; one
launch: the kernel's last warp writes the miss count to mapped host memory), a lookup of
1 M ids runs at ~2.7 G keys/s, and an ``EmbeddingBag`` of 50 x 10 ids through a warmed
10 % cache is 2.6-5x faster than pulling every row from the CPU store; DLRM inference
through a cache per table 3.1x. The Triton path's host cost is ~150 µs a lookup, ~1 ms
more for one that inserts.

**Training** goes through :class:`TrainCache` instead (write-back: rows with their optimizer
state, updated on the device; see its module, ``embank._gpu_train``).

Use it in eval mode as the source of :class:`embank.torch.Embedding`/``EmbeddingBag``/
``EmbeddingBagCollection``: ``EmbeddingBag(GpuCache(table, ...))``. Writes made
through the same process's :class:`~embank.Table` objects of the store (``push``,
``push_grad``, ``delete``, a worker's pushes) invalidate the rows they touch; rows
written elsewhere (another process, the update stream) reach the cache through
:meth:`GpuCache.refresh` (or ``refresh_every=`` seconds in the background).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    import torch
except ImportError as e:  # the package installs without PyTorch
    raise ImportError("embank.gpu needs PyTorch: pip install 'embank[torch]' (or torch itself)") from e
import torch.nn.functional as F

# What each part holds: _gpu_native (the native path), _gpu_buckets (the Python path's
# structure and operations, Triton or PyTorch), _gpu_transfer (its host-device copies),
# _gpu_insert (its inserts and the background inserter).
from . import _native
from ._gpu_buckets import EMPTY as EMPTY
from ._gpu_buckets import KEEP as KEEP
from ._gpu_buckets import LOCKED as LOCKED
from ._gpu_buckets import ONES_CHUNK as ONES_CHUNK
from ._gpu_buckets import _triton_usable, key_hash
from ._gpu_insert import _AsyncQueue, _insert_loop, _Inserts
from ._gpu_native import _NativeCache
from ._gpu_train import TrainCache
from ._gpu_transfer import _Staging
from ._table import Table
from .errors import InvalidInputError

__all__ = ["GpuCache", "TrainCache", "key_hash"]

SLOTS_DEFAULT = 128
QUEUE_KEYS_MAX_DEFAULT = 1 << 20
MISS_IDS_HINT_MIN = 1024  # miss ids a lookup copies to the host with the count, at least
_POLICIES = {"lru": 0, "lfu": 1, "custom": 2}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _host_keys(keys: Any) -> npt.NDArray[np.int64]:
    """Keys given on the host (list, numpy, CPU tensor) as the int64 bits of u64 keys."""
    a = np.asarray(keys)
    if a.dtype.kind == "i" and a.size and a.min() < 0:
        raise InvalidInputError(f"keys hold a negative value ({int(a.min())}); embank keys are u64")
    if a.dtype.kind not in "iu" and a.size:
        raise InvalidInputError(f"keys must be integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a.astype(np.uint64).reshape(-1)).view(np.int64)


class GpuCache(_NativeCache, _Inserts):
    """The rows of ``table`` most used, in ``device`` memory (see the module's text).

    Args:
        table: an embank :class:`~embank.Table` (embedded or remote).
        rows_max: rows the cache holds at most, rounded down to whole buckets
            (``stats()["rows_max"]`` is the bound kept).
        device: where the cache lives (default: ``"cuda"`` if available, else the CPU).
        insert: ``"sync"``, ``"async"`` or ``"auto"`` (default; async once the hit rate
            over the last ``window`` lookups reaches ``hit_rate_threshold``, 0.8).
        dtype: element type of the cached rows: ``torch.float32`` (default),
            ``torch.float16`` or ``torch.bfloat16``; lookups return float32.
        slots: entries per bucket, a power of two up to 128 (default 128; lowered to
            the largest power of two <= ``rows_max`` for a smaller cache, and halved,
            down to 8, while rounding ``rows_max`` down to whole buckets would lose
            more than an eighth of it).
        policy: ``"lru"`` (default), ``"lfu"`` or ``"custom"`` (see the module's text).
        kernels: ``"native"``, ``"triton"``, ``"torch"`` or ``"auto"`` (default: native on
            CUDA, PyTorch elsewhere; see the module's text).
        window: lookups the hit rate of ``"auto"`` is taken over (default 32).
        default: the row an async miss is answered with (a number or ``dim`` values);
            default: the table's ``missing`` default when it is a number, else zeros.
        refresh_every: also refresh in the background every this many seconds (default:
            never).
        queue_keys_max: keys waiting for a background insert at most; more are dropped
            and counted (default 1 Mi).
        stored_rows: for a table storing ``f16`` or ``int8`` rows, fetch misses as stored
            (:meth:`~embank.Table.lookup_stored`) and decode them on the device (default
            True): an int8 row of dim 128 crosses to the device in 136 bytes, not 512,
            and the host does not decode it. The rows cached are the same either way
            (int8: ``q * scale + bias`` without a fused multiply-add, as the store
            decodes). ``False``: fetch float32 rows (:meth:`~embank.Table.lookup`).
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
        slots: int = SLOTS_DEFAULT,
        policy: str = "lru",
        kernels: str = "auto",
        window: int = 32,
        default: float | Any = None,
        refresh_every: float | None = None,
        queue_keys_max: int = QUEUE_KEYS_MAX_DEFAULT,
        stored_rows: bool = True,
    ) -> None:
        if not isinstance(table, Table):
            raise InvalidInputError(f"GpuCache caches an embank Table, got {type(table).__name__}")
        if rows_max < 1:
            raise InvalidInputError(f"rows_max must be >= 1, got {rows_max}")
        if insert not in ("sync", "async", "auto"):
            raise InvalidInputError(f'insert must be "sync", "async" or "auto", got {insert!r}')
        if not 0.0 <= hit_rate_threshold <= 1.0:
            raise InvalidInputError(f"hit_rate_threshold must be in [0, 1], got {hit_rate_threshold}")
        if dtype not in _DTYPES:
            raise InvalidInputError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        if slots < 1 or slots > SLOTS_DEFAULT or slots & (slots - 1):
            raise InvalidInputError(f"slots must be a power of two up to {SLOTS_DEFAULT}, got {slots}")
        if policy not in _POLICIES:
            raise InvalidInputError(f'policy must be "lru", "lfu" or "custom", got {policy!r}')
        if queue_keys_max < 1:
            raise InvalidInputError(f"queue_keys_max must be >= 1, got {queue_keys_max}")
        self.table = table
        self.dim = table.dim
        # The table's element type when misses are fetched as stored (None: float32 rows).
        self._stored: str | None = table.stored_dtype if stored_rows and table.stored_dtype != "f32" else None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if kernels == "auto":
            kernels = "native" if self.device.type == "cuda" else "torch"
        if kernels not in ("native", "triton", "torch"):
            raise InvalidInputError(f'kernels must be "native", "triton", "torch" or "auto", got {kernels!r}')
        if kernels == "triton" and not _triton_usable(self.device):
            raise InvalidInputError("Triton kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
        if kernels == "native" and self.device.type == "cpu" and not _native.gpu_emulator():
            raise InvalidInputError(
                'kernels="native" runs on CUDA; on the CPU only in a build with the GPU emulator '
                "(make test builds one)"
            )
        if kernels == "native" and self.device.type not in ("cuda", "cpu"):
            raise InvalidInputError(f'kernels="native" runs on CUDA, not {self.device.type}')
        self.kernels = kernels
        self.insert_mode, self.threshold, self.policy = insert, hit_rate_threshold, policy
        self._policy = _POLICIES[policy]
        s = min(slots, 1 << (rows_max.bit_length() - 1))
        while s > 8 and (rows_max % s) * 8 > rows_max:  # whole buckets would lose > 1/8
            s //= 2
        self.slots = s
        self.n_buckets = rows_max // s  # rounded down: rows_max is a bound
        self.dtype = dtype
        fill = default
        if fill is None:
            missing = table.options.get("missing")
            fill = float(missing) if isinstance(missing, (int, float)) else 0.0
        default_values = torch.as_tensor(fill, dtype=torch.float32).expand(self.dim)
        self._n: Any = None
        self._closed = False
        if kernels == "native":
            self._window_len = max(1, window)
            self._init_native(table, default_values, stored_rows)
            self._remote = table._remote
            if self._remote:  # an embedded table's writes reach the cache through the store's notices
                table._write_listeners().add(self._on_write)
            self._stop = threading.Event()
            weakref.finalize(self, self._stop.set)
            self._refresher: threading.Thread | None = None
            if refresh_every is not None:
                self.start_refresh(refresh_every)
            return
        dev = self.device
        s = self.slots
        self.keys = torch.full((self.n_buckets, s), EMPTY, dtype=torch.int64, device=dev)
        self.digests = torch.zeros((self.n_buckets, s), dtype=torch.uint8, device=dev)
        self.scores = torch.full((self.n_buckets, s), -1, dtype=torch.int64, device=dev)
        self.values = torch.zeros((self.n_buckets * s, self.dim), dtype=dtype, device=dev)
        self.versions = torch.zeros(self.n_buckets, dtype=torch.int64, device=dev)
        # Counted on the device (no sync): index 4 the rows invalidated; and each insert's
        # outcomes (see `_write`) by kind (1 sync, 2 async), counted in one launch.
        self._counts = torch.zeros(5, dtype=torch.int64, device=dev)
        self._outcomes = torch.zeros((3, 8), dtype=torch.int64, device=dev)
        self._ones = torch.ones(ONES_CHUNK, dtype=torch.int64, device=dev)  # never reallocated
        self.default_row = default_values.to(dev).clone()
        self.clock = 0
        self._lock = threading.RLock()
        self._order: Any = None  # the event after the cache's last launch (CUDA)
        self._streams: set[int] = set()  # streams the cache's tensors were recorded on
        self._miss_ids_hint = MISS_IDS_HINT_MIN  # twice the last lookup's misses
        self._staging: list[_Staging] = []
        self._window: list[tuple[int, int]] = []
        self._window_len = max(1, window)
        self._stats = dict.fromkeys(
            ("lookups", "hits", "misses", "default_answers", "refreshes", "refresh_rows", "refresh_changed",
             "refresh_bytes"),
            0,
        )  # fmt: skip
        self._refresh_seconds = 0.0
        self._side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._queue = _AsyncQueue(queue_keys_max)
        self._inserter = threading.Thread(
            target=_insert_loop, args=(weakref.ref(self), self._queue), name="embank-gpu-insert", daemon=True
        )
        self._inserter.start()
        self._stop = threading.Event()
        weakref.finalize(self, self._queue.close)
        weakref.finalize(self, self._stop.set)
        self._refresher = None
        if refresh_every is not None:
            self.start_refresh(refresh_every)
        table._write_listeners().add(self._on_write)

    def lookup_pooled(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        mode: str = "sum",
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bags of ``ids`` (1-D) pooled as ``torch.nn.functional.embedding_bag`` pools them:
        ``offsets`` (1-D, where each bag starts), ``mode`` ``"sum"`` or ``"mean"``,
        ``per_sample_weights`` (sum only). ``(bags, dim)`` float32 on the cache's device.
        With ``kernels="native"`` the rows are found and pooled in one launch (a sync
        lookup's misses are added to their bags in one more); otherwise :meth:`lookup`
        then ``embedding_bag``. An async miss pools the default row."""
        if mode not in ("sum", "mean"):
            raise InvalidInputError(f'mode must be "sum" or "mean", got {mode!r}')
        if per_sample_weights is not None and mode != "sum":
            raise InvalidInputError('per_sample_weights need mode="sum" (as in torch.nn.EmbeddingBag)')
        flat = self._device_ids(ids)
        if ids.dim() != 1 or offsets.dim() != 1:
            raise InvalidInputError(
                f"ids and offsets must be 1-D, got {tuple(ids.shape)} and {tuple(offsets.shape)}"
            )
        n, bags = flat.numel(), offsets.numel()
        weights = None
        if per_sample_weights is not None:
            weights = per_sample_weights.reshape(-1).to(self.device, torch.float32).contiguous()
            if weights.numel() != n:
                raise InvalidInputError(
                    f"per_sample_weights must have the shape of ids, got {weights.numel()} for {n}"
                )
        if self._n is None:
            rows = self.lookup(flat, scores)
            every = torch.arange(n, device=self.device)
            return F.embedding_bag(
                every, rows, offsets.to(self.device), mode=mode, per_sample_weights=weights
            )
        offs = offsets.to(self.device, torch.int64).contiguous()
        given, _keep = self._native_prelude(scores, n, ids.shape)
        out = torch.empty((bags, self.dim), dtype=torch.float32, device=self.device)
        self._n.lookup_pooled(
            flat.data_ptr(), n, offs.data_ptr(), bags, 0 if weights is None else weights.data_ptr(),
            mode == "mean", out.data_ptr(), self._stream_of(), given,
        )  # fmt: skip
        return out

    # ---- the public interface ----

    def _device_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise InvalidInputError(f"ids must be a torch tensor, got {type(ids).__name__}")
        if ids.dtype == torch.uint64:
            ids = ids.view(torch.int64)
        elif ids.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError(f"ids must be an int64, uint64 or int32 tensor, got {ids.dtype}")
        # Contiguous: the kernels read n ids from the address (a column of a batch, or
        # any strided view, would be read as the n ids after its first).
        return ids.reshape(-1).to(self.device, torch.int64).contiguous()

    def lookup(self, ids: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` (any shape; uint64, int64 or int32: an int64 id is the u64 key
        of the same bits) as ``(*ids.shape, dim)`` float32 on the cache's device. Never
        creates rows: an id the table lacks answers its missing default (not cached).
        ``scores`` (int64 in [0, 2^55), the shape of ``ids``): with ``policy="custom"``,
        the scores of the ids (a hit keeps the larger; a new key is refused when its
        score is below its full bucket's lowest; a new key given twice in one lookup is
        inserted with the larger of its scores, whatever their order, so the Triton
        kernels and the PyTorch path cache the same keys). One host sync (see the
        module's text)."""
        if self._n is not None:
            return self._lookup_native(ids, scores)
        self._queue.raise_error()
        flat = self._device_ids(ids)
        n = len(flat)
        given = flat
        if self._policy == 2:
            if scores is None:
                raise InvalidInputError('policy="custom" needs the scores of the ids')
            given = scores.reshape(-1).to(self.device, torch.int64).contiguous()
            if len(given) != n:
                raise InvalidInputError(
                    f"scores must have the shape of ids, got {scores.shape} for {ids.shape}"
                )
        staging = self._take_staging()
        try:
            with self._ordered():
                self.clock += 1
                out, vers, payload, miss_at = self._lookup_find(flat, given)
                asynchronous = self._async()
                # The count and the first `k` miss ids (and, for an async custom-score
                # cache, their scores) come to the host in one copy.
                k = min(n, self._miss_ids_hint)
                with_scores = self._policy == 2 and asynchronous
                if with_scores:
                    gathered = miss_at[:k].clamp(min=0, max=max(n - 1, 0))  # past the count: any place
                    head = torch.cat([payload[: 1 + k], given[gathered]])
                else:
                    head = payload[: 1 + k]
                host, copied = self._to_host(staging, head)
            if copied is not None:
                copied.synchronize()  # the one host sync: miss count and miss ids
            n_miss = int(host[0])
            with self._lock:
                self._miss_ids_hint = max(MISS_IDS_HINT_MIN, 2 * n_miss)
            if n_miss:
                first = min(n_miss, k)
                miss_ids = host[1 : 1 + first].numpy().copy()
                miss_scores = host[1 + k : 1 + k + first].numpy().copy() if with_scores else None
                if n_miss > k:  # more misses than the hint: a second copy and wait for the rest
                    rest = miss_at[k:n_miss]
                    more, copied = self._to_host(
                        staging, torch.cat([flat[rest]] + ([given[rest]] if with_scores else []))
                    )
                    if copied is not None:
                        copied.synchronize()
                    miss_ids = np.concatenate([miss_ids, more[: n_miss - k].numpy()])
                    if miss_scores is not None:
                        miss_scores = np.concatenate([miss_scores, more[n_miss - k :].numpy()])
                self._misses(
                    staging, miss_ids, miss_at[:n_miss], flat, out, vers, given, asynchronous, miss_scores
                )
        finally:
            self._give_staging(staging)
        with self._lock:
            self._stats["lookups"] += 1
            self._stats["hits"] += n - n_miss
            self._stats["misses"] += n_miss
            self._window.append((n - n_miss, n))
            if len(self._window) > self._window_len:
                self._window.pop(0)
        return out.reshape(*ids.shape, self.dim)

    def wait(self) -> None:
        """Waits until the background inserts queued so far are done; raises the error
        of a failed one (once)."""
        if self._n is not None:
            self._n.wait()
            return
        self._queue.join()
        self._queue.raise_error()

    def invalidate(self, keys: Any) -> int:
        """Drops ``keys`` (a tensor on any device, numpy array or list of u64 keys) from
        the cache; a later lookup reads them from the table again. Returns how many were
        cached (waits for the device)."""
        if self._n is not None:
            if isinstance(keys, torch.Tensor):
                keys = self._device_ids(keys).cpu().numpy()
            return int(self._n.invalidate(_host_keys(keys).view(np.uint64).tolist()))
        return int(self._invalidate_keys(keys).sum())

    def _invalidate_keys(self, keys: Any) -> torch.Tensor:
        if isinstance(keys, torch.Tensor):
            ids = self._device_ids(keys)
        else:
            ids = torch.from_numpy(_host_keys(keys)).to(self.device)
        if not len(ids):
            return torch.zeros(0, dtype=torch.int64)
        with self._ordered():
            done = self._invalidate(ids)
            self._counts[4] += done.sum()
        return done

    def _on_write(self, keys: npt.NDArray[np.uint64]) -> None:
        if self._n is not None:
            self._n.notice(np.asarray(keys, dtype=np.uint64).tolist())  # dropped before the next lookup
            return
        self._invalidate_keys(keys)  # no host wait

    def refresh(self, batch: int = 65_536) -> dict[str, float]:
        """Re-reads every cached key from the table in batches and replaces the rows that
        changed (a key the table no longer holds is dropped). A row is written only if
        its bucket's version has not moved since its key was read, so a write through
        the table meanwhile (which invalidates) is never overwritten by the older row.
        Returns rows, changed, bytes moved between host and device (keys down, rows
        up: float32, or as stored with ``stored_rows``) and seconds; the native path adds
        where the seconds went (``setup_seconds``: the buffers, allocated by the first
        refresh and kept, and the keys copied down and listed;
        ``read_seconds``: waiting for its ``reader_threads`` reading the table;
        ``wait_seconds``: waiting for the device), and keeps its buffers for the next
        refresh until :meth:`close` (pinned and device, ~80 MB at most, and 8 bytes a
        slot). Waits for the device (it is not the lookup's path)."""
        if self._n is not None:
            rows, changed, moved, seconds, setup, read, wait, threads = self._n.refresh()
            return {
                "rows": rows,
                "changed": changed,
                "bytes": moved,
                "seconds": seconds,
                "setup_seconds": setup,
                "read_seconds": read,
                "wait_seconds": wait,
                "reader_threads": threads,
            }
        t0 = time.perf_counter()
        with self._ordered():
            keys_flat = self.keys.view(-1)
            occupied = ((keys_flat != EMPTY) & (keys_flat != LOCKED)).nonzero().squeeze(1)
        rows_done = changed = moved = 0
        staging = self._take_staging()
        try:
            for i in range(0, len(occupied), batch):
                at = occupied[i : i + batch]
                with self._ordered():
                    ids = self.keys.view(-1)[at]
                    vers = self.versions[at // self.slots]
                    host_ids, copied = self._to_host(staging, ids)
                if copied is not None:
                    copied.synchronize()  # outside the lock
                host = host_ids.numpy().copy()
                live = (host != EMPTY) & (host != LOCKED)
                if not live.any():
                    continue
                fresh, exists = self._fetch(host[live])
                take = np.flatnonzero(live)
                rows_all = np.zeros((len(host), fresh.shape[1]), dtype=fresh.dtype)
                rows_all[take] = fresh
                ok = np.zeros(len(host), dtype=bool)
                ok[take[exists]] = True
                gone = host[take[~exists]]
                with self._ordered():
                    okd, dev_rows = self._to_device(staging, ok.astype(np.int64), rows_all)
                    assert dev_rows is not None
                    slot = torch.where(okd.bool(), at, -1)
                    done = self._write(ids, dev_rows, slot, ids, torch.full_like(ids, KEEP), vers)
                    n_changed = ((done & 2) != 0).sum()
                if len(gone):
                    n_changed = n_changed + self._invalidate_keys(gone).sum()
                changed += int(n_changed)
                rows_done += int(live.sum())
                moved += len(host) * 8 + rows_all.nbytes
        finally:
            self._give_staging(staging)
        seconds = time.perf_counter() - t0
        with self._lock:
            self._stats["refreshes"] += 1
            self._stats["refresh_rows"] += rows_done
            self._stats["refresh_changed"] += changed
            self._stats["refresh_bytes"] += moved
            self._refresh_seconds += seconds
        return {"rows": rows_done, "changed": changed, "bytes": moved, "seconds": seconds}

    def start_refresh(self, every: float) -> None:
        """Refreshes in a background thread every ``every`` seconds until :meth:`close`
        (the thread holds the cache only while it refreshes)."""
        if every <= 0:
            raise InvalidInputError(f"refresh every must be > 0 seconds, got {every}")
        if self._refresher is not None:
            raise InvalidInputError("a periodic refresh is already running")
        ref, stop = weakref.ref(self), self._stop

        def loop() -> None:
            while not stop.wait(every):
                me = ref()
                if me is None:
                    return
                me.refresh()
                del me

        self._refresher = threading.Thread(target=loop, name="embank-gpu-refresh", daemon=True)
        self._refresher.start()

    def stats(self) -> dict[str, Any]:
        """Hits, misses (ids, repeats included), hit rate (all and over the window),
        inserts (sync, async), inserts refused (a full bucket of higher scores, or a
        write meanwhile), misses answered with the default, async keys dropped (queue
        full) and errors, evictions, invalidated rows, refresh rows/bytes/seconds/GB/s,
        rows cached, rows_max, bytes of the structure and, on CUDA, memory allocated.
        Waits for the device."""
        if self._n is not None:
            return self._stats_native()
        with self._ordered():
            counts = self._counts.tolist()
            outcomes = self._outcomes.tolist()
            rows_cached = int(((self.keys != EMPTY) & (self.keys != LOCKED)).sum())
        # An outcome is 0 (refused) or 1 | 2 (the row changed) | 4 (a key evicted).
        counts[0] = sum(c for o in outcomes for v, c in enumerate(o) if v & 4)
        counts[1], counts[2] = (sum(c for v, c in enumerate(outcomes[w]) if v & 1) for w in (1, 2))
        counts[3] = outcomes[1][0] + outcomes[2][0]
        with self._lock:
            s: dict[str, Any] = dict(self._stats)
            (s["evictions"], s["sync_inserts"], s["async_inserts"], s["insert_refused"], s["invalidated"]) = (
                counts
            )
            s["async_dropped"], s["async_errors"] = self._queue.dropped, self._queue.errors
            total = s["hits"] + s["misses"]
            s["hit_rate"] = s["hits"] / total if total else None
            wt = sum(n for _, n in self._window)
            s["window_hit_rate"] = sum(h for h, _ in self._window) / wt if wt else None
            s["refresh_seconds"] = self._refresh_seconds
            s["refresh_gb_per_s"] = (
                s["refresh_bytes"] / self._refresh_seconds / 1e9 if self._refresh_seconds else None
            )
            s["rows_cached"] = rows_cached
        s["rows_max"] = self.n_buckets * self.slots
        s["slots"] = self.slots
        s["bytes"] = sum(
            t.numel() * t.element_size()
            for t in (self.keys, self.digests, self.scores, self.values, self.versions)
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
        """Stops the background threads (queued inserts are finished first) and raises
        the error of a failed background insert not raised yet."""
        if self._closed:
            return
        self._closed = True
        if self._n is not None:
            self._stop.set()
            if self._refresher is not None:
                self._refresher.join()
            if self._remote:
                self.table._write_listeners().discard(self._on_write)
            self._n.close()
            return
        self._stop.set()
        self._queue.join()
        self._queue.close()
        self._inserter.join()
        if self._refresher is not None:
            self._refresher.join()
        self.table._write_listeners().discard(self._on_write)
        self._queue.raise_error()

    def __enter__(self) -> GpuCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GpuCache(table={self.table.name!r}, rows_max={self.n_buckets * self.slots}, "
            f"device={str(self.device)!r}, insert={self.insert_mode!r}, kernels={self.kernels!r})"
        )
