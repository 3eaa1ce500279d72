"""Checkpoints of a training run: :func:`checkpoint`, the one call from every rank that
checkpoints the store and saves the dense state, and state dicts in TorchRec's layout
(:func:`export_state_dict`, :func:`state_dict_chunks`, :func:`load_state_dict`,
:func:`optimizer_state_dict`), streamed in chunks through
``Table.lookup_with_state``/``push_with_state``.

TorchRec's layout: table ``t`` of ``num_embeddings`` rows is the dense tensor
``embedding_bags.t.weight`` of shape ``(num_embeddings, embedding_dim)``, row ``i`` the
embedding of id ``i``. Its fused row-wise Adagrad keeps one accumulator per row,
``momentum1`` (shape ``(num_embeddings,)``); exact Adagrad's ``momentum1`` has the
weight's shape. Here the flat keys are ``embedding_bags.t.weight`` and
``embedding_bags.t.weight.momentum1``; :func:`optimizer_state_dict` nests the latter as
TorchRec's sharded fused optimizer does. An EmbeddingCollection's (unpooled) tables are
``embeddings.t.weight``, as in TorchRec.

A key embank does not hold (never pulled or pushed) exports as what a pull would give
it: the table's initializer row when the table was made by ``from_configs`` (``missing
="init"``), else the table's ``missing`` default; its accumulator as the optimizer's
initial value. So an export is the model embank would compute with, row for row.

Nothing holds a whole table in memory on embank's side: :func:`state_dict_chunks`
reads ``chunk_rows`` ids at a time, :func:`load_state_dict` writes that many at a
time (so a memory-mapped source tensor is paged in piece by piece). TorchRec's layout
does need one tensor per table at the other end: for a table larger than DRAM, export
into file-backed tensors (``export_state_dict(..., out={key: torch.from_file(path,
shared=True, size=rows * dim).view(rows, dim)})``), whose pages the kernel writes back
to the file, and hand those to ``torch.distributed.checkpoint.save`` (which runs in
one process without a process group and writes each tensor as one item). Only Adagrad
and row-wise Adagrad state crosses (``momentum1``, as FBGEMM keeps it); Adam's
per-row step counts and FTRL's ``z``/``n`` have no FBGEMM counterpart and stay behind
(a load starts them afresh).

Tables served by ``embank serve`` (a store from :func:`embank.connect`) move the same
way, rows and optimizer state streamed ``chunk_rows`` ids a call through the shards
(``LOOKUP_WITH_STATE`` and ``PUSH_WITH_STATE``, routed as every call is, answered by each
shard's primary: a replica keeps no optimizer state where reads see it and refuses).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._store import Store
from ._table import Table
from .errors import EmbankError, InvalidInputError

if TYPE_CHECKING:
    from ._sparse import SparseOptimizer

__all__ = [
    "checkpoint",
    "export_state_dict",
    "load_state_dict",
    "optimizer_state_dict",
    "state_dict_chunks",
]

#: Rows read or written per call when a table moves in or out (at most this many rows
#: of a table are in flight).
CHUNK_ROWS = 65_536
PREFIX = "embedding_bags."
#: An EmbeddingCollection's (unpooled tables') state-dict prefix, as TorchRec's.
PREFIX_UNPOOLED = "embeddings."


def checkpoint(
    store: Any,
    batch_id: int,
    dense_state: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] | None = None,
    *,
    sparse: SparseOptimizer | None = None,
) -> None:
    """A coordinated checkpoint of a training run, in one call from every rank.

    Pushes what ``sparse`` still delays, waits for every rank (a barrier when
    ``torch.distributed`` is initialized), then rank 0 checkpoints the store at
    ``batch_id`` (on a networked store every shard checkpoints at that batch id; one
    that fails fails the call and is named) and saves ``dense_state`` to ``path``
    (written to a temporary file, then renamed) — the tables first, so a kill between
    the two leaves the tables one checkpoint ahead, which a resume undoes with
    ``store.restore``. Rank 0 then tells every rank how it went: no rank trains on
    before the checkpoint is whole, and if it failed every rank raises (rank 0 the
    store's own error, the others :class:`~embank.errors.EmbankError` quoting it).
    """
    import torch.distributed as dist

    if sparse is not None:
        sparse.flush()
    on = dist.is_available() and dist.is_initialized()
    if on:
        dist.barrier()
    failure: BaseException | None = None
    if not on or dist.get_rank() == 0:
        try:
            store.checkpoint(batch_id)
            if dense_state is not None and path is not None:
                tmp = f"{os.fspath(path)}.tmp"
                torch.save(dict(dense_state), tmp)
                os.replace(tmp, path)
        except Exception as e:  # told to every rank below
            failure = e
    if on:
        box: list[str | None] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(box, src=0)
        if failure is None and box[0] is not None:
            raise EmbankError(f"the checkpoint at batch {batch_id} failed on rank 0: {box[0]}")
    if failure is not None:
        raise failure


def _momentum(table: Table, records: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """The FBGEMM-shaped ``momentum1`` of records, for optimizers both sides share."""
    if not _has_momentum(table):
        return None
    state = records[:, table.dim :]
    rowwise = table.optimizer["kind"] == "rowwise_adagrad"  # type: ignore[index]
    return torch.from_numpy(np.ascontiguousarray(state[:, 0] if rowwise else state))


def _configs_of(source: Any) -> list[Any] | None:
    """A from_configs collection's table configs (pooled or not); None for anything else."""
    if hasattr(source, "embedding_bag_configs"):
        configs: list[Any] = source.embedding_bag_configs()
        return configs
    if hasattr(source, "embedding_configs") and hasattr(source, "store"):
        configs = source.embedding_configs()
        return configs
    return None


def _prefix_of(source: Any) -> str:
    """``embeddings.`` for an EmbeddingCollection, ``embedding_bags.`` otherwise."""
    return (
        PREFIX if hasattr(source, "embedding_bag_configs") or isinstance(source, Store) else PREFIX_UNPOOLED
    )


def _sources(
    source: Any, tables: Sequence[str] | None, num_embeddings: Mapping[str, int] | None
) -> list[tuple[Table, int]]:
    """``(table, rows)`` of what to export: a collection's configs, or a store's tables
    with ``num_embeddings``."""
    configs = _configs_of(source)
    if configs is not None:
        store = source.store
        sizes = {c.name: int(c.num_embeddings) for c in configs}
        sizes.update(num_embeddings or {})
    elif isinstance(source, Store):
        store = source
        if num_embeddings is None:
            raise InvalidInputError(
                "exporting a store's tables in TorchRec's dense layout needs num_embeddings={table: rows}"
            )
        sizes = dict(num_embeddings)
    else:
        raise InvalidInputError(
            "expected an embank Store, or an EmbeddingBagCollection or EmbeddingCollection made by "
            "from_configs, "
            f"got {type(source).__name__}"
        )
    store._flush_write_backs()  # rows trained through a TrainCache, as they are now
    names = list(tables) if tables is not None else list(sizes)
    missing = [n for n in names if n not in sizes]
    if missing:
        raise InvalidInputError(f"no num_embeddings for tables {missing}")
    return [(store.table(n), sizes[n]) for n in names]


def _has_momentum(table: Table) -> bool:
    """Whether the table's optimizer keeps state TorchRec's layout has (``momentum1``)."""
    opt = table.optimizer
    return opt is not None and opt["kind"] in ("rowwise_adagrad", "adagrad")


def state_dict_chunks(
    source: Any,
    *,
    tables: Sequence[str] | None = None,
    num_embeddings: Mapping[str, int] | None = None,
    optimizer_state: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """Streams tables in TorchRec's layout as ``(key, first_row, rows)``: ``rows`` are
    rows ``first_row..first_row + len(rows) - 1`` of the tensor ``key``
    (``embedding_bags.<table>.weight``; with ``optimizer_state``, also
    ``embedding_bags.<table>.weight.momentum1`` of row-wise Adagrad and Adagrad
    tables). At most ``chunk_rows`` rows of one table are in memory at a time.

    ``source``: a collection made by :meth:`EmbeddingBagCollection.from_configs` (its
    configs give each table's ``num_embeddings``) or a :class:`~embank.Store` with
    ``num_embeddings={table: rows}``; embedded or served by ``embank serve``."""
    if chunk_rows < 1:
        raise InvalidInputError("chunk_rows must be at least 1")
    sources = _sources(source, tables, num_embeddings)
    for table, rows in sources:
        key = f"{_prefix_of(source)}{table.name}.weight"
        held = len(table)
        if held > rows:
            _refuse_beyond(table, rows)
        found_total = 0
        # No momentum1 to give (SGD, Adam, FTRL, none): the rows alone, as for weights.
        with_state = optimizer_state and _has_momentum(table)
        for start in range(0, rows, chunk_rows):
            keys = np.arange(start, min(start + chunk_rows, rows), dtype=np.uint64)
            if not with_state:
                values, found = table.lookup(keys)
                found_total += int(np.count_nonzero(found))
                yield key, start, torch.from_numpy(values)
                continue
            records, found = table.lookup_with_state(keys)
            found_total += int(np.count_nonzero(found))
            yield key, start, torch.from_numpy(np.ascontiguousarray(records[:, : table.dim]))
            momentum = _momentum(table, records)
            assert momentum is not None  # with_state: the optimizer keeps momentum1
            yield f"{key}.momentum1", start, momentum
        if found_total < held:
            _refuse_beyond(table, rows)


def _refuse_beyond(table: Table, rows: int) -> None:
    """Raises for a table holding ids ``>= rows``, which TorchRec's layout has no row for
    (a table trained with ``allow_ids_beyond_num_embeddings=True``): an export never
    drops a trained row silently."""
    beyond, top = 0, -1
    for keys, _ in table.export(CHUNK_ROWS):  # the error path only: one scan for the count
        over = keys[keys >= np.uint64(rows)]
        beyond += len(over)
        if len(over):
            top = max(top, int(over.max()))
    if beyond == 0:
        return
    raise InvalidInputError(
        f"table {table.name!r} holds {beyond} rows with ids >= num_embeddings {rows} (up to id {top}), "
        f"which TorchRec's layout has no row for: export with num_embeddings={{{table.name!r}: {top + 1}}} "
        "to include them"
    )


def export_state_dict(
    source: Any,
    *,
    tables: Sequence[str] | None = None,
    num_embeddings: Mapping[str, int] | None = None,
    optimizer_state: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Tables as TorchRec's ``EmbeddingBagCollection.state_dict()`` has them:
    ``{"embedding_bags.<table>.weight": (num_embeddings, dim)}`` (plus
    ``....weight.momentum1`` with ``optimizer_state``), filled chunk by chunk from
    :func:`state_dict_chunks`.

    ``out`` gives the tensors to fill (a TorchRec model's own ``state_dict()``, or
    file-backed tensors from ``torch.from_file(path, shared=True, size=...)`` for tables
    larger than DRAM: pages go to the file, not to the process). Without it each table
    is allocated whole; for a streaming export use :func:`state_dict_chunks`."""
    result: dict[str, torch.Tensor] = {}
    for key, start, rows in state_dict_chunks(
        source, tables=tables, num_embeddings=num_embeddings, optimizer_state=optimizer_state,
        chunk_rows=chunk_rows,
    ):  # fmt: skip
        dest = result.get(key)
        if dest is None:
            if out is not None and key in out:
                dest = out[key]
            else:
                size = _rows_of(source, key, num_embeddings)
                dest = torch.empty((size, *rows.shape[1:]), dtype=torch.float32)
            result[key] = dest
        with torch.no_grad():
            dest[start : start + len(rows)].copy_(rows)
    return result


def _rows_of(source: Any, key: str, num_embeddings: Mapping[str, int] | None) -> int:
    [(_, rows)] = _sources(source, [_table_name(key)[0]], num_embeddings)
    return rows


_KEY = re.compile(
    r"^(?:.*\.)?(?P<prefix>embedding_bags|embeddings)\.(?P<table>.+?)\.weight(?:\.(?P<state>momentum1|momentum_1))?$"
)


def _table_name(key: str) -> tuple[str, bool]:
    """``(table, is_momentum)`` of a state-dict key."""
    m = _KEY.match(key)
    if m is None:
        raise InvalidInputError(
            f"{key!r} is not a TorchRec embedding key (embedding_bags.<table>.weight[.momentum1], "
            "or embeddings.<table>.weight of an EmbeddingCollection)"
        )
    return m.group("table"), m.group("state") is not None


def optimizer_state_dict(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The ``momentum1`` entries of an exported state dict nested as TorchRec's sharded
    fused optimizer's ``state_dict()`` has them:
    ``{"state": {"embedding_bags.<t>.weight": {"<t>.momentum1": tensor}}}`` (``embeddings.``
    for an EmbeddingCollection's)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        table, is_momentum = _table_name(key)
        if is_momentum:
            m = _KEY.match(key)
            assert m is not None  # _table_name matched it
            state[f"{m.group('prefix')}.{table}.weight"] = {f"{table}.momentum1": tensor}
    return {"state": state}


def _flat_momentum(optimizer: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``embedding_bags.<t>.weight.momentum1`` entries from a fused optimizer's state dict
    (TorchRec's sharded layout ``<t>.momentum1`` or ``FusedEmbeddingBagCollection``'s
    ``<t>.weight.momentum_1``)."""
    out: dict[str, torch.Tensor] = {}
    for entries in optimizer.get("state", optimizer).values():
        for name, tensor in entries.items():
            m = re.match(r"^(?P<table>.+?)(?:\.weight)?\.(?:momentum1|momentum_1)$", name)
            if m is not None:
                out[f"{PREFIX}{m.group('table')}.weight.momentum1"] = tensor
    return out


def load_state_dict(
    target: Any,
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, int, torch.Tensor]],
    *,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    chunk_rows: int = CHUNK_ROWS,
    strict: bool = True,
) -> list[str]:
    """Writes TorchRec-layout tables into embank; returns the tables written.

    ``target``: a :class:`~embank.Store`, embedded or served by ``embank serve`` (the
    tables must exist: make them with :meth:`EmbeddingBagCollection.from_configs`), or
    such a collection.
    ``state_dict``: ``{"embedding_bags.<t>.weight": (rows, dim)}`` (a model prefix
    before ``embedding_bags.`` is allowed; other keys are refused with ``strict``,
    skipped without), optionally with ``"....weight.momentum1"``; or the chunks of
    :func:`state_dict_chunks`. Row ``i`` becomes key ``i``, written ``chunk_rows`` at a
    time, so a memory-mapped tensor (``torch.load(..., mmap=True)``) is read piece by
    piece. ``optimizer_state_dict``: a TorchRec fused optimizer's ``state_dict()``
    (its ``momentum1``/``momentum_1`` entries). Where a table's momentum is given (and
    its optimizer is row-wise Adagrad or Adagrad) rows are written with it; otherwise
    their optimizer state starts afresh."""
    store = target.store if _configs_of(target) is not None else target
    if not isinstance(store, Store):
        raise InvalidInputError(
            f"expected an embank Store or a from_configs collection, got {type(target).__name__}"
        )
    if chunk_rows < 1:
        raise InvalidInputError("chunk_rows must be at least 1")
    # TrainCaches over the tables would answer with, and write back, the rows replaced.
    for cache in list(store._write_backs):
        cache._clear_for_store()
    if isinstance(state_dict, Mapping):
        entries = dict(state_dict)
        if optimizer_state_dict is not None:
            entries.update(_flat_momentum(optimizer_state_dict))
        weights: dict[str, torch.Tensor] = {}
        momenta: dict[str, torch.Tensor] = {}
        for key, tensor in entries.items():
            try:
                table, is_momentum = _table_name(key)
            except InvalidInputError:
                if strict:
                    raise
                continue
            (momenta if is_momentum else weights)[table] = tensor
        for table in momenta:
            if table not in weights:
                raise InvalidInputError(f"a momentum1 for table {table!r} without its weight")
        for name, weight in weights.items():
            t = store.table(name)
            for start in range(0, len(weight), chunk_rows):
                stop = min(start + chunk_rows, len(weight))
                m = momenta.get(name)
                _write(t, start, weight[start:stop], None if m is None else m[start:stop])
        return list(weights)
    written: list[str] = []
    for key, start, rows in state_dict:
        table, is_momentum = _table_name(key)
        if is_momentum:
            raise InvalidInputError(
                "chunks carry no momentum (write rows with their momentum from a mapping instead)"
            )
        _write(store.table(table), start, rows, None)
        if table not in written:
            written.append(table)
    return written


def _write(table: Table, start: int, weight: torch.Tensor, momentum: torch.Tensor | None) -> None:
    rows = np.ascontiguousarray(weight.detach().to("cpu", torch.float32).numpy())
    if rows.ndim != 2 or rows.shape[1] != table.dim:
        raise InvalidInputError(
            f"table {table.name!r} has dim {table.dim}; its weight has rows of shape {tuple(rows.shape[1:])}"
        )
    keys = np.arange(start, start + len(rows), dtype=np.uint64)
    if momentum is None or not _has_momentum(table):
        table.push(keys, rows)
        return
    m = momentum.detach().to("cpu", torch.float32).numpy().reshape(len(rows), -1)
    if m.shape[1] != table.state_len:
        kind = table.optimizer["kind"]  # type: ignore[index]
        raise InvalidInputError(
            f"table {table.name!r} ({kind}) keeps {table.state_len} state values a row; "
            f"its momentum1 has {m.shape[1]}"
        )
    table.push_with_state(keys, np.ascontiguousarray(np.concatenate([rows, m], axis=1)))
