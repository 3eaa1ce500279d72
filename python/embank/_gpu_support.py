"""What :class:`embank.gpu.GpuCache` runs on: pinned staging buffers reused across
calls, the bounded queue of rows waiting for the background inserter, and the inserter's
loop."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from .errors import EmbankError, InvalidInputError

if TYPE_CHECKING:
    from .gpu import GpuCache

ASYNC_BATCH_KEYS_MAX = 1 << 16  # keys the background inserter takes at a time
# The inserter gathers the misses of a few lookups before it inserts: an insert costs the
# host about the same for 10 keys as for 10,000 (a dozen launches), and while it runs it
# holds the interpreter from the lookups (seen on an H100: a warmed cache inserting after
# every lookup doubled the lookups' p50).
ASYNC_GATHER_KEYS = 4096
ASYNC_GATHER_S = 0.005


_Keys = TypeVar("_Keys", torch.Tensor, "npt.NDArray[np.int64]")


def key_hash(keys: _Keys) -> _Keys:
    """splitmix64's finalizer of int64 keys, in int64 arithmetic (the Triton kernels mix
    the same way): the low bits pick the bucket, the top byte is the digest. A tensor or
    a numpy array (the same bits: both wrap on overflow, both shift arithmetically)."""
    h = keys ^ ((keys >> 30) & 0x3FFFFFFFF)
    h = h * -4658895280553007687
    h = h ^ ((h >> 27) & 0x1FFFFFFFFF)
    h = h * -7723592293110705685
    return h ^ ((h >> 31) & 0x1FFFFFFFF)


def _triton_usable(device: torch.device) -> bool:
    try:
        import triton  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _host_keys(keys: Any) -> npt.NDArray[np.int64]:
    """Keys given on the host (list, numpy, CPU tensor) as the int64 bits of u64 keys."""
    a = np.asarray(keys)
    if a.dtype.kind == "i" and a.size and a.min() < 0:
        raise InvalidInputError(f"keys hold a negative value ({int(a.min())}); embank keys are u64")
    if a.dtype.kind not in "iu" and a.size:
        raise InvalidInputError(f"keys must be integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a.astype(np.uint64).reshape(-1)).view(np.int64)


def decode_rows(stored: torch.Tensor, stored_dtype: str, dim: int, kernels: str = "torch") -> torch.Tensor:
    """Stored rows (uint8, ``n * row_bytes`` bytes as :meth:`embank.Table.lookup_stored`
    lays them out) decoded where they are, into an ``(n, dim)`` float32 tensor: exactly
    what :meth:`embank.Table.lookup` returns. ``"f16"``: a cast. ``"int8"``: ``q * scale +
    bias``, a float32 multiply then a float32 add (never fused into one rounding); with
    ``kernels="triton"`` in one launch, else in PyTorch."""
    flat = stored.reshape(-1)
    if stored_dtype == "f32":
        return flat.view(torch.float32).view(-1, dim).clone()
    if stored_dtype == "f16":
        return flat.view(torch.float16).view(-1, dim).float()
    if stored_dtype != "int8":
        raise InvalidInputError(f"stored dtype must be one of f32, f16, int8; got {stored_dtype!r}")
    rows = flat.view(-1, dim + 8)
    if kernels == "triton":
        from . import _triton

        return _triton.decode_int8(rows, dim)
    q = rows[:, :dim].float()
    tail = rows[:, dim:].contiguous().view(torch.float32)  # (n, 2): scale, bias
    return q.mul_(tail[:, 0:1]).add_(tail[:, 1:2])


class _Staging:
    """Host buffers (pinned on CUDA) reused across calls, grown on demand: ``ids`` (int64)
    for device-to-host and host-to-device ids, ``rows`` (float32) for rows to the device.
    ``copied`` is the event after the last host-to-device copy out of them: the host
    waits on it before writing into them again."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self.ids = torch.empty(0, dtype=torch.int64, pin_memory=self.pin)
        self.rows = torch.empty(0, dtype=torch.float32, pin_memory=self.pin)
        self.copied: Any = None

    def ready(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def ids_of(self, n: int) -> torch.Tensor:
        if len(self.ids) < n:
            self.ids = torch.empty(max(n, 2 * len(self.ids)), dtype=torch.int64, pin_memory=self.pin)
        return self.ids[:n]

    def bytes_of(self, n: int) -> torch.Tensor:
        """``n`` bytes (uint8) of the ``rows`` buffer, for stored rows to the device."""
        return self.rows_of((n + 3) // 4).view(torch.uint8)[:n]

    def rows_of(self, n: int) -> torch.Tensor:
        if len(self.rows) < n:
            self.rows = torch.empty(max(n, 2 * len(self.rows)), dtype=torch.float32, pin_memory=self.pin)
        return self.rows[:n]


class _AsyncQueue:
    """Keys waiting for a background insert: deduplicated, at most ``keys_max`` (the
    rest dropped and counted), and the first error of the inserter, kept until the
    cache's next call raises it. Holds no reference to the cache."""

    def __init__(self, keys_max: int) -> None:
        self.cond = threading.Condition()
        self.pending: dict[int, int] = {}  # key: score (the largest given; custom policy)
        self.keys_max = keys_max
        self.busy = 0
        self.dropped = 0
        self.errors = 0
        self.error: BaseException | None = None
        self.closed = False

    def put(self, keys: npt.NDArray[np.int64], scores: npt.NDArray[np.int64]) -> None:
        with self.cond:
            for k, score in zip(keys.tolist(), scores.tolist()):
                if k in self.pending:
                    self.pending[k] = max(score, self.pending[k])
                elif len(self.pending) >= self.keys_max:
                    self.dropped += 1
                else:
                    self.pending[k] = score
            self.cond.notify_all()

    def take(self, timeout: float) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """Up to ``ASYNC_BATCH_KEYS_MAX`` keys and their scores; none after ``timeout``;
        None once closed."""
        with self.cond:
            if not self.pending and not self.closed:
                self.cond.wait(timeout)
            deadline = time.monotonic() + ASYNC_GATHER_S
            while self.pending and len(self.pending) < ASYNC_GATHER_KEYS and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            if self.closed and not self.pending:
                return None
            take: list[int] = []
            for k in self.pending:
                take.append(k)
                if len(take) >= ASYNC_BATCH_KEYS_MAX:
                    break
            scores = [self.pending.pop(k) for k in take]
            self.busy += len(take)
            return np.array(take, dtype=np.int64), np.array(scores, dtype=np.int64)

    def done(self, n: int, error: BaseException | None) -> None:
        with self.cond:
            self.busy -= n
            if error is not None:
                self.errors += 1
                if self.error is None:
                    self.error = error
            self.cond.notify_all()

    def join(self) -> None:
        with self.cond:
            while self.pending or self.busy:
                self.cond.wait(0.1)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def raise_error(self) -> None:
        with self.cond:
            e, self.error = self.error, None
        if e is not None:
            raise EmbankError(f"a background insert of the GPU cache failed: {e!r}") from e


def _insert_loop(ref: weakref.ref[GpuCache], q: _AsyncQueue) -> None:
    """The background inserter. Holds the cache only while it inserts a batch, so a
    cache nobody else holds is collected (and this thread ends)."""
    while True:
        taken = q.take(0.2)
        if taken is None:
            return
        keys, scores = taken
        if not len(keys):
            if ref() is None:
                return
            continue
        error: BaseException | None = None
        cache = ref()
        try:
            if cache is None:
                return
            cache._fill(keys, scores)
        except BaseException as e:
            error = e
        finally:
            del cache
            q.done(len(keys), error)
