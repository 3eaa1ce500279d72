"""The public Store API: a thin, typed layer over ``embank._native``; a store's tables
are :class:`~embank.Table` objects (``_table.py``).

Inputs are checked here, with messages that say what was expected; the
engine checks again.
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _native
from ._publisher import Publisher
from ._table import KeysLike, Rows, Table, _keys, _WriteListeners
from .errors import ConfigError, InvalidInputError, PublishError, TableExistsError
from .init import Initializer, zeros
from .optim import Optimizer

__all__ = ["Store"]


def _deprecated(old: str, new: str) -> None:
    message = f"{old}= is deprecated: use {new}= (bounds are named with _max last)"
    warnings.warn(message, DeprecationWarning, stacklevel=3)


def _lifecycle_json(
    admit_after: int, ttl_steps: int | None, ttl_seconds: float | None, rows_max: int | None, evict: str
) -> str | None:
    if evict not in ("lru", "lfu"):
        raise ConfigError(f'evict must be "lru" or "lfu", got {evict!r}')
    for name, v in (("admit_after", admit_after), ("ttl_steps", ttl_steps), ("rows_max", rows_max)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise ConfigError(f"{name} must be a non-negative int, got {v!r}")
    if admit_after <= 1 and ttl_steps is None and ttl_seconds is None and rows_max is None:
        return None
    return json.dumps(
        {
            "admit_after": int(admit_after),
            "ttl_steps": None if ttl_steps is None else int(ttl_steps),
            "ttl_seconds": None if ttl_seconds is None else float(ttl_seconds),
            "rows_max": None if rows_max is None else int(rows_max),
            "evict": evict,
        }
    )


# The names create_table takes (the engine refuses any other, naming these).
_DTYPE_NAMES = {"f32": "f32", "float32": "f32", "f16": "f16", "float16": "f16", "half": "f16", "int8": "int8"}


def _spec(options: dict[str, Any]) -> str:
    """The options a get-or-create compares, as words: dim, dtype, optimizer."""
    dtype = str(options.get("dtype", "f32"))
    opt = options.get("optimizer")
    none = not opt or (isinstance(opt, dict) and opt.get("kind") == "none")
    opt_text = "no optimizer" if none else "optimizer " + json.dumps(opt, sort_keys=True)
    return f"dim {options.get('dim')}, dtype {_DTYPE_NAMES.get(dtype.lower(), dtype)}, {opt_text}"


class Store:
    """An open store: one model's tables, in a directory of this process
    (:func:`embank.open`) or on the shards of a networked store (:func:`embank.connect`).

    Both kinds have the same methods and raise the same errors. A store is a context
    manager; leaving the ``with`` block closes it (flushing every table).
    """

    def __init__(self, native: _native.Store) -> None:
        self._s = native
        self._publishers: list[Publisher] = []
        self._listeners: dict[str, _WriteListeners] = {}
        # Write-back caches over the tables (embank.gpu.TrainCache): a checkpoint, a close
        # and a state-dict export write their dirty rows first.
        self._write_backs: weakref.WeakSet[Any] = weakref.WeakSet()

    def _flush_write_backs(self) -> None:
        for cache in list(self._write_backs):
            cache._flush_for_store()

    def _listeners_of(self, name: str) -> _WriteListeners:
        return self._listeners.setdefault(name, _WriteListeners())

    @property
    def path(self) -> str:
        """The store's directory, or ``tcp://host:port,...`` for a remote store."""
        return str(self._s.path)

    @property
    def remote(self) -> bool:
        """Whether the tables live on servers (:func:`embank.connect`)."""
        return self._s.remote

    @property
    def closed(self) -> bool:
        return self._s.closed

    def create_table(
        self,
        name: str,
        dim: int,
        *,
        dtype: str = "f32",
        init: Initializer | None = None,
        seed: int = 0,
        capacity: int = 1 << 20,
        growth: bool = True,
        load_factor_max: float = 0.9,
        missing: float | str = 0.0,
        medium: str = "mmap",
        placement: str = "auto",
        optimizer: Optimizer | None = None,
        staleness_bound: int | None = None,
        lease_seconds: float = 60.0,
        admit_after: int = 0,
        ttl_steps: int | None = None,
        ttl_seconds: float | None = None,
        rows_max: int | None = None,
        evict: str = "lru",
        max_rows: int | None = None,
        exist_ok: bool = False,
    ) -> Table:
        """Creates a table.

        Args:
            name: 1 to 128 letters, digits, ``_``, ``-`` or ``.``.
            exist_ok: if the table exists already, return it (get-or-create) when its
                dim, dtype and optimizer are the ones asked for, and raise
                :class:`~embank.TableExistsError` naming both when they are not (its
                other options are kept as they are). Default: an existing table raises.
            dim: elements per row, 1 to 4096.
            dtype: how rows are stored: ``"f32"`` (the default), ``"f16"`` (IEEE half,
                rounded to nearest even: half the bytes, for training and serving) or
                ``"int8"`` (row-wise 8-bit with an f32 scale and bias per row, about a
                quarter of the bytes, for serving: no optimizer, no ``push_grad``).
                ``"float32"``, ``"float16"`` and ``"half"`` are taken too; any other
                name raises :class:`~embank.ConfigError`.
                Every call still takes and returns float32; a stored row reads back
                rounded (``docs/FORMAT.md`` states the formulas and error bounds).
            init: value of never-written rows (default :func:`embank.init.zeros`).
            seed: seeds the initializer and the index hash.
            capacity: rows the index is sized for; it grows past that unless ``growth`` is off.
            growth: grow the index when it fills; when off, a full table raises
                :class:`~embank.errors.TableFullError`.
            load_factor_max: fill of the index that triggers growth, in (0.7, 0.98].
            missing: what :meth:`Table.lookup` returns for missing keys: a number, or
                ``"init"`` for the row the initializer would create.
            medium: ``"mmap"`` (a memory-mapped file: persistent memory, CXL, page cache)
                or ``"block"`` (a data file read with O_DIRECT through io_uring, for
                tables larger than DRAM).
            placement: ``"cache"`` (hot rows in the store's DRAM row cache, updates
                written back in batches), ``"pin"`` (the whole table in the cache),
                ``"bypass"`` (straight to the medium), or ``"auto"`` (the default:
                ``cache`` on the block medium, ``bypass`` on mmap).
            optimizer: the server-side optimizer :meth:`Table.push_grad` applies
                (:class:`embank.optim.SGD`, :class:`~embank.optim.Adagrad`,
                :class:`~embank.optim.Adam`); its state is stored with each row.
            staleness_bound: how far behind a :meth:`Table.worker` pull may be: ``None``
                (ASP, the default: nothing waits), ``0`` (BSP: per key strictly pull, push,
                pull, push), ``k`` (SSP: at most k updates behind).
            lease_seconds: a worker silent this long loses its holds.
            admit_after: admission by access count: a key's row is created by the pull that
                sees it for the ``admit_after``-th time (0 or 1: at once; each pull counts
                once per distinct key). Until then pulls return the initializer's row without
                storing it and gradients pushed for the key are dropped. :meth:`Table.push`
                always creates.
            ttl_steps: evict rows not touched (pulled, looked up, pushed, updated) during
                this many :meth:`Table.push_grad` calls of the table.
            ttl_seconds: evict rows not touched for this many seconds. Expired rows are
                evicted about once a second by the store, or at once by
                :meth:`Table.evict_expired`.
            rows_max: the most rows the table keeps: a batch that would create more first
                evicts victims (``rows_max / 32`` more than needed), never rows of the batch
                (``max_rows``, its old name, is read too, deprecated).
            evict: the victims of ``rows_max``: ``"lru"`` (least recently touched) or
                ``"lfu"`` (fewest touches).

        Admission counts and touch times live in DRAM (about 48 bytes per row of a table
        with a TTL or ``rows_max``) and start over when the store is reopened. Evicted
        rows are gone from every tier and counted in ``stats()["lifecycle"]``.
        """
        if staleness_bound is not None and staleness_bound < 0:
            raise ConfigError(f"staleness_bound must be None or >= 0, got {staleness_bound}")
        init = init or zeros()
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
            raise TypeError(f"dim must be an int, got {type(dim).__name__}")
        if dim < 1 or dim > 4096:
            raise ConfigError(f"dim must be between 1 and 4096, got {dim}")
        if capacity < 1 or seed < 0:
            raise ConfigError("capacity must be >= 1 and seed >= 0")
        if missing == "init":
            missing_kind, missing_value = "init", 0.0
        elif isinstance(missing, (int, float)):
            missing_kind, missing_value = ("zeros", 0.0) if missing == 0 else ("value", float(missing))
        else:
            raise InvalidInputError(f'missing must be a number or "init", got {missing!r}')
        options: dict[str, Any] = {
            "dim": int(dim),
            "dtype": str(dtype),
            "init": init._options(),
            "seed": int(seed),
            "capacity": int(capacity),
            "growth": bool(growth),
            "load_factor_max": float(load_factor_max),
            "missing": {
                "kind": missing_kind,
                **({"value": missing_value} if missing_kind == "value" else {}),
            },
            "medium": medium,
            "placement": placement,
            "staleness_bound": None if staleness_bound is None else int(staleness_bound),
            "lease_seconds": float(lease_seconds),
        }
        if optimizer is not None:
            options["optimizer"] = json.loads(optimizer._json())
        if max_rows is not None:
            _deprecated("max_rows", "rows_max")
            rows_max = max_rows
        lifecycle = _lifecycle_json(admit_after, ttl_steps, ttl_seconds, rows_max, evict)
        if lifecycle is not None:
            options["lifecycle"] = json.loads(lifecycle)
        if exist_ok and name in self:
            return self._existing(name, options)
        try:
            native = self._s.create_table(name, json.dumps(options))
        except TableExistsError:
            if exist_ok:  # created meanwhile by another handle
                return self._existing(name, options)
            t = self.table(name)
            raise TableExistsError(
                f"table {name!r} exists already ({_spec(t.options)}): open it with store.table({name!r}), "
                "or pass exist_ok=True to get it when it matches"
            ) from None
        return Table(native, self._listeners_of(name), self._s, self)

    def _existing(self, name: str, asked: dict[str, Any]) -> Table:
        """The existing table ``name`` for ``create_table(exist_ok=True)``, if it matches."""
        t = self.table(name)
        have = t.options
        if _spec(have) != _spec(asked):
            raise TableExistsError(
                f"table {name!r} exists with {_spec(have)}; asked for {_spec(asked)}: "
                "drop it, or use another name"
            )
        return t

    def table(self, name: str) -> Table:
        """The table called ``name``; raises :class:`~embank.errors.NotFoundError` (a ``KeyError``)."""
        return Table(self._s.table(name), self._listeners_of(name), self._s, self)

    def __getitem__(self, name: str) -> Table:
        return self.table(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._s.tables()

    def tables(self) -> list[str]:
        """Names of all tables, sorted."""
        return self._s.tables()

    def drop_table(self, name: str) -> None:
        """Deletes a table and its files."""
        self._s.drop_table(name)

    def flush(self) -> None:
        """Makes every write before this call durable."""
        self._s.flush()

    def wait_repaired(self) -> None:
        """Waits until every table's background repair after a crash is done.

        A store whose process was killed serves as soon as it is open; a background
        thread finishes the repair (typically well under a second per 10 M rows). Until
        then ``len(table)`` may be off by the writes the crash cut short, and
        ``table.stats()["recovered"]["pending"]`` is true. Remote stores poll the shards."""
        self._s.wait_repaired()

    def checkpoint(self, batch_id: int, meta: bytes = b"") -> None:
        """Marks a batch boundary of training.

        After a crash, opening the store returns every table — rows and optimizer
        state — to exactly the last checkpoint, even though later writes had reached the
        medium; :meth:`restore` returns to any retained one on demand. Cheap: no copy of
        any table (each key's row at the checkpoint is journaled on its first change
        after it). Waits for batches in flight on other threads; tables behind the row
        cache first write back their dirty rows, and so does every open
        :class:`~embank.gpu.TrainCache` over the store's tables. ``batch_id`` must increase. On a remote
        store every shard checkpoints (call it between batches).

        ``meta`` is a small opaque blob (at most 64 KiB) kept with the checkpoint — the
        stream offsets it covers, a trainer's position — and returned by
        :meth:`checkpoint_info`, also after a reopen.

        Every open :meth:`publisher` is told of the checkpoint, whatever another one
        does: one whose broker stays down does not hold back the others. If any of them
        fails, :class:`~embank.errors.PublishError` names every failing one (its
        ``errors`` lists them) after all were told; the checkpoint itself was taken.
        """
        if batch_id < 0:
            raise InvalidInputError(f"batch_id must be >= 0, got {batch_id}")
        if not isinstance(meta, (bytes, bytearray, memoryview)):
            raise TypeError(f"meta must be bytes, got {type(meta).__name__}")
        self._flush_write_backs()
        self._s.checkpoint(int(batch_id), bytes(meta))
        publishers = [p for p in self._publishers if not p.closed]
        failed: list[PublishError] = []
        for p in publishers:
            try:
                p._checkpointed()
            except PublishError as e:
                failed.append(e)
        if failed:
            raise PublishError.of(failed, publishers=len(publishers), batch_id=int(batch_id))

    def publisher(
        self,
        transport: str,
        brokers: str,
        *,
        topic: str = "embank-updates",
        partitions: int = 1,
        every: int = 1,
        checkpoints_pending_max: int = 4,
        message_bytes: int = 1 << 20,
        tables: Sequence[str] | None = None,
        timeout: float = 10.0,
        keep_checkpoints: int = 8,
        max_pending: int | None = None,
    ) -> Publisher:
        """Publishes this store's checkpoints to an update stream that serving replicas
        (``embank serve`` with an ``[updates]`` section) apply.

        From now on every ``every``-th :meth:`checkpoint` hands the newest checkpoint to
        a background thread, which sends the rows written and keys deleted since the
        last checkpoint it published, as they were at the checkpoint, then a commit
        marker in every partition; training goes on meanwhile. The first publish (and
        one after the publisher lost its place) sends every table whole.

        Args:
            transport: ``"kafka"`` or ``"redis"`` (Redis Streams).
            brokers: Kafka bootstrap servers (``"host:port,..."``) or a Redis URL.
            topic: the Kafka topic (created with ``partitions`` partitions if missing),
                or the prefix of the Redis stream keys (``<topic>.<partition>``).
            partitions: one per serving shard; keys go by the shard hash of
                :func:`embank.connect`.
            every: publish every n-th checkpoint.
            checkpoints_pending_max: checkpoints that may wait for an unreachable broker; past
                that :meth:`checkpoint` raises :class:`~embank.errors.PublishError`
                (the checkpoint is taken; updates are never dropped silently).
            message_bytes: bound of one message.
            tables: only these tables (default all).
            timeout: seconds one broker operation may take.
            keep_checkpoints: checkpoints the stream keeps: a replica at most this many
                behind goes on from its position, one further behind (or a new one) reads
                the full snapshot the stream begins with. The publisher trims the stream
                (Redis ``XTRIM MINID``, Kafka ``DeleteRecords``) only at a full snapshot,
                and sends one after a checkpoint's changes once that many checkpoints
                came since the last and their changes weigh as much as it. 0: never trim
                (the stream grows forever).
            max_pending: the old name of ``checkpoints_pending_max`` (deprecated).

        Embedded stores only (a shard publishes with ``embank publish``).
        """
        if max_pending is not None:
            _deprecated("max_pending", "checkpoints_pending_max")
            checkpoints_pending_max = max_pending
        if every < 1:
            raise ConfigError(f"every must be at least 1, got {every}")
        options = {
            "transport": transport,
            "brokers": brokers,
            "topic": topic,
            "timeout_seconds": float(timeout),
            "partitions": int(partitions),
            "message_bytes": int(message_bytes),
            "keep_checkpoints": int(keep_checkpoints),
            "checkpoints_pending_max": int(checkpoints_pending_max),
            "tables": None if tables is None else [str(t) for t in tables],
        }
        p = Publisher(self._s.publisher(json.dumps(options)), every)
        self._publishers.append(p)
        return p

    def served(self) -> list[dict[str, Any]]:
        """Which training checkpoint each shard serves: ``batch_id``, ``seq``, whether
        it is a ``replica``, its ``state`` and the checkpoints it can be read at exactly
        (``readable``, oldest first; embedded: the newest retained checkpoint and the
        retained ones)."""
        out: list[dict[str, Any]] = json.loads(self._s.served_json())
        return out

    def replica_counts(self) -> list[list[dict[str, Any]]]:
        """What each replica of a remote store did since :func:`connect` (``[shard][replica]``):
        ``address``, requests ``answered``, copies of slow reads sent to it
        (``hedges_sent``) and those it answered first (``hedges_won``),
        ``deadlines_missed``, ``ejections`` and ``readmissions`` (out of and back into the
        rotation), whether it is ``ejected`` now and ``why``, its recent ``p99_ms``.
        ``[]`` for an embedded store."""
        out: list[list[dict[str, Any]]] = json.loads(self._s.replica_counts_json())
        return out

    def checkpoints(self) -> list[int]:
        """Batch ids of the retained checkpoints, oldest first (``keep_checkpoints`` of
        :func:`open` says how many are kept)."""
        return [int(c["batch_id"]) for c in json.loads(self._s.checkpoints_json())]

    def checkpoint_info(self) -> list[dict[str, Any]]:
        """The retained checkpoints, oldest first: ``batch_id``, ``seq``, ``unix_seconds``
        and the ``meta`` bytes given to :meth:`checkpoint`."""
        out = []
        for c in json.loads(self._s.checkpoints_json()):
            out.append(
                {
                    "batch_id": int(c["batch_id"]),
                    "seq": int(c["seq"]),
                    "unix_seconds": float(c["unix_seconds"]),
                    "meta": bytes.fromhex(c.get("meta", "")),
                }
            )
        return out

    def export_checkpoint(
        self, table: str, batch_id: int, chunk_size: int = 65_536
    ) -> Iterator[tuple[npt.NDArray[np.uint64], Rows]]:
        """Streams ``(keys, rows)`` of ``table`` as it was at checkpoint ``batch_id`` —
        a consistent snapshot, while training goes on (embedded stores)."""
        if chunk_size < 1:
            raise InvalidInputError("chunk_size must be at least 1")
        yield from self._s.export_checkpoint(table, int(batch_id), chunk_size)

    def export_changes(
        self, table: str, since: int
    ) -> tuple[npt.NDArray[np.uint64], Rows, npt.NDArray[np.uint64]]:
        """The incremental export since checkpoint ``since``: ``(keys, rows, deleted)`` —
        the current rows of the keys written since, and the keys deleted since."""
        return self._s.export_changes(table, int(since))

    def lookup_checkpoint(
        self, table: str, batch_id: int, keys: KeysLike
    ) -> tuple[Rows, npt.NDArray[np.bool_]]:
        """``(rows, found)`` of ``keys`` of ``table`` as they were at checkpoint
        ``batch_id``, while training goes on or later checkpoints are applied: like
        :meth:`Table.lookup`, at the checkpoint (``table.lookup(keys, checkpoint=...)``).
        Embedded: a retained checkpoint; each call costs a pass over the keys changed
        since. Remote: every shard answers at that training checkpoint, from a replica
        that holds it (see :meth:`served`'s ``readable``). Raises
        :class:`~embank.errors.NotFoundError` if none holds it."""
        return self._s.lookup_checkpoint(table, int(batch_id), _keys(keys))

    def restore(self, batch_id: int) -> None:
        """Returns every table to checkpoint ``batch_id`` and forgets later checkpoints.

        Table objects obtained before are closed afterwards: get them again with
        :meth:`table`. Raises :class:`~embank.errors.NotFoundError` if that checkpoint
        is not retained."""
        self._s.restore(int(batch_id))

    def close(self) -> None:
        """Flushes and closes every table and releases the store's lock. Idempotent.
        Publishers of the store stop (what they had not sent waits for the next one).

        On a remote store: flushes every shard and closes this client's connections;
        the servers keep running. Open :class:`~embank.gpu.TrainCache` objects over its
        tables write their dirty rows first."""
        if not self.closed:
            self._flush_write_backs()
        for p in self._publishers:
            p.close()
        self._publishers.clear()
        self._s.close()

    def stats(self) -> dict[str, Any]:
        """Rows, capacity, load factor, bytes on disk and mapped, probe lengths, per table."""
        out: dict[str, Any] = json.loads(self._s.stats_json())
        return out

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tables())} tables"
        return f"<embank.Store {self.path!r} ({state})>"
