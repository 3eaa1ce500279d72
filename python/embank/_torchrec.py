"""What TorchRec users bring along: table configs, fused-optimizer specs, ``KeyedTensor``
outputs and state dicts in TorchRec's layout. Imported by :mod:`embank.torch`; TorchRec
itself is optional (its own classes are used when it is installed).

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
way, their weights streamed ``chunk_rows`` ids a call through the shards (lookups and
pushes routed as every call is). Their optimizer state does not cross the wire (reading
and writing a row's state run where the store is): an export with
``optimizer_state=True`` and a load with ``momentum1`` are refused before anything is
read or written; a load of weights starts the served rows' state afresh.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from . import init as embank_init
from . import optim
from ._store import Store
from ._table import Table
from .errors import ConfigError, InvalidInputError, UnsupportedError

__all__ = [
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "export_state_dict",
    "load_state_dict",
    "optimizer_from_spec",
    "optimizer_state_dict",
    "state_dict_chunks",
]

#: Rows read or written per call when a table moves in or out (at most this many rows
#: of a table are in flight).
CHUNK_ROWS = 65_536
PREFIX = "embedding_bags."
#: An EmbeddingCollection's (unpooled tables') state-dict prefix, as TorchRec's.
PREFIX_UNPOOLED = "embeddings."


class PoolingType(enum.Enum):
    """TorchRec's pooling names (``torchrec.PoolingType`` is accepted as well)."""

    SUM = "SUM"
    MEAN = "MEAN"


@dataclass
class EmbeddingConfig:
    """TorchRec's ``EmbeddingConfig`` (an unpooled table, for
    :class:`~embank.torch.EmbeddingCollection`) with the fields embank reads, for use
    without TorchRec: ``num_embeddings`` (ids ``0..num_embeddings-1``: the table's
    capacity and the rows of its state dict), ``embedding_dim``, ``name``,
    ``feature_names`` and the uniform initializer's bounds (default, as TorchRec's:
    ``±sqrt(1 / num_embeddings)``)."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None

    def get_weight_init_max(self) -> float:
        return math.sqrt(1 / self.num_embeddings) if self.weight_init_max is None else self.weight_init_max

    def get_weight_init_min(self) -> float:
        return -math.sqrt(1 / self.num_embeddings) if self.weight_init_min is None else self.weight_init_min

    def num_features(self) -> int:
        return len(self.feature_names)


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """TorchRec's ``EmbeddingBagConfig``: :class:`EmbeddingConfig` and ``pooling``
    (:class:`PoolingType` or ``"sum"``/``"mean"``)."""

    pooling: PoolingType | str = PoolingType.SUM


def pooling_mode(config: Any) -> str:
    """``"sum"`` or ``"mean"`` from a config's ``pooling`` (an enum of either kind or a
    string). A config without one (TorchRec's ``EmbeddingConfig``: an unpooled table,
    one row per id) is refused: pooling it would be a different model."""
    if not hasattr(config, "pooling"):
        raise ConfigError(
            f"table {getattr(config, 'name', '')!r}: a {type(config).__name__} has no pooling: it is an "
            "unpooled table of TorchRec's EmbeddingCollection (one row per id, a JaggedTensor out), "
            "not of an EmbeddingBagCollection: use embank.torch.EmbeddingCollection.from_configs"
        )
    p = config.pooling
    name = str(getattr(p, "value", p)).lower()
    if name not in ("sum", "mean"):
        raise ConfigError(f"table {config.name!r}: pooling {p!r} is not supported (SUM or MEAN)")
    return name


def init_bounds(config: Any) -> tuple[float, float]:
    """The uniform initializer's ``(low, high)`` of a config, as TorchRec computes them."""
    if hasattr(config, "get_weight_init_min"):
        return float(config.get_weight_init_min()), float(config.get_weight_init_max())
    bound = math.sqrt(1 / config.num_embeddings)
    return -bound, bound


