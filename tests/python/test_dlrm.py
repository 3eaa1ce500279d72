"""examples/dlrm/train.py as a user runs it: SIGKILLed mid-epoch (twice) and resumed, it
ends exactly where an uninterrupted run ends; bench/dlrm_compare.py's --baseline
(torch.nn.EmbeddingBag) learns the same data about as well."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "dlrm" / "train.py"
COMPARE = ROOT / "bench" / "dlrm_compare.py"  # the example with the comparison modes
ARGS = ["--synthetic", "12000", "--synthetic-scale", "20000", "--batch-size", "256", "--epochs", "2",
        "--threads", "1", "--quiet"]  # fmt: skip


def run(work: Path, *extra: str, script: Path = TRAIN) -> dict[str, Any]:
    out = work / "metrics.json"
    r = subprocess.run(
        [sys.executable, str(script), "--work", str(work), "--metrics-out", str(out), *ARGS, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def kill_after(work: Path, checkpoint: int, rng: random.Random, *extra: str) -> None:
    """Starts a run and SIGKILLs it a random moment after it reports `checkpoint` or a
    later one (a fast run may have passed `checkpoint` before the previous kill landed,
    and resumes after it)."""
    p = subprocess.Popen(
        [sys.executable, str(TRAIN), "--work", str(work), *ARGS, "--checkpoint-every", "10", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None
    for line in p.stdout:
        words = line.split()
        if len(words) == 2 and words[0] == "checkpoint" and int(words[1]) >= checkpoint:
            break
    else:
        pytest.fail(f"the run ended before checkpoint {checkpoint}")
    # Within about two checkpoint intervals on a fast machine (~100 batches/s), so the
    # run is still going when the kill lands.
    time.sleep(rng.uniform(0.0, 0.2))
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_killed_and_resumed_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    whole = run(tmp_path / "whole", "--checkpoint-every", "10")
    work = tmp_path / "killed"
    kill_after(work, 20, rng)  # epoch 1 of 2 (47 batches an epoch)
    kill_after(work, 60, rng, "--resume")  # epoch 2, after a resume
    resumed = run(work, "--checkpoint-every", "10", "--resume")
    assert resumed["batches"] == whole["batches"] == 94
    assert abs(resumed["auc"] - whole["auc"]) <= 0.002, (resumed, whole)
    assert abs(resumed["logloss"] - whole["logloss"]) <= 0.002
    assert whole["auc"] > 0.6


def test_baseline_learns_the_same_data(tmp_path: Path) -> None:
    ours = run(tmp_path / "e")
    base = run(tmp_path / "b", "--baseline", script=COMPARE)
    assert base["mode"] == "baseline" and ours["mode"] == "embank-mmap"
    assert base["auc"] > 0.6 and ours["auc"] > 0.6
    # Same model, same start, same data: apart from float rounding the same training
    # (docs/BENCHMARKS.md has the runs at a size where AUCs are measured precisely).
    assert abs(base["auc"] - ours["auc"]) < 0.02, (ours, base)
    # Rows created up front (--materialize, as the baseline's are) are the ones the
    # steps' first pulls create: the same run, to the bit.
    made = run(tmp_path / "m", "--materialize", script=COMPARE)
    assert (made["auc"], made["logloss"]) == (ours["auc"], ours["logloss"]), (made, ours)


def test_served_as_f16_and_int8_keeps_the_auc_of_f32_serving(tmp_path: Path) -> None:
    r = run(tmp_path / "s", "--serve-dtypes", "f16,int8", "--gpu-cache-rows", "2048", script=COMPARE)
    f32 = r["auc"]
    # Through a GPU cache (on the CPU here, PyTorch kernels) the rows are the table's: the
    # same AUC, with a cache small enough to evict.
    g = r["gpu_cache"]
    assert abs(g["auc"] - f32) < 1e-9 and abs(g["logloss"] - r["logloss"]) < 1e-6, (g, r["auc"])
    assert 0.2 < g["hit_rate"] < 1.0
    assert f32 > 0.6
    for dt in ("f16", "int8"):
        served = r["serve"][dt]
        assert abs(served["auc"] - f32) <= 0.001, (dt, served, f32)
    # Records of dim 16 (no optimizer state): 48 bytes as f16, 48 as int8 (16 + 24 rounded
    # to 16), against 80 for f32.
    assert r["serve"]["f16"]["record_bytes"] == 48 and r["serve"]["int8"]["record_bytes"] == 48


def test_help_explains_the_options() -> None:
    for script, opts in (
        (TRAIN, ("--resume", "--checkpoint-every", "--staleness", "--cache-fraction", "--local-shards")),
        (COMPARE, ("--baseline", "--torchrec", "--per-table", "--serve-dtypes", "--checkpoint-every")),
    ):
        r = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, (script, r.stderr[-2000:])
        for opt in opts:
            assert opt in r.stdout, (script, opt)
