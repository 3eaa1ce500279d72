# mypy: disable-error-code="misc, no-untyped-def, import-untyped"
"""The Triton kernels of :class:`embank.gpu.TrainCache`: :func:`find` (each id's slot, a
hit's clock touched: one launch where the PyTorch path takes a dozen operations) and
:func:`update`, which applies the table's optimizer to the cached records of a step's
rows in place (``records[slot]``: ``dim`` row values, then the state), where the PyTorch
path takes a dozen operations and a gather and scatter of the records.

Element-wise kinds only (SGD, Adagrad, Adam, AdamW, FTRL): their operations are the
store's (``crates/embank-core/src/optim.rs``) one for one, square roots and divisions
rounded to nearest (``sqrt_rn``, ``div_rn``), compiled without fused multiply-adds
(``enable_fp_fusion=False``), so a row comes out bit for bit as the store's. Adam's
bias corrections (a ``powf`` a row) come computed by the caller. The row-wise and
table-step kinds, whose row sums the store adds in order, stay on the PyTorch path.
``TRITON_INTERPRET=1`` runs it on the CPU (the tests compare it with the PyTorch path);
``tests/python/test_gpu_aot.py`` compiles every variant for sm_80 and sm_90.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton import _on

SGD, ADAGRAD, ADAM, ADAMW, FTRL = 0, 1, 2, 3, 4
KINDS = {"sgd": SGD, "adagrad": ADAGRAD, "adam": ADAM, "adamw": ADAMW, "ftrl": FTRL}
COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _mix(key):
    # splitmix64's finalizer in int64 arithmetic (embank.gpu.key_hash; _triton._mix).
    h = key ^ ((key >> 30) & 0x3FFFFFFFF)
    h = h * -4658895280553007687
    h = h ^ ((h >> 27) & 0x1FFFFFFFFF)
    h = h * -7723592293110705685
    return h ^ ((h >> 31) & 0x1FFFFFFFF)


@triton.jit(do_not_specialize=["n", "n_buckets", "clock"])
def _find(
    ids_ptr, n, keys_ptr, used_ptr, slot_out_ptr, n_buckets, clock, S: tl.constexpr, S_BLOCK: tl.constexpr
):
    # One program an id: its bucket's S keys compared at once; a hit's slot is touched.
    i = tl.program_id(0)
    key = tl.load(ids_ptr + i)
    bucket = _mix(key) % n_buckets
    bucket = tl.where(bucket < 0, bucket + n_buckets, bucket)  # floored, as torch.remainder
    j = tl.arange(0, S_BLOCK)
    cand = tl.load(keys_ptr + bucket * S + j, mask=j < S, other=-1)
    at = tl.min(tl.where(cand == key, j, S_BLOCK), axis=0)
    found = at < S_BLOCK
    slot = tl.where(found, bucket * S + at, -1)
    tl.store(slot_out_ptr + i, slot)
    if found:
        tl.store(used_ptr + slot, clock)


def find(ids: torch.Tensor, keys: torch.Tensor, used: torch.Tensor, slots: int, clock: int) -> torch.Tensor:
    """Each id's slot in the cache (-1: not cached); the slots found get ``clock``."""
    n = ids.numel()
    out = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n:
        nb = keys.numel() // slots
        with _on(ids.device):  # Triton launches on the current device: the cache's
            _find[(n,)](ids.contiguous(), n, keys, used, out, nb, clock, S=slots, S_BLOCK=_pow2(slots))
    return out


def _pow2(x: int) -> int:
    return max(1, int(triton.next_power_of_2(x)))


