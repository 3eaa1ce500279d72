"""Every Triton kernel of the GPU cache compiles ahead of time for sm_80 and sm_90, on the
CPU, with the installed Triton: every variant the cache launches (row types f32, f16,
bf16; the decoder of stored int8 rows; dims 1 to 512, powers of two or not; bucket sizes;
unspecialized and specialized on aligned pointers), through every stage (TTIR, TTGIR,
LLVM IR, PTX and, with the ptxas Triton ships, a cubin). The interpreter tests
never compile a kernel; this one does, so a kernel a GPU would refuse fails here."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

ARCHS = (80, 90)
DTYPES = ("float32", "float16", "bfloat16")
DIMS = (1, 3, 8, 32, 100, 128, 512)
SLOTS = (128, 8, 1)  # the default; small caches' (f32, one dim)


def _variants() -> list[tuple[str, int, str, int, int]]:
    """Distinct (kernel, arch, dtype, dim, slots) launches: a dim is compiled once per
    distinct set of constexprs (dims 100 and 128 share a DIM_BLOCK). sm_80 gets the
    unspecialized kernels, sm_90 those a launch of aligned tensors specializes (both
    occur on either; each is compiled on one, to keep the test's time)."""
    from embank import _triton

    seen: set[str] = set()
    out = []
    for arch in ARCHS:
        for slots in SLOTS:
            for dtype in DTYPES if slots == 128 else ("float32",):
                for dim in DIMS if slots == 128 else (3,):
                    for kernel, sig, consts in _triton.aot_variants(getattr(torch, dtype), dim, slots):
                        aligned_dim = arch == 90 and "dim" in sig and dim % 16 == 0
                        key = repr(
                            (
                                kernel.fn.__name__,
                                arch,
                                sorted(sig.items()),
                                sorted(consts.items()),
                                aligned_dim,
                            )
                        )
                        if key not in seen:
                            seen.add(key)
                            out.append((kernel.fn.__name__, arch, dtype, dim, slots))
    return out


def _compile(job: tuple[str, int, str, int, int]) -> tuple[str, list[str] | str]:
    """Compiles one variant; returns its stages, or the error text."""
    import triton as tr  # type: ignore[import-untyped]
    from embank import _triton
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    name, arch, dtype, dim, slots = job
    for kernel, sig, consts in _triton.aot_variants(getattr(torch, dtype), dim, slots):
        if kernel.fn.__name__ == name:
            attrs = {}
            if arch == 90:  # as a launch specializes: 16-byte aligned pointers, dim % 16 == 0
                for name, ty in sig.items():
                    if ty.startswith("*") or (name == "dim" and dim % 16 == 0):
                        attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
            try:
                compiled = tr.compile(
                    ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                    target=GPUTarget("cuda", arch, 32),
                    options=_triton.COMPILE_OPTIONS.get(kernel.fn.__name__, {}),
                )
            except Exception as e:
                return repr(job), f"{type(e).__name__}: {str(e)[:2000]}"
            return repr(job), sorted(compiled.asm)
    return repr(job), "no such kernel"


def test_every_kernel_compiles_for_sm80_and_sm90() -> None:
    jobs = _variants()
    assert {j[0] for j in jobs} == {"_find", "_choose", "_write", "_invalidate", "_decode_int8"}
    ctx: Any = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), mp_context=ctx) as pool:
        results = list(pool.map(_compile, jobs))
    failed = [(job, r) for job, r in results if isinstance(r, str)]
    assert not failed, f"{len(failed)} of {len(jobs)} variants do not compile; first: {failed[0]}"
    for job, stages in results:
        assert {"ttir", "ttgir", "llir", "ptx"} <= set(stages), f"{job}: stages {stages}"
        assert "cubin" in stages, f"{job}: no cubin (is Triton's ptxas missing?): {stages}"


def _compile_train(job: tuple[str, int, int]) -> tuple[str, list[str] | str]:
    """Compiles TrainCache's update for one (kind, arch, dim); its stages or the error."""
    import triton as tr
    from embank import _triton_train
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kind, arch, dim = job
    variants = (
        _triton_train.aot_find_variants(dim) if kind == "find" else _triton_train.aot_variants(kind, dim)
    )
    for kernel, sig, consts in variants:
        try:
            compiled = tr.compile(
                ASTSource(fn=kernel, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", arch, 32),
                options=_triton_train.COMPILE_OPTIONS,
            )
        except Exception as e:
            return repr(job), f"{type(e).__name__}: {str(e)[:2000]}"
        return repr(job), sorted(compiled.asm) + (["FMA"] if "fma.rn" in compiled.asm["ptx"] else [])
    return repr(job), "no such kernel"


def test_the_train_cache_update_compiles_for_sm80_and_sm90() -> None:
    """embank.gpu.TrainCache's kernels (_triton_train.py): the update of every kind, at a
    small, an odd and the largest dim, with no fused multiply-add in the PTX (the store's
    arithmetic has none); the find at the default, an odd and a one-slot bucket."""
    from embank import _triton_train

    jobs = [(k, arch, dim) for k in _triton_train.KINDS for arch in ARCHS for dim in (3, 64, 512)]
    jobs += [("find", arch, slots) for arch in ARCHS for slots in (32, 7, 1)]  # (slots, not dim)
    ctx: Any = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), mp_context=ctx) as pool:
        results = list(pool.map(_compile_train, jobs))
    failed = [(job, r) for job, r in results if isinstance(r, str)]
    assert not failed, f"{len(failed)} of {len(jobs)} variants do not compile; first: {failed[0]}"
    for job, stages in results:
        assert {"ptx", "cubin"} <= set(stages), f"{job}: stages {stages}"
        assert "FMA" not in stages, f"{job}: a fused multiply-add in the PTX: not the store's arithmetic"
