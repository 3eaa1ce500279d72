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
import warnings
from collections.abc import Mapping, Sequence
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
    tracked_max: int = 4_000_000,
    max_tracked: int | None = None,
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
    if max_tracked is not None:
        warnings.warn("max_tracked= is deprecated: use tracked_max=", DeprecationWarning, stacklevel=2)
        tracked_max = max_tracked
    request: dict[str, Any] = {
        "dim": int(dim),
        "dtype": dtype,
        "optimizer": optimizer,
        "medium": medium,
        "target_hit_rate": float(target_hit_rate),
        "tracked_max": int(tracked_max),
        "cache_bytes": [c if isinstance(c, str) else int(c) for c in cache_bytes],
        "budget_dram": budget_dram,
        "budget_gpu": budget_gpu,
        "sample_rate": sample_rate,
        "workload": workload,
        "criteo": [os.fspath(f) for f in criteo],
        "features": [int(f) for f in features],
        "training": bool(training),
        "lookahead": bool(lookahead),
        **workload_options,
    }
    names: list[str] = []
    arrays: list[npt.NDArray[np.uint64]] = []
    paths: list[str] = []
    for name, t in (traces or {}).items():
        if isinstance(t, (str, os.PathLike)):
            paths.append(f"{name}={os.fspath(t)}")
        else:
            names.append(name)
            arrays.append(np.ascontiguousarray(np.asarray(t).astype(np.uint64, copy=False)))
    request["traces"] = paths
    request = {k: v for k, v in request.items() if v is not None}
    result: dict[str, Any] = json.loads(_native.plan_json(json.dumps(request), names, arrays))
    return result
