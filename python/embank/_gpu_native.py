"""The GPU cache's native path (``kernels="native"``, the default on CUDA): the cache is one
``_native.GpuTable`` of crates/embank-gpu, and a lookup is one call into it, which
launches the CUDA kernels of ``crates/embank-gpu/kernels/cache.cu`` on the caller's
stream (on the CPU: their emulator, in a test build)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import _native
from ._table import Table
from .errors import InvalidInputError


def _stream_getter(device: torch.device) -> Any:
    """A function returning the handle of ``device``'s current stream (0 on the CPU):
    PyTorch's raw getter where it has one (no Stream object made: ~0.3 us, not ~3)."""
    if device.type != "cuda":
        return lambda: 0
    index = device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(device).cuda_stream


class _NativeCache:
    """The native path of :class:`embank.gpu.GpuCache` (its state: made in its
    constructor)."""

    device: torch.device
    dim: int
    dtype: torch.dtype
    slots: int
    n_buckets: int
    policy: str
    _policy: int
    insert_mode: str
    threshold: float
    kernels: str
    _window_len: int
    _n: Any

    if TYPE_CHECKING:

        def _device_ids(self, ids: torch.Tensor) -> torch.Tensor: ...  # GpuCache's (ids checked)

    def _init_native(self, table: Table, default_values: torch.Tensor, stored_rows: bool) -> None:
        """The cache as one native object: every lookup is one call into Rust, which
        launches the CUDA kernels of crates/embank-gpu/kernels/cache.cu itself (on the CPU:
        their emulator, in a test build)."""
        ordinal = self.device.index if self.device.type == "cuda" else -1
        if self.device.type == "cuda":
            torch.cuda.init()  # type: ignore[no-untyped-call]  # the primary context the native path shares with PyTorch
        self._stream_of = _stream_getter(self.device)
        self._n = _native.GpuTable(
            table._t,
            ordinal,
            self.n_buckets,
            self.slots,
            str(self.dtype).replace("torch.", ""),
            self.policy,
            self.insert_mode,
            self.threshold,
            self._window_len,
            [float(v) for v in default_values.tolist()],
            stored_rows,
            table._store,
        )
        self._insert_sent = self.insert_mode

    def _native_prelude(self, scores: torch.Tensor | None, n: int, shape: Any) -> tuple[int, Any]:
        """The scores' address (custom policy; the tensor is returned to keep it alive)
        and the insert mode sent to the native object if it changed."""
        given, keep = 0, None
        if self._policy == 2:
            if scores is None:
                raise InvalidInputError('policy="custom" needs the scores of the ids')
            keep = scores.reshape(-1).to(self.device, torch.int64).contiguous()
            if len(keep) != n:
                raise InvalidInputError(f"scores must have the shape of ids, got {scores.shape} for {shape}")
            if len(keep) and int(keep.min()) < 0:
                raise InvalidInputError("scores must be >= 0")
            given = keep.data_ptr()
        if self.insert_mode != self._insert_sent:  # the attribute is the switch, as for the other kernels
            if self.insert_mode not in ("sync", "async", "auto"):
                raise InvalidInputError(f'insert must be "sync", "async" or "auto", got {self.insert_mode!r}')
            self._n.set_insert(self.insert_mode)
            self._insert_sent = self.insert_mode
        return given, keep

    def _lookup_native(self, ids: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        # The common case (int64 ids on the cache's device, no scores) without a PyTorch
        # call but the output's allocation: this is the host's whole share of a lookup.
        if (
            type(ids) is torch.Tensor
            and ids.dtype is torch.int64
            and ids.device == self.device
            and ids.is_contiguous()
            and scores is None
            and self._policy != 2
            and self.insert_mode == self._insert_sent
        ):
            n = ids.numel()
            out = torch.empty((n, self.dim), dtype=torch.float32, device=self.device)
            self._n.lookup(ids.data_ptr(), n, out.data_ptr(), self._stream_of(), 0)
            return out if ids.dim() == 1 else out.view(*ids.shape, self.dim)
        flat = self._device_ids(ids)
        n = flat.numel()
        given, _keep = self._native_prelude(scores, n, ids.shape)
        out = torch.empty((n, self.dim), dtype=torch.float32, device=self.device)
        self._n.lookup(flat.data_ptr(), n, out.data_ptr(), self._stream_of(), given)
        return out.reshape(*ids.shape, self.dim)

    def _stats_native(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self._n.stats())
        total = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / total if total else None
        secs = s["refresh_seconds"]
        s["refresh_gb_per_s"] = s["refresh_bytes"] / secs / 1e9 if secs else None
        s["slots"] = self.slots
        s["device"], s["kernels"], s["insert"], s["policy"] = (
            str(self.device),
            self.kernels,
            self.insert_mode,
            self.policy,
        )
        s["dtype"] = str(self.dtype).replace("torch.", "")
        return s
