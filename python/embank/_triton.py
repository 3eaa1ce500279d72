# mypy: disable-error-code="misc, no-untyped-def, import-untyped"
"""Triton kernels of the GPU cache (:mod:`embank.gpu`). Each does exactly what its
pure-PyTorch counterpart in :mod:`embank.gpu` does (the reference and the CPU path);
with ``TRITON_INTERPRET=1`` they run on the CPU, which is how the CPU tests check them.
``tests/python/test_gpu_aot.py`` compiles every variant ahead of time for sm_80 and
sm_90 (:func:`aot_variants`), so a kernel that does not compile fails on the CPU too.

Layout, after HierarchicalKV's buckets: ``S`` slots a bucket (128 by default) holding
keys (int64: the bits of the u64 key; ``EMPTY`` and ``LOCKED`` are reserved), one-byte
digests, scores (int64; -1 when empty) and, at row ``bucket * S + slot`` of ``values``,
the row; and one version a bucket, bumped by every invalidation of a key hashing there.

- :func:`find` (``_find``): ``BLOCK`` keys a program; a key's ``S`` digests are compared
  first and its keys loaded only where a digest matches; the row is gathered with 64-bit
  offsets; a hit's score is touched (LRU: the clock; LFU: +1, atomically; custom: the
  larger of the two); the bucket's version is read for the caller's later insert; for a
  lookup, the misses are compacted in the same launch (one atomic a program reserves
  their places), so a lookup is this launch and one copy of the count and miss ids.
- :func:`choose` (``_choose``): the slot a new key takes: the ``rank``-th lowest-score
  slot of its bucket (empty slots first; ``rank`` numbers the batch's new keys of a
  bucket, so none takes a slot twice), or none when its score is below that slot's
  (refused, as HierarchicalKV refuses a key scoring below its full bucket's minimum),
  or when the bucket's version moved since the find.
- :func:`write` (``_write``): claims each chosen slot by compare-and-swap of the key it
  expects into ``LOCKED``, writes digest, score and row, then publishes the key; a lost
  claim or a moved version writes nothing. Refresh uses it with ``score=KEEP``.
- :func:`invalidate` (``_invalidate``): bumps the version of each key's bucket and
  empties its slot (claimed the same way).

No kernel recompiles as counters grow: sizes, clocks and versions are not specialized
(``do_not_specialize``). Launches go to the current stream of the tensors' device; the
caller (:class:`embank.gpu.GpuCache`) orders them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

EMPTY = -1  # u64::MAX: an empty slot
LOCKED = -2  # u64::MAX - 1: a slot being written
KEEP = -2  # a score argument meaning "leave the slot's score as it is"
LRU, LFU, CUSTOM = 0, 1, 2


@triton.jit
def _mix(key):
    # splitmix64's finalizer in int64 arithmetic (shifts masked to be logical).
    h = key ^ ((key >> 30) & 0x3FFFFFFFF)
    h = h * -4658895280553007687  # 0xBF58476D1CE4E5B9
    h = h ^ ((h >> 27) & 0x1FFFFFFFFF)
    h = h * -7723592293110705685  # 0x94D049BB133111EB
    h = h ^ ((h >> 31) & 0x1FFFFFFFF)
    return h


@triton.jit
def _to_row_type(row, values_ptr):
    # float32 rows to the cache's type, rounding to nearest even; bf16 by hand, as
    # Triton's interpreter truncates (rows are finite: the table refuses others).
    if values_ptr.dtype.element_ty == tl.bfloat16:
        bits = row.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return row.to(values_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["n", "n_buckets", "clock", "policy"])
def _find(
    ids_ptr,
    given_ptr,
    n,
    keys_ptr,
    digests_ptr,
    scores_ptr,
    versions_ptr,
    values_ptr,
    out_ptr,
    slot_out_ptr,
    version_out_ptr,
    payload_ptr,
    miss_at_ptr,
    n_buckets,
    clock,
    policy,
    dim,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    TOUCH: tl.constexpr,
    GATHER: tl.constexpr,
    COMPACT: tl.constexpr,
):
    """Rows (float32, zeros where absent) into ``out``, flat slots (``-1 - bucket``
    where absent) into ``slot_out`` (not with ``COMPACT``) and the versions of the misses' buckets
    into ``version_out`` (0 for a hit). ``COMPACT``: the
    misses are appended (in no fixed order) to ``payload`` (``[count, ids...]``, the
    count zeroed by the caller) and their places in the batch to ``miss_at``."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    key = tl.load(ids_ptr + i, mask=valid, other=-1)
    h = _mix(key)
    bucket = (h & 0x7FFFFFFFFFFFFFFF) % n_buckets
    digest = ((h >> 56) & 0xFF).to(tl.uint8)
    offs = tl.arange(0, S)
    at = bucket[:, None] * S + offs[None, :]
    d = tl.load(digests_ptr + at, mask=valid[:, None], other=0)
    dm = (d == digest[:, None]) & (valid & (key != -1) & (key != -2))[:, None]
    k = tl.load(keys_ptr + at, mask=dm, other=-1)  # keys read only where a digest matches
    match = dm & (k == key[:, None])
    slot = tl.min(tl.where(match, offs[None, :], S), axis=1)
    found = slot < S
    flat = tl.where(found, bucket * S + slot, -1)
    if not COMPACT:  # a lookup needs no slots: its misses are compacted below
        tl.store(slot_out_ptr + i, tl.where(found, flat, -1 - bucket), mask=valid)  # absent: its bucket
    # Versions matter for misses only (their insert checks them): hits read none.
    tl.store(version_out_ptr + i, tl.load(versions_ptr + bucket, mask=valid & ~found, other=0), mask=valid)
    if COMPACT:
        miss = (valid & ~found).to(tl.int64)
        base = tl.atomic_add(payload_ptr, tl.sum(miss, axis=0))  # one atomic a program
        at = base + tl.cumsum(miss, axis=0) - 1
        tl.store(payload_ptr + 1 + at, key, mask=miss != 0)
        tl.store(miss_at_ptr + at, i, mask=miss != 0)
    if TOUCH:
        hit = found & valid
        if policy == 0:
            tl.store(scores_ptr + flat, tl.zeros_like(flat) + clock, mask=hit)
        elif policy == 1:
            tl.atomic_add(scores_ptr + flat, tl.zeros_like(flat) + 1, mask=hit)
        else:
            given = tl.load(given_ptr + i, mask=hit, other=0)
            tl.atomic_max(scores_ptr + flat, given, mask=hit)
    if GATHER:
        cols = tl.arange(0, DIM_BLOCK)
        cm = cols < dim
        row = tl.load(
            values_ptr + flat[:, None] * dim + cols[None, :], mask=found[:, None] & cm[None, :], other=0.0
        )
        tl.store(
            out_ptr + i[:, None] * dim + cols[None, :], row.to(tl.float32), mask=valid[:, None] & cm[None, :]
        )


