"""embank: a tiered parameter server for huge embedding tables.

>>> import embank, numpy as np, tempfile, os
>>> with embank.open(os.path.join(tempfile.mkdtemp(), "model")) as store:
...     users = store.create_table("user", dim=4, init=embank.init.normal(0, 0.01))
...     users.push(np.array([7], dtype=np.uint64), np.ones((1, 4), dtype=np.float32))
...     rows = users.pull(np.array([7, 8], dtype=np.uint64))  # key 8 is created
...     print(rows.shape, rows[0].tolist(), len(users))
(2, 4) [1.0, 1.0, 1.0, 1.0] 2
"""

from __future__ import annotations

from . import errors, init, optim
from ._native import __version__
from ._open import connect, open, shard_of
from ._plan import plan
from ._publisher import Publisher
from ._store import Store
from ._table import Table, Worker, decode_rows
from .errors import (
    ConfigError,
    CorruptStoreError,
    EmbankError,
    FormatVersionError,
    InvalidInputError,
    NotFoundError,
    PublishError,
    ShardUnavailableError,
    StoreClosedError,
    StoreLockedError,
    TableExistsError,
    TableFullError,
    UnauthorizedError,
)

__all__ = [
    "ConfigError",
    "CorruptStoreError",
    "EmbankError",
    "FormatVersionError",
    "InvalidInputError",
    "NotFoundError",
    "PublishError",
    "Publisher",
    "ShardUnavailableError",
    "Store",
    "StoreClosedError",
    "StoreLockedError",
    "Table",
    "TableExistsError",
    "TableFullError",
    "UnauthorizedError",
    "Worker",
    "__version__",
    "connect",
    "decode_rows",
    "errors",
    "init",
    "open",
    "optim",
    "plan",
    "shard_of",
]
