"""What the modules of :mod:`embank.torch` stand on: ids to keys, the host-device
transfers, reading keyed jagged input, and the two functions that are not modules
(:func:`checkpoint`, :func:`lookahead`)."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar, Union

import numpy as np
import numpy.typing as npt
import torch

from ._table import Table, Worker
from .errors import EmbankError, InvalidInputError

B = TypeVar("B")
Source = Union[Table, Worker]
Jagged = Mapping[str, Sequence[Any]]

if TYPE_CHECKING:
    from .torch import SparseOptimizer


def _to_keys(ids: torch.Tensor, what: str) -> npt.NDArray[np.uint64]:
    a = _ids64(ids, what)
    if a.size and a.min() < 0:
        raise InvalidInputError(f"{what} holds a negative id ({int(a.min())}); embank keys are >= 0")
    return a.astype(np.uint64)


class _Transfer:
    """Copies between the host and one CUDA device, through pinned memory.

    ``upload`` (forward): the host tensor is copied into pinned memory, then to the
    device on the copy stream; the caller's stream waits for the copy's event, the host
    does not. ``download`` (backward): the device tensor is copied into pinned memory on
    the caller's stream, after the kernels that made it, and the host waits for that
    copy's event (the gradient is needed on the host at once, so a second stream would
    gain nothing). Pinned memory comes from torch's caching host allocator: reused
    across calls, and a block is not handed out again before the copy that reads it has
    finished (a ``non_blocking`` copy records an event for its block)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"  # the tests drive this class on the CPU
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=self.pinned)
        staged.copy_(host)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = staged.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self.stream)
        compute.wait_event(copied)
        out.record_stream(compute)  # allocated on the copy stream, used (and freed) on the caller's
        return out

    def download(self, device_tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=self.pinned)
        host.copy_(device_tensor, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(torch.cuda.current_stream(self.device))
        copied.synchronize()
        return host


@functools.cache
def _cuda_transfer(device: torch.device) -> _Transfer:
    return _Transfer(device)  # one copy stream a device, shared by every module


def _transfer_for(device: torch.device) -> _Transfer | None:
    """The pinned, stream-ordered copies to ``device``; None for the CPU and for devices
    other than CUDA (plain copies). The tests replace it to drive the CUDA code on the CPU."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_transfer(torch.device("cuda", index))


class _ToDevice(torch.autograd.Function):
    """A host tensor uploaded to a device; its gradient downloaded in backward."""

    @staticmethod
    def forward(ctx: Any, host: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
        ctx.transfer = transfer
        return transfer.upload(host)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.transfer.download(grad), None


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, differentiable (the gradient comes back to the host)."""
    transfer = _transfer_for(device)
    if transfer is None:
        return host.to(device)  # the CPU: the same tensor
    out: torch.Tensor = _ToDevice.apply(host, transfer)
    return out


def _np(t: Any, dtype: torch.dtype) -> Any:
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", dtype).numpy()
    return np.asarray(t)


def _ids64(t: Any, what: str) -> npt.NDArray[np.int64]:
    if isinstance(t, torch.Tensor) and t.dtype not in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.uint8,
        torch.int8,
    ):
        raise InvalidInputError(f"{what} must be an integer tensor, got {t.dtype}")
    a = _np(t, torch.int64)
    if a.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must be integers, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _kjt_inputs(
    kjt: Any, names: list[str]
) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]], list[torch.Tensor | None]] | None:
    """Every feature's ``(values, offsets, weights)`` straight from a TorchRec
    ``KeyedJaggedTensor``'s flat values and offsets (no per-feature tensors; the weights
    are slices of the KJT's own, so their gradient reaches it); None for anything else
    (or a KJT whose features have batches of different sizes)."""
    if not (hasattr(kjt, "length_per_key") and hasattr(kjt, "offsets") and hasattr(kjt, "stride")):
        return None
    if getattr(kjt, "variable_stride_per_key", lambda: False)():
        return None
    position = {k: i for i, k in enumerate(kjt.keys())}
    missing = [n for n in names if n not in position]
    if missing:
        raise InvalidInputError(f"features missing from the input: {missing}")
    stride = int(kjt.stride())
    values = _ids64(kjt.values(), "values of the KeyedJaggedTensor")
    offsets = _ids64(kjt.offsets(), "offsets of the KeyedJaggedTensor")
    w = kjt.weights_or_none()
    out_v: list[npt.NDArray[np.int64]] = []
    out_o: list[npt.NDArray[np.int64]] = []
    out_w: list[torch.Tensor | None] = []
    for name in names:
        f = position[name]
        o = offsets[f * stride : (f + 1) * stride + 1]
        lo, hi = int(o[0]), int(o[-1])
        out_v.append(values[lo:hi])
        out_o.append(o[:-1] - lo)
        out_w.append(None if w is None else w[lo:hi])
    return out_v, out_o, out_w


def _as_jagged(features: Any) -> Jagged:
    if isinstance(features, Mapping):
        return features
    # TorchRec's KeyedJaggedTensor, without importing torchrec.
    if hasattr(features, "to_dict") and hasattr(features, "keys"):
        d = features.to_dict()
        return {k: (jt.values(), jt.offsets()[:-1], jt.weights_or_none()) for k, jt in d.items()}
    raise InvalidInputError(
        f"expected a KeyedJaggedTensor or a mapping name -> (values, offsets), got {type(features).__name__}"
    )


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
    batches: Iterable[B], keys_of: Callable[[B], Mapping[Table, npt.ArrayLike | torch.Tensor] | None]
) -> Iterator[B]:
    """Yields ``batches`` one behind: while batch *i* trains, the rows of batch *i+1* are
    already being loaded by the store (``Table.lookahead``: the maintenance thread reads
    them into the row cache, the caller never waits).

    ``keys_of(batch)`` returns ``table -> keys`` of that batch (or starts the reads
    itself and returns None, as :meth:`EmbeddingBagCollection.prefetch` does).
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


def _hint(keys: Mapping[Table, npt.ArrayLike | torch.Tensor] | None) -> None:
    if keys is None:  # keys_of hinted itself (EmbeddingBagCollection.prefetch)
        return
    for table, k in keys.items():
        if isinstance(k, torch.Tensor):
            k = _to_keys(k, "lookahead keys")
        table.lookahead(np.unique(np.asarray(k, dtype=np.uint64)))


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
