"""Host-device transfers of the modules of :mod:`embank.torch`: a module's rows are pulled,
pooled and updated on the host, and only its outputs go up to the device (and their
gradient down), through pinned memory and a copy stream a device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


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


def sum_rows(inverse: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    """``g``'s rows summed by ``inverse`` into ``n`` rows, the same bits every run. On
    the CPU each row's duplicates are added in their order (the store's order of float
    operations). On CUDA ``index_add_`` adds by atomics in whatever order they land (its
    last bits vary from run to run, and so would a cache's rows); ``index_put_`` with
    ``accumulate=True`` sorts the indices and adds each one's rows in turn instead."""
    out = torch.zeros((n, g.shape[1]), dtype=g.dtype, device=g.device)
    if g.device.type == "cuda":
        return out.index_put_((inverse,), g, accumulate=True)
    return out.index_add_(0, inverse, g)


def gather_rows(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows[inverse]``, whose gradient sums each row's repeats as :func:`sum_rows` does:
    on CUDA ``F.embedding``'s backward adds them by atomics (its last bits vary from run
    to run) where indexing's sorts them (``index_put_(accumulate=True)``); on the CPU
    ``F.embedding``'s adds them in their order, the store's."""
    return rows[inverse] if rows.is_cuda else torch.nn.functional.embedding(inverse, rows)


class StreamFollower:
    """Orders one object's calls across CUDA streams: a call on another stream than the
    last call's makes its stream wait (on the device) for the last one first. For an
    object that launches work it does not wait for (a TrainCache's update), so that a call
    on another stream (a look-ahead's, another thread's) never races it. The tensors the
    object holds from one call to a later one (``kept()``) are recorded on the new stream
    too, so the caching allocator does not hand their memory to another allocation on
    the stream they were made on while the new stream may still read them. A no-op off
    CUDA."""

    def __init__(self, device: torch.device, kept: Callable[[], list[torch.Tensor]] = list) -> None:
        self.device = device
        self.kept = kept
        self.last: Any = None

    def follow(self) -> None:
        if self.device.type != "cuda":
            return
        cur = torch.cuda.current_stream(self.device)
        if self.last is not None and self.last != cur:
            cur.wait_stream(self.last)
            for t in self.kept():
                self.record(t, cur)
        self.last = cur

    @staticmethod
    def record(t: torch.Tensor, stream: Any) -> None:
        if t.is_cuda:  # a caller's tensor may live on the host
            t.record_stream(stream)


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