@triton.jit(do_not_specialize=["n", "n_buckets", "clock", "policy"])
def _choose(
    ids_ptr,
    present_ptr,
    rank_ptr,
    given_ptr,
    snap_ptr,
    n,
    keys_ptr,
    scores_ptr,
    versions_ptr,
    slot_out_ptr,
    expect_out_ptr,
    score_out_ptr,
    n_buckets,
    clock,
    policy,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The slot a new key is written to (-1: refused, present, reserved, or its bucket's
    version moved), the key that slot must hold for the claim to succeed, and the new
    key's score."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    key = tl.load(ids_ptr + i, mask=valid, other=-1)
    present = tl.load(present_ptr + i, mask=valid, other=-1)
    rank = tl.load(rank_ptr + i, mask=valid, other=S)
    given = tl.load(given_ptr + i, mask=valid, other=0)
    snap = tl.load(snap_ptr + i, mask=valid, other=0)
    h = _mix(key)
    bucket = (h & 0x7FFFFFFFFFFFFFFF) % n_buckets
    offs = tl.arange(0, S)
    sc = tl.load(scores_ptr + bucket[:, None] * S + offs[None, :], mask=valid[:, None], other=0)
    packed = tl.sort((sc + 1) * S + offs[None, :], dim=1)  # by score (empty: -1), ties by slot
    pick = tl.sum(tl.where(offs[None, :] == rank[:, None], packed, 0), axis=1)
    if policy == 0:
        new_score = tl.zeros_like(key) + clock
    elif policy == 1:
        new_score = tl.zeros_like(key) + 1
    else:
        new_score = given
    fresh = tl.load(versions_ptr + bucket, mask=valid, other=0) == snap
    usable = valid & fresh & (key != -1) & (key != -2) & (present < 0)
    admit = usable & (rank < S) & (new_score >= pick // S - 1)
    slot = tl.where(admit, bucket * S + pick % S, -1)
    expect = tl.load(keys_ptr + slot, mask=slot >= 0, other=-2)
    tl.store(slot_out_ptr + i, slot, mask=valid)
    tl.store(expect_out_ptr + i, expect, mask=valid)
    tl.store(score_out_ptr + i, new_score, mask=valid)


@triton.jit(do_not_specialize=["n"])
def _write(
    ids_ptr,
    rows_ptr,
    slot_ptr,
    expect_ptr,
    score_ptr,
    snap_ptr,
    n,
    keys_ptr,
    digests_ptr,
    scores_ptr,
    versions_ptr,
    values_ptr,
    done_ptr,
    dim,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    """Claims, writes and publishes each chosen slot. ``done``: 0 nothing written, else
    1 | 2 if the row differs from the one there | 4 if another key was evicted."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    flat = tl.load(slot_ptr + i, mask=valid, other=-1)
    want = valid & (flat >= 0)
    key = tl.load(ids_ptr + i, mask=want, other=-1)
    expect = tl.load(expect_ptr + i, mask=want, other=-2)
    snap = tl.load(snap_ptr + i, mask=want, other=0)
    want = want & (tl.load(versions_ptr + flat // S, mask=want, other=0) == snap) & (expect != -2)
    target = tl.where(want, flat, 0)
    locked = tl.zeros_like(key) - 2
    # A lane that must not claim compares against LOCKED and writes LOCKED: a no-op.
    seen = tl.atomic_cas(keys_ptr + target, tl.where(want, expect, locked), locked, sem="acquire")
    claimed = want & (seen == expect)
    h = _mix(key)
    tl.store(digests_ptr + flat, ((h >> 56) & 0xFF).to(tl.uint8), mask=claimed)
    score = tl.load(score_ptr + i, mask=claimed, other=-2)
    tl.store(scores_ptr + flat, score, mask=claimed & (score != -2))
    cols = tl.arange(0, DIM_BLOCK)
    cm = claimed[:, None] & (cols < dim)[None, :]
    dst = values_ptr + flat[:, None] * dim + cols[None, :]
    row = _to_row_type(tl.load(rows_ptr + i[:, None] * dim + cols[None, :], mask=cm, other=0.0), values_ptr)
    before = tl.load(dst, mask=cm, other=0.0)
    changed = tl.max(tl.where(cm & (before != row), 1, 0), axis=1)
    tl.store(dst, row, mask=cm)
    tl.debug_barrier()  # the program's row stores before the key is published
    tl.atomic_xchg(keys_ptr + flat, key, mask=claimed, sem="release")
    evicted = claimed & (expect != key) & (expect != -1)
    done = tl.where(claimed, 1 + 2 * changed + tl.where(evicted, 4, 0), 0)
    tl.store(done_ptr + i, done.to(tl.int64), mask=valid)


@triton.jit(do_not_specialize=["n", "n_buckets"])
def _invalidate(
    ids_ptr,
    n,
    keys_ptr,
    digests_ptr,
    scores_ptr,
    versions_ptr,
    done_ptr,
    n_buckets,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Bumps each key's bucket version and empties its slot; ``done``: 1 where emptied."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    key = tl.load(ids_ptr + i, mask=valid, other=-1)
    h = _mix(key)
    bucket = (h & 0x7FFFFFFFFFFFFFFF) % n_buckets
    digest = ((h >> 56) & 0xFF).to(tl.uint8)
    tl.atomic_add(versions_ptr + bucket, tl.zeros_like(bucket) + 1, mask=valid)
    offs = tl.arange(0, S)
    at = bucket[:, None] * S + offs[None, :]
    d = tl.load(digests_ptr + at, mask=valid[:, None], other=0)
    dm = (d == digest[:, None]) & (valid & (key != -1) & (key != -2))[:, None]
    k = tl.load(keys_ptr + at, mask=dm, other=-1)
    slot = tl.min(tl.where(dm & (k == key[:, None]), offs[None, :], S), axis=1)
    found = slot < S
    flat = tl.where(found, bucket * S + slot, 0)
    locked = tl.zeros_like(key) - 2
    seen = tl.atomic_cas(keys_ptr + flat, tl.where(found, key, locked), locked, sem="acquire")
    claimed = found & (seen == key)
    tl.store(digests_ptr + flat, tl.zeros_like(digest), mask=claimed)
    tl.store(scores_ptr + flat, tl.zeros_like(key) - 1, mask=claimed)
    tl.debug_barrier()
    tl.atomic_xchg(keys_ptr + flat, tl.zeros_like(key) - 1, mask=claimed, sem="release")
    tl.store(done_ptr + i, claimed.to(tl.int64), mask=valid)


@triton.jit(do_not_specialize=["n"])
def _decode_int8(rows_ptr, n, out_ptr, dim, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr):
    """Stored int8 rows (``dim`` bytes ``q``, then ``scale`` and ``bias`` as float32, little-
    endian, ``dim + 8`` bytes a row) into float32 rows: ``q * scale + bias``. Scale and
    bias are assembled from their bytes (a row's tail is 4-byte aligned only when ``dim``
    is); launched with fp fusion off, so the multiply and the add round apart, as the
    store decodes."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    rb = dim + 8
    cols = tl.arange(0, DIM_BLOCK)
    cm = valid[:, None] & (cols < dim)[None, :]
    q = tl.load(rows_ptr + i[:, None] * rb + cols[None, :], mask=cm, other=0).to(tl.float32)
    tail = rows_ptr + i * rb + dim
    scale_bits = tl.zeros_like(i).to(tl.int32)
    bias_bits = tl.zeros_like(i).to(tl.int32)
    for b in tl.static_range(4):
        scale_bits |= tl.load(tail + b, mask=valid, other=0).to(tl.int32) << (8 * b)
        bias_bits |= tl.load(tail + 4 + b, mask=valid, other=0).to(tl.int32) << (8 * b)
    scale = scale_bits.to(tl.float32, bitcast=True)
    bias = bias_bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + i[:, None] * dim + cols[None, :], q * scale[:, None] + bias[:, None], mask=cm)


# ---- launch helpers: shapes, blocks, launches on the tensors' device ----

# Compile options a kernel needs beyond the defaults (the ahead-of-time test passes them too).
COMPILE_OPTIONS: dict[str, dict[str, Any]] = {"_decode_int8": {"enable_fp_fusion": False}}

BLOCK_SMALL = 16  # keys a program for choose/invalidate (a [BLOCK, S] tile of scores)


def dim_block(dim: int) -> int:
    return int(triton.next_power_of_2(max(1, dim)))


def keys_per_program(dim: int) -> int:
    """Keys a find/write program handles: a [keys, DIM_BLOCK] row tile of at most 4 k
    elements, and at most 32 keys ([32, 128] digest tile)."""
    return max(1, min(32, 4096 // dim_block(dim)))


def _grid(n: int, block: int) -> tuple[int]:
    return (triton.cdiv(n, block),)


def find(
    ids: torch.Tensor,
    given: torch.Tensor,
    keys: torch.Tensor,
    digests: torch.Tensor,
    scores: torch.Tensor,
    versions: torch.Tensor,
    values: torch.Tensor,
    clock: int,
    policy: int,
    *,
    touch: bool,
    gather: bool,
    compact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``out``, ``slots``, ``versions`` and, with ``compact``, ``payload`` (the miss
    count, then the miss ids) and ``miss_at`` (their places); else empty tensors."""
    n_buckets, s = keys.shape
    dim = values.shape[1]
    n = len(ids)
    dev = ids.device
    out = torch.empty((n, dim if gather else 1), dtype=torch.float32, device=dev)
    # The int64 outputs in one allocation (each costs the host a few µs): a lookup
    # (compact) needs versions, payload and places; other finds slots and versions.
    if compact:
        buf = torch.empty(1 + 3 * n, dtype=torch.int64, device=dev)
        vers, payload, miss_at = buf[:n], buf[n : 2 * n + 1], buf[2 * n + 1 :]
        slots = buf[:0]
        payload[:1].zero_()
    else:
        buf = torch.empty(2 * n, dtype=torch.int64, device=dev)
        slots, vers = buf[:n], buf[n:]
        payload = miss_at = buf[:0]
    if n:
        block = keys_per_program(dim) if gather else 32
        with _on(dev):
            _find[_grid(n, block)](
                ids, given, n, keys, digests, scores, versions, values, out, vers if compact else slots, vers,
                payload if compact else slots, miss_at if compact else slots, n_buckets, clock, policy, dim,
                S=s, BLOCK=block, DIM_BLOCK=dim_block(dim) if gather else 1, TOUCH=touch, GATHER=gather,
                COMPACT=compact,
            )  # fmt: skip
    return out, slots, vers, payload, miss_at


def choose(
    ids: torch.Tensor,
    present: torch.Tensor,
    rank: torch.Tensor,
    given: torch.Tensor,
    snap: torch.Tensor,
    keys: torch.Tensor,
    scores: torch.Tensor,
    versions: torch.Tensor,
    clock: int,
    policy: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_buckets, s = keys.shape
    n = len(ids)
    slot, expect, score = (torch.empty(n, dtype=torch.int64, device=ids.device) for _ in range(3))
    if n:
        with _on(ids.device):
            _choose[_grid(n, BLOCK_SMALL)](
                ids, present, rank, given, snap, n, keys, scores, versions, slot, expect, score, n_buckets,
                clock, policy, S=s, BLOCK=BLOCK_SMALL,
            )  # fmt: skip
    return slot, expect, score


def write(
    ids: torch.Tensor,
    rows: torch.Tensor,
    slot: torch.Tensor,
    expect: torch.Tensor,
    score: torch.Tensor,
    snap: torch.Tensor,
    keys: torch.Tensor,
    digests: torch.Tensor,
    scores: torch.Tensor,
    versions: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    _, s = keys.shape
    dim = values.shape[1]
    n = len(ids)
    done = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n:
        block = keys_per_program(dim)
        with _on(ids.device):
            _write[_grid(n, block)](
                ids, rows, slot, expect, score, snap, n, keys, digests, scores, versions, values, done, dim,
                S=s, BLOCK=block, DIM_BLOCK=dim_block(dim),
            )  # fmt: skip
    return done


def invalidate(
    ids: torch.Tensor, keys: torch.Tensor, digests: torch.Tensor, scores: torch.Tensor, versions: torch.Tensor
) -> torch.Tensor:
    n_buckets, s = keys.shape
    n = len(ids)
    done = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n:
        with _on(ids.device):
            _invalidate[_grid(n, BLOCK_SMALL)](
                ids, n, keys, digests, scores, versions, done, n_buckets, S=s, BLOCK=BLOCK_SMALL
            )
    return done


def decode_int8(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """``rows`` (uint8, ``(n, dim + 8)``) decoded into a new ``(n, dim)`` float32 tensor."""
    n = rows.shape[0]
    out = torch.empty((n, dim), dtype=torch.float32, device=rows.device)
    if n:
        block = keys_per_program(dim)
        with _on(rows.device):
            _decode_int8[_grid(n, block)](
                rows, n, out, dim, BLOCK=block, DIM_BLOCK=dim_block(dim), **COMPILE_OPTIONS["_decode_int8"]
            )
    return out


class _on:
    """Launches on ``device`` (the cache's), not the current CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.ctx: Any = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# ---- every variant the cache launches, for the ahead-of-time compile test ----

_TORCH_TO_TRITON = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


def aot_variants(
    dtype: torch.dtype, dim: int, slots: int
) -> Iterator[tuple[Any, dict[str, str], dict[str, Any]]]:
    """``(kernel, signature, constexprs)`` of every launch a cache of ``dtype`` rows of
    ``dim`` values and ``slots`` slots a bucket makes (for ``triton.compile``)."""
    v = _TORCH_TO_TRITON[dtype]
    i64 = "*i64"
    db = dim_block(dim)
    kp = keys_per_program(dim)
    find_sig = {
        "ids_ptr": i64, "given_ptr": i64, "n": "i64", "keys_ptr": i64, "digests_ptr": "*u8",
        "scores_ptr": i64, "versions_ptr": i64, "values_ptr": v, "out_ptr": "*fp32", "slot_out_ptr": i64,
        "version_out_ptr": i64, "payload_ptr": i64, "miss_at_ptr": i64, "n_buckets": "i64", "clock": "i64",
        "policy": "i32", "dim": "i32",
    }  # fmt: skip
    find_consts = ("S", "BLOCK", "DIM_BLOCK", "TOUCH", "GATHER", "COMPACT")
    for touch, gather in ((True, True), (False, False)):  # a lookup's; an insert's, refresh's
        yield (
            _find,
            {**find_sig, **dict.fromkeys(find_consts, "constexpr")},
            {"S": slots, "BLOCK": kp if gather else 32, "DIM_BLOCK": db if gather else 1, "TOUCH": touch,
             "GATHER": gather, "COMPACT": gather},
        )  # fmt: skip
    yield (
        _choose,
        {
            **dict.fromkeys(("ids_ptr", "present_ptr", "rank_ptr", "given_ptr", "snap_ptr"), i64), "n": "i64",
            **dict.fromkeys(("keys_ptr", "scores_ptr", "versions_ptr", "slot_out_ptr", "expect_out_ptr",
                             "score_out_ptr"), i64),
            "n_buckets": "i64", "clock": "i64", "policy": "i32", "S": "constexpr", "BLOCK": "constexpr",
        },
        {"S": slots, "BLOCK": BLOCK_SMALL},
    )  # fmt: skip
    yield (
        _write,
        {
            "ids_ptr": i64, "rows_ptr": "*fp32", "slot_ptr": i64, "expect_ptr": i64, "score_ptr": i64,
            "snap_ptr": i64, "n": "i64", "keys_ptr": i64, "digests_ptr": "*u8", "scores_ptr": i64,
            "versions_ptr": i64, "values_ptr": v, "done_ptr": i64, "dim": "i32",
            "S": "constexpr", "BLOCK": "constexpr", "DIM_BLOCK": "constexpr",
        },
        {"S": slots, "BLOCK": kp, "DIM_BLOCK": db},
    )  # fmt: skip
    yield (
        _decode_int8,
        {"rows_ptr": "*u8", "n": "i64", "out_ptr": "*fp32", "dim": "i32", "BLOCK": "constexpr",
         "DIM_BLOCK": "constexpr"},
        {"BLOCK": kp, "DIM_BLOCK": db},
    )  # fmt: skip
    yield (
        _invalidate,
        {
            "ids_ptr": i64, "n": "i64", "keys_ptr": i64, "digests_ptr": "*u8", "scores_ptr": i64,
            "versions_ptr": i64, "done_ptr": i64, "n_buckets": "i64", "S": "constexpr", "BLOCK": "constexpr",
        },
        {"S": slots, "BLOCK": BLOCK_SMALL},
    )  # fmt: skip