class KeyedTensor:
    """TorchRec's ``KeyedTensor`` for use without TorchRec: the pooled embeddings of
    several features side by side in one ``(batch, sum(dims))`` tensor."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = keys, length_per_key, values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._lengths

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._lengths).tolist()]

    def key_dim(self) -> int:
        return 1

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self._keys, torch.split(self._values, self._lengths, dim=1)))

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self._keys.index(key)
        start = sum(self._lengths[:i])
        return self._values[:, start : start + self._lengths[i]]

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths})"


class JaggedTensor:
    """TorchRec's ``JaggedTensor`` for use without TorchRec: ``values`` (one row per id)
    in bags of ``lengths``."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._values, self._lengths = values, lengths

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> None:
        return None

    def to_dense(self) -> list[torch.Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={tuple(self._values.shape)}, lengths={self._lengths.tolist()})"


def jagged_tensor_class() -> Any:
    """TorchRec's ``JaggedTensor`` when TorchRec is installed, else :class:`JaggedTensor`."""
    if importlib.util.find_spec("torchrec") is not None:
        return importlib.import_module("torchrec.sparse.jagged_tensor").JaggedTensor
    return JaggedTensor


def keyed_tensor_class() -> Any:
    """TorchRec's ``KeyedTensor`` when TorchRec is installed, else :class:`KeyedTensor`."""
    if importlib.util.find_spec("torchrec") is not None:
        return importlib.import_module("torchrec.sparse.jagged_tensor").KeyedTensor
    return KeyedTensor


# --- optimizers -------------------------------------------------------------------

Spec = Union[optim.Optimizer, Mapping[str, Any], tuple[Any, Mapping[str, Any]], str, Any]

_KINDS = {
    "exact_rowwise_adagrad": "rowwise_adagrad",
    "rowwise_adagrad": "rowwise_adagrad",
    "exact_adagrad": "adagrad",
    "adagrad": "adagrad",
    "exact_sgd": "sgd",
    "sgd": "sgd",
    "adamw": "adamw",
    "ftrl": "ftrl",
}
#: FBGEMM's default ``eps`` (``SplitTableBatchedEmbeddingBagsCodegen(eps=1.0e-8)``), which
#: its (row-wise) Adagrad uses when a spec gives none; embank.optim.Adagrad's own default
#: is PyTorch's 1e-10.
FBGEMM_EPS = 1e-8
_SUPPORTED = (
    "EmbOptimType.EXACT_ROWWISE_ADAGRAD (or ROWWISE_ADAGRAD), EXACT_ADAGRAD, EXACT_SGD (or SGD); "
    'the names "adamw" and "ftrl"; or an embank.optim optimizer (SGD, Adagrad, RowWiseAdagrad, '
    "Adam, AdamW, Ftrl)"
)
# fused_params keys that tune FBGEMM's kernels or caches, not the update rule.
_NOT_OPTIMIZER = {
    "stochastic_rounding",
    "output_dtype",
    "cache_load_factor",
    "cache_precision",
    "cache_algorithm",
    "cache_reserved_memory",
    "prefetch_pipeline",
    "gradient_clipping",
    "max_gradient",
    "pooling_mode",
    "embedding_location",
}
_PARAMETERS = {
    "sgd": {"lr"},
    "adagrad": {"lr", "eps", "initial_accumulator_value"},
    "rowwise_adagrad": {"lr", "eps", "initial_accumulator_value"},
    "adamw": {"lr", "beta1", "beta2", "eps", "weight_decay"},
    "ftrl": {"lr", "beta", "l1", "l2", "initial_accumulator_value"},
}


