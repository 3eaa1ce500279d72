"""A write-back cache for training on the accelerator: :class:`TrainCache` keeps the hot
rows of a table **with their optimizer state** in device memory, answers a step's pulls
there, and applies the table's optimizer to them there; a row goes back to the table
only when it is evicted (dirty) or at :meth:`TrainCache.flush` /
:meth:`TrainCache.checkpoint`.

>>> import embank, embank.gpu, embank.optim, numpy as np, torch, tempfile, os
>>> store = embank.open(os.path.join(tempfile.mkdtemp(), "t"))
>>> t = store.create_table("item", dim=2, optimizer=embank.optim.SGD(lr=0.5))
>>> t.push([7], np.array([[1.0, 2.0]], dtype=np.float32))
>>> cache = embank.gpu.TrainCache(t, rows_max=64, device="cpu")
>>> cache.pull(torch.tensor([7])).tolist()
[[1.0, 2.0]]
>>> cache.push_grad(torch.tensor([7, 7]), torch.ones(2, 2))   # duplicates summed: one update
>>> cache.pull(torch.tensor([7])).tolist(), t.pull([7]).tolist()  # the table: not yet
([[0.0, 1.0]], [[1.0, 2.0]])
>>> cache.checkpoint(1)  # the dirty rows written back, then the store's checkpoint
>>> t.pull([7]).tolist()
[[0.0, 1.0]]
>>> cache.close(); store.close()

**Structure.** Buckets of ``slots`` entries: keys, records (``dim`` row values then the
optimizer's ``state_len`` values, float32), a dirty flag and an LRU clock each. A key
lives in the bucket its hash picks (:func:`embank.gpu.key_hash`, as :class:`GpuCache`).
A pull finds the batch's ids; the misses take the bucket's empty slots first, then its
least recently used ones among those the call does not use itself; an evicted dirty row
is written back (``push_with_state``) before the misses are read, so a key evicted and
missed again reads what was written. A miss is read with its state
(``lookup_with_state``); one the table does not hold is created there with the table's
initializer (``pull``), as a pull through the table creates it. Ids of a call that do not
fit their bucket (more misses than the bucket has slots free for them) are answered
from the table and updated straight through to it.

**Updates** run on the device (``kernels="native"``: one launch of a CUDA kernel,
:mod:`embank._gpu_train_native`; else PyTorch operations) in the order of the store's own
optimizer (``crates/embank-core/src/optim.rs``), in float32, with square roots, powers
and divisions rounded as the host rounds them (PyTorch's vectorized ``sqrt`` and its
division by a scalar through a reciprocal can be an ulp off): on the CPU every kind is
bit for bit the store's (the tests check it). FBGEMM's table-step kinds
(``FbgemmAdam``, ``Lamb``, their partial row-wise forms) bias-correct with the step
passed to :meth:`push_grad` (or the last + 1), and a flush gives the table that step.

**What the table holds.** Between write-backs the cache owns its rows: the table has each
cached row as it was when it was last written back. The table's store writes the dirty
rows of its open caches before every checkpoint (``store.checkpoint``,
:meth:`checkpoint`), ``close`` and state-dict export, so a checkpoint holds every update
and a run resumed after a crash from it continues exactly as the uninterrupted one (the
cache starts empty; it changes where rows are, never their values); rows updated after
the last checkpoint and not written back are lost with the process, as a crash loses
them anyway. ``write_back_every=k`` writes back every ``k`` steps: readers of the table
(``embank serve`` replicas fed by the update stream, an evaluation process) then see rows
at most ``k`` steps behind the trainer. A write-back cache owns its rows: a write to a
cached row through the table by anyone else is overwritten at the next write-back, and
two trainers' write-back caches would overwrite each other's updates
(``SparseOptimizer(distributed=True)`` refuses one).

**Many trainers** (``write="through"``, :mod:`embank._gpu_shared`): every update is applied
to the cached rows on the device *and* its gradient pushed to the table, whose optimizer
applies it; no row is ever dirty. Under ``SparseOptimizer(distributed=True)`` each rank
applies the step's global gradient (every rank's, averaged) to the rows it caches, and
the rank owning a row pushes it to the table once, before the step's barrier: after
every step each rank's cached rows equal the table's (bit for bit where the device rounds
as the host, the CPU; on a GPU an update may differ in the last bit, and
``refresh_every=k`` re-reads every cached row every ``k`` steps). A row changed in the
table by anyone outside the group (another job's pushes) reaches a rank's cache within
``refresh_every`` steps: the staleness bound, as ``delay`` / ``staleness_bound`` bound a
worker's.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from . import _gpu_shared, _gpu_train_native
from ._device import StreamFollower, sum_rows
from ._gpu_buckets import EMPTY, _triton_usable, key_hash
from ._gpu_writer import TABLE_SHIFT, _Writer, split_keys
from ._table import Table
from .errors import InvalidInputError

__all__ = ["TrainCache"]

SLOTS_DEFAULT = 32
_PINNED = 1 << 62  # a slot the call uses itself: never its victim
_FREE = -(1 << 62)  # an empty slot: taken first
_TABLE_STEP = ("fbgemm_adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")
_TRITON_KINDS = ("sgd", "adagrad", "adam", "adamw", "ftrl")  # updated by the Triton kernel
_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl", *_TABLE_STEP)


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the store holds its hyper-parameters."""
    return float(np.float32(x))


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square roots (the host's ``sqrtf``): PyTorch's vectorized
    CPU ``sqrt`` may be an ulp off. Taken in float64 and rounded once more, which is exact
    for a square root."""
    return torch.sqrt(x.double()).float()


def _div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` divided element by element: PyTorch turns ``scalar / tensor`` into a
    reciprocal times the scalar, and CUDA ``tensor / scalar`` into a multiplication by
    the reciprocal, each an ulp off the host's division at times."""
    like = a if isinstance(a, torch.Tensor) else b
    assert isinstance(like, torch.Tensor)
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(like, a)
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(like, b)
    return torch.div(a, b)


def _pow(base: float, t: torch.Tensor) -> torch.Tensor:
    """``base ** t`` in float32 as the store computes it (float64, then rounded once)."""
    return torch.pow(torch.tensor(base, dtype=torch.float64, device=t.device), t.double()).float()


def _tables_of(table: Any) -> list[Table]:
    """The table, or the tables, a cache is over: each with an optimizer; several share
    their dim, optimizer and store."""
    tables = list(table) if isinstance(table, (list, tuple)) else [table]
    if not tables:
        raise InvalidInputError("a TrainCache needs a table")
    for t in tables:
        if not isinstance(t, Table):
            raise InvalidInputError(f"TrainCache caches embank Tables, got {type(t).__name__}")
        if t.optimizer is None:
            raise InvalidInputError(
                f"table {t.name!r} has no optimizer: a TrainCache applies the table's optimizer "
                "on the device (create the table with optimizer=...)"
            )
    first = tables[0]

    def store_of(t: Table) -> Any:
        return t._owner() if t._owner is not None else None

    for t in tables[1:]:
        if (t.dim, t.optimizer) != (first.dim, first.optimizer):
            raise InvalidInputError(
                f"a TrainCache over several tables needs one dim and optimizer: {first.name!r} has "
                f"{first.dim}, {first.optimizer}; {t.name!r} has {t.dim}, {t.optimizer}"
            )
        if store_of(t) is not store_of(first):
            raise InvalidInputError("a TrainCache over several tables needs them from one store")
    if len({t.name for t in tables}) != len(tables):
        raise InvalidInputError("a TrainCache over several tables needs them distinct")
    if len(tables) > 1 << (63 - TABLE_SHIFT):
        raise InvalidInputError(f"a TrainCache holds at most {1 << (63 - TABLE_SHIFT)} tables")
    return tables


def _keys_tensor(keys: Any, device: torch.device) -> torch.Tensor:
    if isinstance(keys, torch.Tensor):
        if keys.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError(f"ids must be an integer tensor, got {keys.dtype}")
        k = keys.reshape(-1).to(device=device, dtype=torch.int64)
    else:
        arr = np.asarray(keys)
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInputError(f"ids must be integers, got {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
            raise InvalidInputError(f"ids must be below 2**63, got {int(arr.max())}")
        k = torch.from_numpy(np.ascontiguousarray(arr.reshape(-1).astype(np.int64))).to(device)
    if k.numel() and bool((k < 0).any()):
        raise InvalidInputError(f"ids must be non-negative, got {int(k[k < 0][0])}")
    return k


class TrainCache:
    """The rows of ``table`` a trainer uses most, with their optimizer state, in
    ``device`` memory, updated there (see the module's text).

    Args:
        table: an embank :class:`~embank.Table` with an optimizer (embedded or remote;
            a remote one's primaries answer ``lookup_with_state``), or a list of tables
            of one dim, optimizer and store: one cache for all of them (a step's rows of
            every table found, placed and updated in one call each), keyed by
            :meth:`keys_of`.
        rows_max: rows the cache holds at most (rounded down to whole buckets), or
        bytes_max: device bytes for the cache instead: rows and state (``4 * (dim +
            state_len)`` a row) and 17 bytes of bookkeeping a row.
        device: where the cache lives (default: ``"cuda"`` if available, else the CPU).
        slots: entries per bucket (default 32, at most ``rows_max``).
        write_back_every: flush every this many steps (default: never but when evicted,
            at :meth:`flush` and :meth:`checkpoint`).
        write_back: ``"background"`` (default: evicted rows are written to the table by
            a thread of the cache's, off the step's path; at most ``queue_rows_max``
            rows wait) or ``"inline"`` (before the step goes on).
        queue_rows_max: rows waiting for the background writer at most (default 1 Mi).
        kernels: ``"native"`` (a pull is two native calls, find and place, an update one
            launch: the CUDA kernels of ``crates/embank-gpu/kernels/train.cuh``, launched
            from Rust on the current stream; SGD, Adagrad, row-wise Adagrad, Adam, AdamW,
            FTRL; on the CPU their emulator, in a test build), ``"triton"`` (the updates of
            the element-wise kinds in one Triton launch: SGD, Adagrad, Adam, AdamW, FTRL;
            on the CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (PyTorch operations), or
            ``"auto"`` (default: Triton on CUDA when it is installed; the native kernels
            have not run on a GPU yet). All give the same bits and place rows alike.
        write: ``"back"`` (default: one trainer owns the table's rows; dirty rows go back
            when evicted or flushed) or ``"through"`` (each update also pushed to the
            table: many trainers, see the module's text).
        refresh_every: with ``write="through"``, drop every cached row every this many
            steps, so rows others change reach the cache within that many steps.

    Threads may share a cache (its calls take a lock); on CUDA a call on another stream
    than the last call's waits for that stream first (an update is not waited for).
    """

    def __init__(
        self,
        table: Table | list[Table],
        rows_max: int | None = None,
        *,
        bytes_max: int | None = None,
        device: str | torch.device | None = None,
        slots: int = SLOTS_DEFAULT,
        write_back_every: int | None = None,
        write_back: str = "background",
        queue_rows_max: int = 1 << 20,
        kernels: str = "auto",
        write: str = "back",
        refresh_every: int | None = None,
    ) -> None:
        tables = _tables_of(table)
        table = tables[0]
        opt = table.optimizer
        assert opt is not None
        if opt["kind"] not in _KINDS:
            raise InvalidInputError(f"optimizer {opt['kind']!r} is not applied on the device yet")
        self.table, self.tables = table, tables
        self.dim = table.dim
        self.state_len = table.state_len
        self.width = self.dim + self.state_len
        if (rows_max is None) == (bytes_max is None):
            raise InvalidInputError("give rows_max or bytes_max (one of them)")
        if bytes_max is not None:
            if bytes_max < 1:
                raise InvalidInputError(f"bytes_max must be >= 1, got {bytes_max}")
            rows_max = bytes_max // (4 * self.width + 17)
        assert rows_max is not None
        if rows_max < 1:
            raise InvalidInputError(
                f"rows_max must be >= 1 (bytes_max too small for one row), got {rows_max}"
            )
        if slots < 1:
            raise InvalidInputError(f"slots must be >= 1, got {slots}")
        if write_back_every is not None and write_back_every < 1:
            raise InvalidInputError(f"write_back_every must be >= 1, got {write_back_every}")
        if write_back not in ("background", "inline"):
            raise InvalidInputError(f'write_back must be "background" or "inline", got {write_back!r}')
        if queue_rows_max < 1:
            raise InvalidInputError(f"queue_rows_max must be >= 1, got {queue_rows_max}")
        if write not in ("back", "through"):
            raise InvalidInputError(f'write must be "back" or "through", got {write!r}')
        if write == "through" and len(tables) > 1:  # a push failing midway would leave them apart
            raise InvalidInputError('write="through" takes a cache of one table')
        if refresh_every is not None and (write != "through" or refresh_every < 1):
            raise InvalidInputError('refresh_every needs write="through" and must be >= 1')
        self.write, self.refresh_every, self._steps_since_refresh = write, refresh_every, 0
        self._writer = _Writer(tables, write_back == "background", queue_rows_max)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and dev.index is None:  # one device for the cache's life
            dev = torch.device("cuda", torch.cuda.current_device())
        if kernels == "auto":
            kernels = "triton" if dev.type == "cuda" and _triton_usable(dev) else "torch"
        if kernels not in ("triton", "torch", "native"):
            raise InvalidInputError(f'kernels must be "native", "triton", "torch" or "auto", got {kernels!r}')
        if kernels == "triton" and not _triton_usable(dev):
            raise InvalidInputError("Triton kernels need CUDA, or TRITON_INTERPRET=1 on the CPU")
        self.kernels = kernels
        self.slots = min(slots, rows_max)
        self.n_buckets = rows_max // self.slots
        self.rows_max = self.n_buckets * self.slots
        self.write_back_every = write_back_every
        self.device = dev
        dev, cap = self.device, self.rows_max
        self.keys = torch.full((cap,), EMPTY, dtype=torch.int64, device=dev)
        self.records = torch.zeros((cap, self.width), dtype=torch.float32, device=dev)
        self.dirty = torch.zeros(cap, dtype=torch.bool, device=dev)
        self.used = torch.zeros(cap, dtype=torch.int64, device=dev)
        self._clock = 1
        self._placed = 0  # counts calls that placed rows: a slot found before still holds its key
        self._last_pull: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # add_grad's gradients of one step: (step, ids, grads), applied as one update.
        self._gathered: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._opt = {k: (_f32(v) if isinstance(v, float) else v) for k, v in opt.items()}
        self._step = max(t.optimizer_step for t in tables)
        self._step_written = self._step
        self._steps_since_flush = 0
        self._lock = threading.RLock()
        self._closed = False
        self._stream_of: Any = None
        self._streams = StreamFollower(self.device, self._kept)
        self._nk: Any = None  # the native kernels over the tensors above (kernels="native")
        if kernels == "native":
            _gpu_train_native.attach(self)
        # The store's checkpoints, close and exports write this cache's rows first.
        self._owner = table._owner() if table._owner is not None else None
        if self._owner is not None:
            self._owner._write_backs.add(self)
        counters = "pulls hits misses created evicted written_back overflow updates flushes refreshes"
        self._stats = dict.fromkeys(counters.split(), 0)
        self._streams.follow()  # the arrays above were made on this stream

    # ---- the API ----

    def pull(self, ids: Any) -> torch.Tensor:
        """Rows of ``ids`` (any shape of integers, repeats allowed) as ``(n, dim)`` float32
        on the cache's device; a row the table does not hold is created there with the
        table's initializer."""
        k = _keys_tensor(ids, self.device)
        uniq, inverse = torch.unique(k, return_inverse=True)
        return self.pull_unique(uniq)[inverse]

    def pull_unique(self, uniq: torch.Tensor) -> torch.Tensor:
        """:meth:`pull` of ids already unique (an int64 tensor on the cache's device)."""
        with self._lock:
            self._check_open()
            self._apply_gathered()
            self._stats["pulls"] += 1
            if self._nk is not None:  # the rows written by the kernels
                rows = torch.empty((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
                slot, spill = _gpu_train_native.resident(self, uniq, rows)
                self._last_pull = (uniq, slot, self._placed) if spill is None else None
                return rows
            slot, spill = self._resident(uniq)
            # Its gradient's push_grad (the same tensor, no row placed since) finds nothing.
            self._last_pull = (uniq, slot, self._placed) if spill is None else None
            rows = torch.empty((uniq.numel(), self.dim), dtype=torch.float32, device=self.device)
            inside = slot >= 0
            rows[inside] = self.records[slot[inside], : self.dim]
            if spill is not None:
                rows[~inside] = spill[1][:, : self.dim]
            return rows

    def push_grad(self, ids: Any, grads: torch.Tensor, step: int | None = None) -> None:
        """Applies the table's optimizer on the device to the rows of ``ids`` with
        gradients ``grads`` (``(n, dim)``), duplicates summed first: one update a row a
        call, as :meth:`embank.Table.push_grad`. ``step``: the training step for FBGEMM's
        kinds (default: the last + 1). Rows not cached are brought in first."""
        if self._gathered is not None:
            with self._lock:
                self._apply_gathered()
        last = self._last_pull
        if last is not None and ids is last[0] and last[2] == self._placed:
            # The ids of the last pull_unique, all still where it found them.
            if not isinstance(grads, torch.Tensor) or grads.shape != (ids.numel(), self.dim):
                raise InvalidInputError(f"grads must have shape ({ids.numel()}, {self.dim})")
            g = grads.detach().to(self.device, torch.float32)
            if g.numel() and not bool(torch.isfinite(g).all()):
                raise InvalidInputError("grads hold a value that is not finite: nothing was updated")
            with self._lock:
                self._check_open()
                if self._last_pull is last and last[2] == self._placed:
                    step = self._next_step(step)
                    if self.write == "through":  # the table first: a failed push changes nothing
                        _gpu_shared.push_through(self, ids, g, step)
                    self._apply(last[1], None, g, step, ids.numel())
                    return
        k = _keys_tensor(ids, self.device)
        if not isinstance(grads, torch.Tensor):
            grads = torch.as_tensor(np.asarray(grads, dtype=np.float32))
        g = grads.detach().to(self.device, torch.float32).reshape(-1, self.dim) if grads.numel() else grads
        if g.shape != (k.numel(), self.dim):
            raise InvalidInputError(
                f"grads must have shape ({k.numel()}, {self.dim}), got {tuple(grads.shape)}"
            )
        if g.numel() and not bool(torch.isfinite(g).all()):
            raise InvalidInputError("grads hold a value that is not finite: nothing was updated")
        with self._lock:
            self._check_open()
            step = self._next_step(step)
            if not k.numel():
                self._apply(None, None, g, step, 0)
                return
            uniq, inverse = torch.unique(k, return_inverse=True)
            if uniq.numel() == k.numel():
                summed = torch.empty_like(g).index_copy_(0, inverse, g)
            else:
                summed = sum_rows(inverse, g, uniq.numel())
            # Rows missed are read (and placed) before the push: read after it, they would
            # get this step's update twice.
            slot, spill = self._resident(uniq)
            if self.write == "through":  # the table before the cache's rows
                _gpu_shared.push_through(self, uniq, summed, step)
            self._apply(slot, spill, summed, step, uniq.numel())

    def _next_step(self, step: int | None) -> int:
        step = self._step + 1 if step is None else int(step)
        if step < 1:
            raise InvalidInputError(f"step must be >= 1, got {step}")
        self._step = max(self._step, step)
        return step

    def _apply(
        self,
        slot: torch.Tensor | None,
        spill: tuple[torch.Tensor, torch.Tensor] | None,
        summed: torch.Tensor,
        step: int,
        n: int,
    ) -> None:
        """One update of the rows at ``slot`` (and of ``spill``'s, written through)."""
        if slot is not None:
            if self._nk is not None:  # one launch: slots < 0 skipped, rows marked dirty
                _gpu_train_native.update(self, slot, summed)
            else:
                if spill is None:
                    s, mine = slot, summed
                else:
                    inside = slot >= 0
                    s, mine = slot[inside], summed[inside]
                if self.kernels == "triton" and self._opt["kind"] in _TRITON_KINDS:
                    self._update_in_place(s, mine)
                else:
                    self.records[s] = self._update(self.records[s], mine, step)
                if self.write == "back":
                    self.dirty[s] = True
            if self.write == "back":  # written through: the caller pushes the gradient
                if spill is not None:
                    keys, recs = spill
                    self._write_back(keys, self._update(recs, summed[slot < 0], step))
        self._stats["updates"] += n
        if self.write == "through":
            _gpu_shared.count_step(self)
        self._steps_since_flush += 1
        if self.write_back_every is not None and self._steps_since_flush >= self.write_back_every:
            self._flush()

    def add_grad(self, ids: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Gathers a gradient of training step ``step`` (the backward of
        :mod:`embank.torch`'s modules): every gradient of one step (a table's features
        each pooled by a module of its own) is summed and applied as **one** update, as
        FBGEMM's fused backward does, at the next :meth:`pull`, :meth:`push_grad`,
        :meth:`flush` or :meth:`checkpoint`, or when a gradient of another step comes."""
        with self._lock:
            self._check_open()
            if self._gathered is not None and self._gathered[0] != step:
                self._apply_gathered()
            if self._gathered is None:
                self._gathered = (step, [], [])
            self._gathered[1].append(ids)
            self._gathered[2].append(grads)

    def _kept(self) -> list[torch.Tensor]:
        """The tensors held from one call to a later one (StreamFollower records them)."""
        held = list(self._last_pull[:2]) if self._last_pull is not None else []
        return held + (self._gathered[1] + self._gathered[2] if self._gathered is not None else [])

    def _apply_gathered(self) -> None:
        got, self._gathered = self._gathered, None
        if got is None:
            return
        step, ids, grads = got
        if len(ids) == 1:  # one module's: its pull's slots may still hold
            self.push_grad(ids[0], grads[0], step)
        else:
            self.push_grad(torch.cat(ids), torch.cat(grads), step)

    def flush(self) -> int:
        """Writes every dirty row (and its state) back to the table; returns how many.
        The rows stay cached, clean."""
        with self._lock:
            self._check_open()
            return self._flush()

    def checkpoint(self, batch_id: int, meta: bytes = b"") -> None:
        """The table's store's ``checkpoint(batch_id, meta)``, which writes the dirty rows
        of every open TrainCache over its tables first (this one's included): the
        checkpoint holds every update made through them."""
        with self._lock:
            self._check_open()
            if self._owner is None:
                raise InvalidInputError("checkpoint needs a table obtained from its store")
            self._owner.checkpoint(batch_id, meta)

    def _flush_for_store(self) -> None:
        """The store's call before a checkpoint, a close or an export."""
        with self._lock:
            if not self._closed:
                self._flush()

    def _clear_for_store(self) -> None:
        """The store's call before tables are written underneath (a state dict loaded):
        dirty rows written back, then every row dropped, so the next pull reads them."""
        with self._lock:
            if self._closed:
                return
            self._flush()
            self.keys.fill_(EMPTY)
            self.dirty.fill_(False)
            self.used.zero_()
            self._placed += 1
            self._last_pull = None

    def stats(self) -> dict[str, Any]:
        """Counters (pulls, hits, misses, created, evicted, written_back, overflow,
        updates, flushes, refreshes), the rows cached and dirty now, and the bound."""
        with self._lock:
            if not self._closed:
                self._streams.follow()
                self._apply_gathered()
            out: dict[str, Any] = dict(self._stats)
            out["rows"] = int((self.keys != EMPTY).sum())
            out["dirty"] = int(self.dirty.sum())
            out["rows_max"] = self.rows_max
            out["hit_rate"] = self._stats["hits"] / max(1, self._stats["hits"] + self._stats["misses"])
            return out

    def close(self) -> None:
        """Flushes, then frees the device memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self._flush()
            finally:
                self._writer.close()
            self._closed = True
            if self.device.type == "cuda":  # its arrays freed: nothing queued may still use them
                torch.cuda.current_stream(self.device).synchronize()
            self._nk = None
            if self._owner is not None:
                self._owner._write_backs.discard(self)
            self.keys = self.records = self.dirty = self.used = torch.empty(0)

    def __enter__(self) -> TrainCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys_of(self, table: int | str | Table, ids: Any) -> torch.Tensor:
        """The cache's keys of ``ids`` of ``table`` (its index in the tables, its name, or
        the Table): for a cache over several tables, ``(index << 48) | id`` (ids below
        2**48), what its pulls and updates take; for one table, the ids. An int64 tensor
        on the cache's device."""
        if isinstance(table, Table):
            names = [t.name for t in self.tables]
            index = names.index(table.name) if table.name in names else -1
        elif isinstance(table, str):
            index = next((i for i, t in enumerate(self.tables) if t.name == table), -1)
        else:
            index = int(table) if 0 <= int(table) < len(self.tables) else -1
        if index < 0:
            raise InvalidInputError(f"table {table!r} is not one of this cache's")
        k = _keys_tensor(ids, self.device)
        if len(self.tables) == 1:
            return k
        if k.numel() and int(k.max()) >> TABLE_SHIFT:
            raise InvalidInputError(f"ids of a cache over several tables are below 2**{TABLE_SHIFT}")
        return k | (index << TABLE_SHIFT)

    def __repr__(self) -> str:
        names = ", ".join(repr(t.name) for t in self.tables)
        return (
            f"TrainCache(table{'s' if len(self.tables) > 1 else ''}={names}, rows_max={self.rows_max}, "
            f"slots={self.slots}, "
            f"device={str(self.device)!r}, optimizer={self._opt['kind']!r}, write={self.write!r})"
        )

    # ---- the structure ----

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError("this TrainCache is closed")
        self._writer.raise_error()
        self._streams.follow()  # after another stream's update (see StreamFollower)

    def _flush(self) -> int:
        self._streams.follow()
        self._apply_gathered()
        d = self.dirty.nonzero().reshape(-1)
        n = int(d.numel())
        if n:
            self._write_back(self.keys[d], self.records[d])
            self.dirty[d] = False
        self._writer.drain()  # after the evictions queued before them
        if self._step > self._step_written and self._opt["kind"] in _TABLE_STEP:
            # The table's step is the cache's: a checkpoint records it.
            for t in self.tables:
                t.push_grad(np.empty(0, np.uint64), np.empty((0, self.dim), np.float32), self._step)
        self._step_written = self._step
        self._steps_since_flush = 0
        self._stats["flushes"] += 1
        return n

    def _write_back(self, keys: torch.Tensor, records: torch.Tensor) -> None:
        if keys.numel():
            k = keys.to("cpu").numpy().astype(np.uint64)
            self._write_back_np(k, records.detach().to("cpu", torch.float32).numpy())

    def _write_back_np(self, k: npt.NDArray[np.uint64], records: npt.NDArray[np.float32]) -> None:
        order = np.argsort(k)  # sorted: the queue is searched by key
        self._writer.put(np.ascontiguousarray(k[order]), np.ascontiguousarray(records[order]))
        self._stats["written_back"] += int(k.size)

    def _fetch(self, keys: torch.Tensor) -> torch.Tensor:
        k = keys.to("cpu").numpy().astype(np.uint64)
        return torch.from_numpy(self._fetch_np(k)).to(self.device)

    def _fetch_np(self, k: npt.NDArray[np.uint64]) -> npt.NDArray[np.float32]:
        """Records of ``k`` from the table; rows it does not hold are created there."""
        if len(self.tables) > 1 and k.size and int(k.max()) >> TABLE_SHIFT >= len(self.tables):
            bad = int(k.max())
            raise InvalidInputError(
                f"id {bad} names no table of this cache (table index {bad >> TABLE_SHIFT} of "
                f"{len(self.tables)}): a cache over several tables takes keys_of(table, ids)"
            )
        queued, rows = self._writer.take(k)
        records: npt.NDArray[np.float32] = np.empty((k.size, self.width), dtype=np.float32)
        for table, at, ids in split_keys(self.tables, k):
            got, found = table.lookup_with_state(ids)
            if rows is not None:
                q = queued if at is None else queued[at]
                got[q] = (rows if at is None else rows[at])[q]
                found |= q
            if not found.all():
                missing = ~found
                got[missing, : self.dim] = table.pull(ids[missing])
                self._stats["created"] += int(missing.sum())
            if at is None:
                records = got
            else:
                records[at] = got
        return np.ascontiguousarray(records, dtype=np.float32)

    def _resident(self, uniq: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Makes ``uniq`` (unique ids) resident where their buckets have room: their slots
        (-1 for those that do not fit) and, for those, ``(keys, records)`` read from the
        table."""
        if self._nk is not None:
            return _gpu_train_native.resident(self, uniq, None)
        s, nb = self.slots, self.n_buckets
        clock = self._clock
        self._clock += 1
        if self.kernels == "triton":
            from . import _triton_train

            slot = _triton_train.find(uniq, self.keys, self.used, s, clock)
            hit = slot >= 0
        else:
            bucket = torch.remainder(key_hash(uniq), nb)
            base = bucket * s
            eq = self.keys.view(nb, s)[bucket] == uniq[:, None]
            hit = eq.any(dim=1)
            slot = torch.where(hit, base + eq.to(torch.int8).argmax(dim=1), torch.full_like(base, -1))
            self.used[slot[hit]] = clock
        miss = (~hit).nonzero().reshape(-1)  # the call's one wait for the device when all hit
        self._stats["hits"] += uniq.numel() - miss.numel()
        spill = None
        if not miss.numel():
            return slot, spill
        bucket = torch.remainder(key_hash(uniq), nb)
        hits = slot[hit]
        self._stats["misses"] += int(miss.numel())
        mb = bucket[miss]
        # Each bucket's slots in the order they are given out: empty ones, then the least
        # recently used; the slots this call hits are never given.
        buckets, binv, counts = torch.unique(mb, return_inverse=True, return_counts=True)
        pri = self.used.view(nb, s)[buckets].clone()
        pri[self.keys.view(nb, s)[buckets] == EMPTY] = _FREE
        pinned = torch.zeros((nb * s,), dtype=torch.bool, device=self.device)
        pinned[hits] = True
        pinned_b = pinned.view(nb, s)[buckets]
        pri[pinned_b] = _PINNED
        order = torch.argsort(pri, dim=1, stable=True)
        free = s - pinned_b.sum(dim=1)
        # Each miss's rank among its bucket's misses.
        by_bucket = torch.argsort(binv, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(by_bucket)
        rank[by_bucket] = torch.arange(miss.numel(), device=self.device) - starts[binv[by_bucket]]
        fits = rank < free[binv]
        placed = miss[fits]
        victims = buckets[binv[fits]] * s + order[binv[fits], rank[fits]]
        # Evicted dirty rows go back before the misses are read.
        old = self.keys[victims]
        evicted = old != EMPTY
        self._stats["evicted"] += int(evicted.sum())
        out = victims[evicted & self.dirty[victims]]
        if out.numel():
            self._write_back(self.keys[out], self.records[out])
        records = self._fetch(uniq[miss])
        self._placed += 1
        self.keys[victims] = uniq[placed]
        self.records[victims] = records[fits]
        self.dirty[victims] = False
        self.used[victims] = clock
        slot[placed] = victims
        if not bool(fits.all()):
            self._stats["overflow"] += int((~fits).sum())
            spill = (uniq[miss[~fits]], records[~fits])
        return slot, spill

    # ---- the optimizers, in the store's order of operations ----

    def _update_in_place(self, slots: torch.Tensor, g: torch.Tensor) -> None:
        """The element-wise kinds' update of ``records[slots]`` in one Triton launch."""
        from . import _triton_train

        bc = None
        if self._opt["kind"] in ("adam", "adamw"):
            t = self.records[slots, 3 * self.dim] + 1.0
            bc = torch.stack([1.0 - _pow(self._opt["beta1"], t), 1.0 - _pow(self._opt["beta2"], t)], 1)
        _triton_train.update(self.records, slots.contiguous(), g.contiguous(), self._opt, bc)

    def _update(self, rec: torch.Tensor, g: torch.Tensor, step: int) -> torch.Tensor:
        o, d = self._opt, self.dim
        kind = o["kind"]
        rec = rec.clone()
        w = rec[:, :d]
        if kind == "sgd":
            rec[:, :d] = w - o["lr"] * g
        elif kind == "adagrad":
            s = rec[:, d : 2 * d] + g * g
            rec[:, d : 2 * d] = s
            rec[:, :d] = w - (o["lr"] * g) / (_sqrt(s) + o["eps"])
        elif kind == "rowwise_adagrad":
            acc = self._sum_squares_in_order(g)
            s0 = rec[:, d] + _div(acc, float(d))
            rec[:, d] = s0
            mult = _div(o["lr"], _sqrt(s0) + o["eps"])
            rec[:, :d] = w - mult[:, None] * g
        elif kind == "ftrl":
            z, n = rec[:, d : 2 * d], rec[:, 2 * d : 3 * d]
            n_new = n + g * g
            sigma = _div(_sqrt(n_new) - _sqrt(n), o["lr"])
            z_new = z + (g - sigma * w)
            l1 = o["l1"]
            denom = _div(o["beta"] + _sqrt(n_new), o["lr"]) + o["l2"]
            w_new = -(z_new - torch.sign(z_new) * l1) / denom
            rec[:, :d] = torch.where(z_new.abs() <= l1, torch.zeros_like(w_new), w_new)
            rec[:, d : 2 * d] = z_new
            rec[:, 2 * d : 3 * d] = n_new
        elif kind in ("adam", "adamw"):
            if kind == "adamw":
                decay = float(np.float32(1.0) - np.float32(o["lr"]) * np.float32(o["weight_decay"]))
                w = w * decay
            b1, b2 = o["beta1"], o["beta2"]
            m, v, t = rec[:, d : 2 * d], rec[:, 2 * d : 3 * d], rec[:, 3 * d] + 1.0
            bc1 = 1.0 - _pow(b1, t)
            bc2 = 1.0 - _pow(b2, t)
            m = b1 * m + _f32(1.0 - b1) * g
            v = b2 * v + (_f32(1.0 - b2) * g) * g
            mhat, vhat = m / bc1[:, None], v / bc2[:, None]
            rec[:, :d] = w - (o["lr"] * mhat) / (_sqrt(vhat) + o["eps"])
            rec[:, d : 2 * d], rec[:, 2 * d : 3 * d], rec[:, 3 * d] = m, v, t
        else:
            self._table_step(rec, g, step)
        return rec

    def _table_step(self, rec: torch.Tensor, g: torch.Tensor, step: int) -> None:
        """FBGEMM's kernels for one row (``TableStepRule::apply`` in the store)."""
        o, d = self._opt, self.dim
        kind = str(o["kind"])
        rowwise, lamb = kind.startswith("partial_rowwise"), kind.endswith("lamb")
        b1, b2, eps, wd = o["beta1"], o["beta2"], o["eps"], o["weight_decay"]
        bc1 = _f32(1.0 - float(np.float32(b1) ** np.float32(step)))
        bc2 = _f32(1.0 - float(np.float32(b2) ** np.float32(step)))
        w, m = rec[:, :d], rec[:, d : 2 * d]
        if rowwise:
            v0 = b2 * rec[:, 2 * d] + _f32(1.0 - b2) * _div(self._sum_squares_in_order(g), float(d))
            rec[:, 2 * d] = v0
            denominator = (_sqrt(_div(v0, bc2)) + eps)[:, None]
        m = b1 * m + _f32(1.0 - b1) * g
        rec[:, d : 2 * d] = m
        if not rowwise:
            v = b2 * rec[:, 2 * d : 3 * d] + (_f32(1.0 - b2) * g) * g
            rec[:, 2 * d : 3 * d] = v
            denominator = _sqrt(_div(v, bc2)) + eps
        r = _div(m, bc1) / denominator + wd * w
        if not lamb:
            rec[:, :d] = w - o["lr"] * r
            return
        w_sq = self._sum_squares_in_order(w)
        r_sq = self._sum_squares_in_order(r)
        trust = torch.where(r_sq > 0, _sqrt(w_sq) / _sqrt(r_sq), torch.zeros_like(r_sq))
        rec[:, :d] = w - (o["lr"] * trust)[:, None] * r

    @staticmethod
    def _sum_squares_in_order(x: torch.Tensor) -> torch.Tensor:
        """Each row's sum of squares, added left to right in float32 (the store's order)."""
        acc = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        for j in range(x.shape[1]):
            acc = acc + x[:, j] * x[:, j]
        return acc
