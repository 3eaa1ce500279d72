"""Collections of features over embank tables, trained with one native call per step
each way: :class:`EmbeddingBagCollection` (pooled, TorchRec's ``EmbeddingBagCollection``)
and :class:`EmbeddingCollection` (unpooled, TorchRec's ``EmbeddingCollection``). The
tables' side is the store's :class:`~embank._table.FusedTables`; here are the autograd
step around it and the gradients a step gathers."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ._collection_cache import SharedCacheBags, shared_inputs
from ._device import _to_device
from ._embedding import EmbeddingBag
from ._gradients import _StepCounter
from ._jagged import Features
from ._lookahead import B, lookahead
from ._store import Store
from ._table import FusedTables, Source, Table, Worker, _table_of
from ._torchrec import (
    Spec,
    jagged_tensor_class,
    keyed_tensor_class,
    optimizer_from_spec,
    pooling_mode,
    table_for_config,
)
from .errors import ConfigError, InvalidInputError
from .gpu import GpuCache, TrainCache

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]


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

    def push(self, got: list[Any], step: int) -> int:
        """Pushes training step ``step``'s gradients: one native call for every table, or
        (several forwards in the step) one ``push_grad`` per table of their sum."""
        c = self.collection
        if len(got) == 1:
            return c._tables.push(got[0], step)
        n = 0
        for src, (keys, grads) in self.per_table(got):
            src.push_grad(keys, grads, step)
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
        tables: FusedTables,
        values: list[npt.NDArray[np.int64]],
        offsets: list[npt.NDArray[np.int64]],
        weights: list[npt.NDArray[np.float32] | None],
    ) -> torch.Tensor:
        flat, step = tables.forward(values, offsets, weights, training=True)
        ctx.collection, ctx.step = collection, step
        return torch.from_numpy(flat)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        g = np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy().reshape(-1))
        ctx.collection._gathered(ctx.collection._tables.backward(ctx.step, g))
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
    :class:`~embank.gpu.GpuCache`, a :class:`~embank.gpu.TrainCache` (training on its
    device) or ``pooled=True`` give one :class:`EmbeddingBag` per feature instead.
    Weights that require grad get their gradient (the rows then pool in torch);
    ``is_weighted=False`` ignores the input's weights, ``True`` requires them
    (TorchRec's ``is_weighted``), ``None`` (default) uses them where given.

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
        features: Mapping[str, Source | GpuCache | TrainCache],
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
            raise InvalidInputError(
                "fused=True needs every feature on a Table or Worker (not a GpuCache or TrainCache)"
            )
        if fused and pooled:
            raise InvalidInputError("pooled=True pools bags per table in the store: use fused=False with it")
        self.feature_names = list(features)
        self.mode, self.push, self.fused = mode, push, fused
        self.modes = modes  # each feature's pooling
        # How the input is read: ids, bag starts, weights (and, from_configs, id bounds).
        self._features = Features(self.feature_names, modes, is_weighted)
        # Features pooling differently: the engine sums, MEAN bags weighted by 1 / length.
        native_mode = "sum" if self._features.mixed else modes[0]
        # Moved by ``module.to(device)`` with the model: where outputs go (not saved).
        self.register_buffer("_where", torch.empty(0), persistent=False)
        self.bags = torch.nn.ModuleDict()
        self._shared: SharedCacheBags | None = None  # from_configs(shared_train_cache=True)
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
        # Every table pulled, pooled and trained in one native call each way (the store's side).
        self._tables = FusedTables(self._sources, index, native_mode, threads)
        self.pending = _FusedPending(self)
        # push="backward": each backward is a training step (FBGEMM's fused backward).
        self._steps = _StepCounter()
        self._anchor = torch.zeros(0, requires_grad=True)

    def _gathered(self, grads: Any) -> None:
        if self.push == "backward":
            self.pending.push([grads], self._steps.next(self._sources))
        else:
            self.pending.add(grads)

    def is_weighted(self) -> bool:
        """Whether bags are pooled with their weights (TorchRec's ``is_weighted()``);
        ``is_weighted=None`` at construction uses weights where the input has them."""
        return bool(self._features.is_weighted)

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
        train_cache_rows: int | None = None,
        device: str | torch.device | None = None,
        shared_train_cache: bool = False,
        train_cache_options: Mapping[str, Any] | None = None,
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
        them their gradient. TorchRec's ``EmbeddingConfig`` (unpooled) is refused.

        ``train_cache_rows``: train on the accelerator through a
        :class:`~embank.gpu.TrainCache` of that many rows a table (at most its
        ``num_embeddings``) on ``device`` (default: CUDA if available): the batch's rows
        are found, pooled and updated there, and only misses and evicted rows cross to
        the store. A table's features' gradients of a step make one update, as the fused
        collection's; ``store.checkpoint`` writes the caches' dirty rows first.
        ``shared_train_cache=True``: one TrainCache over every table instead (tables of
        one dim and optimizer; ``train_cache_rows`` rows a table, together), a step's ids
        of every feature found, placed, pooled and updated in one call each, not one a
        feature (``push="backward"``). ``train_cache_options``: more of
        :class:`~embank.gpu.TrainCache`'s arguments (``kernels``, ``slots``, ...)."""
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
        if train_cache_rows is not None and train_cache_rows < 1:
            raise InvalidInputError(f"train_cache_rows must be >= 1, got {train_cache_rows}")
        taken = {"table", "rows_max", "bytes_max", "device"} & set(train_cache_options or {})
        if taken:
            raise InvalidInputError(
                f"train_cache_options cannot set {sorted(taken)}: from_configs sets them "
                "(train_cache_rows, device)"
            )
        if shared_train_cache and (train_cache_rows is None or push != "backward"):
            raise InvalidInputError('shared_train_cache=True needs train_cache_rows and push="backward"')
        shared = shared_train_cache
        made_tables: list[Table] = []
        cache_rows = 0
        modes: dict[str, str] = {}
        features: dict[str, Source | GpuCache | TrainCache] = {}
        bounds: list[tuple[int, str]] = []
        for c in tables:
            table = table_for_config(store, c, opt, table_options or {})
            source: Table | TrainCache = table
            if train_cache_rows is not None:
                rows = min(train_cache_rows, int(c.num_embeddings))
                if shared:
                    made_tables.append(table)
                    cache_rows += rows
                else:
                    source = TrainCache(table, rows_max=rows, device=device, **(train_cache_options or {}))
            for f in c.feature_names:
                if f in features:
                    raise InvalidInputError(f"feature {f!r} is in two table configs")
                features[f] = source
                modes[f] = pooling[c.name]
                bounds.append((int(c.num_embeddings), c.name))
        if not features:
            raise InvalidInputError("the table configs name no feature_names")
        alike = set(modes.values())
        mode: str | dict[str, str] = alike.pop() if len(alike) == 1 else modes
        fused = False if shared else None
        made = cls(
            features,
            mode,
            push=push,
            threads=threads,
            output="keyed_tensor",
            is_weighted=is_weighted,
            fused=fused,
        )
        made._configs = list(tables)
        made._features.id_bounds = None if allow_ids_beyond_num_embeddings else bounds
        made.store = store
        if shared:
            cache = TrainCache(made_tables, rows_max=cache_rows, device=device, **(train_cache_options or {}))
            names = [t.name for t in made_tables]
            made._shared = SharedCacheBags(
                cache,
                [names.index(_table_of(features[f]).name) for f in made.feature_names],  # type: ignore[arg-type]
                [None if allow_ids_beyond_num_embeddings else b for b, _ in bounds],
            )
        return made

    def train_caches(self) -> list[TrainCache]:
        """The :class:`~embank.gpu.TrainCache` of each table trained through one (in
        feature order, each once; ``store.checkpoint`` writes their rows itself)."""
        found: list[TrainCache] = []
        if self._shared is not None:
            return [self._shared.cache]
        for bag in self.bags.values():
            trainer = getattr(bag, "trainer", None)
            if trainer is not None and trainer not in found:
                found.append(trainer)
        return found

    def embedding_bag_configs(self) -> list[Any]:
        """The table configs of :meth:`from_configs` (as TorchRec's collection has them)."""
        if self._configs is None:
            raise InvalidInputError("this collection was not made by from_configs: it has no table configs")
        return self._configs

    def forward(self, features: Any) -> Any:
        """Pooled rows of every feature: ``name -> (batch, dim)``, or a ``KeyedTensor``
        with ``output="keyed_tensor"``."""
        if self._shared is not None or not self.fused:
            out = (
                self._forward_shared(features)
                if self._shared is not None
                else self._forward_per_table(features)
            )
            if self._keyed_tensor is None:
                return out
            pooled = [out[n] for n in self.feature_names]
            return self._keyed_tensor(
                keys=self.feature_names,
                length_per_key=[p.shape[1] for p in pooled],
                values=torch.cat(pooled, 1),
            )
        values, offsets, given = self._features.inputs(features)
        training = torch.is_grad_enabled() and self.training
        weights = self._features.native_weights(values, offsets, given)
        if training and any(w is not None and w.requires_grad for w in given):
            flat = self._forward_weights_with_grad(values, offsets, given)
        elif training:
            flat = _FusedStep.apply(self._anchor, self, self._tables, values, offsets, weights)
        else:
            flat = torch.from_numpy(self._tables.forward(values, offsets, weights, training=False)[0])
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

    def _rows_per_id(self, values: list[npt.NDArray[np.int64]], training: bool) -> tuple[torch.Tensor, int]:
        """Every id's row, unpooled, in one native call (each id its own bag): flat
        feature blocks of ``m x dim`` (``m`` the most ids of a feature; rows past a
        feature's ids are empty bags, zeros), and ``m``. Training: backward sends the
        rows' gradients to the store as the pooled path does."""
        m = max(len(v) for v in values)
        singles = [np.minimum(np.arange(m, dtype=np.int64), len(v)) for v in values]  # then empty bags
        none: list[npt.NDArray[np.float32] | None] = [None] * len(values)
        if training:
            flat: torch.Tensor = _FusedStep.apply(self._anchor, self, self._tables, values, singles, none)
        else:
            flat = torch.from_numpy(self._tables.forward(values, singles, none, training=False)[0])
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

    def _forward_shared(self, features: Any) -> dict[str, torch.Tensor]:
        """Through one TrainCache over every table (``shared_train_cache=True``)."""
        assert self._shared is not None
        training = torch.is_grad_enabled() and self.training
        if isinstance(features, torch.Tensor):
            if features.dim() != 2 or features.shape[1] != len(self.feature_names):
                shared_inputs(features, self.feature_names, None)  # raises: the shape
            self._features.weights([None] * len(self.feature_names))  # a weighted one refuses
            pooled = self._shared.forward_dense(self.feature_names, features, training)
            out = self._output_device(features)
            return {n: p if p.device == out else p.to(out) for n, p in zip(self.feature_names, pooled)}
        jagged = self._features.jagged(features)
        inputs = shared_inputs(features, self.feature_names, jagged)
        given = self._features.weights([w for _, _, w in inputs])
        inputs = [(v, o, w) for (v, o, _), w in zip(inputs, given)]
        pooled = self._shared.forward(self.feature_names, self.modes, inputs, training)
        return {n: p.to(self._output_device(features)) for n, p in zip(self.feature_names, pooled)}

    def _forward_per_table(self, features: Any) -> dict[str, torch.Tensor]:
        if isinstance(features, torch.Tensor):
            n = features.shape[0]
            offsets = torch.arange(n, dtype=torch.int64)
            return {
                name: self.bags[name](features[:, j].contiguous(), offsets)
                for j, name in enumerate(self.feature_names)
            }
        jagged = self._features.jagged(features)
        given = [(list(jagged[n])[2:] or [None])[0] for n in self.feature_names]
        weights = self._features.weights([None if w is None else torch.as_tensor(w) for w in given])
        out: dict[str, torch.Tensor] = {}
        for name, w in zip(self.feature_names, weights):
            values, offsets, *_ = jagged[name]
            out[name] = self.bags[name](values, offsets, w)
        return out

    def lookahead(self, features: Any) -> None:
        """Starts reading these features' rows into the store's row cache in the
        background (one native call for every table); returns at once."""
        values, offsets, _ = self._features.inputs(features)
        if self.fused:
            self._tables.lookahead(values, offsets)
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
        made._rows._features.id_bounds = None if allow_ids_beyond_num_embeddings else bounds
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
        values, offsets, _ = rows._features.inputs(features)
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
