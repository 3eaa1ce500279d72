"""One table and a training worker of it: the public Table API, a thin, typed layer over
``embank._native``; the row format as stored (sized, encoded and decoded by the store's
own codec); several tables trained in one native call (:class:`FusedTables`).

Inputs are checked here, with messages that say what was expected; the
engine checks again.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from . import _native
from .errors import ConfigError, InvalidInputError

KeysLike = Union[npt.NDArray[np.integer[Any]], Sequence[int]]
Rows = npt.NDArray[np.float32]

__all__ = ["FusedTables", "Table", "Worker", "decode_rows", "row_bytes"]


def _keys(keys: KeysLike) -> npt.NDArray[np.uint64]:
    """Keys as a contiguous uint64 array, without copying when they already are
    (a strided view, such as ``keys[::2]``, is copied: keys are small)."""
    if isinstance(keys, np.ndarray):
        arr = keys
    else:
        arr = np.asarray(keys)
        if arr.size == 0:
            arr = arr.astype(np.uint64)
    if arr.ndim != 1:
        raise InvalidInputError(f"keys must be a 1-D array, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.dtype == np.uint64:
        return arr.view(np.uint64)
    if arr.dtype.kind in "iu":
        if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
            bad = int(arr[arr < 0][0])
            raise InvalidInputError(f"keys must be non-negative, got {bad}")
        if arr.dtype == np.int64:
            return arr.view(np.uint64)
        return arr.astype(np.uint64)
    raise TypeError(f"keys must be uint64 (or non-negative int64), got dtype {arr.dtype}")


def _rows(rows: Rows, n: int, dim: int, table: str) -> Rows:
    if not isinstance(rows, np.ndarray):
        raise TypeError(f"rows must be a float32 numpy array, got {type(rows).__name__}")
    if rows.dtype != np.float32:
        raise TypeError(f"rows must be float32, got dtype {rows.dtype} (use rows.astype(np.float32))")
    if rows.ndim != 2 or rows.shape[0] != n or rows.shape[1] != dim:
        raise InvalidInputError(
            f"rows must have shape ({n}, {dim}) for {n} keys of table {table!r} (dim {dim}), got {rows.shape}"
        )
    if not rows.flags.c_contiguous:
        raise InvalidInputError("rows must be a C-contiguous array (use np.ascontiguousarray)")
    return rows


class _WriteListeners:
    """Callbacks told the keys of every write made through a store's :class:`Table`
    objects of one table (what keeps a :class:`embank.gpu.GpuCache` consistent). Held
    weakly: a dropped listener's object is forgotten."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._methods: list[weakref.WeakMethod[Any]] = []

    def add(self, method: Any) -> None:
        with self._lock:
            self._methods.append(weakref.WeakMethod(method))

    def discard(self, method: Any) -> None:
        with self._lock:
            self._methods = [m for m in self._methods if m() is not None and m() != method]

    def __bool__(self) -> bool:
        with self._lock:
            return any(m() is not None for m in self._methods)

    def notify(self, keys: npt.NDArray[np.uint64]) -> None:
        with self._lock:
            live = [f for f in (m() for m in self._methods) if f is not None]
        for f in live:
            f(keys)


def row_bytes(stored_dtype: str, dim: int) -> int:
    """Bytes of one stored row of ``dim`` values of ``stored_dtype`` (``"f32"``, ``"f16"``,
    ``"int8"``: ``dim`` bytes, then scale and bias), as the store's codec lays it out."""
    return _native.row_bytes(stored_dtype, dim)


def decode_rows(stored: npt.ArrayLike, stored_dtype: str, dim: int) -> Rows:
    """Rows as :meth:`Table.lookup_stored` returns them (``(n, row_bytes)`` uint8), decoded
    to an ``(n, dim)`` float32 array by the store's own codec: exactly what
    :meth:`Table.lookup` returns (int8: ``q * scale + bias``, a float32 multiply, then a
    float32 add). One native call for the batch, the GIL released."""
    return _native.decode_rows(np.ascontiguousarray(stored, dtype=np.uint8), stored_dtype, dim)


