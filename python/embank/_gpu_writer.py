"""The background writer of :class:`embank.gpu.TrainCache`: rows evicted from the cache
go back to the table on a thread of their own, oldest first."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from ._table import Table
from .errors import InvalidInputError

__all__ = ["TABLE_SHIFT", "_Writer", "split_keys"]

# A cache over several tables keys each row by (its table's index << TABLE_SHIFT) | id.
TABLE_SHIFT = 48


def split_keys(
    tables: list[Table], keys: npt.NDArray[np.uint64]
) -> list[tuple[Table, npt.NDArray[np.intp] | None, npt.NDArray[np.uint64]]]:
    """``keys`` of a cache over ``tables`` as ``(table, positions, ids)`` a table (for one
    table: every key, positions None)."""
    if len(tables) == 1:
        return [(tables[0], None, keys)] if keys.size else []
    index = keys >> np.uint64(TABLE_SHIFT)
    out: list[tuple[Table, npt.NDArray[np.intp] | None, npt.NDArray[np.uint64]]] = []
    for i in np.unique(index):
        at = np.nonzero(index == i)[0]
        ids = np.ascontiguousarray(keys[at] & np.uint64((1 << TABLE_SHIFT) - 1))
        out.append((tables[int(i)], at, ids))
    return out


class _Writer:
    """Rows going back to the table, oldest first, written by a thread of their own: an
    eviction costs the step a copy to the host, not the table's write. A batch leaves
    the queue once written, so a read of the table never misses a row in flight:
    :meth:`TrainCache._fetch` reads the queue first (the newest copy of a key wins)."""

    def __init__(self, tables: list[Table], background: bool, rows_max: int) -> None:
        self.tables = tables  # a cache over several: keys carry their table's index
        self.background = background
        self.rows_max = rows_max  # rows queued at most: an eviction waits beyond it
        self.queue: list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]] = []
        self.queued = 0
        self.written = 0
        self.error: BaseException | None = None
        self.stop = False
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def put(self, keys: npt.NDArray[np.uint64], records: npt.NDArray[np.float32]) -> None:
        if not self.background:
            # Rows a failed write left parked go first (and stay readable by `take`).
            with self.cond:
                self.queue.append((keys, records))
                self.queued += int(keys.size)
            self.write_parked()
            return
        with self.cond:
            if self.error is not None:  # parked, readable by `take`, not lost with the call
                self.queue.append((keys, records))
                self.queued += int(keys.size)
            self.raise_error()
            while self.queued and self.queued + keys.size > self.rows_max and self.error is None:
                self.cond.wait()
            self.raise_error()
            self.queue.append((keys, records))
            self.queued += int(keys.size)
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="embank-train-cache-writer", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stop:
                    self.cond.wait()
                if not self.queue:
                    return
                keys, records = self.queue[0]
            try:
                self.write(keys, records)
            except BaseException as e:  # handed to the trainer's next call
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
                return
            with self.cond:
                self.queue.pop(0)
                self.queued -= int(keys.size)
                self.written += int(keys.size)
                self.cond.notify_all()

    def write(self, keys: npt.NDArray[np.uint64], records: npt.NDArray[np.float32]) -> None:
        """Writes rows to their tables (split by the tables' indexes in the keys)."""
        for table, at, ids in split_keys(self.tables, keys):
            table.push_with_state(ids, records if at is None else np.ascontiguousarray(records[at]))

    def write_parked(self) -> None:
        """Inline: writes the queued rows in order, each batch leaving the queue once
        written; a failure leaves it and the rest queued (the caller's flush retries)."""
        while True:
            with self.cond:
                if not self.queue:
                    return
                keys, records = self.queue[0]
            self.write(keys, records)
            with self.cond:
                self.queue.pop(0)
                self.queued -= int(keys.size)
                self.written += int(keys.size)

    def drain(self) -> None:
        """Waits until every queued row is in the table."""
        if not self.background:
            self.write_parked()
            return
        with self.cond:
            while self.queue and self.error is None:
                self.cond.wait()
            self.raise_error()

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise InvalidInputError(
                f"writing rows back to {', '.join(repr(t.name) for t in self.tables)} failed: {self.error}"
            ) from self.error

    def take(
        self, keys: npt.NDArray[np.uint64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32] | None]:
        """The queued records of ``keys`` (the newest of each): which were queued, and
        their records (rows of the others undefined)."""
        with self.cond:
            if not self.queue:
                return np.zeros(keys.size, dtype=bool), None
            got = np.zeros(keys.size, dtype=bool)
            out: npt.NDArray[np.float32] | None = None
            for qk, qr in reversed(self.queue):
                pos = np.searchsorted(qk, keys)
                pos[pos >= qk.size] = 0
                hit = (qk[pos] == keys) & ~got
                if hit.any():
                    if out is None:
                        out = np.empty((keys.size, qr.shape[1]), dtype=np.float32)
                    out[hit] = qr[pos[hit]]
                    got |= hit
            return got, out
