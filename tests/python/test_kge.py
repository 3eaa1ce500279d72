"""examples/kge/train.py: DistMult on the Nations graph with its entity and relation
tables in embank (the entity table read twice a step) matches the same model on
torch.nn.Embedding: filtered test MRR within 0.01."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "kge" / "train.py"


def run(work: Path, *extra: str) -> dict[str, Any]:
    out = work / "metrics.json"
    r = subprocess.run(
        [sys.executable, str(TRAIN), "--dataset", "nations", "--work", str(work), "--epochs", "20",
         "--threads", "1", "--quiet", "--metrics-out", str(out), *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_distmult_in_embank_matches_torch_embedding(tmp_path: Path) -> None:
    ours = run(tmp_path / "e")
    base = run(tmp_path / "b", "--baseline")
    assert ours["mode"] == "embank" and base["mode"] == "baseline"
    assert ours["entities"] == 14 and ours["relations"] == 55
    assert ours["mrr"] > 0.5, ours
    assert abs(ours["mrr"] - base["mrr"]) <= 0.01, (ours, base)
    assert abs(ours["hits@10"] - base["hits@10"]) <= 0.02
