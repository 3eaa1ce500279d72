"""PyTorch modules whose embedding tables live in embank.

The rows are never a ``torch.nn.Parameter``: forward pulls the unique rows of the
batch from the store, pools them in torch, and backward hands the gradient of each
unique row to the table's own optimizer (``push_grad``). Dense optimizers never see
the tables; the optimizer state lives with the rows, larger than memory if need be.

>>> import embank, embank.torch, torch, tempfile, os
>>> store = embank.open(os.path.join(tempfile.mkdtemp(), "m"))
>>> items = store.create_table("item", dim=4, init=embank.init.constant(0.1),
...                            optimizer=embank.optim.SGD(lr=0.1))
>>> bag = embank.torch.EmbeddingBag(items, mode="sum")
>>> sparse = embank.torch.SparseOptimizer([bag])
>>> out = bag(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2]))   # bags [1, 2] and [2, 3]
>>> out.sum().backward()
>>> sparse.step()                      # one push_grad per table; returns the keys pushed
3
>>> [round(x, 4) for x in items.pull([1, 2]).ravel().tolist()]   # key 2 was in both bags
[0.0, 0.0, 0.0, 0.0, -0.1, -0.1, -0.1, -0.1]
>>> store.close()

How gradients reach the store (``push=``):

- ``"step"`` (default): backward gathers each lookup's ``(unique keys, gradients)``;
  :meth:`SparseOptimizer.step` pushes, per table, everything gathered since the last
  step in **one** ``push_grad`` (duplicate keys summed by the store). A table looked up
  several times in one step (a two-tower model's item table for positives and
  negatives) gets one optimizer update with the gradients of every lookup summed —
  what ``torch.nn.Embedding(sparse=True)`` with a sparse optimizer does.
- ``"backward"``: the gradient is pushed from backward itself (no ``step()`` call for
  the table). Only right when each table is looked up once per step.

A module may wrap a :class:`~embank.Table` or a :class:`~embank.Worker` (bounded
staleness: its pulls hold keys until their gradients are pushed), or for inference an
:class:`embank.gpu.GpuCache` (eval mode: rows answered from the cache's device, misses
fetched from its table). torch is an optional dependency, imported when this module is.

Training on a GPU: a module's outputs go to its device (moved with the model by
``model.to("cuda")``; ids given on a device send them there too). The rows stay on the
host, where they are pulled, pooled and updated; only this crosses PCIe:

- ``EmbeddingBagCollection`` (fused): every feature's pooled rows up in one copy a
  forward, their gradient down in one copy a backward;
- ``EmbeddingBag``: pools on the host; its pooled rows up, their gradient down;
- ``Embedding`` (nothing to pool): the unique rows and the inverse index up, the
  unique rows' gradient down.

An upload is copied into pinned memory (torch's caching host allocator: blocks reused
across calls, none handed out again before its copy has finished), then to the device
(``non_blocking``) on a copy stream, one a device; the caller's stream waits for the
copy's event and the host does not wait. A download is copied into pinned memory on the
caller's stream, after the kernels that made the gradient, and the host waits for that
copy's event: the one host wait of a module's backward (one for a whole fused
collection). Ids, offsets or ``per_sample_weights`` given on a device add a host wait
each (they are read on the host): give them from the data loader, on the host.

The next batch's pull overlaps this batch's work: :meth:`EmbeddingBagCollection.prefetch`
(per-table modules: :func:`lookahead`) reads batch *i+1*'s rows into the store's row
cache (the disk or network part of a pull) while batch *i* trains; their values are
read by *i+1*'s forward, after step *i*'s push, so a run equals the CPU's exactly, and
that forward's pull and pooling run on the host while the device finishes step *i*'s
dense optimizer (whose launches return at once).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable

import numpy as np
import numpy.typing as npt

try:
    import torch
except ImportError as e:  # the package installs without PyTorch
    raise ImportError("embank.torch needs PyTorch: pip install 'embank[torch]' (or torch itself)") from e
import torch.nn.functional as F

from . import _native
from ._store import Store
from ._table import Table, Worker
from ._torch_support import (
    B,
    Jagged,
    Source,
    _as_jagged,
    _ids64,
    _kjt_inputs,
    _np,
    _Pending,
    _pending_for,
    _table_of,
    _to_device,
    _to_keys,
    checkpoint,
    lookahead,
)
from ._torchrec import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    JaggedTensor,
    KeyedTensor,
    PoolingType,
    Spec,
    export_state_dict,
    jagged_tensor_class,
    keyed_tensor_class,
    load_state_dict,
    optimizer_from_spec,
    optimizer_state_dict,
    pooling_mode,
    state_dict_chunks,
    table_for_config,
)
from .errors import ConfigError, InvalidInputError
from .gpu import GpuCache

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "SparseOptimizer",
    "checkpoint",
    "export_state_dict",
    "load_state_dict",
    "lookahead",
    "optimizer_from_spec",
    "optimizer_state_dict",
    "state_dict_chunks",
]


class _Lookup(torch.nn.Module):
    """Pulls the unique rows of a batch as a leaf tensor whose gradient goes to the store."""

    _where: torch.Tensor

    def __init__(self, source: Source | GpuCache, push: str) -> None:
        super().__init__()
        self.cache: GpuCache | None = None
        if isinstance(source, GpuCache):
            # Eval-mode lookups answered on the cache's device (see embank.gpu).
            self.cache, source = source, source.table
        if push not in ("step", "backward"):
            raise InvalidInputError(f'push must be "step" or "backward", got {push!r}')
        if not isinstance(source, (Table, Worker)):
            raise InvalidInputError(f"expected an embank Table or Worker, got {type(source).__name__}")
        self.source = source
        self.push = push
        self.table = _table_of(source)
        self.dim = self.table.dim
        self.pending = _pending_for(source)
        # Moved by ``module.to(device)`` with the model: where outputs go (not saved).
        self.register_buffer("_where", torch.empty(0), persistent=False)

    def output_device(self, ids: torch.Tensor) -> torch.device:
        """Where outputs go: the ids' device when it is not the CPU, else the module's."""
        return ids.device if ids.device.type != "cpu" else self._where.device

    def cached_rows(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Every id's row (no unique) from the GpuCache, on ``device``."""
        assert self.cache is not None
        if torch.is_grad_enabled() and self.training:
            raise InvalidInputError(
                "a GpuCache answers lookups in eval mode or under torch.no_grad(); train through the table"
            )
        # No torch.unique: it would wait for the device, and the cache answers repeats
        # from the device anyway (one host sync a lookup).
        return self.cache.lookup(ids.reshape(-1)).to(device)

    def unique_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unique rows ``(u, dim)`` on the host (a leaf that requires grad when training)
        and the inverse index of ``ids``."""
        training = torch.is_grad_enabled() and self.training
        uniq, inverse = torch.unique(ids.reshape(-1).to("cpu"), sorted=True, return_inverse=True)
        keys = _to_keys(uniq, "ids")
        # A worker's pull holds keys until their gradient is pushed: only when training.
        rows = torch.from_numpy((self.source if training else self.table).pull(keys))
        if training:
            rows.requires_grad_(True)
            rows.register_hook(self._hook(keys))  # type: ignore[no-untyped-call]
        return rows, inverse

    def _hook(self, keys: npt.NDArray[np.uint64]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            g = np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy())
            if self.push == "backward":
                self.source.push_grad(keys, g)
            else:
                self.pending.add(keys, g)

        return hook

    def extra_repr(self) -> str:
        return f"table={self.table.name!r}, dim={self.dim}, push={self.push!r}"


class Embedding(_Lookup):
    """``torch.nn.Embedding`` over an embank table: ``forward(ids)`` of any shape returns
    ``(*ids.shape, dim)``. Each unique id is pulled once per call."""

    def __init__(self, table: Source | GpuCache, *, push: str = "step") -> None:
        super().__init__(table, push)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = self.output_device(input)
        if self.cache is not None:
            return self.cached_rows(input, device).reshape(*input.shape, self.dim)
        rows, inverse = self.unique_rows(input)
        # On a device: the unique rows and the inverse go up, the rows' gradient comes down.
        rows, inverse = _to_device(rows, device), _to_device(inverse, device)
        return F.embedding(inverse, rows).reshape(*input.shape, self.dim)


class EmbeddingBag(_Lookup):
    """``torch.nn.EmbeddingBag`` over an embank table: ``forward(input, offsets,
    per_sample_weights)`` with the same meaning (1-D ``input`` with ``offsets``, or 2-D
    ``input`` of fixed-size bags), pooled by ``mode`` ``"sum"`` or ``"mean"``.

    ``pooled=True`` (inference): in eval mode, or under ``torch.no_grad()``, bags are
    pooled in the store by :meth:`embank.Table.lookup_pooled`, so a store opened with
    ``pooled_cache_bytes`` answers bags it has pooled before from its pooled-embedding
    cache. Ids are then read as ``lookup`` reads them: a missing id counts as the
    table's missing default (create the table with ``missing="init"`` to match what a
    pull would create) and nothing is stored."""

    def __init__(
        self, table: Source | GpuCache, mode: str = "sum", *, push: str = "step", pooled: bool = False
    ) -> None:
        super().__init__(table, push)
        if pooled and self.cache is not None:
            raise InvalidInputError("pooled=True pools in the store: it does not combine with a GpuCache")
        if mode not in ("sum", "mean"):
            raise InvalidInputError(f'mode must be "sum" or "mean", got {mode!r}')
        self.mode = mode
        self.pooled = pooled

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input.dim() == 2:
            if offsets is not None:
                raise InvalidInputError("offsets must be None when input is 2-D (fixed-size bags)")
            n, size = input.shape
            offsets = torch.arange(0, n * size, size, dtype=torch.int64, device=input.device)
            input = input.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif input.dim() != 1 or offsets is None:
            raise InvalidInputError("input must be 1-D with offsets, or 2-D without")
        if per_sample_weights is not None and self.mode != "sum":
            raise InvalidInputError('per_sample_weights need mode="sum" (as in torch.nn.EmbeddingBag)')
        device = self.output_device(input)
        if self.pooled and not (torch.is_grad_enabled() and self.training):
            keys = _to_keys(input.reshape(-1).to("cpu"), "ids")
            w = (
                None
                if per_sample_weights is None
                else per_sample_weights.detach().to("cpu", torch.float32).numpy()
            )
            out = self.table.lookup_pooled(keys, offsets.to("cpu").numpy(), w, self.mode)
            return _to_device(torch.from_numpy(out), device)
        if self.cache is not None:
            if torch.is_grad_enabled() and self.training:
                raise InvalidInputError(
                    "a GpuCache answers lookups in eval mode or under torch.no_grad(); "
                    "train through the table"
                )
            # Found and pooled on the cache's device (one launch on the native path).
            pooled = self.cache.lookup_pooled(input, offsets, per_sample_weights, self.mode)
            return pooled.to(device)
        # Pooled on the host: on a device only the pooled rows go up and their gradient
        # comes down.
        rows, inverse = self.unique_rows(input)
        weights = None if per_sample_weights is None else per_sample_weights.to("cpu")
        pooled = F.embedding_bag(inverse, rows, offsets.to("cpu"), mode=self.mode, per_sample_weights=weights)
        return _to_device(pooled, device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}" + (", pooled=True" if self.pooled else "")


class _FusedPending:
    """Per-row gradients gathered by a fused collection since the last step."""

    def __init__(self, collection: EmbeddingBagCollection) -> None:
        self._collection = weakref.ref(collection)
        self.grads: list[Any] = []
        self.lock = threading.Lock()

    @property
    def collection(self) -> EmbeddingBagCollection:
        c = self._collection()
        if c is None:
            raise InvalidInputError("the EmbeddingBagCollection of this lookup was dropped")
        return c

    def add(self, grads: Any) -> None:
        with self.lock:
            self.grads.append(grads)

    def take(self) -> list[Any] | None:
        with self.lock:
            got, self.grads = self.grads, []
        return got or None

    def clear(self) -> None:
        with self.lock:
            self.grads = []

    def per_table(
        self, got: list[Any]
    ) -> list[tuple[Source, tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]]]:
        """The gathered gradients as ``(source, (keys, grads))`` per table."""
        c = self.collection
        out = []
        for t, src in enumerate(c._sources):
            parts = [g.table(t) for g in got]
            keys = np.concatenate([k for k, _ in parts])
            if len(keys):
                out.append((src, (keys, np.ascontiguousarray(np.concatenate([g for _, g in parts])))))
        return out

    def push(self, got: list[Any]) -> int:
        """Pushes one step's gradients: one native call for every table, or (several
        forwards in the step) one ``push_grad`` per table of their sum."""
        c = self.collection
        if len(got) == 1:
            n = c._native.push(got[0])
            c._notify(got[0])
            return int(n)
        n = 0
        for src, (keys, grads) in self.per_table(got):
            src.push_grad(keys, grads)
            n += len(np.unique(keys))
        return n


class _FusedStep(torch.autograd.Function):
    """One native call forward (pull and pool every feature), one backward (per-row
    gradients of every table, handed to the collection's pending list or pushed)."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        collection: EmbeddingBagCollection,
        native: Any,
        values: list[npt.NDArray[np.int64]],
        offsets: list[npt.NDArray[np.int64]],
        weights: list[npt.NDArray[np.float32] | None],
    ) -> torch.Tensor:
        flat, step = native.forward(values, offsets, weights)
        ctx.collection, ctx.step = collection, step
        return torch.from_numpy(flat)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        g = np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy().reshape(-1))
        ctx.collection._gathered(ctx.collection._native.backward(ctx.step, g))
        return (None,) * 6


