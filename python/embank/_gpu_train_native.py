"""``TrainCache(kernels="native")``: a step's finds, placements and updates are native calls
(``_native.TrainKernels``, crates/embank-gpu/src/train.rs) launching the CUDA kernels of
``crates/embank-gpu/kernels/train.cuh`` over the cache's own tensors, on the caller's
stream (on the CPU: their emulator, in a test build). What was some forty PyTorch
operations a pull with misses is two calls (find, place) and a table read; an update is
one launch. The slots chosen are the PyTorch path's, and every update is the store's bit
for bit (the kernels round each operation as the host does)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _native
from ._gpu_native import _stream_getter
from .errors import InvalidInputError

if TYPE_CHECKING:
    from ._gpu_train import TrainCache

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl")


def usable(device: torch.device) -> bool:
    """True where the native kernels run: CUDA, or the CPU in a build with the emulator."""
    return device.type == "cuda" or (device.type == "cpu" and _native.gpu_emulator())


def attach(cache: TrainCache) -> None:
    """Makes ``cache``'s native kernels over its tensors (called once they exist)."""
    dev = cache.device
    if not usable(dev):
        raise InvalidInputError(
            'kernels="native" runs on CUDA (or on the CPU in a build with the gpu-emulator feature); '
            f"this cache is on {dev}"
        )
    if cache._opt["kind"] not in KINDS:
        raise InvalidInputError(
            f'kernels="native" applies {", ".join(KINDS)}; optimizer {cache._opt["kind"]!r} needs '
            'kernels="torch" or "triton"'
        )
    ordinal = -1
    if dev.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]  # the primary context, shared with PyTorch
        ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
    cache._stream_of = _stream_getter(dev)
    cache._nk = _native.TrainKernels(
        ordinal,
        cache.keys.data_ptr(),
        cache.used.data_ptr(),
        cache.records.data_ptr(),
        cache.dirty.data_ptr(),
        cache.n_buckets,
        cache.slots,
        cache.width,
        cache.dim,
    )


def resident(
    cache: TrainCache, uniq: torch.Tensor, rows: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``TrainCache._resident`` natively: the slots of ``uniq`` (unique int64 ids), misses
    read from the table and placed where their buckets have room; with ``rows`` (n x dim
    float32), every id's row written there too."""
    if uniq.dtype != torch.int64 or uniq.device != cache.device:
        raise InvalidInputError(
            f"pull_unique takes unique int64 ids on {cache.device}, got {uniq.dtype} on {uniq.device}"
        )
    n = uniq.numel()
    clock = cache._clock
    cache._clock += 1
    u = uniq.contiguous()
    slot = torch.empty(n, dtype=torch.int64, device=cache.device)
    out = rows.data_ptr() if rows is not None else 0
    stream = cache._stream_of()
    keys, at = cache._nk.find(u.data_ptr(), n, slot.data_ptr(), out, clock, stream)
    m = int(keys.size)
    cache._stats["hits"] += n - m
    if not m:
        return slot, None
    cache._stats["misses"] += m
    records = cache._fetch_np(keys)
    cache._placed += 1
    evicted, dirty_keys, dirty_records, unplaced = cache._nk.place(
        keys, at, records, slot.data_ptr(), out, clock, stream
    )
    cache._stats["evicted"] += int(evicted)
    if dirty_keys.size:
        cache._write_back_np(dirty_keys, dirty_records)
    if not unplaced.size:
        return slot, None
    cache._stats["overflow"] += int(unplaced.size)
    spill_keys = torch.from_numpy(keys[unplaced].astype(np.int64)).to(cache.device)
    return slot, (spill_keys, torch.from_numpy(np.ascontiguousarray(records[unplaced])).to(cache.device))


def _given(cache: TrainCache, what: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Refuses a tensor whose address the kernels could not read as ``dtype`` x ``shape``."""
    if t.dtype != dtype or t.device != cache.device or tuple(t.shape) != shape:
        raise InvalidInputError(
            f"{what}: {dtype} {shape} on {cache.device} wanted, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def find(cache: TrainCache, uniq: torch.Tensor) -> torch.Tensor:
    """The slots of ``uniq`` in the cache (-1 where absent): nothing placed, nothing
    touched."""
    _given(cache, "ids", uniq, torch.int64, (uniq.numel(),))
    u = uniq.contiguous()
    slot = torch.empty(u.numel(), dtype=torch.int64, device=cache.device)
    cache._nk.find(u.data_ptr(), u.numel(), slot.data_ptr(), 0, 0, cache._stream_of())
    return slot


def update(cache: TrainCache, slot: torch.Tensor, grads: torch.Tensor) -> None:
    """The table's optimizer on the rows at ``slot`` (int64, < 0 skipped) with ``grads``
    (one row each), in one launch; marked dirty when the cache writes back."""
    _given(cache, "slots", slot, torch.int64, (slot.numel(),))
    _given(cache, "grads", grads, torch.float32, (slot.numel(), cache.dim))
    o = cache._opt
    s = slot.contiguous()
    g = grads.contiguous()
    cache._nk.update(
        s.data_ptr(),
        g.data_ptr(),
        s.numel(),
        str(o["kind"]),
        float(o["lr"]),
        eps=float(o.get("eps", 0.0)),
        beta1=float(o.get("beta1", 0.0)),
        beta2=float(o.get("beta2", 0.0)),
        weight_decay=float(o.get("weight_decay", 0.0)),
        l1=float(o.get("l1", 0.0)),
        l2=float(o.get("l2", 0.0)),
        beta=float(o.get("beta", 0.0)),
        mark_dirty=cache.write == "back",
        stream=cache._stream_of(),
    )
