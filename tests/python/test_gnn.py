"""examples/gnn/train.py trains (the loss falls) over a power-law graph whose node
embeddings live in an embank table on the block medium larger than its row cache, and
reports edges/s and the hit rate with and without lookahead. (How much lookahead raises
the hit rate depends on the maintenance thread finishing before the next pull, so it is
measured in docs/BENCHMARKS.md, not asserted; `tests/store.rs` checks deterministically
that rows read ahead survive until their pull.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gnn" / "train.py"


def run(work: Path, *extra: str) -> dict[str, Any]:
    out = work / "metrics.json"
    r = subprocess.run(
        [sys.executable, str(TRAIN), "--work", str(work), "--nodes", "50000", "--steps", "40",
         "--fanout", "5", "--batch-size", "256", "--cache-fraction", "0.5", "--threads", "1", "--quiet",
         "--metrics-out", str(out), *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_gnn_trains_and_reports_with_and_without_lookahead(tmp_path: Path) -> None:
    with_la = run(tmp_path / "a")
    without = run(tmp_path / "b", "--no-lookahead")
    for r in (with_la, without):
        assert r["loss_last"] < r["loss_first"] - 0.01, r
        assert r["edges_per_s"] > 0 and r["table_rows"] == 50_000
    assert with_la["lookahead"] and not without["lookahead"]
    assert with_la["lookahead_rows"] > 0
    assert without["lookahead_rows"] == 0
    assert 0 < without["cache_hit_rate"] < 1 and 0 < with_la["cache_hit_rate"] <= 1
