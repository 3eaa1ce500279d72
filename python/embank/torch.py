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
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable, Protocol, TypeVar, Union

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ._store import Table, Worker
from .errors import EmbankError, InvalidInputError
from .gpu import GpuCache

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "SparseOptimizer",
    "checkpoint",
    "lookahead",
]

Source = Union[Table, Worker]
B = TypeVar("B")


class _Pushable(Protocol):
    def push_grad(self, keys: npt.NDArray[np.uint64], grads: npt.NDArray[np.float32]) -> None: ...


def _table_of(source: Source) -> Table:
    return source.table if isinstance(source, Worker) else source


class _Pending:
    """Gradients gathered for one source since the last step."""

    def __init__(self, source: Source) -> None:
        self._source = weakref.ref(source)
        self.keys: list[npt.NDArray[np.uint64]] = []
        self.grads: list[npt.NDArray[np.float32]] = []
        self.lock = threading.Lock()

    def add(self, keys: npt.NDArray[np.uint64], grads: npt.NDArray[np.float32]) -> None:
        with self.lock:
            self.keys.append(keys)
            self.grads.append(grads)

    def take(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]] | None:
        with self.lock:
            if not self.keys:
                return None
            keys, grads = self.keys, self.grads
            self.keys, self.grads = [], []
        if len(keys) == 1:
            return keys[0], grads[0]
        return np.concatenate(keys), np.concatenate(grads)

    def clear(self) -> None:
        with self.lock:
            self.keys, self.grads = [], []

    @property
    def source(self) -> Source:
        s = self._source()
        if s is None:
            raise InvalidInputError("the table of this lookup was dropped")
        return s


# One pending list per source object: modules sharing a Table (or Worker) object share it,
# so a step pushes the sum of all their lookups once. Weak: a dropped table takes its list.
_pending_by_source: weakref.WeakKeyDictionary[Source, _Pending] = weakref.WeakKeyDictionary()
_pending_lock = threading.Lock()


def _pending_for(source: Source) -> _Pending:
    with _pending_lock:
        p = _pending_by_source.get(source)
        if p is None:
            p = _Pending(source)
            _pending_by_source[source] = p
        return p


def _to_keys(ids: torch.Tensor, what: str) -> npt.NDArray[np.uint64]:
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise InvalidInputError(f"{what} must be an integer tensor, got {ids.dtype}")
    a = ids.detach().to("cpu", torch.int64).numpy()
    if a.size and a.min() < 0:
        raise InvalidInputError(f"{what} holds a negative id ({int(a.min())}); embank keys are >= 0")
    return a.astype(np.uint64)


