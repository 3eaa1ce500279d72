"""`embank.plan` gives the numbers `embank plan` prints, and they are right on a trace
whose answer is known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import embank
import numpy as np


def test_plan_function_matches_the_command_and_a_known_trace(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    keys = (rng.zipf(1.3, 200_000) % 50_000).astype(np.uint64)
    np.save(tmp_path / "t.npy", keys)
    p = embank.plan({"t": keys}, dim=32, dtype="int8", cache_bytes=["256K", "2M"], budget_gpu="1M")
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [sys.executable, "-m", "embank", "plan", "--trace", f"t={tmp_path / 't.npy'}", "--dim", "32",
         "--dtype", "int8", "--cache-bytes", "256K,2M", "--budget-gpu", "1M", "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    q = json.loads(out.read_text())
    for d in (p, q):
        d.pop("seconds")
    assert p == q
    t = p["tables"][0]
    assert t["shape"]["dtype"] == "int8" and t["bytes"]["cache_entry_bytes"] == 32 + 8 + 96
    # A cache of the whole table misses only first accesses (within a row lost to sharding).
    full = t["row_cache_curve"][-1]["hit_rate"]
    assert abs(full - (1 - len(np.unique(keys)) / len(keys))) < 1e-4
    assert t["at_cache_bytes"][0]["hit_rate"] < t["at_cache_bytes"][1]["hit_rate"] <= full + 1e-3
    assert 0 < t["at_budget_gpu"]["hit_rate"] <= full + 1e-3
