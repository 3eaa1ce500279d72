# mypy: disable-error-code="misc, no-untyped-def, import-untyped"
"""Triton kernels of the GPU cache (:mod:`embank.gpu`): find-and-gather, and the two
launches of an insert (choose a slot, then write it). They do exactly what the
pure-PyTorch operations in :mod:`embank.gpu` do, which are their reference and the CPU
path; with ``TRITON_INTERPRET=1`` they run on the CPU (the tests do).

Layout (set-associative, as HugeCTR's HPS slab sets and HierarchicalKV's buckets): a
bucket of ``S`` slots holds keys (int64; -1 is an empty slot), one-byte digests,
scores (the LRU clock of the last use, or an LFU count; -1 when empty) and, at row
``bucket * S + slot`` of ``values``, the row. A key's bucket and digest come from one
64-bit mix of the key (:func:`embank.gpu.key_hash`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _mix(key: Any) -> Any:
    # splitmix64's finalizer in int64 arithmetic (shifts masked to be logical).
    h = key ^ ((key >> 30) & 0x3FFFFFFFF)
    h = h * -4658895280553007687  # 0xBF58476D1CE4E5B9
    h = h ^ ((h >> 27) & 0x1FFFFFFFFF)
    h = h * -7723592293110705685  # 0x94D049BB133111EB
    h = h ^ ((h >> 31) & 0x1FFFFFFFF)
    return h


@triton.jit
def _find_gather(
    ids_ptr,
    keys_ptr,
    digests_ptr,
    scores_ptr,
    values_ptr,
    out_ptr,
    slot_out_ptr,
    n_buckets,
    clock,
    DIM: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    S: tl.constexpr,
    TOUCH: tl.constexpr,
    LFU: tl.constexpr,
    GATHER: tl.constexpr,
) -> None:
    """One key per program: digest compare, key compare, gather the row into ``out``
    (float32), the flat slot (or -1) into ``slot_out``; a hit's score is touched."""
    pid = tl.program_id(0)
    key = tl.load(ids_ptr + pid)
    h = _mix(key)
    bucket = (h & 0x7FFFFFFFFFFFFFFF) % n_buckets
    digest = ((h >> 56) & 0xFF).to(tl.uint8)
    offs = tl.arange(0, S)
    base = bucket * S
    d = tl.load(digests_ptr + base + offs)
    k = tl.load(keys_ptr + base + offs)
    match = (d == digest) & (k == key)
    slot = tl.min(tl.where(match, offs, S), axis=0)
    found = slot < S
    flat = tl.where(found, base + slot, -1)
    tl.store(slot_out_ptr + pid, flat)
    if TOUCH:
        if LFU:
            old = tl.load(scores_ptr + flat, mask=found, other=0)
            tl.store(scores_ptr + flat, old + 1, mask=found)
        else:
            tl.store(scores_ptr + flat, clock, mask=found)
    if GATHER:
        cols = tl.arange(0, DIM_BLOCK)
        cm = cols < DIM
        row = tl.load(values_ptr + flat * DIM + cols, mask=cm & found, other=0.0)
        tl.store(out_ptr + pid * DIM + cols, row.to(tl.float32), mask=cm)


@triton.jit
def _choose(
    ids_ptr,
    rank_ptr,
    scores_ptr,
    slot_out_ptr,
    n_buckets,
    S: tl.constexpr,
) -> None:
    """A new key's slot: the ``rank``-th of its bucket's slots ordered by score (empty
    slots first, ties by slot), read before any of the batch's writes."""
    pid = tl.program_id(0)
    key = tl.load(ids_ptr + pid)
    rank = tl.load(rank_ptr + pid)
    h = _mix(key)
    bucket = (h & 0x7FFFFFFFFFFFFFFF) % n_buckets
    offs = tl.arange(0, S)
    sc = tl.load(scores_ptr + bucket * S + offs)
    packed = tl.sort((sc + 1) * S + offs)
    pick = tl.sum(tl.where(offs == rank, packed, 0), axis=0)
    tl.store(slot_out_ptr + pid, bucket * S + pick % S)


@triton.jit
def _write(
    ids_ptr,
    rows_ptr,
    slot_ptr,
    keys_ptr,
    digests_ptr,
    scores_ptr,
    values_ptr,
    clock,
    DIM: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
) -> None:
    """Writes a chosen slot: key, digest, score, row (cast to the cache's type)."""
    pid = tl.program_id(0)
    key = tl.load(ids_ptr + pid)
    flat = tl.load(slot_ptr + pid)
    h = _mix(key)
    tl.store(keys_ptr + flat, key)
    tl.store(digests_ptr + flat, ((h >> 56) & 0xFF).to(tl.uint8))
    tl.store(scores_ptr + flat, clock)
    cols = tl.arange(0, DIM_BLOCK)
    cm = cols < DIM
    row = tl.load(rows_ptr + pid * DIM + cols, mask=cm, other=0.0)
    tl.store(values_ptr + flat * DIM + cols, row.to(values_ptr.dtype.element_ty), mask=cm)


def find_gather(
    ids: torch.Tensor,
    keys: torch.Tensor,
    digests: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor,
    clock: int,
    *,
    touch: bool,
    lfu: bool,
    gather: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_buckets, s = keys.shape
    dim = values.shape[1]
    out = torch.empty((len(ids), dim if gather else 1), dtype=torch.float32, device=ids.device)
    slots = torch.empty(len(ids), dtype=torch.int64, device=ids.device)
    if len(ids):
        _find_gather[(len(ids),)](
            ids, keys, digests, scores, values, out, slots, n_buckets, clock,
            DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim), S=s, TOUCH=touch, LFU=lfu, GATHER=gather,
        )  # fmt: skip
    return out, slots


def choose(ids: torch.Tensor, rank: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    n_buckets, s = scores.shape
    slots = torch.empty(len(ids), dtype=torch.int64, device=ids.device)
    if len(ids):
        _choose[(len(ids),)](ids, rank, scores, slots, n_buckets, S=s)
    return slots


def write(
    ids: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    digests: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor,
    clock: int,
) -> None:
    dim = values.shape[1]
    if len(ids):
        _write[(len(ids),)](
            ids, rows, slots, keys, digests, scores, values, clock,
            DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
