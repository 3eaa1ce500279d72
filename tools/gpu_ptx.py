"""Compiles the GPU cache's kernels (crates/embank-gpu/kernels/cache.cu, with train.cuh) to
PTX with NVRTC, the CUDA compiler as a library (PyPI's nvidia-cuda-nvrtc-cu12: no CUDA
toolkit, no host compiler), and checks the PTX with ptxas for the real targets (sm_80,
sm_90), and that the training update has no fused multiply-add.

    python tools/gpu_ptx.py            # writes crates/embank-gpu/kernels/cache.ptx
    python tools/gpu_ptx.py --check    # fails if cache.ptx is not what cache.cu compiles to,
                                       # or if ptxas refuses it for sm_80 or sm_90

The PTX is committed and embedded in the extension, and the CUDA driver compiles it for
the GPU at hand when a cache is made (no CUDA at build time, none to install). Its
``.version`` line is lowered to PTX ISA 7.0 (CUDA 11.0, the first with sm_80) and the
``used_bytes_mask`` pragmas (a load hint of ISA 8.3) are dropped, so that drivers from
CUDA 11.0 on load it; ptxas checks that nothing newer is used.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "crates" / "embank-gpu" / "kernels"
PTX_ISA = "7.0"
ARCH = "compute_80"
TARGETS = ("sm_80", "sm_90")


def _find(pattern: str) -> str:
    for base in [*sys.path, os.path.join(sys.prefix, "lib")]:
        hits = sorted(glob.glob(os.path.join(base, pattern)))
        if hits:
            return hits[0]
    raise SystemExit(
        f"gpu_ptx: {pattern} not found on sys.path (pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12)"
    )


def compile_ptx() -> str:
    lib = ctypes.CDLL(_find("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    src = (KERNELS / "cache.cu").read_bytes()
    headers = ("target.h", "train.cuh")  # what cache.cu includes
    prog = ctypes.c_void_p()
    names = (ctypes.c_char_p * len(headers))(*(h.encode() for h in headers))
    bodies = (ctypes.c_char_p * len(headers))(*((KERNELS / h).read_bytes() for h in headers))
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"cache.cu", len(headers), bodies, names)
    if rc:
        raise SystemExit(f"gpu_ptx: nvrtcCreateProgram failed ({rc})")
    opts = [f"--gpu-architecture={ARCH}".encode(), b"-std=c++17", b"--fmad=false", b"-lineinfo"]
    copts = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        raise SystemExit(f"gpu_ptx: cache.cu does not compile:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    text = ptx.value.decode()
    text = re.sub(r"^\.version \d+\.\d+$", f".version {PTX_ISA}", text, count=1, flags=re.M)
    # Line info names the files by the compiler's working directory: by name alone, so the
    # PTX is the same on every machine.
    text = re.sub(r'^(\s*\.file\s+\d+\s+")[^"]*/([^"/]+")', r"\1\2", text, flags=re.M)
    # A hint of PTX ISA 8.3 that ISA 7.0 lacks (ptxas checks the rest).
    text = re.sub(r'^\s*\.pragma "used_bytes_mask \d+";\n', "", text, flags=re.M)
    return text


def check_targets(ptx: str) -> None:
    ptxas = _find("nvidia/cuda_nvcc/bin/ptxas")
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "cache.ptx"
        p.write_text(ptx)
        for t in TARGETS:
            r = subprocess.run([ptxas, f"--gpu-name={t}", "-v", "-o", str(Path(d) / f"{t}.cubin"), str(p)],
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode:
                raise SystemExit(f"gpu_ptx: ptxas refuses cache.ptx for {t}:\n{r.stderr}")
            clean = r"\b0 bytes spill stores, 0 bytes spill loads"
            spills = [ln for ln in r.stderr.splitlines() if "spill" in ln and not re.search(clean, ln)]
            print(f"gpu_ptx: {t}: ok ({len(re.findall('Compiling entry function', r.stderr))} kernels)")
            for ln in spills:
                print(f"gpu_ptx: {t}: {ln.strip()}")


def check_rounding(ptx: str) -> None:
    """The training update (train.cuh's embank_train_update) rounds each operation as the
    store does: no fused multiply-add in it (a contraction changes the last bit)."""
    body = re.search(r"\.entry embank_train_update\b.*?^}", ptx, flags=re.S | re.M)
    if body is None:
        raise SystemExit("gpu_ptx: no embank_train_update in the PTX")
    fused = re.findall(r"\bfma\.\S+", body.group(0))
    if fused:
        raise SystemExit(f"gpu_ptx: embank_train_update fuses multiply-adds ({len(fused)}: {fused[0]})")
    print("gpu_ptx: embank_train_update: no fused multiply-add")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed PTX, do not write it")
    args = ap.parse_args()
    ptx = compile_ptx()
    check_rounding(ptx)
    out = KERNELS / "cache.ptx"
    if args.check:
        if not out.exists() or out.read_text() != ptx:
            raise SystemExit("gpu_ptx: kernels/cache.ptx is stale: run python tools/gpu_ptx.py")
        print("gpu_ptx: cache.ptx is what cache.cu compiles to")
    else:
        out.write_text(ptx)
        print(f"gpu_ptx: wrote {out.relative_to(ROOT)} ({len(ptx)} bytes)")
    check_targets(ptx)


if __name__ == "__main__":
    main()