def _kind(name: Any) -> str:
    """embank's optimizer kind of an ``EmbOptimType``, a torch optimizer class or a name."""
    if isinstance(name, type):  # torch.optim.SGD, torchrec.optim.RowWiseAdagrad, ...
        name = name.__name__
    text = str(getattr(name, "value", name)).lower()
    text = text.rsplit(".", 1)[-1].replace("row_wise", "rowwise").replace("-", "_")
    text = {"rowwiseadagrad": "rowwise_adagrad"}.get(text, text)
    if text == "adam":  # EmbOptimType.ADAM, torch.optim.Adam (FusedEmbeddingBagCollection's), "adam"
        raise ConfigError(
            f"optimizer {name!r} is FBGEMM's Adam, whose bias correction counts steps per table "
            "(every row uses the table's step count); embank's Adam counts them per row, which "
            "gives other rows. To train with embank's per-row Adam, pass "
            "optimizer=embank.optim.Adam(lr, betas=(0.9, 0.999), eps=1e-8)"
        )
    if text not in _KINDS:
        raise ConfigError(f"optimizer {name!r} is not supported by embank; use {_SUPPORTED}")
    return _KINDS[text]


def optimizer_from_spec(spec: Spec) -> optim.Optimizer:
    """An embank optimizer from what a TorchRec user writes for a fused one:

    - an :class:`embank.optim.Optimizer`, returned as it is;
    - ``(EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.02, "eps": 1e-8})`` (the type may be
      a name such as ``"exact_rowwise_adagrad"``, ``"adagrad"``, ``"sgd"``, ``"adamw"``,
      ``"ftrl"``, or a torch optimizer class as ``FusedEmbeddingBagCollection`` takes);
    - TorchRec's ``fused_params``: ``{"optimizer": EmbOptimType..., "learning_rate": 0.02,
      "eps": 1e-8}``.

    ``lr``/``learning_rate``, ``eps`` (for Adagrad and row-wise Adagrad FBGEMM's default,
    1e-8, when not given), ``beta1``/``beta2`` (or ``betas``), ``weight_decay`` and FTRL's
    ``beta``, ``l1``, ``l2``, ``initial_accumulator_value`` are read; keys that tune
    FBGEMM's kernels (``stochastic_rounding``, ``cache_*``, ``output_dtype``) are ignored;
    anything else raises :class:`~embank.errors.ConfigError` rather than being dropped
    silently (a ``weight_decay`` on Adagrad, say). FBGEMM's Adam (``EmbOptimType.ADAM``,
    ``torch.optim.Adam``, ``"adam"``) is refused: its bias correction counts steps per
    table, embank's :class:`~embank.optim.Adam` per row (pass that to use it); so are
    optimizers embank does not implement (LAMB, PARTIAL_ROWWISE_ADAM, ...).
    rather than being dropped silently (a ``weight_decay`` on Adagrad, say)."""
    if isinstance(spec, optim.Optimizer):
        return spec
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ConfigError(f"an optimizer spec tuple is (type, kwargs), got {spec!r}")
        kind, params = _kind(spec[0]), dict(spec[1])
    elif isinstance(spec, Mapping):
        params = dict(spec)
        if "optimizer" not in params:
            raise ConfigError(f'fused_params need an "optimizer" entry, got keys {sorted(params)}')
        kind = _kind(params.pop("optimizer"))
    else:
        kind, params = _kind(spec), {}
    if "learning_rate" in params:
        params["lr"] = params.pop("learning_rate")
    if "betas" in params:
        params["beta1"], params["beta2"] = params.pop("betas")
    for k in list(params):
        if k in _NOT_OPTIMIZER:
            del params[k]
    # Zero-valued extras are what FBGEMM's defaults say anyway.
    for k in ("weight_decay", "momentum"):
        if k in params and k not in _PARAMETERS[kind] and not params[k]:
            del params[k]
    unknown = sorted(set(params) - _PARAMETERS[kind])
    if unknown:
        raise ConfigError(f"{kind} optimizer: parameters {unknown} are not supported")
    if "lr" not in params:
        raise ConfigError(f"{kind} optimizer: a learning rate (lr or learning_rate) is needed")
    lr = float(params.pop("lr"))
    args = {k: float(v) for k, v in params.items()}
    if kind in ("adagrad", "rowwise_adagrad"):
        args.setdefault("eps", FBGEMM_EPS)
    if kind == "adamw":
        b1, b2 = args.pop("beta1", 0.9), args.pop("beta2", 0.999)
        return optim.AdamW(lr, (b1, b2), **args)
    cls = {
        "sgd": optim.SGD,
        "adagrad": optim.Adagrad,
        "rowwise_adagrad": optim.RowWiseAdagrad,
        "ftrl": optim.Ftrl,
    }[kind]
    made: optim.Optimizer = cls(lr, **args)
    return made


