"""examples/dlrm/train.py trained on 2 local shards to a checkpoint and past it, its shard
stores resharded to 3 by `embank reshard`, resumed on 3 shards: it ends with the same AUC,
log loss and every row as an uninterrupted run on 2 shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import embank
import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "dlrm" / "train.py"

ARGS = ["--synthetic", "6000", "--synthetic-scale", "20000", "--batch-size", "256", "--epochs", "2",
        "--threads", "1", "--quiet", "--checkpoint-every", "10"]  # fmt: skip
BATCHES = 2 * 24  # 6000 examples in batches of 256, twice


def run(work: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    out = work / "metrics.json"
    r = subprocess.run(
        [sys.executable, str(TRAIN), "--work", str(work), "--metrics-out", str(out), *ARGS, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        # The example's local shards serve plain TCP on loopback: no TLS.
        env={**{k: v for k, v in os.environ.items() if not k.startswith("EMBANK_TLS_")}, **(env or {})},
    )
    if env and "EMBANK_DLRM_KILL" in env:
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
        return None
    assert r.returncode == 0, r.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def rows(stores: list[Path]) -> dict[str, dict[int, npt.NDArray[np.float32]]]:
    """Every row of every table on a set of shard stores, with its optimizer state."""
    out: dict[str, dict[int, npt.NDArray[np.float32]]] = {}
    for path in stores:
        with embank.open(path) as store:
            for name in store.tables():
                t = store.table(name)
                for keys, _ in t.export():
                    records, found = t.lookup_with_state(keys)
                    assert found.all()
                    mine = out.setdefault(name, {})
                    for k, r in zip(keys.tolist(), records):
                        assert k not in mine, f"key {k} of {name} on two shards"
                        mine[k] = r.copy()
    return out


def test_trained_on_two_shards_resharded_to_three_resumes_like_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = run(tmp_path / "whole", "--local-shards", "2")
    assert whole is not None
    work = tmp_path / "resharded"
    # Killed 5 batches past the checkpoint of batch 40: the shards kept those pushes, which
    # the reshard must leave out (it reads the checkpoint through the undo journals).
    run(work, "--local-shards", "2", env={"EMBANK_DLRM_KILL": "0:45"})
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import shards  # type: ignore[import-not-found]  # the example's local shards: WORK/shards/<i>/store
    finally:
        sys.path.pop(0)
    shards.stop(work)  # the shards outlive a killed trainer: stop them (offline from here)
    os.rename(work / "shards", work / "shards-2")
    old = [str(work / "shards-2" / str(i) / "store") for i in range(2)]
    new = [str(work / "shards" / str(i) / "store") for i in range(3)]
    r = subprocess.run(
        [sys.executable, "-m", "embank", "reshard", "--quiet", "--from", *old, "--to", *new],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "resharded 2 -> 3 stores at checkpoint 40: 26 tables" in r.stderr, r.stderr
    resumed = run(work, "--local-shards", "3", "--resume")
    assert resumed is not None
    assert (whole["shards"], resumed["shards"]) == (2, 3)
    assert resumed["batches"] == whole["batches"] == BATCHES
    # Deterministic training (one thread, seeded), each row updated by its own shard: the
    # same numbers, exactly.
    assert resumed["auc"] == whole["auc"], (resumed["auc"], whole["auc"])
    assert resumed["logloss"] == whole["logloss"]
    assert resumed["rows"] == whole["rows"]
    a = rows([tmp_path / "whole" / "shards" / str(i) / "store" for i in range(2)])
    b = rows([work / "shards" / str(i) / "store" for i in range(3)])
    assert a.keys() == b.keys() and len(a) == 26
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k, row in a[name].items():
            assert np.array_equal(row, b[name][k]), (name, k)