class _Lookup(torch.nn.Module):
    """Pulls the unique rows of a batch as a leaf tensor whose gradient goes to the store."""

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

    def unique_rows(self, ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Unique rows ``(u, dim)`` (requires grad when training) and the inverse index of ``ids``."""
        flat = ids.reshape(-1)
        training = torch.is_grad_enabled() and self.training
        if self.cache is not None:
            if training:
                raise InvalidInputError(
                    "a GpuCache answers lookups in eval mode or under torch.no_grad(); "
                    "train through the table"
                )
            uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            return self.cache.lookup(uniq).to(device), inverse.to(device)
        uniq, inverse = torch.unique(flat.to("cpu"), sorted=True, return_inverse=True)
        keys = _to_keys(uniq, "ids")
        # A worker's pull holds keys until their gradient is pushed: only when training.
        rows = torch.from_numpy((self.source if training else self.table).pull(keys))
        if device.type != "cpu":
            rows = rows.to(device, non_blocking=True)
            inverse = inverse.to(device)
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
        rows, inverse = self.unique_rows(input, input.device)
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
        if self.pooled and not (torch.is_grad_enabled() and self.training):
            keys = _to_keys(input.reshape(-1).to("cpu"), "ids")
            w = (
                None
                if per_sample_weights is None
                else per_sample_weights.detach().to("cpu", torch.float32).numpy()
            )
            out = self.table.lookup_pooled(keys, offsets.to("cpu").numpy(), w, self.mode)
            return torch.from_numpy(out).to(input.device)
        rows, inverse = self.unique_rows(input, input.device)
        return F.embedding_bag(
            inverse, rows, offsets.to(inverse.device), mode=self.mode, per_sample_weights=per_sample_weights
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}" + (", pooled=True" if self.pooled else "")


Jagged = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


class EmbeddingBagCollection(torch.nn.Module):
    """Several pooled features over embank tables.

    ``features``: feature name -> table (a table may serve several features: the
    gradients of all of them are summed into one update per step). ``forward`` takes
    TorchRec's ``KeyedJaggedTensor`` or a mapping ``name -> (values, offsets)`` and
    returns ``name -> (batch, dim)`` pooled rows.
    """

    def __init__(
        self,
        features: Mapping[str, Source | GpuCache],
        mode: str = "sum",
        *,
        push: str = "step",
        pooled: bool = False,
    ) -> None:
        super().__init__()
        if not features:
            raise InvalidInputError("an EmbeddingBagCollection needs at least one feature")
        self.bags = torch.nn.ModuleDict(
            {n: EmbeddingBag(s, mode, push=push, pooled=pooled) for n, s in features.items()}
        )
        self.feature_names = list(features)

    def forward(self, features: Any) -> dict[str, torch.Tensor]:
        jagged = _as_jagged(features)
        missing = [n for n in self.feature_names if n not in jagged]
        if missing:
            raise InvalidInputError(f"features missing from the input: {missing}")
        out: dict[str, torch.Tensor] = {}
        for name in self.feature_names:
            values, offsets = jagged[name]
            out[name] = self.bags[name](values, offsets)
        return out


def _as_jagged(features: Any) -> Jagged:
    if isinstance(features, Mapping):
        return features
    # TorchRec's KeyedJaggedTensor, without importing torchrec.
    if hasattr(features, "to_dict") and hasattr(features, "keys"):
        d = features.to_dict()
        return {k: (jt.values(), jt.offsets()[:-1]) for k, jt in d.items()}
    raise InvalidInputError(
        f"expected a KeyedJaggedTensor or a mapping name -> (values, offsets), got {type(features).__name__}"
    )


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
        if not lookups:
            raise InvalidInputError("no embank Embedding/EmbeddingBag module found")
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
        self._late: list[list[tuple[_Pending, tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]]]] = []

    def step(self) -> int:
        """One ``push_grad`` per table of everything gathered since the last step (or,
        with a delay, since the step ``delay`` steps ago); returns how many keys were pushed."""
        if self.distributed:
            return self._step_distributed()
        gathered = [(p, got) for p in self._pending if (got := p.take()) is not None]
        self._late.append(gathered)
        n = 0
        while len(self._late) > self.delay:
            n += self._push(self._late.pop(0))
        return n

    def _step_distributed(self) -> int:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        mine = [p.take() for p in self._pending]
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        n = 0
        for i, p in enumerate(self._pending):
            parts = [r[i] for r in every if r[i] is not None]
            if not parts:
                continue
            keys = np.concatenate([k for k, _ in parts])
            grads = np.concatenate([g for _, g in parts]) / np.float32(world)
            own = (keys % np.uint64(world)) == np.uint64(rank)
            if own.any():
                p.source.push_grad(keys[own], np.ascontiguousarray(grads[own]))
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
    def _push(gathered: list[tuple[_Pending, tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]]]) -> int:
        n = 0
        for p, (keys, grads) in gathered:
            p.source.push_grad(keys, grads)
            n += len(keys)
        return n

    def zero_grad(self) -> None:
        """Drops gradients gathered since the last step (not the delayed ones)."""
        for p in self._pending:
            p.clear()

    @property
    def tables(self) -> list[str]:
        return [_table_of(p.source).name for p in self._pending]


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


def lookahead(
    batches: Iterable[B], keys_of: Callable[[B], Mapping[Table, npt.ArrayLike | torch.Tensor]]
) -> Iterator[B]:
    """Yields ``batches`` one behind: while batch *i* trains, the rows of batch *i+1* are
    already being loaded by the store (``Table.lookahead``: the maintenance thread reads
    them into the row cache, the caller never waits).

    ``keys_of(batch)`` returns ``table -> keys`` of that batch.
    """
    it = iter(batches)
    try:
        current = next(it)
    except StopIteration:
        return
    _hint(keys_of(current))
    for nxt in it:
        _hint(keys_of(nxt))
        yield current
        current = nxt
    yield current


def _hint(keys: Mapping[Table, npt.ArrayLike | torch.Tensor]) -> None:
    for table, k in keys.items():
        if isinstance(k, torch.Tensor):
            k = _to_keys(k, "lookahead keys")
        table.lookahead(np.unique(np.asarray(k, dtype=np.uint64)))