def table_for_config(
    store: Store, config: Any, optimizer: optim.Optimizer | None, table_options: Mapping[str, Any]
) -> Table:
    """Opens the table of ``config`` in ``store`` (its dim checked) or creates it:
    ``num_embeddings`` as capacity, TorchRec's uniform initializer, ``missing="init"``."""
    name = config.name
    if not name:
        raise ConfigError("an EmbeddingBagConfig needs a name (the table's)")
    if name in store:
        table = store.table(name)
        if table.dim != config.embedding_dim:
            raise ConfigError(
                f"table {name!r} exists with dim {table.dim}, the config says {config.embedding_dim}"
            )
        have = table.optimizer
        want = None if optimizer is None else json.loads(optimizer._json())
        if want is not None and (have is None or have["kind"] != want["kind"]):
            raise ConfigError(f"table {name!r} exists with optimizer {have}, the spec says {want}")
        return table
    low, high = init_bounds(config)
    options: dict[str, Any] = {
        "capacity": max(int(config.num_embeddings), 1),
        "init": embank_init.uniform(low, high),
        "missing": "init",
        "optimizer": optimizer,
        **table_options,
    }
    return store.create_table(name, int(config.embedding_dim), **options)


# --- state dicts --------------------------------------------------------------------


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
    names = list(tables) if tables is not None else list(sizes)
    missing = [n for n in names if n not in sizes]
    if missing:
        raise InvalidInputError(f"no num_embeddings for tables {missing}")
    return [(store.table(n), sizes[n]) for n in names]


def _has_momentum(table: Table) -> bool:
    """Whether the table's optimizer keeps state TorchRec's layout has (``momentum1``)."""
    opt = table.optimizer
    return opt is not None and opt["kind"] in ("rowwise_adagrad", "adagrad")


def _refuse_served_state(table: Table, doing: str) -> None:
    """Raises for the ``momentum1`` of a table served by ``embank serve``, which this
    client cannot read or write (only rows cross the wire)."""
    if table._remote and _has_momentum(table):
        raise UnsupportedError(
            f"table {table.name!r} is served by embank serve: {doing} its optimizer state (momentum1) "
            "is not possible over the wire (a row's optimizer state is read and written only where "
            "the store is); move the weights alone (optimizer_state=False, no optimizer_state_dict "
            "or momentum1): the served rows' optimizer state then starts afresh"
        )


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
    ``num_embeddings={table: rows}``; embedded or served by ``embank serve`` (weights
    only: ``optimizer_state`` raises :class:`~embank.errors.UnsupportedError` for a
    served table, before anything is read)."""
    if chunk_rows < 1:
        raise InvalidInputError("chunk_rows must be at least 1")
    sources = _sources(source, tables, num_embeddings)
    if optimizer_state:
        for table, _ in sources:
            _refuse_served_state(table, "exporting")
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
    their optimizer state starts afresh. A momentum for a served table raises
    :class:`~embank.errors.UnsupportedError` before anything is written."""
    store = target.store if _configs_of(target) is not None else target
    if not isinstance(store, Store):
        raise InvalidInputError(
            f"expected an embank Store or a from_configs collection, got {type(target).__name__}"
        )
    if chunk_rows < 1:
        raise InvalidInputError("chunk_rows must be at least 1")
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
            _refuse_served_state(store.table(table), "loading")
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
