"""Host-device copies of the GPU cache's Python path: pinned staging buffers reused across
calls, ids and rows up to the device (a compact table's stored rows decoded there) and
ids down."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._table import Table
from .errors import InvalidInputError


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


class _Transfers:
    """The copies of :class:`embank.gpu.GpuCache`'s Python path (its state: made in its
    constructor)."""

    table: Table
    device: torch.device
    dim: int
    kernels: str
    _stored: str | None
    _side: Any
    _lock: threading.RLock
    _staging: list[_Staging]

    def _take_staging(self) -> _Staging:
        with self._lock:
            return self._staging.pop() if self._staging else _Staging(self.device)

    def _give_staging(self, staging: _Staging) -> None:
        with self._lock:
            self._staging.append(staging)

    def _fetch(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
        """Rows of ``keys`` (int64 bits of u64) from the table, for :meth:`_to_device`:
        float32 rows, or the table's stored rows (uint8) where the cache decodes them."""
        if self._stored is not None:
            return self.table.lookup_stored(keys.view(np.uint64))
        return self.table.lookup(keys.view(np.uint64))

    def _to_device(
        self, staging: _Staging, ids: npt.NDArray[np.int64], rows: npt.NDArray[Any] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ids`` (and ``rows``: float32, or stored rows from :meth:`_fetch`, decoded on the
        device into float32) to the device through ``staging``'s buffers, on the current
        stream, without waiting for the copy."""
        staging.ready()
        hid = staging.ids_of(len(ids))
        hid.numpy()[:] = ids
        dev_ids = hid.to(self.device, non_blocking=True)
        dev_rows = None
        if rows is not None and rows.dtype == np.uint8:
            hb = staging.bytes_of(rows.size)
            hb.numpy()[:] = rows.reshape(-1)
            dev_bytes = hb.to(self.device, non_blocking=True)
            assert self._stored is not None
            dev_rows = decode_rows(dev_bytes, self._stored, self.dim, self.kernels)  # a new tensor
        elif rows is not None:
            hr = staging.rows_of(rows.size)
            hr.numpy()[:] = rows.reshape(-1)
            dev_rows = hr.to(self.device, non_blocking=True).view(-1, self.dim)
            if self._side is None:
                dev_rows = dev_rows.clone()
        if self._side is not None:
            staging.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            staging.copied.record(torch.cuda.current_stream(self.device))
        else:
            dev_ids = dev_ids.clone()
        return dev_ids, dev_rows

    def _to_host(self, staging: _Staging, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``t`` (int64) into ``staging``'s host buffer, and the event to wait on (outside the
        lock) before reading it (None on the CPU: nothing to wait for)."""
        staging.ready()
        h = staging.ids_of(len(t))
        h.copy_(t, non_blocking=True)
        if self._side is None:
            return h, None
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(self.device))
        return h, done
