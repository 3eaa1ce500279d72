"""Click-log data in the Criteo display-advertising format, and a synthetic generator.

The format (one example per line, tab-separated): ``label``, 13 integer features
``I1..I13``, 26 categorical features ``C1..C26`` hashed to 8 hex digits. Any feature
may be empty (missing).

>>> import embank.datasets as ds, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "day_0.tsv")
>>> ds.write_synthetic(path, rows=1000, seed=1)
1000
>>> b = next(ds.read_criteo(path, batch_size=256))
>>> b.dense.shape, b.sparse.shape, b.labels.shape
((256, 13), (256, 26), (256,))

Reading turns integer features into ``log(1 + max(x, 0))`` (missing: 0) and categorical
ones into ids (``int(hex, 16)``; missing: :data:`MISSING_ID`), optionally modulo a hash
size so tables of fixed size can hold them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "MISSING_ID",
    "NUM_DENSE",
    "NUM_SPARSE",
    "Batch",
    "read_criteo",
    "synthetic_cardinalities",
    "synthetic_values",
    "write_synthetic",
]

NUM_DENSE = 13
NUM_SPARSE = 26
#: Id of a missing categorical value (outside the 32-bit range of hashed values).
MISSING_ID = 1 << 32


@dataclass
class Batch:
    """A batch of examples: ``dense`` (n, 13) float32, ``sparse`` (n, 26) int64 ids,
    ``labels`` (n,) float32 in {0, 1}."""

    dense: npt.NDArray[np.float32]
    sparse: npt.NDArray[np.int64]
    labels: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return len(self.labels)


def _parse(lines: list[str], where: str, first_line: int, hash_size: int | None) -> Batch:
    n = len(lines)
    fields = [line.rstrip("\n").split("\t") for line in lines]
    for i, f in enumerate(fields):
        if len(f) != 1 + NUM_DENSE + NUM_SPARSE:
            raise ValueError(
                f"{where}:{first_line + i}: expected {1 + NUM_DENSE + NUM_SPARSE} tab-separated fields, "
                f"got {len(f)}"
            )
    cols = np.array(fields, dtype=np.str_).T if n else np.zeros((40, 0), dtype=np.str_)
    try:
        labels = cols[0].astype(np.float32)
    except ValueError as e:
        raise ValueError(f"{where}: a label is not a number ({e})") from None
    dense = np.zeros((n, NUM_DENSE), dtype=np.float32)
    for j in range(NUM_DENSE):
        c = cols[1 + j]
        have = c != ""
        try:
            v = c[have].astype(np.int64)
        except ValueError as e:
            raise ValueError(f"{where}: integer feature I{j + 1} is not an integer ({e})") from None
        dense[have, j] = np.log1p(np.maximum(v, 0)).astype(np.float32)
    sparse = np.empty((n, NUM_SPARSE), dtype=np.int64)
    for j in range(NUM_SPARSE):
        c = cols[1 + NUM_DENSE + j]
        try:
            ids = np.array([int(x, 16) if x else MISSING_ID for x in c.tolist()], dtype=np.int64)
        except ValueError as e:
            raise ValueError(f"{where}: categorical feature C{j + 1} is not hexadecimal ({e})") from None
        if hash_size is not None:
            ids %= hash_size
        sparse[:, j] = ids
    return Batch(dense, sparse, labels)


def read_criteo(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    batch_size: int = 4096,
    *,
    hash_size: int | None = None,
    skip_batches: int = 0,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Streams batches from Criteo-format TSV files, in file order (nothing is held in
    memory beyond a batch). ``skip_batches`` skips that many batches first (resuming a
    run at a batch boundary); ``hash_size`` takes categorical ids modulo it. A malformed
    line raises ``ValueError`` naming the file and line."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if hash_size is not None and hash_size < 1:
        raise ValueError("hash_size must be at least 1")
    files = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    buf: list[str] = []
    where, first = "", 1
    index = 0
    for path in files:
        with open(path, encoding="ascii", errors="strict", newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                if not buf:
                    where, first = os.fspath(path), lineno
                buf.append(line)
                if len(buf) == batch_size:
                    if index >= skip_batches:
                        yield _parse(buf, where, first, hash_size)
                    index += 1
                    buf = []
    if buf and not drop_last and index >= skip_batches:
        yield _parse(buf, where, first, hash_size)


def synthetic_cardinalities(scale: int = 100_000) -> list[int]:
    """Distinct values of each of the 26 categorical features: a spread like Criteo's,
    from a handful to ``scale``."""
    return [max(4, int(scale * f)) for f in np.geomspace(1.0, 1e-4, NUM_SPARSE).tolist()]


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # splitmix64 finaliser, vectorised: a deterministic pseudo-random value per id.
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def synthetic_values(ids: npt.NDArray[np.int64], seed: int) -> npt.NDArray[np.int64]:
    """The 32-bit values :func:`write_synthetic` writes (as 8 hex digits) for dense ids
    ``0..card-1`` of a feature, under ``seed``: what a reader sees for each id."""
    salt = np.uint64((seed * (1 << 40)) % (1 << 64))
    return (_mix(ids.astype(np.uint64) + salt) & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _hidden_weight(feature: int, ids: npt.NDArray[np.int64], seed: int) -> npt.NDArray[np.float64]:
    h = _mix(ids.astype(np.uint64) ^ np.uint64((seed * 1_000_003 + feature) * 0x100000001B3 % (1 << 64)))
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.asarray(u * 2.0 - 1.0, dtype=np.float64)


def write_synthetic(
    path: str | os.PathLike[str],
    rows: int,
    *,
    seed: int = 0,
    part: int = 0,
    scale: int = 100_000,
    zipf: float = 1.1,
    missing: float = 0.02,
    chunk: int = 65_536,
) -> int:
    """Writes ``rows`` examples in the Criteo format to ``path``; returns ``rows``.

    Deterministic for ``(seed, part)`` (the same file every time; give a test file
    another ``part`` than the training file). Categorical ids follow a
    power law (exponent ``zipf``) over :func:`synthetic_cardinalities`; a fraction
    ``missing`` of every feature is left empty. Labels depend on the features — a hidden
    weight per categorical value (shared by every file of the same ``seed``, so train and
    test files agree) plus a few integer features — so a model can learn them (AUC well
    above 0.5).
    """
    if rows < 0:
        raise ValueError("rows must be >= 0")
    cards = synthetic_cardinalities(scale)
    # The hidden weights belong to the seed; the examples to (seed, part).
    stream = np.random.default_rng([seed, part, 7])
    written = 0
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        while written < rows:
            n = min(chunk, rows - written)
            dense = np.floor(stream.lognormal(1.0, 1.5, size=(n, NUM_DENSE))).astype(np.int64)
            ids = np.empty((n, NUM_SPARSE), dtype=np.int64)
            logit = np.full(n, -1.2)
            for j, card in enumerate(cards):
                # Power law over ranks 0..card-1: density ~ (r + 1)^-zipf (inverse CDF).
                u = stream.random(n)
                a = 1.0 - zipf if abs(zipf - 1.0) > 1e-6 else -1e-6
                x = ((float(card + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
                r = np.clip(np.floor(x).astype(np.int64) - 1, 0, card - 1)
                ids[:, j] = r
                logit += 0.9 * _hidden_weight(j, r, seed) * (1.0 if j < 8 else 0.4)
            logit += 0.35 * (np.log1p(dense[:, 0]) - 1.2) - 0.25 * (np.log1p(dense[:, 3]) - 1.2)
            labels = (stream.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
            # Written as 8 hex digits of a hash of (seed, id), as Criteo's values are hashed.
            hashed = synthetic_values(ids, seed)
            miss_d = stream.random((n, NUM_DENSE)) < missing
            miss_s = stream.random((n, NUM_SPARSE)) < missing
            out = io.StringIO()
            for i in range(n):
                d = ["" if miss_d[i, j] else str(dense[i, j]) for j in range(NUM_DENSE)]
                s = ["" if miss_s[i, j] else f"{hashed[i, j]:08x}" for j in range(NUM_SPARSE)]
                out.write(f"{labels[i]}\t" + "\t".join(d) + "\t" + "\t".join(s) + "\n")
            f.write(out.getvalue())
            written += n
    os.replace(tmp, path)
    return rows