@triton.jit(do_not_specialize=["n"])
def _update(
    records_ptr,
    slots_ptr,
    grads_ptr,
    bc_ptr,
    n,
    width,
    dim,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    decay,
    l1,
    l2,
    KIND: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    # One program a row: its record at records[slot], its gradient at grads[row].
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    d = tl.arange(0, DIM_BLOCK)
    mask = d < dim
    base = records_ptr + slot * width
    g = tl.load(grads_ptr + row.to(tl.int64) * dim + d, mask=mask, other=0.0)
    w = tl.load(base + d, mask=mask, other=0.0)
    if KIND == 0:  # SGD: w -= lr * g
        tl.store(base + d, w - lr * g, mask=mask)
    elif KIND == 1:  # Adagrad: s += g * g; w -= lr * g / (sqrt(s) + eps)
        s = tl.load(base + dim + d, mask=mask, other=0.0)
        s = s + g * g
        tl.store(base + dim + d, s, mask=mask)
        tl.store(base + d, w - tl.div_rn(lr * g, tl.sqrt_rn(s) + eps), mask=mask)
    elif KIND == 4:  # FTRL (z, then n)
        z = tl.load(base + dim + d, mask=mask, other=0.0)
        nn = tl.load(base + 2 * dim + d, mask=mask, other=0.0)
        n_new = nn + g * g
        sigma = tl.div_rn(tl.sqrt_rn(n_new) - tl.sqrt_rn(nn), lr)
        z = z + (g - sigma * w)
        sign = tl.where(z > 0, 1.0, tl.where(z < 0, -1.0, 0.0))
        # (beta1 carries FTRL's beta.)
        w_new = tl.div_rn(-(z - sign * l1), tl.div_rn(beta1 + tl.sqrt_rn(n_new), lr) + l2)
        w_new = tl.where(tl.abs(z) <= l1, 0.0, w_new)
        tl.store(base + d, w_new, mask=mask)
        tl.store(base + dim + d, z, mask=mask)
        tl.store(base + 2 * dim + d, n_new, mask=mask)
    else:  # Adam / AdamW (m, v, then the row's step count)
        if KIND == 3:
            w = w * decay
        m = tl.load(base + dim + d, mask=mask, other=0.0)
        v = tl.load(base + 2 * dim + d, mask=mask, other=0.0)
        t = tl.load(base + 3 * dim)
        bc1 = tl.load(bc_ptr + 2 * row)
        bc2 = tl.load(bc_ptr + 2 * row + 1)
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + (one_minus_beta2 * g) * g
        mhat = tl.div_rn(m, bc1)
        vhat = tl.div_rn(v, bc2)
        tl.store(base + d, w - tl.div_rn(lr * mhat, tl.sqrt_rn(vhat) + eps), mask=mask)
        tl.store(base + dim + d, m, mask=mask)
        tl.store(base + 2 * dim + d, v, mask=mask)
        tl.store(base + 3 * dim, t + 1.0)


def dim_block(dim: int) -> int:
    return _pow2(dim)


def update(
    records: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    opt: dict[str, Any],
    bias_corrections: torch.Tensor | None,
) -> None:
    """Applies ``opt`` (the table's optimizer, its values float32-exact) in place to
    ``records[slots]`` with ``grads`` (one row each, distinct slots). Adam's and AdamW's
    ``bias_corrections``: ``(n, 2)`` float32, each row's ``1 - beta1^t`` and
    ``1 - beta2^t`` for its next step ``t``."""
    n, dim = grads.shape
    if n == 0:
        return
    kind = KINDS[opt["kind"]]
    f = float
    b1 = f(opt.get("beta1", opt.get("beta", 0.0)))
    b2 = f(opt.get("beta2", 0.0))
    decay = 1.0
    if kind == ADAMW:
        import numpy as np

        decay = f(np.float32(1.0) - np.float32(opt["lr"]) * np.float32(opt["weight_decay"]))
    bc = bias_corrections if bias_corrections is not None else grads  # unread unless Adam
    with _on(records.device):
        _update[(n,)](
            records, slots, grads.contiguous(), bc, n, records.shape[1], dim,
            f(opt["lr"]), f(opt.get("eps", 0.0)), b1, _one_minus(b1), b2, _one_minus(b2), decay,
            f(opt.get("l1", 0.0)), f(opt.get("l2", 0.0)),
            KIND=kind, DIM_BLOCK=dim_block(dim), **COMPILE_OPTIONS,
        )  # fmt: skip


def _one_minus(x: float) -> float:
    import numpy as np

    return float(np.float32(1.0) - np.float32(x))


def aot_variants(kind: str, dim: int) -> Iterator[tuple[Any, dict[str, str], dict[str, Any]]]:
    """``(kernel, signature, constexprs)`` of the launch for ``kind`` at ``dim``."""
    sig = {
        "records_ptr": "*fp32", "slots_ptr": "*i64", "grads_ptr": "*fp32", "bc_ptr": "*fp32", "n": "i64",
        "width": "i32", "dim": "i32", **dict.fromkeys(
            ("lr", "eps", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "decay", "l1", "l2"), "fp32"
        ),
        "KIND": "constexpr", "DIM_BLOCK": "constexpr",
    }  # fmt: skip
    yield _update, sig, {"KIND": KINDS[kind], "DIM_BLOCK": dim_block(dim)}


def aot_find_variants(slots: int) -> Iterator[tuple[Any, dict[str, str], dict[str, Any]]]:
    """``(kernel, signature, constexprs)`` of the find for buckets of ``slots``."""
    sig = {
        "ids_ptr": "*i64", "n": "i64", "keys_ptr": "*i64", "used_ptr": "*i64", "slot_out_ptr": "*i64",
        "n_buckets": "i64", "clock": "i64", "S": "constexpr", "S_BLOCK": "constexpr",
    }  # fmt: skip
    yield _find, sig, {"S": slots, "S_BLOCK": _pow2(slots)}