class Table:
    """One embedding table. Obtain it from :meth:`Store.create_table` or :meth:`Store.table`.

    Every method takes a batch of keys; the GIL is released while the engine works.
    """

    def __init__(
        self,
        native: _native.Table,
        listeners: _WriteListeners | None = None,
        store: _native.Store | None = None,
        owner: Any = None,
    ) -> None:
        self._t = native
        self._listeners = listeners if listeners is not None else _WriteListeners()
        self._store = store
        # The embank.Store that made it (weak: a table does not keep its store open).
        self._owner = weakref.ref(owner) if owner is not None else None

    def _write_listeners(self) -> _WriteListeners:
        return self._listeners

    @property
    def name(self) -> str:
        return self._t.name

    @property
    def dim(self) -> int:
        return self._t.dim

    @property
    def dtype(self) -> np.dtype[np.float32]:
        """The dtype of rows the table takes and returns (always float32)."""
        return np.dtype(np.float32)

    @functools.cached_property
    def stored_dtype(self) -> str:
        """How rows are stored: ``"f32"``, ``"f16"`` or ``"int8"`` (fixed when the table is
        created: read once)."""
        return str(self.options.get("dtype", "f32"))

    @property
    def _remote(self) -> bool:
        """Whether the table lives on servers (its store is :func:`embank.connect`'s)."""
        return bool(self._t.remote)

    @property
    def options(self) -> dict[str, Any]:
        """The options the table was created with."""
        meta: dict[str, Any] = json.loads(self._t.meta_json())
        return meta

    def pull(self, keys: KeysLike) -> Rows:
        """Rows of ``keys`` as an ``(n, dim)`` float32 array; missing rows are created
        with the table's initializer."""
        return self._t.pull(_keys(keys))

    def lookup(
        self,
        keys: KeysLike,
        default: float | npt.ArrayLike | None = None,
        *,
        min_checkpoint: int | None = None,
        checkpoint: int | None = None,
    ) -> tuple[Rows, npt.NDArray[np.bool_]]:
        """Rows of ``keys`` and a found-mask; never creates rows.

        Missing rows hold the table's ``missing`` default, or ``default`` if given
        (a number, or a vector of ``dim`` values). ``min_checkpoint`` (remote replicas
        fed by an update stream): only replicas serving the training checkpoint of
        that batch id or a later one answer; raises ``ShardUnavailableError`` when a
        shard has none yet.

        What is atomic on replicas fed by an update stream: each shard's part of the
        call is read at one checkpoint (a part of several requests at the newest
        checkpoint a replica serves when the call begins); different shards, and
        different tables, may answer at different checkpoints. For one checkpoint
        across shards and tables, pass ``checkpoint=`` (the lowest ``batch_id`` of
        :meth:`Store.served` is one every shard serves).

        ``checkpoint``: the rows exactly as they were at the training checkpoint of that
        batch id, on every shard, while later ones are applied — what a model reading
        several tables needs to never mix two checkpoints. Answered by replicas that
        still hold it (``Store.served()``'s ``readable``; ``keep_checkpoints`` bounds
        how many); embedded, by a retained checkpoint (see
        :meth:`Store.lookup_checkpoint`). Raises :class:`~embank.errors.NotFoundError`
        when none holds it.
        """
        if min_checkpoint is not None and min_checkpoint < 0:
            raise InvalidInputError(f"min_checkpoint must be >= 0, got {min_checkpoint}")
        if checkpoint is not None:
            if min_checkpoint is not None:
                raise InvalidInputError("give checkpoint= (exact) or min_checkpoint= (at least), not both")
            if checkpoint < 0:
                raise InvalidInputError(f"checkpoint must be >= 0, got {checkpoint}")
            if self._store is None:
                raise InvalidInputError("checkpoint= needs a table obtained from its store")
            rows, found = self._store.lookup_checkpoint(self.name, int(checkpoint), _keys(keys))
        else:
            rows, found = self._t.lookup(_keys(keys), None if min_checkpoint is None else int(min_checkpoint))
        if default is not None:
            fill = np.asarray(default, dtype=np.float32)
            if fill.ndim > 1 or (fill.ndim == 1 and fill.shape[0] != self.dim):
                raise InvalidInputError(f"default must be a number or a vector of {self.dim} values")
            rows[~found] = fill
        return rows, found

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as stored (what :meth:`lookup_stored` returns a key)."""
        return row_bytes(self.stored_dtype, self.dim)

    def lookup_stored(self, keys: KeysLike) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
        """Rows of ``keys`` as the table stores them, not decoded to float32: an
        ``(n, row_bytes)`` uint8 array and a found-mask; never creates rows.

        For a consumer that decodes rows itself, after moving a quarter of the bytes
        (an int8 table's rows to a GPU, decoded there: :class:`embank.gpu.GpuCache` does
        this). Per :attr:`stored_dtype`: ``"f32"`` the little-endian floats; ``"f16"``
        IEEE halves; ``"int8"`` ``dim`` bytes ``q``, then ``scale`` and ``bias`` (float32),
        the value being ``q * scale + bias``. :func:`embank.decode_rows` decodes them to
        exactly what :meth:`lookup` returns. Missing keys hold the ``missing`` default,
        encoded. A remote table's rows travel as float32 and are encoded by the client.
        """
        return self._t.lookup_stored(_keys(keys))

    def place_hot(self, keys: KeysLike) -> dict[str, Any]:
        """Hot placement: moves ``keys`` (the hot set) into their home index buckets, so
        each is found with one bucket read. The index is rebuilt at its size with these
        keys first (crash-safe as a growth is); lookups go on meanwhile, writes and pulls
        of the store wait for it, about one pass over the index. Returns the fraction of
        the held keys at home before and after, how many the table holds, and seconds.
        Embedded stores only."""
        report: dict[str, Any] = json.loads(self._t.place_hot(_keys(keys)))
        return report

    def home_fraction(self, keys: KeysLike) -> float:
        """Of ``keys`` the table holds, the fraction found in their home index bucket."""
        frac, _held = self._t.home_fraction(_keys(keys))
        return float(frac)

    def lookup_pooled(
        self,
        ids: KeysLike,
        offsets: Any,
        weights: Any = None,
        mode: str = "sum",
        include_last_offset: bool = False,
    ) -> Rows:
        """Pooled rows of bags, as ``torch.nn.EmbeddingBag`` pools them: bag ``b`` is
        ``ids[offsets[b]:offsets[b + 1]]``, pooled by ``mode`` (``"sum"``, weighted by
        ``weights`` — one per id — if given, or ``"mean"``). ``offsets`` holds the start
        of every bag (with ``include_last_offset``, also the end, ``len(ids)``, as in
        ``torch.nn.functional.embedding_bag``). Returns a
        ``(bags, dim)`` float32 array. Ids are read as :meth:`lookup` reads them:
        missing ones count as the table's missing default, nothing is created.

        On a store opened with ``pooled_cache_bytes``, a bag seen before (same ids in the
        same order, same weights and mode) is answered from the pooled-embedding cache.
        """
        keys = _keys(ids)
        offs: npt.NDArray[np.int64] = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if not include_last_offset:
            offs = np.append(offs, len(keys))
        if (offs < 0).any():
            raise InvalidInputError("offsets must be >= 0")
        w = (
            None
            if weights is None
            else np.ascontiguousarray(np.asarray(weights, dtype=np.float32).reshape(-1))
        )
        return self._t.lookup_pooled(keys, offs.astype(np.uint64), w, mode)

    def push(self, keys: KeysLike, rows: Rows) -> None:
        """Writes rows (insert or replace). With duplicate keys the last row wins.
        Non-finite values are refused and nothing is written."""
        k = _keys(keys)
        try:
            self._t.push(k, _rows(rows, len(k), self.dim, self.name))
        finally:
            self._listeners.notify(k)

    @property
    def state_len(self) -> int:
        """``float32`` values of optimizer state kept with each row: 0 without an
        optimizer (or SGD), 1 for row-wise Adagrad, ``dim`` for Adagrad, ``2 * dim`` for
        FTRL (``z`` then ``n``), ``2 * dim + 1`` for Adam and AdamW (moments, then the
        step count), ``2 * dim`` for FbgemmAdam and Lamb (moments; their step is the
        table's), ``dim + 1`` for their partial row-wise forms (m, then one v)."""
        return self._t.state_len

    def lookup_with_state(self, keys: KeysLike) -> tuple[Rows, npt.NDArray[np.bool_]]:
        """Like :meth:`lookup`, with each row's optimizer state after it:
        ``(records, found)`` where ``records`` is ``(n, dim + state_len)``. A missing key
        gets the missing default and the optimizer's initial state; nothing is created.
        A served table reads them from each shard's primary (a replica refuses)."""
        return self._t.lookup_with_state(_keys(keys))

    def push_with_state(self, keys: KeysLike, records: Rows) -> None:
        """Writes rows together with their optimizer state (``(n, dim + state_len)``
        float32, laid out as :meth:`lookup_with_state` returns them); :meth:`push` starts
        the state afresh instead. A non-finite value, or a state the optimizer cannot
        reach (a negative accumulator), is refused with nothing written. On a table with a
        lifecycle, rows are admitted at once and room is made
        under ``rows_max`` first, as :meth:`push` does."""
        k = _keys(keys)
        width = self.dim + self.state_len
        if not isinstance(records, np.ndarray) or records.dtype != np.float32:
            raise TypeError("records must be a float32 numpy array")
        if records.shape != (len(k), width):
            raise InvalidInputError(
                f"records must have shape ({len(k)}, {width}) for {len(k)} keys of table {self.name!r} "
                f"(dim {self.dim} + state {self.state_len}), got {records.shape}"
            )
        try:
            self._t.push_with_state(k, np.ascontiguousarray(records))
        finally:
            self._listeners.notify(k)

    def delete(self, keys: KeysLike) -> int:
        """Deletes keys; returns how many were present."""
        k = _keys(keys)
        try:
            return self._t.delete(k)
        finally:
            self._listeners.notify(k)

    def push_grad(self, keys: KeysLike, grads: Rows, step: int | None = None) -> None:
        """Applies the table's optimizer to the rows of ``keys`` with gradients ``grads``
        (``(n, dim)`` float32). Gradients of duplicate keys are summed first, so each row
        gets one update per call; missing rows are created with the initializer, then
        updated. Raises :class:`~embank.errors.ConfigError` if the table has no optimizer.

        ``step``: the training step (from 1) the gradients belong to. FBGEMM's optimizers
        (:class:`~embank.optim.FbgemmAdam`, :class:`~embank.optim.Lamb`, their partial
        row-wise forms) bias-correct every row of a step with it, however many calls
        (workers, ranks) the step makes, and the table's :attr:`optimizer_step` becomes it
        if later. Without one, the call is a step of its own (the table's step + 1). Other
        optimizers ignore it."""
        k = _keys(keys)
        try:
            self._t.push_grad(k, _rows(grads, len(k), self.dim, self.name), step)
        finally:
            self._listeners.notify(k)

    @property
    def optimizer_step(self) -> int:
        """The training step of the table's last update, for FBGEMM's optimizers (0 before
        the first, and always for the others). Kept by checkpoints: after
        ``store.restore(batch)`` it is the checkpoint's."""
        return self._t.optimizer_step()

    def worker(self, timeout: float = 60.0) -> Worker:
        """A training worker's view of this table, for bounded staleness.

        Its :meth:`Worker.pull` takes a hold on each key until its
        :meth:`Worker.push_grad`; under the table's ``staleness_bound`` a pull of a key
        that already has ``bound + 1`` holds waits (at most ``timeout`` seconds, then
        :class:`~embank.errors.EmbankTimeoutError` naming the key). Leaving a ``with``
        block, or :meth:`Worker.release`, gives back its holds; a worker that dies
        loses them when its lease (``lease_seconds`` of the table) runs out.
        """
        return Worker(self, timeout)

    @property
    def staleness_bound(self) -> int | None:
        """Bounded staleness of :meth:`worker` pulls: ``None`` (ASP), 0 (BSP) or k (SSP)."""
        bound: int | None = json.loads(self._t.meta_json()).get("staleness_bound")
        return bound

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The optimizer and its current hyper-parameters, or ``None``."""
        opt: dict[str, Any] = json.loads(self._t.meta_json())["optimizer"]
        return None if opt["kind"] == "none" else opt

    def set_lr(self, lr: float) -> None:
        """Changes the optimizer's learning rate (durable at once)."""
        self._t.set_lr(float(lr))

    def lookahead(self, keys: KeysLike) -> bool:
        """Loads these rows into the DRAM row cache in the background, so a later
        :meth:`pull` of them hits. Returns at once; ``False`` if the request queue
        was full and the hint was dropped (it is only a hint)."""
        return self._t.lookahead(_keys(keys))

    def __len__(self) -> int:
        return len(self._t)

    def evict_expired(self) -> int:
        """Evicts now every row past the table's TTL (``ttl_steps``/``ttl_seconds``);
        returns how many. The store also does so about once a second."""
        return self._t.evict_expired()

    def export(self, chunk_size: int = 65_536) -> Iterator[tuple[npt.NDArray[np.uint64], Rows]]:
        """Streams every ``(keys, rows)`` in chunks of at most ``chunk_size`` keys."""
        if chunk_size < 1:
            raise InvalidInputError("chunk_size must be at least 1")
        yield from self._t.export(chunk_size)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self._t.stats_json())
        return out

    def __repr__(self) -> str:
        return f"<embank.Table {self.name!r} dim={self.dim}>"