class EmbeddingBagCollection(torch.nn.Module):
    """Several pooled features over embank tables, trained with **one native call per
    step each way**.

    ``features``: feature name -> table (a :class:`~embank.Table` or
    :class:`~embank.Worker`; a table may serve several features: the gradients of all
    of them are summed into one update per step). ``forward`` takes TorchRec's
    ``KeyedJaggedTensor``, a mapping ``name -> (values, offsets[, per_sample_weights])``,
    or a ``(batch, features)`` integer tensor (one id per feature per example, features
    in the collection's order), and returns ``name -> (batch, dim)`` pooled rows.
    ``mode``: ``"sum"`` or ``"mean"``, or a mapping feature name -> mode (features pooled
    differently in one collection).

    Fused (the default when every feature is a table or worker): forward hands every
    feature's ids to the engine in one call, which deduplicates them per table, pulls
    each table's distinct rows once (remote tables in parallel on up to ``threads``
    threads, 4 by default; embedded tables on the calling thread unless ``threads`` says)
    and pools them (``mode`` sum, weighted sum or mean) into one tensor; backward
    reduces the pooled gradient to one gradient per distinct row in one call, and
    :meth:`SparseOptimizer.step` applies every table's optimizer in one call
    (``push="backward"``: backward applies it). The results are the per-table
    modules' up to the order floats are summed in. ``fused=False``, a
    :class:`~embank.gpu.GpuCache` or ``pooled=True`` give one :class:`EmbeddingBag`
    per feature instead. Weights that require grad get their gradient (the rows then
    pool in torch); ``is_weighted=False`` ignores the input's weights, ``True`` requires
    them (TorchRec's ``is_weighted``), ``None`` (default) uses them where given.

    :meth:`prefetch` wraps a batch iterator so each batch's rows are read into the
    store's row cache while the batch before it trains.

    ``output="keyed_tensor"`` returns TorchRec's ``KeyedTensor`` (the look-alike
    :class:`KeyedTensor` without TorchRec) instead of a dict: every feature's pooled rows
    side by side, in the collection's order. :meth:`from_configs` makes such a collection
    from TorchRec's table configs, a drop-in for ``torchrec.EmbeddingBagCollection``.
    """

    _where: torch.Tensor

    def __init__(
        self,
        features: Mapping[str, Source | GpuCache],
        mode: str | Mapping[str, str] = "sum",
        *,
        push: str = "step",
        pooled: bool = False,
        fused: bool | None = None,
        threads: int | None = None,
        output: str = "dict",
        is_weighted: bool | None = None,
    ) -> None:
        super().__init__()
        if not features:
            raise InvalidInputError("an EmbeddingBagCollection needs at least one feature")
        given_modes = [mode.get(n) for n in features] if isinstance(mode, Mapping) else [mode] * len(features)
        modes: list[str] = []
        for name, m in zip(features, given_modes):
            if m not in ("sum", "mean"):
                raise InvalidInputError(f'feature {name!r}: mode must be "sum" or "mean", got {m!r}')
            modes.append(str(m))
        if push not in ("step", "backward"):
            raise InvalidInputError(f'push must be "step" or "backward", got {push!r}')
        if output not in ("dict", "keyed_tensor"):
            raise InvalidInputError(f'output must be "dict" or "keyed_tensor", got {output!r}')
        self.output = output
        self._keyed_tensor: Any = keyed_tensor_class() if output == "keyed_tensor" else None
        self._configs: list[Any] | None = None
        self.store: Store | None = None
        plain = all(isinstance(s, (Table, Worker)) for s in features.values())
        if fused is None:
            fused = plain and not pooled
        if fused and not plain:
            raise InvalidInputError("fused=True needs every feature on a Table or Worker (not a GpuCache)")
        if fused and pooled:
            raise InvalidInputError("pooled=True pools bags per table in the store: use fused=False with it")
        self.feature_names = list(features)
        self.mode, self.push, self.fused = mode, push, fused
        self.modes = modes  # each feature's pooling
        # Features pooling differently: the engine sums, MEAN bags weighted by 1 / length.
        self._mixed = len(set(modes)) > 1
        native_mode = "sum" if self._mixed else modes[0]
        # from_configs: each feature's num_embeddings (ids must be below it) and table name.
        self._id_bounds: list[tuple[int, str]] | None = None
        self._is_weighted = is_weighted
        # Moved by ``module.to(device)`` with the model: where outputs go (not saved).
        self.register_buffer("_where", torch.empty(0), persistent=False)
        self.bags = torch.nn.ModuleDict()
        if not fused:
            self.bags.update(
                {
                    n: EmbeddingBag(s, m, push=push, pooled=pooled)
                    for (n, s), m in zip(features.items(), modes)
                }
            )
            return
        # One entry per distinct source object (modules sharing a Table share its update).
        self._sources: list[Source] = []
        index: list[int] = []
        for src in features.values():
            assert isinstance(src, (Table, Worker))
            hit = next((i for i, s in enumerate(self._sources) if s is src), None)
            if hit is None:
                self._sources.append(src)
                hit = len(self._sources) - 1
            index.append(hit)
        self.dims = [_table_of(s).dim for s in features.values()]  # type: ignore[arg-type]
        if threads is None:
            # Embedded tables are CPU work: one thread (more compete with torch's own
            # threads, which spin between ops). Remote tables wait on round trips: overlap
            # a few (4 ran as fast as 16 through 2 shards, with fewer connections: each
            # thread may open one per shard at once, and a server closes unauthenticated
            # ones past 16 per address, which clients then open again).
            remote = any(_table_of(s)._t.remote for s in self._sources)
            threads = min(len(self._sources), 4) if remote else 1
        natives = [_table_of(s)._t for s in self._sources]
        workers = [s.id if isinstance(s, Worker) else None for s in self._sources]
        timeout = max([s.timeout for s in self._sources if isinstance(s, Worker)], default=60.0)
        self._native = _native.Collection(natives, index, workers, native_mode, threads, timeout)
        # Evaluation pulls through the tables, never a worker's holds.
        self._native_eval = (
            _native.Collection(natives, index, [None] * len(natives), native_mode, threads, timeout)
            if any(w is not None for w in workers)
            else self._native
        )
        self.pending = _FusedPending(self)
        self._anchor = torch.zeros(0, requires_grad=True)

    def _gathered(self, grads: Any) -> None:
        if self.push == "backward":
            self.pending.push([grads])
        else:
            self.pending.add(grads)

    def _notify(self, grads: Any) -> None:
        """Tells each table's write listeners (a GpuCache over it) the rows pushed."""
        for t, src in enumerate(self._sources):
            listeners = _table_of(src)._listeners
            if listeners:
                listeners.notify(grads.table(t)[0])

    def _jagged(self, features: Any) -> Jagged:
        jagged = _as_jagged(features)
        missing = [n for n in self.feature_names if n not in jagged]
        if missing:
            raise InvalidInputError(f"features missing from the input: {missing}")
        return jagged

    def _inputs(
        self, features: Any
    ) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]], list[torch.Tensor | None]]:
        """Every feature's ids, bag starts and weights (as given: a tensor whose gradient
        is wanted stays one), the weights as ``is_weighted`` says."""
        if isinstance(features, torch.Tensor):
            if features.dim() != 2 or features.shape[1] != len(self.feature_names):
                raise InvalidInputError(
                    f"a tensor of ids must be (batch, {len(self.feature_names)}): one id per feature "
                    f"per example; got shape {tuple(features.shape)}"
                )
            ids = _ids64(features, "ids").T.copy()  # one contiguous row per feature
            starts = np.arange(ids.shape[1], dtype=np.int64)
            return self._bounded(list(ids)), [starts] * len(ids), self._weights([None] * len(ids))
        fast = _kjt_inputs(features, self.feature_names)
        if fast is not None:
            values, offsets, given = fast
            return self._bounded(values), offsets, self._weights(given)
        jagged = self._jagged(features)
        values, offsets, given = [], [], []
        for name in self.feature_names:
            v, o, *w = jagged[name]
            values.append(_ids64(v, f"values of {name!r}"))
            offsets.append(_ids64(o, f"offsets of {name!r}"))
            wt = w[0] if w else None
            given.append(wt if wt is None or isinstance(wt, torch.Tensor) else torch.as_tensor(wt))
        return self._bounded(values), offsets, self._weights(given)

    def _bounded(self, values: list[npt.NDArray[np.int64]]) -> list[npt.NDArray[np.int64]]:
        """``values``, checked against the configs' ``num_embeddings`` (from_configs)."""
        if self._id_bounds is None:
            return values
        for name, v, (bound, table) in zip(self.feature_names, values, self._id_bounds):
            if len(v) and (top := int(v.max())) >= bound:
                raise InvalidInputError(
                    f"feature {name!r}: id {top} is not below num_embeddings {bound} of table {table!r} "
                    "(TorchRec's collection refuses it too); from_configs(..., "
                    "allow_ids_beyond_num_embeddings=True) lets the table grow past it"
                )
        return values

    def _weights(self, given: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The weights pooling uses: none with ``is_weighted=False`` (TorchRec's unweighted
        collection ignores a KJT's weights), every feature's with ``is_weighted=True``."""
        if self._is_weighted is False:
            return [None] * len(given)
        for name, mode, w in zip(self.feature_names, self.modes, given):
            if w is None and self._is_weighted:
                raise InvalidInputError(
                    f"feature {name!r} has no weights: the collection is weighted (is_weighted=True)"
                )
            if w is not None and mode != "sum":
                raise InvalidInputError(
                    f'feature {name!r}: per_sample_weights need mode="sum" (as in torch.nn.EmbeddingBag)'
                )
        return given

    def is_weighted(self) -> bool:
        """Whether bags are pooled with their weights (TorchRec's ``is_weighted()``);
        ``is_weighted=None`` at construction uses weights where the input has them."""
        return bool(self._is_weighted)

    @classmethod
    def from_configs(
        cls,
        store: Store,
        tables: Sequence[Any],
        optimizer: Spec | None = None,
        *,
        table_options: Mapping[str, Any] | None = None,
        push: str = "backward",
        threads: int | None = None,
        is_weighted: bool = False,
        allow_ids_beyond_num_embeddings: bool = False,
    ) -> EmbeddingBagCollection:
        """A drop-in for ``torchrec.EmbeddingBagCollection(tables=...)`` with a fused
        optimizer: ``forward(kjt)`` takes a ``KeyedJaggedTensor`` and returns a
        ``KeyedTensor`` (keys: the feature names in config order, ``length_per_key``:
        their dims), and backward applies the optimizer to the rows in the store (as
        FBGEMM's fused backward does: no optimizer step to call for the tables).

        ``tables``: ``torchrec.EmbeddingBagConfig`` objects, or
        :class:`embank.torch.EmbeddingBagConfig` without TorchRec. Each opens the table of
        its ``name`` in ``store`` or creates it: ``num_embeddings`` as capacity (an id
        ``>= num_embeddings`` raises :class:`~embank.errors.InvalidInputError`, as in
        TorchRec; ``allow_ids_beyond_num_embeddings=True`` lets the table grow past it,
        and an export then needs a larger ``num_embeddings``), ``embedding_dim``, TorchRec's
        uniform initializer (``weight_init_min``/``max``, default
        ``±sqrt(1 / num_embeddings)``), ``missing="init"``. A table with several
        ``feature_names`` serves each; their gradients make one update per step. Each
        table pools as its config says (SUM or MEAN, mixed in one collection as in
        TorchRec). ``table_options`` go to
        :meth:`~embank.Store.create_table` (``medium``, ``placement``, ``dtype``, ...).

        ``optimizer``: see :func:`optimizer_from_spec` — e.g.
        ``(EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.02, "eps": 1e-8})``, TorchRec's
        ``fused_params`` dict, or an :mod:`embank.optim` optimizer; ``None`` keeps an
        existing table's optimizer and gives a new table none (inference: training it
        raises :class:`~embank.errors.ConfigError`). ``push="step"`` instead
        gathers gradients for :class:`SparseOptimizer` (delays, many trainers).

        ``is_weighted`` as TorchRec's: ``False`` (default) pools ids unweighted and
        ignores a KJT's weights, ``True`` pools with them (SUM tables only) and gives
        them their gradient. TorchRec's ``EmbeddingConfig`` (unpooled) is refused."""
        if not tables:
            raise InvalidInputError("from_configs needs at least one table config")
        opt = None if optimizer is None else optimizer_from_spec(optimizer)
        pooling = {c.name: pooling_mode(c) for c in tables}
        if is_weighted and "mean" in pooling.values():
            means = sorted(n for n, m in pooling.items() if m == "mean")
            raise InvalidInputError(
                f"is_weighted=True needs SUM pooling (as torch.nn.EmbeddingBag's weights): "
                f"tables {means} pool MEAN"
            )
        modes: dict[str, str] = {}
        features: dict[str, Source | GpuCache] = {}
        bounds: list[tuple[int, str]] = []
        for c in tables:
            table = table_for_config(store, c, opt, table_options or {})
            for f in c.feature_names:
                if f in features:
                    raise InvalidInputError(f"feature {f!r} is in two table configs")
                features[f] = table
                modes[f] = pooling[c.name]
                bounds.append((int(c.num_embeddings), c.name))
        if not features:
            raise InvalidInputError("the table configs name no feature_names")
        alike = set(modes.values())
        mode: str | dict[str, str] = alike.pop() if len(alike) == 1 else modes
        made = cls(features, mode, push=push, threads=threads, output="keyed_tensor", is_weighted=is_weighted)
        made._configs = list(tables)
        made._id_bounds = None if allow_ids_beyond_num_embeddings else bounds
        made.store = store
        return made

    def embedding_bag_configs(self) -> list[Any]:
        """The table configs of :meth:`from_configs` (as TorchRec's collection has them)."""
        if self._configs is None:
            raise InvalidInputError("this collection was not made by from_configs: it has no table configs")
        return self._configs

    def forward(self, features: Any) -> Any:
        """Pooled rows of every feature: ``name -> (batch, dim)``, or a ``KeyedTensor``
        with ``output="keyed_tensor"``."""
        if not self.fused:
            out = self._forward_per_table(features)
            if self._keyed_tensor is None:
                return out
            pooled = [out[n] for n in self.feature_names]
            return self._keyed_tensor(
                keys=self.feature_names,
                length_per_key=[p.shape[1] for p in pooled],
                values=torch.cat(pooled, 1),
            )
        values, offsets, given = self._inputs(features)
        training = torch.is_grad_enabled() and self.training
        weights = self._native_weights(values, offsets, given)
        if training and any(w is not None and w.requires_grad for w in given):
            flat = self._forward_weights_with_grad(values, offsets, given)
        elif training:
            flat = _FusedStep.apply(self._anchor, self, self._native, values, offsets, weights)
        else:
            flat = torch.from_numpy(self._native_eval.forward(values, offsets, weights)[0])
        # On a device: the pooled rows of every feature go up in one copy, their gradient
        # comes down in one.
        flat = _to_device(flat, self._output_device(features))
        bags = len(offsets[0])
        parts = torch.split(flat, [bags * d for d in self.dims])
        if self._keyed_tensor is not None:
            # TorchRec's layout: (batch, sum of dims), features side by side.
            side = torch.cat([p.view(bags, d) for p, d in zip(parts, self.dims)], 1)
            return self._keyed_tensor(keys=self.feature_names, length_per_key=self.dims, values=side)
        return {n: p.view(bags, d) for n, p, d in zip(self.feature_names, parts, self.dims)}

    def _native_weights(
        self,
        values: list[npt.NDArray[np.int64]],
        offsets: list[npt.NDArray[np.int64]],
        given: list[torch.Tensor | None],
    ) -> list[npt.NDArray[np.float32] | None]:
        """The weights the engine pools with: the given ones, and in a collection whose
        features pool differently (the engine sums) ``1 / length`` for each MEAN bag's ids."""
        out: list[npt.NDArray[np.float32] | None] = []
        for v, o, w, mode in zip(values, offsets, given, self.modes):
            if self._mixed and mode == "mean":
                lengths = np.diff(np.append(o, len(v)))
                out.append(np.repeat(1 / np.maximum(lengths, 1), lengths).astype(np.float32))
            else:
                out.append(None if w is None else np.ascontiguousarray(_np(w, torch.float32), np.float32))
        return out

    def _rows_per_id(self, values: list[npt.NDArray[np.int64]], training: bool) -> tuple[torch.Tensor, int]:
        """Every id's row, unpooled, in one native call (each id its own bag): flat
        feature blocks of ``m x dim`` (``m`` the most ids of a feature; rows past a
        feature's ids are empty bags, zeros), and ``m``. Training: backward sends the
        rows' gradients to the store as the pooled path does."""
        m = max(len(v) for v in values)
        singles = [np.minimum(np.arange(m, dtype=np.int64), len(v)) for v in values]  # then empty bags
        none: list[npt.NDArray[np.float32] | None] = [None] * len(values)
        if training:
            flat: torch.Tensor = _FusedStep.apply(self._anchor, self, self._native, values, singles, none)
        else:
            flat = torch.from_numpy(self._native_eval.forward(values, singles, none)[0])
        return flat, m

    def _forward_weights_with_grad(
        self,
        values: list[npt.NDArray[np.int64]],
        offsets: list[npt.NDArray[np.int64]],
        given: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """The flat output when weights want their gradient: one native call pulls every
        id's row (each id its own bag), torch pools them, so backward gives each weight
        ``dot(row, gradient of its bag)`` (as ``torch.nn.EmbeddingBag`` and TorchRec do)
        and the rows' gradients go to the store as on the fused path."""
        sizes = [len(v) for v in values]
        rows, m = self._rows_per_id(values, training=True)
        pooled = []
        for block, d, n, o, w, mode in zip(
            torch.split(rows, [m * d for d in self.dims]), self.dims, sizes, offsets, given, self.modes
        ):
            weights = None if w is None else w.to("cpu", torch.float32)
            bags = F.embedding_bag(
                torch.arange(n),
                block.view(m, d)[:n],
                torch.from_numpy(o),
                mode=mode,
                per_sample_weights=weights,
            )
            pooled.append(bags.reshape(-1))
        return torch.cat(pooled)

    def _output_device(self, features: Any) -> torch.device:
        """The ids' device when it is not the CPU, else the module's."""
        if isinstance(features, Mapping):
            features = next(iter(features.values()))[0]
        elif not isinstance(features, torch.Tensor) and hasattr(features, "to_dict"):
            features = features.values()  # a KeyedJaggedTensor
        if isinstance(features, torch.Tensor) and features.device.type != "cpu":
            return features.device
        return self._where.device

    def _forward_per_table(self, features: Any) -> dict[str, torch.Tensor]:
        if isinstance(features, torch.Tensor):
            n = features.shape[0]
            offsets = torch.arange(n, dtype=torch.int64)
            return {
                name: self.bags[name](features[:, j].contiguous(), offsets)
                for j, name in enumerate(self.feature_names)
            }
        jagged = self._jagged(features)
        given = [(list(jagged[n])[2:] or [None])[0] for n in self.feature_names]
        weights = self._weights([None if w is None else torch.as_tensor(w) for w in given])
        out: dict[str, torch.Tensor] = {}
        for name, w in zip(self.feature_names, weights):
            values, offsets, *_ = jagged[name]
            out[name] = self.bags[name](values, offsets, w)
        return out

    def lookahead(self, features: Any) -> None:
        """Starts reading these features' rows into the store's row cache in the
        background (one native call for every table); returns at once."""
        values, offsets, _ = self._inputs(features)
        if self.fused:
            self._native.lookahead(values, offsets)
            return
        for name, v in zip(self.feature_names, values):
            bag = self.bags[name]
            assert isinstance(bag, EmbeddingBag)
            bag.table.lookahead(np.unique(v).astype(np.uint64))

    def prefetch(self, batches: Iterable[B], features_of: Callable[[B], Any]) -> Iterator[B]:
        """Yields ``batches`` one behind: while batch *i* trains, the rows of batch *i+1*
        are read into the row cache (``features_of(batch)``: what ``forward`` takes)."""
        return lookahead(batches, lambda b: self.lookahead(features_of(b)))

    def extra_repr(self) -> str:
        return f"features={len(self.feature_names)}, mode={self.mode!r}, fused={self.fused}"


class EmbeddingCollection(torch.nn.Module):
    """TorchRec's ``EmbeddingCollection`` over embank tables: unpooled (sequence)
    embeddings, ``forward(kjt)`` returns ``{feature: JaggedTensor}`` whose values are
    every id's row ``(ids, dim)`` and whose lengths are the KJT's. One native call pulls
    every feature's rows; backward sums each distinct row's gradients and hands them to
    the table's optimizer (``push="backward"``, as FBGEMM's fused backward) or gathers
    them for :class:`SparseOptimizer` (``push="step"``).

    ``features``: feature name -> :class:`~embank.Table` (or :class:`~embank.Worker`);
    :meth:`from_configs` makes one from TorchRec's ``EmbeddingConfig``s. Input as
    :class:`EmbeddingBagCollection` takes it (a KJT, or ``name -> (values, offsets)``);
    weights are ignored (TorchRec's collection has none)."""

    def __init__(
        self,
        features: Mapping[str, Source],
        *,
        push: str = "step",
        threads: int | None = None,
    ) -> None:
        super().__init__()
        self._rows = EmbeddingBagCollection(features, "sum", push=push, threads=threads, is_weighted=False)
        if not self._rows.fused:
            raise InvalidInputError("an EmbeddingCollection needs every feature on a Table or Worker")
        self.feature_names = self._rows.feature_names
        self._configs: list[Any] | None = None
        self.store: Store | None = None
        self._jagged_tensor: Any = jagged_tensor_class()

    @property
    def push(self) -> str:
        return self._rows.push

    @classmethod
    def from_configs(
        cls,
        store: Store,
        tables: Sequence[Any],
        optimizer: Spec | None = None,
        *,
        table_options: Mapping[str, Any] | None = None,
        push: str = "backward",
        threads: int | None = None,
        allow_ids_beyond_num_embeddings: bool = False,
    ) -> EmbeddingCollection:
        """A drop-in for ``torchrec.EmbeddingCollection(tables=...)`` with a fused
        optimizer: ``tables`` are TorchRec's ``EmbeddingConfig``s (or
        :class:`embank.torch.EmbeddingConfig`), each the embank table of its name, made
        and checked as :meth:`EmbeddingBagCollection.from_configs` makes them (an id
        ``>= num_embeddings`` raises unless ``allow_ids_beyond_num_embeddings``);
        ``optimizer`` as there. A pooled config (``EmbeddingBagConfig``) is refused."""
        if not tables:
            raise InvalidInputError("from_configs needs at least one table config")
        for c in tables:
            if hasattr(c, "pooling"):
                raise ConfigError(
                    f"table {c.name!r}: a {type(c).__name__} pools ({c.pooling}); an EmbeddingCollection "
                    "is unpooled (give EmbeddingConfigs, or use EmbeddingBagCollection.from_configs)"
                )
        opt = None if optimizer is None else optimizer_from_spec(optimizer)
        features: dict[str, Source] = {}
        bounds: list[tuple[int, str]] = []
        for c in tables:
            table = table_for_config(store, c, opt, table_options or {})
            for f in c.feature_names or [c.name]:  # TorchRec's default: the table's name
                if f in features:
                    raise InvalidInputError(f"feature {f!r} is in two table configs")
                features[f] = table
                bounds.append((int(c.num_embeddings), c.name))
        made = cls(features, push=push, threads=threads)
        made._rows._id_bounds = None if allow_ids_beyond_num_embeddings else bounds
        made._configs = list(tables)
        made.store = store
        return made

    def embedding_configs(self) -> list[Any]:
        """The table configs of :meth:`from_configs` (as TorchRec's collection has them)."""
        if self._configs is None:
            raise InvalidInputError("this collection was not made by from_configs: it has no table configs")
        return self._configs

    def forward(self, features: Any) -> dict[str, Any]:
        rows = self._rows
        values, offsets, _ = rows._inputs(features)
        flat, m = rows._rows_per_id(values, training=torch.is_grad_enabled() and self.training)
        flat = _to_device(flat, rows._output_device(features))
        out: dict[str, Any] = {}
        for name, block, d, v, o in zip(
            self.feature_names, torch.split(flat, [m * d for d in rows.dims]), rows.dims, values, offsets
        ):
            lengths = torch.from_numpy(np.diff(np.append(o, len(v)))).to(flat.device)
            out[name] = self._jagged_tensor(values=block.view(m, d)[: len(v)], lengths=lengths)
        return out

    def lookahead(self, features: Any) -> None:
        """Starts reading these features' rows into the store's row cache (see
        :meth:`EmbeddingBagCollection.lookahead`)."""
        self._rows.lookahead(features)

    def extra_repr(self) -> str:
        return f"features={len(self.feature_names)}"


def _lookups(modules: Iterable[torch.nn.Module]) -> list[_Lookup]:
    found: list[_Lookup] = []
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, _Lookup) and sub not in found:
                found.append(sub)
    return found


class SparseOptimizer:
    r"""Pushes the gradients gathered by embank modules to their tables' optimizers.

    ``modules``: the model (or its embank modules); every embank lookup inside is found.
    Call :meth:`step` where you call the dense optimizer's ``step`` and :meth:`zero_grad`
    with its ``zero_grad`` (drops what was gathered and not pushed). The update rule and
    learning rate are the table's (``create_table(optimizer=...)``, ``Table.set_lr``).

    ``delay=k`` pushes each step's gradients ``k`` steps later (stale synchronous
    training: the next k steps pull rows without them). With modules over
    :class:`~embank.Worker` objects of tables whose ``staleness_bound`` is at least k the store
    enforces the bound. :meth:`flush` pushes everything still delayed (before a
    checkpoint, an evaluation, the end).

    ``distributed=True`` (many trainer processes under ``torch.distributed``, e.g.
    ``torchrun``, the tables on shared ``embank serve`` shards): each step gathers every
    rank's gradients of each table, averages them as ``DistributedDataParallel``
    averages the dense ones, and pushes each row once, from the rank that owns it (key
    modulo world size), then waits at a barrier: every row gets one update per step
    with the whole global batch's gradient, whatever the ranks' timing, so a run is
    reproducible and matches one process training on the global batch.
    """

    def __init__(
        self,
        modules: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        delay: int = 0,
        distributed: bool = False,
    ) -> None:
        mods = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        lookups = _lookups(mods)
        collections = [
            sub for m in mods for sub in m.modules() if isinstance(sub, EmbeddingBagCollection) and sub.fused
        ]
        self._fused: list[_FusedPending] = []
        for c in collections:
            if c.push == "step" and c.pending not in self._fused:
                self._fused.append(c.pending)
        if not lookups and not collections:
            raise InvalidInputError("no embank Embedding/EmbeddingBag/EmbeddingBagCollection module found")
        if delay < 0:
            raise InvalidInputError(f"delay must be >= 0, got {delay}")
        self.delay = delay
        self.distributed = distributed
        if distributed:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise InvalidInputError(
                    "distributed=True needs torch.distributed initialized (init_process_group)"
                )
            if delay:
                raise InvalidInputError("distributed=True pushes every step: no delay")
        self._pending: list[_Pending] = []
        for lk in lookups:
            if lk.push == "step" and lk.pending not in self._pending:
                self._pending.append(lk.pending)
        self._late: list[list[tuple[Any, Any]]] = []

    def step(self) -> int:
        """One ``push_grad`` per table of everything gathered since the last step (or,
        with a delay, since the step ``delay`` steps ago); returns how many keys were pushed."""
        if self.distributed:
            return self._step_distributed()
        gathered: list[tuple[Any, Any]] = [(p, got) for p in self._pending if (got := p.take()) is not None]
        gathered += [(f, fg) for f in self._fused if (fg := f.take()) is not None]
        self._late.append(gathered)
        n = 0
        while len(self._late) > self.delay:
            n += self._push(self._late.pop(0))
        return n

    def _step_distributed(self) -> int:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        # One entry per table source, in an order every rank shares: the per-table
        # modules', then each fused collection's tables.
        sources: list[Source] = [p.source for p in self._pending]
        mine: list[Any] = [p.take() for p in self._pending]
        for f in self._fused:
            got = f.take()
            by_source = dict((id(s), kg) for s, kg in f.per_table(got)) if got else {}
            for src in f.collection._sources:
                sources.append(src)
                mine.append(by_source.get(id(src)))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        n = 0
        for i, source in enumerate(sources):
            parts = [r[i] for r in every if r[i] is not None]
            if not parts:
                continue
            keys = np.concatenate([k for k, _ in parts])
            grads = np.concatenate([g for _, g in parts]) / np.float32(world)
            own = (keys % np.uint64(world)) == np.uint64(rank)
            if own.any():
                source.push_grad(keys[own], np.ascontiguousarray(grads[own]))
                n += int(own.sum())
        dist.barrier()  # no rank pulls the next batch before every row is updated
        return n

    def flush(self) -> int:
        """Pushes every delayed step now; returns how many keys were pushed."""
        n = 0
        while self._late:
            n += self._push(self._late.pop(0))
        return n

    @staticmethod
    def _push(gathered: list[tuple[Any, Any]]) -> int:
        n = 0
        for p, got in gathered:
            if isinstance(p, _FusedPending):
                n += p.push(got)
                continue
            keys, grads = got
            p.source.push_grad(keys, grads)
            n += len(keys)
        return n

    def zero_grad(self) -> None:
        """Drops gradients gathered since the last step (not the delayed ones)."""
        for p in self._pending:
            p.clear()
        for f in self._fused:
            f.clear()

    @property
    def tables(self) -> list[str]:
        names = [_table_of(p.source).name for p in self._pending]
        for f in self._fused:
            names += [_table_of(s).name for s in f.collection._sources]
        return names
