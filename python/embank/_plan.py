"""Sizing tiers before buying memory: :func:`plan` is ``embank plan`` as a function.

>>> import numpy as np, embank
>>> keys = np.random.default_rng(0).zipf(1.2, 100_000).astype(np.uint64)
>>> p = embank.plan({"items": keys}, dim=64, cache_bytes=["1M", "8M"])
>>> p["tables"][0]["placement"] in ("pin", "cache", "bypass")
True
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _native


def plan(
    traces: Mapping[str, npt.ArrayLike | str | os.PathLike[str]] | None = None,
    *,
    workload: str | None = None,
    criteo: Sequence[str | os.PathLike[str]] = (),
    features: Sequence[int] = (),
    training: bool = False,
    lookahead: bool = False,
    dim: int = 128,
    dtype: str = "f32",
    optimizer: str = "none",
    medium: str = "block",
    cache_bytes: Sequence[int | str] = (),
    budget_dram: int | str | None = None,
    budget_gpu: int | str | None = None,
    target_hit_rate: float = 0.9,
    sample_rate: float | None = None,
    max_tracked: int = 4_000_000,
    **workload_options: Any,
) -> dict[str, Any]:
    """Predicts, per table, the hit rate of the DRAM row cache and of a GPU cache at every
    size (a miss-ratio curve from the key stream's stack distances; sampled for long
    traces), the bytes of each tier from embank's own layouts, a placement (``pin``,
    ``cache`` or ``bypass``) and what a DRAM or GPU budget buys. The same numbers as
    ``embank plan`` (``embank plan --help`` explains every option).

    Args:
        traces: table name -> keys in access order (a 1-D integer array, or a ``.npy`` path).
        workload: or ``"ycsb-c"``/``"hps-a"`` generated as ``embank bench`` generates it
            (``keys=``, ``zipf=``, ``batch=``, ``threads=``, ``stream_batches=``, ``seed=``).
        criteo: or Criteo-format TSV files: each categorical feature of ``features``
            (default all 26) a table; the result's ``store`` is then the store-wide row
            cache they share, over batches of ``batch=`` lines (``hash_size=`` as the
            DLRM example's).
        training: model steps that pull each batch's distinct ids and push them back.
        lookahead: the next batch's rows are read ahead of each step.
        cache_bytes: row-cache sizes to predict the hit rate at.
        budget_dram, budget_gpu: budgets in bytes (``"8G"`` works too).
    """
    argv: list[str] = ["--dim", str(dim), "--dtype", dtype, "--optimizer", optimizer, "--medium", medium]
    argv += ["--target-hit-rate", str(target_hit_rate), "--max-tracked", str(max_tracked)]
    if cache_bytes:
        argv += ["--cache-bytes", ",".join(str(c) for c in cache_bytes)]
    if budget_dram is not None:
        argv += ["--budget-dram", str(budget_dram)]
    if budget_gpu is not None:
        argv += ["--budget-gpu", str(budget_gpu)]
    if sample_rate is not None:
        argv += ["--sample-rate", str(sample_rate)]
    if workload is not None:
        argv += ["--workload", workload]
    for f in criteo:
        argv += ["--criteo", os.fspath(f)]
    if features:
        argv += ["--features", ",".join(str(f) for f in features)]
    if training:
        argv.append("--training")
    if lookahead:
        argv.append("--lookahead")
    for k, v in workload_options.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    with tempfile.TemporaryDirectory(prefix="embank-plan-") as tmp:
        for name, t in (traces or {}).items():
            if isinstance(t, (str, os.PathLike)):
                path = Path(t)
            else:
                path = Path(tmp) / f"{name}.npy"
                np.save(path, np.ascontiguousarray(np.asarray(t).astype(np.uint64, copy=False)))
            argv += ["--trace", f"{name}={path}"]
        result: dict[str, Any] = json.loads(_native.plan_json(argv))
    return result