class Worker:
    """A training worker of one table (from :meth:`Table.worker`): pulls under the
    table's staleness bound and pushes gradients that give the holds back."""

    def __init__(self, table: Table, timeout: float) -> None:
        if timeout < 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout}")
        self.table = table
        self.timeout = float(timeout)
        #: Identifies this worker's holds (random, so workers of many processes never collide).
        self.id = int.from_bytes(os.urandom(8), "little")

    def pull(self, keys: KeysLike) -> Rows:
        """Like :meth:`Table.pull`, holding each key until :meth:`push_grad`."""
        return self.table._t.pull_held(self.id, _keys(keys), self.timeout)

    def push_grad(self, keys: KeysLike, grads: Rows, step: int | None = None) -> None:
        """Like :meth:`Table.push_grad`, then gives back this worker's holds of ``keys``."""
        k = _keys(keys)
        try:
            rows = _rows(grads, len(k), self.table.dim, self.table.name)
            self.table._t.push_grad_held(self.id, k, rows, step)
        finally:
            self.table._listeners.notify(k)

    def release(self) -> int:
        """Gives back every hold of this worker; returns how many it had."""
        return self.table._t.release(self.id)

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<embank.Worker {self.id:#x} of {self.table.name!r}>"


Source = Union[Table, Worker]


def _table_of(source: Source) -> Table:
    # A Worker's, or a TrainCache's (embank.gpu): its table.
    return source if isinstance(source, Table) else source.table


class FusedTables:
    """Several tables pulled, pooled and trained in one native call each way (the core's
    ``fused`` module): the store side of :class:`embank.torch.EmbeddingBagCollection`.

    ``sources``: the distinct tables (a :class:`Worker`: its pulls hold keys until their
    gradients are pushed); ``features``: each feature's index in ``sources``; ``mode``:
    how the engine pools (``"sum"`` or ``"mean"``); ``threads``: tables read at once.
    :meth:`forward` pulls and pools every feature's bags (training: through the workers;
    evaluation: through the tables, never a worker's holds), :meth:`backward` reduces the
    pooled gradient to one gradient per distinct row, :meth:`push` applies every table's
    optimizer and tells each table's write listeners (a GpuCache over it) the rows."""

    def __init__(
        self, sources: Sequence[Source], features: list[int], mode: str, threads: int | None
    ) -> None:
        self.sources = list(sources)
        tables = [_table_of(s) for s in self.sources]
        if threads is None:
            # Embedded tables are CPU work: one thread (more compete with torch's own
            # threads, which spin between ops). Remote tables wait on round trips: overlap
            # a few (4 ran as fast as 16 through 2 shards, with fewer connections: each
            # thread may open one per shard at once, and a server closes unauthenticated
            # ones past 16 per address, which clients then open again).
            remote = any(t._remote for t in tables)
            threads = min(len(self.sources), 4) if remote else 1
        natives = [t._t for t in tables]
        workers = [s.id if isinstance(s, Worker) else None for s in self.sources]
        timeout = max([s.timeout for s in self.sources if isinstance(s, Worker)], default=60.0)
        self._train = _native.Collection(natives, features, workers, mode, threads, timeout)
        # Evaluation pulls through the tables, never a worker's holds.
        self._eval = (
            _native.Collection(natives, features, [None] * len(natives), mode, threads, timeout)
            if any(w is not None for w in workers)
            else self._train
        )
        self._listeners = [t._listeners for t in tables]

    def forward(
        self,
        values: list[npt.NDArray[np.int64]],
        offsets: list[npt.NDArray[np.int64]],
        weights: list[npt.NDArray[np.float32] | None],
        *,
        training: bool,
    ) -> tuple[npt.NDArray[np.float32], _native.Step]:
        """Every feature's bags pooled, flat (feature blocks of ``bags x dim``), and the
        step a :meth:`backward` of them needs."""
        return (self._train if training else self._eval).forward(values, offsets, weights)

    def backward(self, step: _native.Step, grad: npt.NDArray[np.float32]) -> _native.Grads:
        """The flat pooled gradient of ``step`` as one gradient per distinct row of each table."""
        return self._train.backward(step, grad)

    def push(self, grads: _native.Grads, step: int | None = None) -> int:
        """Applies every table's optimizer to ``grads`` in one call (as part of training
        ``step``, see :meth:`Table.push_grad`), then tells each table's write listeners the
        rows pushed; returns the rows pushed."""
        n = self._train.push(grads, step)
        for t, listeners in enumerate(self._listeners):
            if listeners:
                listeners.notify(grads.table(t)[0])
        return int(n)

    def lookahead(self, values: list[npt.NDArray[np.int64]], offsets: list[npt.NDArray[np.int64]]) -> None:
        """Starts reading these features' rows into the row cache in the background."""
        self._train.lookahead(values, offsets)
