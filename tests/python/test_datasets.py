"""The Criteo-format reader (missing values, bad lines, batching, resuming) and the
synthetic generator (deterministic, power-law ids, learnable labels)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import embank.datasets as ds
import numpy as np
import pytest

LINE = "1\t5\t\t-3\t0" + "\t1" * 9 + "\t68fd1e64\t\t0a519c5c" + "\tdeadbeef" * 23 + "\n"


def test_reader_handles_missing_values(tmp_path: Path) -> None:
    f = tmp_path / "d.tsv"
    f.write_text(LINE + LINE.replace("1\t5", "0\t", 1))
    (b,) = list(ds.read_criteo(f, batch_size=10))
    assert len(b) == 2 and b.labels.tolist() == [1.0, 0.0]
    assert b.dense.dtype == np.float32 and b.sparse.dtype == np.int64
    np.testing.assert_allclose(b.dense[0, :4], [np.log1p(5), 0, 0, 0])  # I2 missing, I3 < 0
    assert b.dense[1, 0] == 0  # missing
    assert b.sparse[0, :3].tolist() == [0x68FD1E64, ds.MISSING_ID, 0x0A519C5C]
    (h,) = list(ds.read_criteo(f, batch_size=10, hash_size=1000))
    assert h.sparse.max() < 1000 and h.sparse[0, 0] == 0x68FD1E64 % 1000


def test_reader_batches_resumes_and_spans_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    ds.write_synthetic(a, 250, seed=4)
    ds.write_synthetic(b, 100, seed=4, part=1)
    sizes = [len(x) for x in ds.read_criteo([a, b], batch_size=64)]
    assert sizes == [64] * 5 + [30]
    assert [len(x) for x in ds.read_criteo([a, b], batch_size=64, drop_last=True)] == [64] * 5
    whole = list(ds.read_criteo([a, b], batch_size=64))
    resumed = list(ds.read_criteo([a, b], batch_size=64, skip_batches=4))
    assert len(resumed) == 2
    np.testing.assert_array_equal(resumed[0].sparse, whole[4].sparse)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("1\t2\t3\n", "expected 40"),
        (LINE.replace("68fd1e64", "zz"), "C1 is not hexadecimal"),
        (LINE.replace("\t5\t", "\tfive\t", 1), "I1 is not an integer"),
        ("x" + LINE[1:], "label"),
    ],
)
def test_bad_lines_name_the_file_and_the_feature(tmp_path: Path, line: str, needle: str) -> None:
    f = tmp_path / "bad.tsv"
    f.write_text(LINE + line)
    with pytest.raises(ValueError, match=needle) as e:
        list(ds.read_criteo(f, batch_size=8))
    assert "bad.tsv" in str(e.value)


def test_synthetic_data_is_deterministic_power_law_and_learnable(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
    ds.write_synthetic(a, 30_000, seed=9)
    ds.write_synthetic(b, 30_000, seed=9)
    ds.write_synthetic(c, 30_000, seed=9, part=1)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b, c)]
    assert digest[0] == digest[1] != digest[2]
    (train,) = list(ds.read_criteo(a, batch_size=30_000))
    (test,) = list(ds.read_criteo(c, batch_size=30_000))
    assert 0.1 < train.labels.mean() < 0.5
    # Power law: the most frequent value of C1 is far more common than the median one.
    _, counts = np.unique(train.sparse[:, 0], return_counts=True)
    assert counts.max() > 20 * np.median(counts)
    # Learnable: per-value click rates of a few features, learned on one part, rank the
    # other part's examples well above chance (train and test share the hidden weights).
    score = np.zeros(len(test))
    for j in range(6):
        vals, inv = np.unique(train.sparse[:, j], return_inverse=True)
        rate = (np.bincount(inv, weights=train.labels) + 1) / (np.bincount(inv) + 4)
        pos = np.searchsorted(vals, test.sparse[:, j]).clip(0, len(vals) - 1)
        known = vals[pos] == test.sparse[:, j]
        score += np.log(np.where(known, rate[pos], train.labels.mean()))
    y = test.labels > 0.5
    ranks = np.argsort(np.argsort(score)) + 1
    auc = (ranks[y].sum() - y.sum() * (y.sum() + 1) / 2) / (y.sum() * (~y).sum())
    assert auc > 0.6, auc
